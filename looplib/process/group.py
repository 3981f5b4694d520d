"""The process group: started once per process (a sweep reuses it for every job), torn down at exit.

Every rank checks in on the launch's board first (``looplib.process.board``), so a rank that
refused before the group came up is heard, not waited for.
"""
from __future__ import annotations

import atexit
import datetime
import logging
import os

import torch
import torch.distributed as dist

from . import this
from .launcher import export_torch_env


def init_process_group(device: torch.device, timeout_s: int = 1800) -> None:
    """NCCL on CUDA, gloo on the CPU. Once per process: a sweep (-m) reuses it for every job,
    and it is torn down when the process exits."""
    if dist.is_initialized():
        return
    export_torch_env()
    this().board.check_in(timeout_s)  # every rank here, or one refused: said now, not after the launcher's SIGKILL
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=device if device.type == "cuda" else None)
    atexit.register(destroy_process_group)


def destroy_process_group() -> None:
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - at exit, after a lost rank or a launcher's SIGTERM: nothing to report
        pass


def start(engine) -> None:
    """Bring up the process group for ``engine`` and learn its rank and world size."""
    by_hand = not dist.is_initialized() and not any(k in os.environ for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID"))
    init_process_group(engine.device, engine.timeout_s)
    engine.rank, engine.world_size = dist.get_rank(), dist.get_world_size()
    if by_hand:  # a multi-process engine started as a plain command: say so rather than train alone in silence
        logging.getLogger("looplib").warning(
            "%s was started without a launcher, so it trains as one process; for several: "
            "torchrun --nproc_per_node N -m looplib.train ... (or the deepspeed launcher)", type(engine).__name__)
    if engine.rank != 0:  # one voice: the other ranks only warn
        logging.getLogger("looplib").setLevel(logging.WARNING)
