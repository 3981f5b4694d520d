"""FSDP2 on the CPU (gloo): two processes reproduce one process and DDP; sharded checkpoints
resume exactly, and onto another number of processes."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from safetensors.torch import load_file, save_model

import dist_workers as W
from conftest import gpu, needs_bnb, run_cli
import warm_ranks
from looplib.engines.deepspeed import CPUAdam
from looplib.engines.fsdp import FSDP as FSDPEngine
from looplib.process.launcher import free_port
from looplib.errors import ConfigError
from looplib.evaluation import Evaluation, HalfWeights
from looplib.optim import SGD, Adafactor, Adam8bit
from looplib.precision import FP32
from looplib.store.checkpoint_dir import is_valid
from test_engines_ddp import QUICK, WEIGHT_ATOL, rows, torchrun

# As for DDP (tests/dist/test_engines_ddp.py): two ranks sum their halves of each window in another
# order than one process, and FSDP reduce-scatters in fp32: losses agree to float rounding,
# weights after 4 AdamW steps of lr 1e-2 to 1e-4 (1% of one step; Adam's 1/sqrt(v) magnifies
# rounding where a gradient is near zero).
LOSS_RTOL = 1e-6


def test_two_processes_match_one_process_and_ddp(tmp_path):
    W.spawn(W.fsdp_worker, 2, tmp_path)
    got = torch.load(tmp_path / "fsdp.pt", weights_only=True)
    losses, weights = W.local_reference(W.STEPS)
    assert got["losses"] == pytest.approx(losses, rel=LOSS_RTOL)
    assert got["losses"] == pytest.approx(got["ddp_losses"], rel=LOSS_RTOL)
    # clipping (max norm 0.5, below every step's norm) on sharded gradients: the norm is the
    # global one, as DDP's all-reduced gradients give it
    assert min(got["ddp_grad_norms"]) > W.CLIP
    assert got["grad_norms"] == pytest.approx(got["ddp_grad_norms"], rel=1e-5)
    assert sorted(got["weights"]) == sorted(weights)
    # model.safetensors: the gathered weights, tied ones stored once, as the local engine writes them
    save_model(W.tiny_gpt(), str(tmp_path / "local.safetensors"))
    assert sorted(got["export"]) == sorted(load_file(tmp_path / "local.safetensors"))
    for name, value in weights.items():
        torch.testing.assert_close(got["weights"][name], value, atol=WEIGHT_ATOL, rtol=0)
        torch.testing.assert_close(got["weights"][name], got["ddp_weights"][name], atol=WEIGHT_ATOL, rtol=0)
        assert name not in got["export"] or torch.equal(got["export"][name], got["weights"][name])
    # accumulation (2 micro-batches per step): each unit's gradients reduce-scattered once per
    # optimizer step, on the window's last micro-batch (without set_requires_gradient_sync: twice)
    assert got["steps"] == W.STEPS
    assert got["reduce_calls"] == W.STEPS * got["units"] == W.STEPS * 3  # 2 blocks + the root
    # fp16: 16-bit compute, ShardedGradScaler; an inf on rank 1 alone skips the step on rank 0 too
    assert got["fp16"] == {"scaler": "ShardedGradScaler", "scale": 2.0**9, "param_dtype": "torch.float16",
                           "norm": float("inf"), "unchanged": True}


# activation checkpointing on the blocks FSDP shards: recomputation runs inside the gathered block
FSDP = ["+engine=fsdp", "+checkpointing=blocks", *QUICK, "max_steps=6", "checkpoint.every_steps=2"]


def losses(run_dir):
    return {m["step"]: m["loss"] for m in rows(run_dir / "metrics.jsonl") if "loss" in m}


def test_preempted_run_resumes_bitwise_and_onto_one_process(tmp_path):
    """SIGTERM to the whole job (as a scheduler sends it) under torchrun, its sharded checkpoints
    written in the background (checkpoint.async=true: DCP on a process group of its own, rank 0's
    manifest after every rank's shards): exit 75, resume=auto bitwise equal to the uninterrupted
    (synchronous) run. The same run's step-4
    checkpoint, resumed with the same command by one process (the accumulation doubles: the same
    global batch) and under DDP by two, continues with the same losses and weights."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    ref = tmp_path / "ref"
    r = torchrun(*FSDP, "batch_size=4", f"hydra.run.dir={ref}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("a sample from the trained model") == 1  # generate() through the FSDP root
    ckpt = ref / "checkpoints" / "step-00000004"
    assert is_valid(ckpt) is None
    shards = sorted(p.name for p in (ckpt / "shards").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # one file per rank
    assert set(json.loads((ckpt / "manifest.json").read_text())["files"]) >= {f"shards/{s}" for s in shards}

    run = tmp_path / "run"
    cmd = warm_ranks.command([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), "-m", "looplib.train", *FSDP, "batch_size=4", "checkpoint.async=true",
           f"hydra.run.dir={run}"])
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    metrics, deadline = run / "metrics.jsonl", time.time() + 300
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 1):
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    saved = [p for p in (run / "checkpoints").iterdir() if is_valid(p) is None]
    assert saved and not (run / "model.safetensors").exists(), err  # stopped before the end, with a checkpoint
    r = torchrun(*FSDP, "batch_size=4", "checkpoint.async=true", "resume=auto", f"hydra.run.dir={run}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stdout and "written in the background" in r.stdout
    a, b = load_file(ref / "model.safetensors"), load_file(run / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert losses(run) == losses(ref)

    # the same command on one process: the accumulation doubles, the global batch stays (issue 27);
    # and the same checkpoint under DDP on two processes: DCP's shards read whole
    one, ddp = tmp_path / "one", tmp_path / "ddp"
    r = run_cli(*FSDP, "batch_size=4", f"resume={ckpt}", f"hydra.run.dir={one}", cwd=tmp_path,
                env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    assert "resume: 2 -> 1 processes: accum_steps 2 -> 4, global batch 16 kept" in r.stdout
    r = torchrun(*[a for a in FSDP if a != "+engine=fsdp"], "+engine=ddp", "batch_size=4", f"resume={ckpt}",
                 f"hydra.run.dir={ddp}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "resume: engine fsdp -> ddp: global batch 16 kept" in r.stdout
    four = tmp_path / "four"  # and on four: the accumulation halves
    r = torchrun(*FSDP, "batch_size=4", f"resume={ckpt}", f"hydra.run.dir={four}", cwd=tmp_path, nproc=4)
    assert r.returncode == 0, r.stderr
    assert "resume: 2 -> 4 processes: accum_steps 2 -> 1, global batch 16 kept" in r.stdout
    ref_losses = losses(ref)
    for run in (one, ddp, four):
        assert losses(run) == pytest.approx({s: ref_losses[s] for s in (5, 6)}, rel=1e-5)
        c = load_file(run / "model.safetensors")
        for k in a:
            torch.testing.assert_close(c[k], a[k], atol=1e-5, rtol=0)


@pytest.mark.parametrize("optim, words", [
    (Adafactor(lr=1e-3), "Adafactor: torch's Adafactor scales each step by the parameter's norm"),
    (CPUAdam(lr=1e-3), "DeepSpeedCPUAdam: DeepSpeed's CPU Adam steps DeepSpeed's flat partitions"),
    pytest.param("adam8bit", "AdamW8bit: bitsandbytes' 8-bit optimizers", marks=needs_bnb),
])
def test_optimizers_that_cannot_step_on_shards_are_refused(optim, words):
    if optim == "adam8bit":
        optim = Adam8bit(lr=1e-3)
    with pytest.raises(ConfigError, match="^optim: \\+engine=fsdp with " + words):
        FSDPEngine("cpu").check(W.settings(2), FP32(), optim)
    FSDPEngine("cpu").check(W.settings(2), FP32(), SGD(lr=1e-3))  # SGD and AdamW step on DTensors


def test_bad_engine_keys_are_refused():
    with pytest.raises(ConfigError, match="^engine.offload: engine.offload=cpu moves shards .* already the CPU"):
        FSDPEngine("cpu", offload="cpu").check(W.settings(2), FP32(), None)
    with pytest.raises(ConfigError, match="^evaluation: \\+evaluation=bf16/fp16 casts each parameter's .data"):
        FSDPEngine("cpu").check_evaluation(HalfWeights("bfloat16"))
    FSDPEngine("cpu").check_evaluation(Evaluation())
    with pytest.raises(ConfigError, match="^engine.blocks: neither engine.blocks nor engine.block_names"):
        FSDPEngine("cpu", blocks=[])
    with pytest.raises(ConfigError, match="^engine.block_names: .* is not a regular expression"):
        FSDPEngine("cpu", block_names="blocks[")


def test_refusal_is_one_line_and_exit_2_on_every_rank(tmp_path):
    """Both ranks refuse at build time, before any process group (so neither waits for the
    other); each rank that refuses says why in one line (started by hand, with no launcher's store
    to say it once through: looplib.process.board)."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "looplib.train", "+engine=fsdp", "data=random", "+optim=adafactor",
                               f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, "PYTHONWARNINGS": "ignore", "RANK": str(rank), "WORLD_SIZE": "2",
                                   "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
             for rank in (0, 1)]
    done = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [2, 2]
    said = [[line for line in err.splitlines() if line.startswith("looplib: error:")] for _, err in done]
    assert len(said[0]) == 1 and said[1] == said[0], said
    assert said[0][0].startswith("looplib: error: optim: +engine=fsdp with Adafactor:")
    assert not (tmp_path / "run").exists()  # nothing half-written


@gpu
@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_torchrun_on_cuda_uses_nccl_with_and_without_offload(tmp_path, offload):
    r = torchrun("+engine=fsdp", *QUICK, "batch_size=4", "device=cuda", "+precision=bf16", f"engine.offload={offload}",
                 f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, nproc=torch.cuda.device_count())
    assert r.returncode == 0, r.stderr
    assert "backend nccl" in r.stdout and "parameters in torch.bfloat16, gradients reduced in torch.float32" in r.stdout
    assert ("shards offloaded to the CPU" in r.stdout) == (offload == "cpu")
    assert (tmp_path / "run" / "model.safetensors").exists()


@gpu
def test_fp8_weights_are_gathered_in_fp8_under_fsdp_on_cuda(tmp_path):
    """+precision=fp8 under +engine=fsdp with the tensorwise recipe: the sharded weights are cast to
    fp8 before the all-gather (torchao's weight wrapper), scales precomputed after each step; it
    trains to a finite loss and says so (skipped below compute capability 8.9, where fp8 is refused)."""
    pytest.importorskip("torchao")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability >= 8.9")
    r = torchrun("+engine=fsdp", *QUICK, "model.d_model=64", "batch_size=4", "device=cuda", "+precision=fp8",
                 "precision.filter=none", "+compile=default", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path,
                 nproc=torch.cuda.device_count())
    assert r.returncode == 0, r.stderr
    assert "FSDP all-gathers in fp8" in r.stdout
    losses = [row["loss"] for row in rows(tmp_path / "run" / "metrics.jsonl") if "loss" in row]
    assert losses and all(loss == loss and loss < 10 for loss in losses)
