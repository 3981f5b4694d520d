"""A refusal always arrives under torchrun (issue 34): whichever rank refuses says its line (identical
lines from several ranks said once), the others say they stopped because that rank refused (not a
preemption), and ``LOOPLIB_EXIT_FILE`` holds 2, never 75."""
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import has_bitsandbytes
import warm_ranks
from looplib.process.launcher import free_port

TESTS = Path(__file__).resolve().parents[1]  # tests/: refusing.py
JOB = ["data=random", "data.n_train=64", "data.n_eval=8", "max_steps=3", "log_every=1", "eval_every=0",
       "eval_samples=4", "sample_tokens=0", "batch_size=4", "model.n_layer=1", "model.d_model=32", "model.n_head=2",
       "model.seq_len=16", "progress=lines"]


def torchrun(tmp_path: Path, *overrides: str, run_dir: Path | None = None) -> tuple[dict[int, list[str]], str, str]:
    """Each rank's looplib lines (``--tee``: every line prefixed with its rank), the whole
    output, and what the exit file holds. ``run_dir``: an existing run's (default: a new one,
    which a refusal must leave no trace of)."""
    status = tmp_path / "status"
    status.write_text("stale\n")
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "LOOPLIB_EXIT_FILE": str(status),
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(warm_ranks.command([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(free_port()), "--tee", "3", "-m", "looplib.train", *JOB, *overrides,
                        f"hydra.run.dir={run_dir or tmp_path / 'run'}"]), cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    out = r.stdout + r.stderr
    said: dict[int, list[str]] = {0: [], 1: []}
    for rank, line in re.findall(r"^\[default(\d)\]:(looplib: .*)$", out, re.M):
        said[int(rank)].append(line)
    worker_lines = "\n".join(re.findall(r"^\[default\d\]:.*$", out, re.M))
    assert "Traceback" not in worker_lines and "SIGTERM" not in worker_lines and "preempt" not in worker_lines, out
    assert r.returncode != 0
    assert run_dir is not None or not (tmp_path / "run").exists(), out  # refused: the directory it made is gone
    return said, out, status.read_text().strip()


def test_the_rank_that_refuses_says_why_and_the_other_says_it_stopped_because_of_it(tmp_path):
    """A setting only rank 1 refuses (tests/refusing.py): the case whose line was lost, torchrun
    stopping rank 0 first with "stopped (SIGTERM)" and 75 in the exit file."""
    said, out, status = torchrun(tmp_path, "+precision._target_=refusing.RefuseOnRank", "+precision.rank=1")
    assert said[1] == ["looplib: error: precision.rank: rank 1 refuses this job (a test's setting); "
                       "leave precision.rank out"], out
    assert said[0] == ["looplib: stopped: rank 1 refused the job, so the other ranks stopped too "
                       "(nothing was trained)"], out
    assert status == "2"


def test_a_run_directory_held_by_another_run_is_refused_by_rank_0_for_every_rank(tmp_path):
    """Only rank 0 holds (and so refuses) the run directory (looplib.store.lock): it says whose it
    is; rank 1, which never looked, says it stopped because rank 0 refused. Nothing is written
    into the held directory (no .hydra/ of either rank)."""
    from looplib.store import lock
    held = tmp_path / "run"
    lock.hold(held, "hydra.run.dir")  # another run: this test's process
    try:
        said, out, status = torchrun(tmp_path, run_dir=held)
        assert said[0] == [f"looplib: error: hydra.run.dir: {held} is held by another run (host {socket.gethostname()}, "
                           f"pid {os.getpid()}, since " + said[0][0].split(", since ")[-1]], out
        assert said[0][0].endswith("give another directory (hydra.run.dir=...)")
        assert said[1] == ["looplib: stopped: rank 0 refused the job, so the other ranks stopped too "
                           "(nothing was trained)"], out
        assert status == "2"
        assert sorted(p.name for p in held.iterdir()) == [lock.LOCK_NAME]  # the holder's file, and nothing else
    finally:
        lock.release(held)


# the cases (+engine=fsdp +peft=qlora now trains: FSDP2 shards the 4-bit base; what it refuses stands in)
CASES = [["lr=-1"], ["+engine=fsdp", "+optim=adafactor"],
         pytest.param(["+engine=fsdp", "engine.offload=cpu", "+peft=qlora"],
                      marks=pytest.mark.skipif(not has_bitsandbytes(), reason="bitsandbytes is not installed"))]


@pytest.mark.parametrize("overrides", CASES, ids=lambda o: " ".join(o))
def test_a_refusal_every_rank_makes_is_said_once_and_never_lost(tmp_path, overrides):
    """Both ranks refuse alike, whichever gets there first: the refusal is said (once), and a rank
    stopped before it refused itself says which rank refused; the exit file holds 2."""
    said, out, status = torchrun(tmp_path, *overrides)
    errors = [(rank, line) for rank in said for line in said[rank] if line.startswith("looplib: error: ")]
    assert len(errors) == 1, out
    first = errors[0][0]
    assert said[first] == [errors[0][1]]
    assert said[1 - first] in ([], [f"looplib: stopped: rank {first} refused the job, so the other ranks stopped "
                                    "too (nothing was trained)"]), out
    assert status == "2"


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def damage(checkpoint: Path, **geometry) -> None:
    """Rewrite the geometry record of ``checkpoint``'s meta.json, its manifest entry to match (a
    record written wrong, not a file cut short: its checksum holds)."""
    import hashlib
    import json
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["geometry"].update(geometry)
    for key, value in geometry.items():
        if value is None:
            del meta["geometry"][key]
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    data = (checkpoint / "meta.json").read_bytes()
    manifest["files"]["meta.json"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def test_a_refused_resume_under_two_ranks_never_rewrites_the_earlier_run(tmp_path):
    """The earlier run's directory is byte for byte as it was after each refused attempt on two
    ranks (its .hydra/ was restored by both ranks through one temporary name and collided, 6 of 24
    tries): a changed setting, then a checkpoint whose geometry record is damaged (a process count
    of 0, a string), each one line naming what is wrong, exit status 2 on every rank."""
    from conftest import run_cli
    run = tmp_path / "earlier"
    r = run_cli(*JOB, "max_steps=4", "checkpoint.every_steps=2", f"hydra.run.dir={run}", cwd=tmp_path,
                env={"OMP_NUM_THREADS": "1", "LOOPLIB_PLOT": "0"})
    assert r.returncode == 0, r.stderr[-2000:]
    newest = run / "checkpoints" / "step-00000004"
    attempts = [((), ("resume=auto", "lr=1e-3", "max_steps=6"),
                 "looplib: error: resume: the config changed lr from 0.002 to 0.001 since the checkpoint"),
                ({"world_size": 0}, (f"resume={newest}", "max_steps=6"),
                 f"looplib: error: resume: {newest} is not a valid checkpoint: {newest / 'meta.json'}: its geometry "
                 "record is damaged (world_size is 0, not a whole number of at least 1)"),
                ({"world_size": "2"}, (f"resume={newest}", "max_steps=6"),
                 f"looplib: error: resume: {newest} is not a valid checkpoint: {newest / 'meta.json'}: its geometry "
                 "record is damaged (world_size is '2', not a whole number of at least 1)")]
    for geometry, overrides, line in attempts:
        if geometry:
            damage(newest, **geometry)
        before = tree(run)
        said, out, status = torchrun(tmp_path, *overrides, run_dir=run)
        errors = [x for rank in said for x in said[rank] if x.startswith("looplib: error: ")]
        assert len(errors) == 1 and errors[0].startswith(line), out
        assert status == "2"
        assert tree(run) == before  # .hydra/, train.log, metrics, checkpoints: byte for byte


@pytest.mark.parametrize("geometry,why", [({"world_size": 0}, "world_size is 0, not a whole number of at least 1"),
                                          ({"accum_steps": None}, "it lacks accum_steps"),
                                          ({"batch_size": "4"}, "batch_size is '4', not a whole number of at least 1"),
                                          ({"engine": 3}, "engine is 3, not a name")])
def test_a_damaged_geometry_record_is_a_refusal_naming_the_file(tmp_path, geometry, why):
    from looplib import ConfigError
    from looplib.store.elastic import damaged, saved_geometry
    good = {"engine": "ddp", "format": "looplib", "world_size": 2, "batch_size": 4, "accum_steps": 1,
            "global_batch": 8}
    assert damaged({"geometry": good}) is None and damaged({}) is None
    meta = {"geometry": {k: v for k, v in {**good, **geometry}.items() if v is not None}}
    assert damaged(meta) == why
    with pytest.raises(ConfigError) as err:
        saved_geometry(tmp_path, meta, {}, 1)
    assert str(err.value) == (f"resume: {tmp_path / 'meta.json'}: its geometry record is damaged ({why}); resume "
                              "from another checkpoint (resume=PATH), or start a new run")


@pytest.mark.parametrize("kind", ["symlink", "directory"])
def test_what_is_not_a_lock_file_is_refused_under_torchrun_with_the_exit_file_written(tmp_path, kind):
    """Issue 43: under torchrun a link at ``.looplib.lock`` truncated the file it led to, and a
    directory there ended in a traceback with ``LOOPLIB_EXIT_FILE`` never written. Now rank 0
    refuses it in one line, the other rank says why it stopped, the exit file holds 2, and
    nothing is written (the file outside, the directory, no ``.hydra/``)."""
    from looplib.store import lock
    run, outside = tmp_path / "run", tmp_path / "outside"
    run.mkdir()
    outside.write_text("precious\n")
    if kind == "symlink":
        (run / lock.LOCK_NAME).symlink_to(outside)
    else:
        (run / lock.LOCK_NAME).mkdir()
    said, out, status = torchrun(tmp_path, run_dir=run)
    assert said[0] == [f"looplib: error: hydra.run.dir: {run / lock.LOCK_NAME} is " + said[0][0].split(" is ", 1)[1]]
    assert "not looplib's lock file" in said[0][0], out
    assert said[1] in ([], ["looplib: stopped: rank 0 refused the job, so the other ranks stopped too "
                            "(nothing was trained)"]), out
    assert status == "2"
    assert outside.read_text() == "precious\n" and [p.name for p in run.iterdir()] == [lock.LOCK_NAME]
