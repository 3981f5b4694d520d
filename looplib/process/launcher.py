"""Several processes, one run: who am I (rank, world, local rank), as the launcher said, and how to
start the same command again on the same processes. No process group needed (``looplib.process.group``
starts it).

Launchers say who a process is through the environment: torchrun and the ``deepspeed``
launcher set RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT; a SLURM task started
by Hydra's submitit launcher has SLURM_PROCID / SLURM_NTASKS instead, which submitit's own
helper translates. A process started by hand is a world of one on a free local port.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import ConfigError

TORCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched_rank() -> int:
    """This process's rank as the launcher set it (0 when started by hand). No process group needed."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return int(os.environ.get("SLURM_PROCID", "0"))
    return 0


def launched_world() -> tuple[int, str]:
    """How many processes the launcher started for this job, and which launcher it was (no
    process group needed): torchrun and the ``deepspeed`` launcher set WORLD_SIZE; a SLURM
    job step with several tasks has SLURM_NTASKS."""
    if "WORLD_SIZE" in os.environ:
        who = ("torchrun" if "TORCHELASTIC_RUN_ID" in os.environ
               else "the deepspeed launcher" if "CROSS_RANK" in os.environ and "LOCAL_SIZE" in os.environ
               else "SLURM" if "SLURM_PROCID" in os.environ else "the launcher")
        return int(os.environ["WORLD_SIZE"]), who
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ:
        return int(os.environ["SLURM_NTASKS"]), "SLURM"
    return 1, ""


def relaunch(module: str = "looplib.train") -> str:
    """The start of a command that runs ``module`` on the processes this one was started with: a
    command looplib prints (a sweep's best trial, tune's best, "Continue with") must train the same
    global batch, so it names the launcher and its process counts. ``python -m MODULE`` for one
    process; on several nodes it is the command for each node (add your rendezvous flags)."""
    world, who = launched_world()
    if world <= 1:
        return f"python -m {module}"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", world)))
    if who == "the deepspeed launcher":
        nodes = int(os.environ.get("CROSS_SIZE", "1"))
        return f"deepspeed{f' --num_nodes {nodes}' if nodes > 1 else ''} --num_gpus {local} --module {module}"
    if who == "SLURM":
        return f"srun --ntasks {world} python -m {module}"
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", max(1, world // max(1, local))))
    if nodes * local != world:  # a launcher that says only WORLD_SIZE: torchrun's equivalent
        nodes, local = 1, world
    return f"torchrun{f' --nnodes {nodes}' if nodes > 1 else ''} --nproc_per_node {local} -m {module}"


def launcher() -> str:
    """``relaunch`` without its module: what a run's records call its launcher (``python`` for one process)."""
    words = relaunch("MODULE")
    return words.removesuffix(" -m MODULE").removesuffix(" --module MODULE")


def strip_launcher_args(argv: list[str]) -> list[str]:
    """The ``deepspeed`` launcher appends ``--local_rank=N``, which Hydra's parser refuses;
    it sets LOCAL_RANK in the environment too, which is what looplib reads."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg.startswith("--local_rank=") or arg.startswith("--local-rank="):
            os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1])
        elif arg in ("--local_rank", "--local-rank"):
            skip = True
        else:
            out.append(arg)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def export_torch_env() -> None:
    """Make sure the env:// rendezvous variables exist (torchrun, deepspeed, SLURM, or by hand)."""
    if all(k in os.environ for k in TORCH_ENV):
        return
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ:
        try:
            from submitit.helpers import TorchDistributedEnvironment
        except ImportError:
            raise ConfigError("engine", "a SLURM job with several tasks needs submitit to find its peers",
                              "pip install hydra-submitit-launcher, or start the tasks with torchrun") from None
        TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        return
    # started by hand: a world of one (DeepSpeed would otherwise go looking for MPI)
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")))


def process_device(device: torch.device) -> torch.device:
    """One GPU per process: cuda -> cuda:LOCAL_RANK. A CPU stays the CPU."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", local_rank())
    return device


# ----------------------------------------------------------------- a rank lost during the run

COLLECTIVE_FAILED = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "ncclRemoteError",
                     "NCCL communicator was aborted", "ProcessGroupGloo", "gloo/transport")


def lost_ranks() -> list[int]:
    """The ranks of this host's launcher that are gone: a launcher's workers are siblings, each
    with its RANK in its environment (torchrun: RANK = the node's first rank + LOCAL_RANK)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "0")))  # torchrun, deepspeed
    if not local_world or "RANK" not in os.environ:
        return []
    first, parent, alive = int(os.environ["RANK"]) - local_rank(), os.getppid(), set()
    try:
        siblings = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    except OSError:
        return []
    for pid in siblings:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                continue  # dead, not yet reaped
            env = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
            alive |= {int(kv[5:]) for kv in env if kv.startswith("RANK=")}
        except (OSError, ValueError, IndexError):
            continue
    return [r for r in range(first, first + local_world) if r not in alive]


def lost_rank_line(err: BaseException) -> str | None:
    """A collective that failed because another rank is gone: the one line that says so (None
    for any other error). Said by the first surviving rank of each host."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    text = str(err)
    if not (isinstance(err, getattr(dist, "DistError", ())) or any(s in text for s in COLLECTIVE_FAILED)):
        return None
    lost = lost_ranks()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "0")))
    first = int(os.environ.get("RANK", "0")) - local_rank()
    survivors = [r for r in range(first, first + local_world) if r not in lost] or [dist.get_rank()]
    if dist.get_rank() != min(survivors):
        return ""  # another rank of this host says it
    who = (f"rank {lost[0]}" if len(lost) == 1 else f"ranks {', '.join(map(str, lost))}") if lost else \
        "a rank on another host"
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))  # torchrun --max-restarts, and those done
    done = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    then = (f"torchrun restarts the workers on the nodes that are left (restart {done + 1} of {restarts}): with "
            "resume=auto they continue from it" if done < restarts else "resume=auto continues from it")
    return (f"looplib: stopped: {who} of {dist.get_world_size()} was lost (its process ended: killed, out of "
            f"memory, or its node failed), so rank {dist.get_rank()} cannot go on; the last complete checkpoint "
            f"stays ({then})")
