"""One run per run directory (issue 34): an OS file lock taken before anything is written, a
second run refused in one line naming the holder, exit status 2, nothing of the first touched."""
import json
import os
import subprocess
import sys
import threading

import pytest

import warm
from conftest import random_tokens, tiny_gpt
from looplib import train_model
from looplib.store import lock
from looplib.store.lock import DirectoryHeld

JOB = ["data=random", "data.n_train=64", "data.n_eval=8", "max_steps=60", "log_every=1", "eval_every=0",
       "eval_samples=4", "sample_tokens=0", "batch_size=4", "model.n_layer=1", "model.d_model=32", "model.n_head=2",
       "model.seq_len=16", "progress=lines", "checkpoint.every_steps=10", "resume=auto"]


def test_two_runs_started_at_once_on_one_directory_one_trains_the_other_is_refused(tmp_path):
    """A job submitted twice: exactly one trains; the other exits 2 naming the holder (host, pid,
    since when), and metrics.jsonl holds exactly one run's rows."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "LOOPLIB_PLOT": "0", "OMP_NUM_THREADS": "1"}
    args = [*JOB, f"hydra.run.dir={tmp_path / 'dup'}"]
    started = [warm.start("looplib.train", args, tmp_path, env) for _ in range(2)]
    ran = [s.wait(600) for s in started]
    assert sorted(r.returncode for r in ran) == [0, 2], [r.stderr[-2000:] for r in ran]
    refused = next(r for r in ran if r.returncode == 2)
    said = [line for line in refused.stderr.splitlines() if line.startswith("looplib:")]
    assert len(said) == 1 and said[0].startswith(f"looplib: error: hydra.run.dir: {tmp_path / 'dup'} is held by "
                                                 "another run (host "), refused.stderr
    assert ", pid " in said[0] and ", since 20" in said[0] and "give another directory" in said[0]
    assert "Traceback" not in refused.stderr and "step 1/" not in refused.stdout + refused.stderr
    rows = [json.loads(line) for line in (tmp_path / "dup" / "metrics.jsonl").read_text().splitlines()]
    steps = [row["step"] for row in rows if "loss" in row]
    assert steps == list(range(1, 61))  # one run's rows, each step once
    assert not (tmp_path / "dup" / lock.LOCK_NAME).exists()  # released at the end


def test_train_model_on_a_held_directory_is_refused_and_writes_nothing(tmp_path):
    """Another run (here another thread of this process) holds the directory: ``train_model`` is
    refused naming it, before anything is written; once released, the same call trains."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)  # an earlier run's files, byte for byte afterwards
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 4.0}\n')
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    taken, done = threading.Event(), threading.Event()

    def other_run():
        lock.hold(run_dir, "run_dir")
        taken.set()
        done.wait(60)
        lock.release(run_dir)

    holder = threading.Thread(target=other_run)
    holder.start()
    taken.wait(60)
    try:
        with pytest.raises(DirectoryHeld) as err:
            train_model(tiny_gpt(), random_tokens(), max_steps=2, batch_size=4, run_dir=run_dir, resume="auto")
        assert err.value.status == 2
        assert str(err.value).startswith(f"run_dir: {run_dir} is held by another run of this process (pid {os.getpid()}")
        assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != lock.LOCK_NAME} == before
    finally:
        done.set()
        holder.join()
    assert not (run_dir / lock.LOCK_NAME).exists()
    result = train_model(tiny_gpt(), random_tokens(), max_steps=2, batch_size=4, run_dir=run_dir, resume="auto",
                         sample_tokens=0)
    assert result.state.step == 2 and not lock.holds(run_dir)


KILLED_HOLDER = """
import fcntl, os, signal, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.write(fd, b'{"host": "h", "pid": 1, "since": "then"}')
print("held", flush=True)
sys.stdin.readline()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_run_leaves_its_directory_free(tmp_path):
    """The kernel releases the lock of a process that dies (here SIGKILL): its lock file stays, and
    the next run takes it; while it lived, its name was what the refusal said."""
    path = tmp_path / lock.LOCK_NAME
    proc = subprocess.Popen([sys.executable, "-c", KILLED_HOLDER, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "held\n"
    with pytest.raises(DirectoryHeld) as err:
        lock.hold(tmp_path, "hydra.run.dir")
    assert "is held by another run (host h, pid 1, since then)" in str(err.value)
    proc.communicate("go\n", timeout=60)
    assert proc.returncode == -9 and path.exists()
    lock.hold(tmp_path, "hydra.run.dir")
    try:
        assert json.loads(path.read_text())["pid"] == os.getpid()
    finally:
        lock.release(tmp_path)
    assert not path.exists()


def test_a_python_run_that_ends_before_training_leaves_no_directory_behind(tmp_path):
    """The lock lives in the run directory, so holding it makes the directory; a run refused (or
    with nothing to do) before it trained removes it again: resume=PATH at the checkpoint's own
    step into a new directory."""
    from looplib.errors import NothingToDo
    train_model(tiny_gpt(), random_tokens(), max_steps=2, batch_size=4, run_dir=tmp_path / "a", sample_tokens=0)
    step = tmp_path / "a" / "checkpoints" / "step-00000002"
    with pytest.raises(NothingToDo, match=f"the checkpoint {step} is at step 2 already"):
        train_model(tiny_gpt(), random_tokens(), max_steps=2, batch_size=4, run_dir=tmp_path / "b", resume=step)
    assert not (tmp_path / "b").exists()


def not_a_lock(kind: str, path, outside):
    """Put something other than a lock file at ``path`` (issue 43)."""
    if kind == "symlink to a file":
        outside.write_text("precious\n")
        path.symlink_to(outside)
    elif kind == "dangling symlink":
        path.symlink_to(outside)
    elif kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "hard link":
        outside.write_text("precious\n")
        os.link(outside, path)


NOT_A_LOCK = ["symlink to a file", "dangling symlink", "directory", "fifo", "hard link"]
SAID = {"symlink to a file": "a symbolic link (to {outside})", "dangling symlink": "a symbolic link (to {outside})",
        "directory": "a directory", "fifo": "a FIFO", "hard link": "a regular file with 2 names"}


def tree(root):
    """Every path under ``root`` with what it is (a link's target, a file's bytes)."""
    out = {}
    for p in sorted(root.rglob("*")):
        out[str(p.relative_to(root))] = (os.readlink(p) if p.is_symlink() else "fifo" if p.is_fifo()
                                         else "dir" if p.is_dir() else p.read_bytes())
    return out


@pytest.mark.parametrize("kind", NOT_A_LOCK)
def test_something_other_than_a_lock_file_at_the_lock_path_is_refused_before_hydra_writes(tmp_path, kind):
    """``.looplib.lock`` is opened without following a link and must be a regular file of its own:
    a link (to a file outside, or dangling), a directory, a FIFO or a hard link there is refused in
    one line, exit 2, and nothing is written: not the file it leads to, not the earlier run's
    ``.hydra/``, not the thing itself (it was followed and truncated, made, or raised a traceback)."""
    from conftest import run_cli
    args = [a for a in JOB if not a.startswith(("max_steps", "checkpoint.every"))] + ["max_steps=2"]
    run_dir, outside = tmp_path / "run", tmp_path / "outside"
    assert run_cli(*args, f"hydra.run.dir={run_dir}", cwd=tmp_path).returncode == 0
    not_a_lock(kind, run_dir / lock.LOCK_NAME, outside)
    before = tree(tmp_path)
    r = run_cli(*args, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-3000:]
    said = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]
    assert said == [f"looplib: error: hydra.run.dir: {run_dir / lock.LOCK_NAME} is "
                    f"{SAID[kind].format(outside=outside)}" + said[0].split(SAID[kind].format(outside=outside), 1)[1]]
    assert "not looplib's lock file" in said[0] and said[0].endswith("or give another directory (hydra.run.dir=...)")
    assert tree(tmp_path) == before  # .hydra/ included, and the file outside (or its absence)


@pytest.mark.parametrize("kind", ["symlink to a file", "fifo"])
def test_train_model_refuses_what_is_not_a_lock_file(tmp_path, kind):
    """The same rule for ``train_model`` (it holds its directory in ``looplib.store.lock`` too)."""
    run_dir, outside = tmp_path / "run", tmp_path / "outside"
    run_dir.mkdir()
    not_a_lock(kind, run_dir / lock.LOCK_NAME, outside)
    before = tree(tmp_path)
    with pytest.raises(lock.NotALock) as err:
        train_model(tiny_gpt(), random_tokens(), max_steps=2, batch_size=4, run_dir=run_dir, sample_tokens=0)
    assert err.value.status == 2 and str(err.value).startswith(f"run_dir: {run_dir / lock.LOCK_NAME} is ")
    assert tree(tmp_path) == before and not lock.holds(run_dir)


LAUNCHERS = [[], ["hydra/launcher=joblib", "hydra.launcher.n_jobs=1"]]


@pytest.mark.parametrize("launcher", LAUNCHERS, ids=["basic", "joblib"])
def test_a_sweep_job_pointed_into_a_live_runs_directory_is_refused_before_hydra_writes(tmp_path, launcher):
    """Issue 43: a sweep re-submitted with resume=auto while its first job still runs. Its job 0
    directory is that live run's: refused in one line naming the job's directory (not only
    hydra.sweep.dir), exit 2, and the live run's .hydra/ (config.yaml, hydra.yaml, overrides.yaml)
    byte for byte as it was (Hydra rewrote them before any callback ran). With the joblib launcher
    the job runs in a worker process, where Hydra wrote .hydra/ before any callback: now the job
    writes it, after the callback has held the directory, on every launcher."""
    if launcher:
        pytest.importorskip("hydra_plugins.hydra_joblib_launcher", reason="pip install hydra-joblib-launcher")
    from looplib.store.background import HOLD
    from test_faults import start, wait_for
    from conftest import run_cli
    sweep = tmp_path / "sweep"
    args = [a for a in JOB if not a.startswith(("max_steps", "checkpoint"))] + ["max_steps=4", "checkpoint.every_steps=2"]
    live = start(*args, f"hydra.run.dir={sweep / '0'}", cwd=tmp_path, env={HOLD: "2"})
    try:
        wait_for(live, "holding the checkpoint write of step 2")  # training, its directory held
        before = {p: p.read_bytes() for p in sorted((sweep / "0" / ".hydra").iterdir())}
        assert len(before) == 3
        r = run_cli("-m", *launcher, *args, "seed=0,1", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
        assert r.returncode == 2, r.stderr[-3000:]
        said = [line for line in r.stderr.splitlines() if line.startswith("looplib:")]
        assert len(said) == 1 and said[0].startswith(
            f"looplib: error: hydra.sweep.dir: the directory of job 0 of the sweep, {sweep / '0'}, is held by another "
            f"run (host "), r.stderr[-3000:]
        assert f"pid {live.pid}, since " in said[0] and "Traceback" not in r.stderr
        assert {p: p.read_bytes() for p in sorted((sweep / "0" / ".hydra").iterdir())} == before
        assert not (sweep / "1").exists()  # no job ran
    finally:
        os.killpg(live.pid, 9)
        live.communicate(timeout=60)


def test_a_second_run_into_a_live_runs_directory_is_not_advised_to_resume_it(tmp_path):
    """Issue 43: a run started (without resume) into a directory whose run is still going was told
    "continue it with resume=auto", which then said "held by another run". Now the line says the
    run there is still going, who holds it, and to wait for its end; exit 2, nothing written."""
    from conftest import run_cli
    run_dir = tmp_path / "live"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 4.0}\n')
    lock.hold(run_dir, "hydra.run.dir")  # the live run: this test's process
    try:
        before = tree(run_dir)
        args = [a for a in JOB if a != "resume=auto"]
        r = run_cli(*args, f"hydra.run.dir={run_dir}", cwd=tmp_path)
        assert r.returncode == 2, r.stderr[-3000:]
        said = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]
        assert len(said) == 1 and said[0].startswith(
            f"looplib: error: hydra.run.dir: {run_dir} holds a run that is still going (host "), said
        assert f"pid {os.getpid()}, since " in said[0] and "its files: metrics.jsonl)" in said[0]
        assert said[0].endswith("wait for that run to end (resume=auto then continues it), or give a new directory "
                                "(hydra.run.dir=...)"), said[0]
        assert tree(run_dir) == before
    finally:
        lock.release(run_dir)
    assert lock.held_by(run_dir) is None
