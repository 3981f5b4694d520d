"""Resume, preemption and kill-anywhere through the command line."""
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from looplib.store.checkpoint_dir import is_valid
from looplib.errors import EXIT_PREEMPTED

from conftest import REPO, run_cli
from looplib.store.background import HOLD
from test_faults import start, wait_for

spec = importlib.util.spec_from_file_location("kill_anywhere", REPO / "scripts" / "kill_anywhere.py")
kill_anywhere = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kill_anywhere)
ARGS = kill_anywhere.ARGS


def losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("reference")
    return kill_anywhere.reference(root), losses(root / "reference")


def test_sigterm_checkpoints_exits_75_and_resumes_exactly(tmp_path, reference):
    weights, ref_losses = reference
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "looplib.train", *ARGS, "checkpoint.every_steps=0", f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err
    assert "preempted" in err and "resume=auto" in err and "preempted" not in out  # the notice: on stderr
    ckpts = sorted((run_dir / "checkpoints").iterdir())
    assert len(ckpts) == 1 and is_valid(ckpts[0]) is None
    stopped_at = int(ckpts[0].name.split("-")[1])
    assert 3 <= stopped_at < 16
    assert not (run_dir / "model.safetensors").exists()  # not finished: no final weights yet

    r = run_cli(*ARGS, "resume=auto", f"hydra.run.dir={run_dir}", cwd=tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    assert f"resumed from {ckpts[0]} at step {stopped_at}" in r.stdout
    got = load_file(str(run_dir / "model.safetensors"))
    assert all(torch.equal(got[k], weights[k]) for k in weights)
    assert losses(run_dir) == ref_losses  # rows before the stop kept, rows after recomputed identically


def test_async_checkpoints_sigterm_waits_for_the_write_and_resumes_exactly(tmp_path, reference):
    """checkpoint.async=true, a checkpoint every step (a write is in flight at every moment): SIGTERM
    waits for the write in flight, saves, exits 75; resume=auto continues bit for bit as the
    uninterrupted (synchronous) run."""
    weights, ref_losses = reference
    run_dir = tmp_path / "run"
    proc = start(*ARGS, "checkpoint.async=true", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    seen = wait_for(proc, "step 3/")
    proc.send_signal(signal.SIGTERM)
    out = "".join(seen) + proc.communicate(timeout=120)[0]
    assert proc.returncode == EXIT_PREEMPTED, out
    newest = sorted((run_dir / "checkpoints").iterdir())[-1]
    stopped_at = int(newest.name.split("-")[1])
    assert is_valid(newest) is None and 3 <= stopped_at < 16, out
    assert out.index(f"checkpoint {newest} (") < out.index("preempted (SIGTERM)")  # written before the stop is said
    r = run_cli(*ARGS, "checkpoint.async=true", "resume=auto", f"hydra.run.dir={run_dir}", cwd=tmp_path,
                env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    assert f"resumed from {newest} at step {stopped_at}" in r.stdout
    got = load_file(str(run_dir / "model.safetensors"))
    assert all(torch.equal(got[k], weights[k]) for k in weights)
    assert losses(run_dir) == ref_losses
    end = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert end["checkpoints"] == 16 - stopped_at and end["checkpoint_write_s"] > 0 and end["checkpoint_s"] >= 0


def test_sigkill_during_a_background_write_leaves_the_previous_checkpoint_whole(tmp_path, reference):
    """The write of step 5 is held (LOOPLIB_TEST_HOLD_CHECKPOINT: after its files, before its
    manifest) while training goes on; SIGKILL then. Step 4 is whole, step 5 never counted;
    resume=auto takes step 4 and ends bit for bit as the uninterrupted run."""
    weights, ref_losses = reference
    run_dir = tmp_path / "run"
    proc = start(*ARGS, "checkpoint.async=true", f"hydra.run.dir={run_dir}", cwd=tmp_path,
                 env={HOLD: "5"})
    wait_for(proc, "holding the checkpoint write of step 5 before its manifest")
    proc.kill()
    proc.communicate(timeout=120)
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names[0].startswith(".tmp-step-00000005-") and names[1:] == ["step-00000003", "step-00000004"], names
    assert (run_dir / "checkpoints" / names[0] / "model.safetensors").exists()  # killed mid-write
    assert is_valid(run_dir / "checkpoints" / "step-00000004") is None
    r = run_cli(*ARGS, "checkpoint.async=true", "resume=auto", f"hydra.run.dir={run_dir}", cwd=tmp_path,
                env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    assert f"resumed from {run_dir / 'checkpoints' / 'step-00000004'} at step 4" in r.stdout
    got = load_file(str(run_dir / "model.safetensors"))
    assert all(torch.equal(got[k], weights[k]) for k in weights)
    assert losses(run_dir) == ref_losses
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp")]  # cleared by the next save


def test_kill_anywhere_4_trials(tmp_path, reference):
    """SIGKILL at random moments (many inside a checkpoint write), then resume=auto: the final weights
    equal the uninterrupted run's. 4 trials in CI; scripts/kill_anywhere.py --trials 100 for more."""
    results = kill_anywhere.run_trials(4, parallel=2, root=tmp_path, expected=reference[0])
    failed = [line for ok, line in results if not ok]
    assert not failed, failed
    killed_running = sum("while running" in line for _, line in results)
    assert killed_running >= 3, [line for _, line in results]


def files_of(run_dir):
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_resume_refuses_a_breaking_change_and_accepts_a_safe_one(tmp_path):
    """A refused command writes nothing anywhere: every file of the run it names (Hydra's .hydra/ and
    train.log included) stays byte for byte; max_steps below the checkpoint is refused, at it there is
    nothing to do (exit 0). The first metrics row after the resume says how many steps it averages."""
    run_dir = tmp_path / "run"
    quick = [a for a in ARGS if not a.startswith(("max_steps", "log_every"))] + ["log_every=2"]
    assert run_cli(*quick, "max_steps=3", f"hydra.run.dir={run_dir}", cwd=tmp_path).returncode == 0
    before = files_of(run_dir)
    for typed, status, said in ((["max_steps=3", "model.n_layer=2"], 2, "changed model.n_layer from 4 to 2"),
                                (["max_steps=3", "+optim=sgd"], 2, "changed optim._target_"),
                                (["max_steps=2"], 2, "error: max_steps: max_steps=2 is below the step of the checkpoint"),
                                (["max_steps=3"], 0, "nothing to do: the run in")):
        r = run_cli(*quick, *typed, "resume=auto", f"hydra.run.dir={run_dir}", cwd=tmp_path)
        lines = [line for line in r.stderr.splitlines() if line.startswith("looplib:")]
        assert r.returncode == status and len(lines) == 1 and said in lines[0], (typed, r.stderr)
        assert "Traceback" not in r.stderr
        assert files_of(run_dir) == before, typed  # byte for byte: config.yaml, .hydra/, train.log, checkpoints
    # resume=PATH at the checkpoint's own step into a new directory: nothing to do, and no directory left behind
    newest = sorted((run_dir / "checkpoints").iterdir())[-1]
    r = run_cli(*quick, "max_steps=3", f"resume={newest}", f"hydra.run.dir={tmp_path / 'new'}", cwd=tmp_path)
    lines = [line for line in r.stderr.splitlines() if line.startswith("looplib:")]
    assert r.returncode == 0 and lines == [f"looplib: nothing to do: the checkpoint {newest} is at step 3 already "
                                           "(max_steps=3); nothing was written; give max_steps above 3 to train "
                                           "further"], r.stderr
    assert not (tmp_path / "new").exists() and files_of(run_dir) == before
    r = run_cli(*quick, "max_steps=6", "resume=auto", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "changed: max_steps: 3 -> 6" in r.stdout
    assert sorted(losses(run_dir)) == [1, 2, 3, 4, 6]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {r["step"]: r["steps_averaged"] for r in rows if "loss" in r} == {1: 1, 2: 1, 3: 1, 4: 1, 6: 2}


def test_resume_auto_without_a_directory_names_only_a_run_that_can_continue(tmp_path):
    quick = [a for a in ARGS if not a.startswith("max_steps")] + ["max_steps=2", "checkpoint.every_steps=0"]
    assert run_cli(*quick, cwd=tmp_path).returncode == 0  # outputs/<date>/<time>: finished at step 2
    r = run_cli(*quick, "resume=auto", cwd=tmp_path)
    assert r.returncode == 2 and "no run under outputs/ has a checkpoint it can continue from" in r.stderr, r.stderr
    r = run_cli(*[a for a in quick if a != "max_steps=2"], "max_steps=4", "resume=auto", cwd=tmp_path)
    [run] = list((tmp_path / "outputs").glob("*/*"))
    assert r.returncode == 2 and f"the most recent run with a checkpoint is {run.relative_to(tmp_path)} (step 2)" in r.stderr, r.stderr


def test_resume_path_without_checkpoint_is_an_error(tmp_path):
    r = run_cli(*ARGS, f"resume={tmp_path / 'nothing'}", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert r.returncode == 2 and "resume: no valid checkpoint at" in r.stderr


def test_checkpoint_enabled_false_writes_no_checkpoint_but_the_same_weights(tmp_path):
    quick = [a for a in ARGS if not a.startswith("max_steps")] + ["max_steps=3"]
    on, off = tmp_path / "on", tmp_path / "off"
    assert run_cli(*quick, "checkpoint.every_steps=1", f"hydra.run.dir={on}", cwd=tmp_path).returncode == 0
    r = run_cli(*quick, "checkpoint.every_steps=1", "checkpoint.enabled=false", f"hydra.run.dir={off}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert len(list((on / "checkpoints").iterdir())) == 2 and not (off / "checkpoints").exists()
    a, b = load_file(str(on / "model.safetensors")), load_file(str(off / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    bad = run_cli(*quick, "checkpoint.enabled=sometimes", f"hydra.run.dir={tmp_path / 'bad'}", cwd=tmp_path)
    assert bad.returncode == 2 and "checkpoint.enabled" in bad.stderr and "Traceback" not in bad.stderr


def exports(run_dir):
    """The weights a run exports, byte for byte (model.safetensors, or every file of adapter/ or hf/)."""
    return {name: data for name, data in files_of(run_dir).items()
            if name == "model.safetensors" or name.startswith(("adapter/", "hf/"))}


SMALL = ["data=random", "data.n_train=32", "data.n_eval=8", "model.n_layer=1", "model.d_model=32", "model.n_head=2",
         "model.seq_len=16", "batch_size=4", "max_steps=3", "log_every=1", "eval_every=0", "eval_samples=4",
         "sample_tokens=0", "checkpoint.every_steps=1", "progress=lines"]


@pytest.mark.parametrize("extra", [[], ["checkpoint.async=true"], ["+peft=lora", "peft.allow_random_base=true"]], ids=["sync", "async", "lora"])
def test_a_run_killed_between_its_last_checkpoint_and_its_export_gets_its_weights_on_resume(tmp_path, extra):
    """Issue 43: SIGKILL after the final checkpoint was complete and before model.safetensors (or
    adapter/) was written lost the weights for good: resume=auto said "nothing to do" and exited 0.
    Now resume=auto writes them from that checkpoint, exit 0, byte for byte the uninterrupted run's."""
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    extra = [*extra, "+logger.kill._target_=signal_at.KillAfterLastCheckpoint"]
    r = run_cli(*SMALL, *extra, f"hydra.run.dir={tmp_path / 'whole'}", cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    whole = exports(tmp_path / "whole")
    assert whole
    run_dir = tmp_path / "killed"
    r = run_cli(*SMALL, *extra, f"hydra.run.dir={run_dir}", cwd=tmp_path,
                env={**env, "KILL_AFTER_LAST_CHECKPOINT": "1"})
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    final = run_dir / "checkpoints" / "step-00000003"
    assert is_valid(final) is None and not exports(run_dir)  # the final checkpoint whole, no weights
    r = run_cli(*SMALL, *extra, "resume=auto",
                f"hydra.run.dir={run_dir}", cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"ended before it wrote its weights (model.safetensors or adapter or hf): writing them now from {final}" \
        in r.stdout + r.stderr
    assert exports(run_dir) == whole
    again = run_cli(*SMALL, *extra, "resume=auto",
                    f"hydra.run.dir={run_dir}", cwd=tmp_path, env=env)  # now it is finished: nothing to do
    assert again.returncode == 0 and f"looplib: nothing to do: the run in {run_dir} is at step 3 already" in again.stderr


def test_two_identical_runs_write_the_same_state_pt_and_an_async_one_too(tmp_path):
    """Issue 43: state.pt differed between any two runs of one config (Python's and NumPy's random
    states, saved in it, were never seeded), so "an async save is byte for byte a synchronous one"
    could not hold across runs. Now both are seeded from ``seed``: two runs, and a third with
    checkpoint.async=true, write the same state.pt (and model.safetensors) at every step."""
    runs = {"a": [], "b": [], "async": ["checkpoint.async=true"]}
    for name, extra in runs.items():
        r = run_cli(*SMALL, *extra, "checkpoint.keep=3", f"hydra.run.dir={tmp_path / name}", cwd=tmp_path,
                    env={"OMP_NUM_THREADS": "1"})
        assert r.returncode == 0, r.stderr[-3000:]
    saved = {name: {step.name: ((step / "state.pt").read_bytes(), (step / "model.safetensors").read_bytes())
                    for step in sorted((tmp_path / name / "checkpoints").iterdir())} for name in runs}
    assert list(saved["a"]) == ["step-00000001", "step-00000002", "step-00000003"]
    assert saved["a"] == saved["b"] == saved["async"]
