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
from looplib.data.loading import EpochSampler, Epochs
from looplib.engines.launch import free_port
from looplib.errors import ConfigError
from looplib.run.elastic import Geometry, check_epoch_end, split, what_changed
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

def test_the_split_keeps_the_global_batch_and_names_the_counts_that_can():
    two = Geometry("ddp", "looplib", 2, 4, 2)  # 2 processes x 4 x 2 = 16
    assert split(two, 1, 4, 2) == (4, 4)    # the same command on one process: accumulation 4
    assert split(two, 4, 4, 2) == (4, 1)    # on four: the micro-batch as typed divides 16 / 4
    assert split(two, 8, 4, 2) == (2, 1)    # on eight it cannot: the largest that divides 2
    assert split(two, 1, 16, 1) == (16, 1)  # batch_size=16 accum_steps=1 keeps it: as typed
    assert split(two, 1, 16, 2) == (16, 1)  # the accumulation as saved: chosen again
    with pytest.raises(ConfigError, match=r"^resume: the checkpoint's global batch of 16 sequences \(2 process\(es\) "
                                          r"x batch_size=4 x accum_steps=2\) cannot be split over 3 processes; "
                                          r"resume on 1, 2, 4, 8 or 16 processes, or start a new run$"):
        split(two, 3, 4, 2)
    with pytest.raises(ConfigError, match=r"choose batch_size x accum_steps = 16 per process, or leave accum_steps=2"):
        split(two, 1, 4, 3)  # an accumulation typed anew that changes the global batch
    assert what_changed(two, Geometry("ddp", "looplib", 1, 4, 4)) == \
        "2 -> 1 processes: accum_steps 2 -> 4, global batch 16 kept"
    assert what_changed(two, Geometry("fsdp", "dcp", 2, 4, 2)) == "engine ddp -> fsdp: global batch 16 kept"
    assert what_changed(two, Geometry("ddp", "looplib", 2, 2, 4)) == \
        "batch_size 4 -> 2, accum_steps 2 -> 4, global batch 16 kept"
    assert what_changed(two, two) == ""


def consumed(world: int, batch: int, keep: int | None, n: int, epoch_start: int, micro: int) -> list[int]:
    """The samples ``micro`` micro-batches per rank read on ``world`` ranks from ``epoch_start``
    micro-batches into the epoch, as one list in the order of the epoch's permutation."""
    per_rank = []
    for rank in range(world):
        sampler = EpochSampler(n, seed=3, rank=rank, world=world, keep=keep)
        sampler.set_epoch(0, epoch_start * batch)
        per_rank.append(list(sampler)[: micro * batch])
    return sorted(i for r in per_rank for i in r)


def test_the_position_is_a_sample_of_the_permutation_on_any_number_of_processes():
    """2 ranks x micro-batch 4 x 3 micro-batches read the first 24 samples of the epoch's
    permutation; restored on 1 process with micro-batch 8 the stream goes on at sample 24, and
    the next 16 samples are those the 2 ranks would have read next. An epoch read to its end
    restores as ended; the epoch keeps the first run's size."""
    n = 64
    loader = torch.utils.data.DataLoader(range(n), batch_size=4, sampler=EpochSampler(n, seed=3, rank=0, world=2))
    epochs = Epochs(loader)
    epochs.batches_seen = 3
    saved = epochs.position()
    assert saved == {"epoch": 0, "batches_seen": 3, "samples": 24, "epoch_samples": 64}
    one = Epochs(torch.utils.data.DataLoader(range(n), batch_size=8, sampler=EpochSampler(n, seed=3, world=1)))
    one.restore(saved, world=2, batch_size=4)
    assert one.batches_seen == 3  # 24 samples = 3 micro-batches of 8
    assert consumed(1, 8, 64, n, one.batches_seen, 2) == consumed(2, 4, None, n, 3, 2)
    perm = consumed(1, 1, 64, n, 0, n)
    assert sorted(consumed(2, 4, None, n, 0, 3)) == sorted(perm[:0] + consumed(1, 1, 64, n, 0, 24))
    ended = {"epoch": 0, "batches_seen": 8, "samples": 64, "epoch_samples": 64}
    one.restore(ended)
    assert one.batches_seen == 8 and len(one.loader.sampler) - one.batches_seen * 8 <= 0
    odd = Epochs(torch.utils.data.DataLoader(range(63), batch_size=4, sampler=EpochSampler(63, seed=3, world=1)))
    odd.restore({"epoch": 1, "batches_seen": 2, "samples": 16, "epoch_samples": 62})  # saved by 2 ranks: 62 of 63
    assert odd.loader.sampler.keep == 62 and odd.epoch == 1 and odd.batches_seen == 4
    # a position written before samples were counted: micro-batches on the world it was saved on
    old = Epochs(torch.utils.data.DataLoader(range(n), batch_size=8, sampler=EpochSampler(n, seed=3, world=1)))
    old.restore({"epoch": 0, "batches_seen": 3}, world=2, batch_size=4)
    assert old.batches_seen == 3


def test_an_epoch_end_the_processes_cannot_reproduce_is_refused_only_when_reached():
    """62 samples per epoch (2 ranks of 63), 4 processes: the end of the epoch would differ."""
    meta = {"step": 2, "samples": 32, "epoch_samples": 62}
    four = Geometry("ddp", "looplib", 4, 2, 2)  # 16 per step: steps 3 and 4 end the epoch (62 - 32 = 30)
    check_epoch_end(meta, four, max_steps=3)  # stops before the epoch's end: exact
    with pytest.raises(ConfigError, match=r"epochs hold 62 samples, which 4 processes cannot split evenly: from step 4 "
                                          r"on, .* resume on 1 or 2 processes, or stop before the epoch's end "
                                          r"\(max_steps=3\)"):
        check_epoch_end(meta, four, max_steps=4)
    check_epoch_end(meta, Geometry("ddp", "looplib", 2, 4, 2), max_steps=100)  # 2 divides 62


def test_deepspeeds_zero3_universal_load_slips_are_put_right():
    """DeepSpeed 0.19.8's ZeRO-3 universal load gives every group the first group's
    hyperparameters and one step tensor to every partition (Adam then counts it up once per
    partition): each group gets its own back, each state its own step."""
    from looplib.engines.deepspeed_universal import fix_universal_groups
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([{"params": [a], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}], lr=1.0)
    built = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    step = torch.tensor(2.0)
    for group in opt.param_groups:  # what the slip leaves
        group.update(weight_decay=0.1, lr=5.0)
    for p in (a, b):
        opt.state[p].update(step=step, exp_avg=torch.zeros(2), exp_avg_sq=torch.zeros(2))
    fix_universal_groups(opt, built, {"scheduler": {"_last_lr": [0.25, 0.25]}})
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert [g["lr"] for g in opt.param_groups] == [0.25, 0.25]
    assert opt.state[a]["step"] is not opt.state[b]["step"] and float(opt.state[b]["step"]) == 2.0


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
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc_per_node",
                                 "1", "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                 f"127.0.0.1:{port}", "--rdzv-conf", conf, "-m", "looplib.train", *job],
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
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                str(free_port()), worker, str(run)]

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
