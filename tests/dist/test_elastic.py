"""A run's life across processes (issue 27): resumed on another number of processes or under
another engine it keeps the global batch and continues at the same sample; DeepSpeed goes
through its universal checkpoint; a node lost under torchrun's elastic mode does not end the
run; ``train_model`` under torchrun resumes as the command line does; a global batch the
processes cannot split is refused naming the counts that can.

(DDP on 1, 2 and 4 processes and DDP -> FSDP: tests/dist/test_engines_ddp.py; FSDP on one process
and FSDP -> DDP: tests/dist/test_engines_fsdp.py.)"""
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, run_cli
import warm_ranks
from looplib.process.launcher import free_port
from test_engines_ddp import QUICK, rows, torchrun

ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "LOOPLIB_PLOT": "0"}


def losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in rows(run_dir / "metrics.jsonl") if "loss" in m}


def same_weights(a: Path, b: Path, atol: float = 0.0) -> None:
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert x.keys() == y.keys()
    for k in x:
        torch.testing.assert_close(x[k], y[k], atol=atol, rtol=0, msg=k)


# ---------------------------------------------------------------- the rules, without processes


# ---------------------------------------------------------------- DeepSpeed: a universal checkpoint

DS = ["+engine=deepspeed", "engine.stage=2", *QUICK, "batch_size=4", "checkpoint.every_steps=2", "checkpoint.keep=3",
      "sample_tokens=0"]


def test_deepspeed_zero2_resumes_on_one_process_through_a_universal_checkpoint(tmp_path):
    """ZeRO-2 on 2 processes, resumed from step 2 with the same command by one and by four: DeepSpeed's own
    ds_to_universal converts the partitions (in a temporary directory, removed afterwards), the
    accumulation doubles, the losses and weights are the 2-process run's. The same checkpoint
    under DDP is refused before any engine is set up, and so is a DDP checkpoint under DeepSpeed
    (tests below)."""
    full = tmp_path / "full"
    r = torchrun(*DS, f"hydra.run.dir={full}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    step2 = full / "checkpoints" / "step-00000002"
    before = sorted(p.relative_to(full) for p in full.rglob("*"))
    one = tmp_path / "one"
    r = run_cli(*DS, f"resume={step2}", f"hydra.run.dir={one}", cwd=tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resume: 2 -> 1 processes: accum_steps 2 -> 4, global batch 16 kept" in r.stdout
    assert "step-00000002 made into a universal checkpoint for 1 process(es) (ds_to_universal" in r.stdout
    # made in this run's checkpoint directory, removed once loaded; the other run's left as it was
    assert not list((one / "checkpoints").glob(".tmp-*")) and sorted(p.relative_to(full) for p in full.rglob("*")) == before
    four = tmp_path / "four"
    r = torchrun(*DS, f"resume={step2}", f"hydra.run.dir={four}", cwd=tmp_path, nproc=4)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resume: 2 -> 4 processes: accum_steps 2 -> 1, global batch 16 kept" in r.stdout
    want = losses(full)
    for run in (one, four):
        assert losses(run) == pytest.approx({3: want[3], 4: want[4]}, rel=1e-5)
        same_weights(full, run, atol=1e-5)

    r = run_cli(*[a for a in DS if not a.startswith(("+engine", "engine."))], "+engine=ddp", f"resume={step2}",
                f"hydra.run.dir={tmp_path / 'ddp'}", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        "looplib: error: resume: the checkpoint holds DeepSpeed's ZeRO partitions (+engine=deepspeed), which "
        "+engine=ddp cannot load; resume with +engine=deepspeed (on any number of processes), or start a new run")
    assert "Traceback" not in r.stderr and not (tmp_path / "ddp").exists()


# ---------------------------------------------------------------- a lost node

ELASTIC = ["+engine=ddp", "data=random", "max_steps=60", "log_every=1", "eval_every=0", "eval_samples=4",
           "sample_tokens=0", "model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.seq_len=16",
           "batch_size=4", "accum_steps=2", "checkpoint.every_steps=4", "checkpoint.keep=100", "progress=lines"]


def test_a_lost_node_does_not_end_the_run(tmp_path):
    """Two torchrun agents as two nodes (one process each, ``--nnodes 1:2 --max-restarts 1``, c10d
    on 127.0.0.1), ``resume=auto`` in a fixed run directory: the second node (agent and worker) is
    killed once a checkpoint exists; the first's worker says the rank is lost, torchrun restarts it
    alone, and it continues from the last checkpoint with accumulation 4 (global batch 16 kept)
    to the end: weights equal to one process resumed from the same checkpoint."""
    run, port = tmp_path / "run", free_port()
    job = [*ELASTIC, "resume=auto", f"hydra.run.dir={run}"]

    def agent(host: bool) -> subprocess.Popen:
        conf = f"is_host={str(host).lower()},last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=2"
        return subprocess.Popen(warm_ranks.command([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc_per_node",
                                 "1", "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                 f"127.0.0.1:{port}", "--rdzv-conf", conf, "-m", "looplib.train", *job]),
                                cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)

    survivor, lost = agent(True), agent(False)  # the survivor hosts the rendezvous store
    try:
        first = run / "checkpoints" / "step-00000004" / "manifest.json"
        deadline = time.time() + 300
        while not first.exists() and time.time() < deadline and lost.poll() is None:
            time.sleep(0.005)
        assert first.exists(), "no checkpoint within 300 s"
        workers = Path(f"/proc/{lost.pid}/task/{lost.pid}/children").read_text().split()
        os.kill(lost.pid, signal.SIGKILL)  # the node: its agent and its worker at once
        for pid in workers:
            os.kill(int(pid), signal.SIGKILL)
        out = survivor.communicate(timeout=300)[0]
    finally:
        for proc in (survivor, lost):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert survivor.returncode == 0, out[-5000:]
    said = [line for line in out.splitlines() if line.startswith("looplib:")]
    assert len(said) == 1 and said[0].startswith("looplib: stopped: a rank on another host of 2 was lost") and \
        "torchrun restarts the workers on the nodes that are left (restart 1 of 1)" in said[0], out[-5000:]
    assert "resume: 2 -> 1 processes: accum_steps 2 -> 4, global batch 16 kept" in out
    resumed = re.search(r"resumed from (\S+/step-\d+) at step (\d+)", out)
    assert resumed, out[-5000:]
    assert sorted(losses(run)) == list(range(1, 61))
    assert "accum_steps: 4\n" in (run / "config.yaml").read_text()

    ref = tmp_path / "ref"
    r = run_cli(*ELASTIC, f"resume={resumed.group(1)}", f"hydra.run.dir={ref}", cwd=tmp_path,
                env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    same_weights(run, ref)
    assert losses(ref) == {s: v for s, v in losses(run).items() if s > int(resumed.group(2))}


# ---------------------------------------------------------------- train_model under torchrun

def test_train_model_under_torchrun_resumes_after_sigterm_as_the_uninterrupted_run(tmp_path):
    """train_model(..., engine=DDP(), resume="auto") on 2 processes: SIGTERM to the job saves and
    stops; the same command continues (the saved config holds nothing that differs per rank) to
    the weights and losses of the uninterrupted run."""
    worker = str(REPO / "tests" / "api_torchrun_worker.py")

    def command(run: Path) -> list[str]:
        return warm_ranks.command([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                str(free_port()), worker, str(run)])

    ref, run = tmp_path / "ref", tmp_path / "run"
    r = subprocess.run(command(ref), cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    proc = subprocess.Popen(command(run), cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    metrics, deadline = run / "metrics.jsonl", time.time() + 300
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert not (run / "model.safetensors").exists(), err[-3000:]  # stopped before the end
    assert "preempted (SIGTERM)" in err and "train_model(..., run_dir=" in err, err[-3000:]
    assert "rank" not in (run / "config.yaml").read_text()  # engine.rank differs per rank: never saved
    r = subprocess.run(command(run), cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr
    same_weights(ref, run)
    assert losses(run) == losses(ref)


# ---------------------------------------------------------------- a global batch that cannot be split

def test_a_global_batch_the_processes_cannot_split_is_refused_naming_the_counts_that_can(tmp_path):
    """A global batch of 3 (one process, batch_size=3) resumed on two processes: every rank exits 2
    before anything is built, one line says why (both ranks refuse alike: said once, by the first
    rank to post it on the launch's board), and nothing is written."""
    one = tmp_path / "one"
    job = [*QUICK, "accum_steps=1", "batch_size=3", "max_steps=2", "checkpoint.every_steps=2", "sample_tokens=0"]
    r = run_cli(*job, f"hydra.run.dir={one}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    ckpt = one / "checkpoints" / "step-00000002"
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in one.rglob("*") if p.is_file()}
    port = str(free_port())

    def rank(r: int):  # the two ranks side by side, as a launcher starts them (each a fork of the warm interpreter)
        return run_cli("+engine=ddp", *job, "max_steps=4", f"resume={ckpt}", f"hydra.run.dir={tmp_path / 'two'}",
                       cwd=tmp_path, env={"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2",
                                          "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"})

    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(rank, (0, 1)))
    assert [r.returncode for r in done] == [2, 2], [r.stderr for r in done]
    said = [[line for line in r.stderr.splitlines() if line.startswith("looplib:")] for r in done]
    assert sorted(said) == [[], [
        "looplib: error: resume: the checkpoint's global batch of 3 sequences (1 process(es) x batch_size=3 x "
        "accum_steps=1) cannot be split over 2 processes; resume on 1 or 3 processes, or start a new run"]], said
    assert "Traceback" not in done[0].stderr + done[1].stderr
    assert not (tmp_path / "two").exists()
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in one.rglob("*") if p.is_file()} == before
    assert json.loads((ckpt / "meta.json").read_text())["geometry"] == {
        "engine": "local", "format": "looplib", "world_size": 1, "batch_size": 3, "accum_steps": 1, "global_batch": 3}

    # the local engine's checkpoint under DeepSpeed: refused before DeepSpeed is set up (it took ~50 s)
    r = run_cli(*job, "+engine=deepspeed", "max_steps=4", f"resume={ckpt}", f"hydra.run.dir={tmp_path / 'ds'}",
                cwd=tmp_path)
    assert r.returncode == 2 and "DeepSpeed config derived" not in r.stdout, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "looplib: error: resume: the checkpoint was written by +engine=local (whole tensors or "
        "torch.distributed.checkpoint shards), which +engine=deepspeed cannot load; resume with +engine=ddp, "
        "+engine=fsdp or +engine=local, or start a new run")
    assert not (tmp_path / "ds").exists()
