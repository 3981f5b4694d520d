"""DDP on the CPU (gloo): two processes reproduce one process with the same global batch."""
import importlib.util
import json
import os

import pytest
import torch
from safetensors.torch import load_file

import dist_workers as W
from conftest import gpu, run_cli
from looplib.process.launcher import free_port

# Two ranks sum their halves of each window in a different order than one process does, and
# the all-reduce averages in fp32: losses agree to float rounding (1e-6 relative). Weights after
# 4 AdamW steps of lr 1e-2 agree to 1e-4 = 1% of one step: Adam divides by sqrt(v), which
# magnifies rounding where a gradient is near zero (measured: 1.2e-5 on one bias element,
# ~1e-7 elsewhere).
LOSS_RTOL, WEIGHT_ATOL = 1e-6, 1e-4


def test_two_processes_match_one_with_the_same_global_batch(tmp_path):
    W.spawn(W.ddp_worker, 2, tmp_path)
    got = torch.load(tmp_path / "ddp.pt", weights_only=True)
    losses, weights = W.local_reference(W.STEPS)
    assert got["losses"] == pytest.approx(losses, rel=LOSS_RTOL)
    for name, value in weights.items():
        torch.testing.assert_close(got["weights"][name], value, atol=WEIGHT_ATOL, rtol=0)
    # no_sync on all but the window's last micro-batch: one all-reduce per optimizer step
    # (ACCUM=2 micro-batches per step; without no_sync there would be two)
    assert got["steps"] == W.STEPS
    assert got["allreduces"] == W.STEPS
    # the held-out loss is a property of the weights: 2 ranks (each its share, summed) = 1 process
    # at batch 4 and at batch 8
    model = W.tiny_gpt()
    model.load_state_dict(got["weights"])
    for batch_size in (4, 8):
        assert got["eval_loss"] == pytest.approx(W.held_out_loss(model, W.Engine("cpu"), 1, batch_size), abs=1e-6)


QUICK = ["data=random", "max_steps=4", "log_every=1", "eval_every=2", "eval_samples=4", "sample_tokens=4",
         "model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=16", "accum_steps=2"]


def torchrun(*args, cwd, nproc=2):
    return run_cli("--nproc_per_node", str(nproc), "--master_port", str(free_port()), "-m", "looplib.train",
                   *args, cwd=cwd, module="torch.distributed.run")


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_torchrun_writes_one_run_directory_that_matches_one_process(tmp_path):
    one = tmp_path / "one"
    r = run_cli(*QUICK, "batch_size=8", f"hydra.run.dir={one}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    tracked = ["+logger=tensorboard"] if importlib.util.find_spec("tensorboard") else []
    r = torchrun("+engine=ddp", *QUICK, "batch_size=4", *tracked, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    runs = list((tmp_path / "outputs").glob("*/*"))
    assert len(runs) == 1, runs                         # one run, one directory (not one per rank)
    run = runs[0]
    assert not list(run.glob("rank*")) and (run / ".hydra" / "config.yaml").exists()
    train = [m for m in rows(run / "metrics.jsonl") if "loss" in m]
    assert [m["step"] for m in train] == [1, 2, 3, 4]    # written once, by rank 0
    ref = [m["loss"] for m in rows(one / "metrics.jsonl") if "loss" in m]
    assert [m["loss"] for m in train] == pytest.approx(ref, rel=1e-5)  # the mean over both ranks
    a, b = load_file(run / "model.safetensors"), load_file(one / "model.safetensors")
    assert a.keys() == b.keys()                          # unwrapped: no "module." prefix
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=WEIGHT_ATOL, rtol=0)
    assert r.stdout.count("a sample from the trained model") == 1
    assert "_target_: looplib.engines.DDP" in (run / "config.yaml").read_text()
    if tracked:  # only rank 0 logs: one event file, every step once
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        assert len(list(run.glob("events.out.tfevents.*"))) == 1
        acc = EventAccumulator(str(run))
        acc.Reload()
        assert [e.step for e in acc.Scalars("loss")] == [m["step"] for m in train]
        assert [e.value for e in acc.Scalars("loss")] == pytest.approx([m["loss"] for m in train], rel=1e-6)


def test_sweep_under_torchrun_one_directory_per_job(tmp_path):
    r = torchrun("-m", "+engine=ddp", *QUICK, "batch_size=2", "max_steps=2", "sample_tokens=0", "lr=1e-3,2e-3",
                 cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    sweeps = list((tmp_path / "multirun").glob("*/*"))
    assert len(sweeps) == 1, sweeps
    jobs = sorted(p.name for p in sweeps[0].iterdir() if p.is_dir())
    assert jobs == ["0", "1"]
    for job, lr in zip(jobs, (1e-3, 2e-3)):
        train = [m for m in rows(sweeps[0] / job / "metrics.jsonl") if "loss" in m]
        assert [m["step"] for m in train] == [1, 2] and train[0]["lr"] == pytest.approx(lr)
    assert not (tmp_path / "outputs").exists()


def test_one_process_without_a_launcher_is_a_world_of_one(tmp_path):
    assert "RANK" not in os.environ
    r = run_cli("+engine=ddp", *QUICK, "batch_size=4", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "DDP: 1 processes, backend gloo" in r.stdout
    assert len([m for m in rows(tmp_path / "run" / "metrics.jsonl") if "loss" in m]) == 4


def test_torchrun_resume_continues_exactly_on_any_number_of_processes_and_under_fsdp(tmp_path):
    """A 2-rank DDP run checkpointed by rank 0 (in the background: checkpoint.async=true, while both
    ranks train on) and resumed from step 2 with the same command: by
    both ranks (bitwise), by one process and by four (issue 27: the accumulation chosen so that
    the global batch of 2 x 4 x 2 = 16 stays, the micro-batch as typed), and under FSDP by two
    (looplib's whole tensors sharded on load): every later loss to 1e-5 relative, weights to 1e-5."""
    common = ["+engine=ddp", *QUICK, "batch_size=4", "checkpoint.every_steps=2", "sample_tokens=0"]
    full = tmp_path / "full"
    r = torchrun(*common, "checkpoint.async=true", f"hydra.run.dir={full}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("written in the background") == 2  # steps 2 and 4, by rank 0 only
    step2 = full / "checkpoints" / "step-00000002"
    resumed = tmp_path / "resumed"
    r = torchrun(*common, f"resume={step2}", f"hydra.run.dir={resumed}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "global batch" not in r.stdout  # nothing changed: nothing said
    a, b = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    full_losses = {m["step"]: m["loss"] for m in rows(full / "metrics.jsonl") if "loss" in m}
    resumed_losses = {m["step"]: m["loss"] for m in rows(resumed / "metrics.jsonl") if "loss" in m}
    assert resumed_losses == {3: full_losses[3], 4: full_losses[4]}

    said = {1: "resume: 2 -> 1 processes: accum_steps 2 -> 4, global batch 16 kept",
            4: "resume: 2 -> 4 processes: accum_steps 2 -> 1, global batch 16 kept",
            "fsdp": "resume: engine ddp -> fsdp: global batch 16 kept"}
    for how, line in said.items():
        run = tmp_path / f"on-{how}"
        args = [*common, f"resume={step2}", f"hydra.run.dir={run}"]
        if how == 1:
            r = run_cli(*args, cwd=tmp_path, env={"OMP_NUM_THREADS": "1"})
        elif how == 4:
            r = torchrun(*args, cwd=tmp_path, nproc=4)
        else:
            r = torchrun(*[x if x != "+engine=ddp" else "+engine=fsdp" for x in args], cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert line in r.stdout, r.stdout
        got = {m["step"]: m["loss"] for m in rows(run / "metrics.jsonl") if "loss" in m}
        assert got == pytest.approx({3: full_losses[3], 4: full_losses[4]}, rel=1e-5), how
        c = load_file(run / "model.safetensors")
        for k in a:
            torch.testing.assert_close(c[k], a[k], atol=1e-5, rtol=0, msg=f"{how} {k}")
        accum = {1: 4, 4: 1, "fsdp": 2}[how]
        assert f"accum_steps: {accum}\n" in (run / "config.yaml").read_text()  # what it ran with


@gpu
def test_torchrun_on_cuda_uses_nccl(tmp_path):
    r = torchrun("+engine=ddp", *QUICK, "batch_size=4", "device=cuda", f"hydra.run.dir={tmp_path / 'run'}",
                 cwd=tmp_path, nproc=torch.cuda.device_count())
    assert r.returncode == 0, r.stderr
    assert "backend nccl" in r.stdout


def test_ranks_given_different_jobs_refuse_in_one_line_before_building(tmp_path):
    """A value read from a per-rank environment variable (here the seed): every rank compares the
    resolved config before anything is built, and refuses alike, naming the key."""
    exit_file = tmp_path / "exit"
    r = run_cli("--nproc_per_node", "2", "--master_port", str(free_port()), "-m", "looplib.train", "+engine=ddp",
                *QUICK, "batch_size=2", "seed='${oc.decode:${oc.env:RANK}}'", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path,
                module="torch.distributed.run", env={"LOOPLIB_EXIT_FILE": str(exit_file)})
    said = [line for line in r.stderr.splitlines() if line.startswith("looplib: ")]
    assert said == ["looplib: error: seed: the 2 processes were given different jobs (seed: rank 0 0, rank 1 1); "
                    "give every process the same command and settings (no value read from a per-rank environment "
                    "variable, no clock-based seed): one run trains one configuration"], r.stderr
    assert exit_file.read_text() == "2\n" and "Traceback (most recent call last)" not in r.stderr.split("looplib:")[0]
    assert not (tmp_path / "run").exists()  # refused before training: nothing stays behind
