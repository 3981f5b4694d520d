"""Faults as users meet them (issue 11): nothing hangs, nothing lost, one line and a documented status.

Groups: hangs and signals at any point; a run directory that holds another run; malformed
checkpoints; a corrupt token cache and an unwritable run directory; Ctrl-C; torchrun statuses.
"""
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from looplib import optim as lo
from looplib.data import Epochs, PythonSource, RandomTokens, build_loader
from looplib.process.launcher import free_port
from looplib.errors import ConfigError
from looplib.loop import fit
from looplib.models import GPT
from looplib.precision import FP32
from looplib.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, Interrupted
from looplib.run.signals import Signals
from looplib.store.checkpoint_dir import InvalidCheckpoint, find_checkpoint, is_valid
from looplib.store import resume
from looplib.store.saving import Checkpoints
from looplib.train_state import TrainState

from conftest import REPO, run_cli
import warm_ranks

TINY = ["data=random", "data.n_train=64", "data.n_eval=8", "model.n_layer=1", "model.d_model=32", "model.n_head=2",
        "model.seq_len=16", "batch_size=4", "log_every=1", "eval_every=0", "eval_samples=4", "sample_tokens=0",
        "checkpoint.every_steps=1", "progress=lines"]
ENV = {"PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def looplib_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("looplib:")]


def files(root: Path) -> dict:
    """Every file under ``root`` with its bytes' digest (to prove nothing was touched)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def start(*args, cwd, module="looplib.train", env=None) -> subprocess.Popen:
    argv = [sys.executable, "-m", module, *args]
    if module == "torch.distributed.run":
        argv = warm_ranks.command(argv)
    return subprocess.Popen(argv, cwd=cwd, env={**os.environ, **ENV, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_for(proc: subprocess.Popen, text: str, timeout: float = 300) -> list[str]:
    """Read the process's output until a line holds ``text`` (no timing assumptions)."""
    seen, deadline = [], time.time() + timeout
    for line in proc.stdout:
        seen.append(line)
        if text in line:
            return seen
        assert time.time() < deadline, "".join(seen)
    raise AssertionError(f"{text!r} never appeared:\n{''.join(seen)}")


# ---------------------------------------------------------------- 1. hangs and signals at any point

def test_an_epoch_without_a_batch_is_an_error_not_an_endless_loop():
    with pytest.raises(ConfigError, match="data: the training data yields no batch .3 training sequences for "
                                          "batch_size=4 with drop_last"):
        Epochs(build_loader(RandomTokens(3, 8, 16), batch_size=4, seed=0, drop_last=True))

    class Nothing(torch.utils.data.IterableDataset):  # no __len__: found at the first epoch's end
        def __iter__(self):
            return iter(())
    epochs = iter(Epochs(DataLoader(Nothing(), batch_size=2)))
    assert list(next(epochs)) == []
    with pytest.raises(ConfigError, match="yields no batch"):
        next(epochs)


def test_a_corpus_shorter_than_one_sequence_is_one_line_and_exit_2(tmp_path):
    r = run_cli(*[a for a in TINY if not a.startswith("data")], "data=pysource", "data.max_bytes=6000", "model.seq_len=4096", f"hydra.run.dir={tmp_path / 'run'}",
                cwd=tmp_path, env={**ENV, "LOOPLIB_CACHE": str(tmp_path / "cache")}, timeout=300)
    # a corpus shorter than one sequence; before the fix: an endless loop at full CPU
    assert r.returncode == 2, r.stderr
    assert looplib_lines(r.stderr) == [r.stderr.strip()] and "yields no batch" in r.stderr
    assert not (tmp_path / "run").exists()  # nothing half-written


def test_sigterm_before_training_exits_75_and_leaves_nothing(tmp_path):
    """A signal while the tokenizer is trained (the longest part before training) stops at once."""
    cache = tmp_path / "cache"
    proc = start("data=pysource", "data.max_bytes=400000", "model.n_layer=1", "max_steps=2",
                 f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, env={"LOOPLIB_CACHE": str(cache)})
    wait_for(proc, "byte-level BPE tokenizer")
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == EXIT_PREEMPTED, out
    assert "before training started; nothing was saved" in out and "Traceback" not in out
    assert not (tmp_path / "run").exists()
    assert not cache.exists() or not [p for p in cache.iterdir() if ".tmp" in p.name]  # no half-built cache


def test_a_signal_while_training_is_a_flag_and_a_second_ctrl_c_stops_at_once():
    before = signal.getsignal(signal.SIGINT)  # default_int_handler; ignored in a pytest-xdist worker
    with Signals() as signals:
        with pytest.raises(Interrupted):  # before training: at once
            os.kill(os.getpid(), signal.SIGTERM)
        signals.signum = None
        with signals.deferred():
            os.kill(os.getpid(), signal.SIGINT)      # first Ctrl-C: the loop saves and stops
            assert signals.requested and signals.status == EXIT_INTERRUPTED
            with pytest.raises(Interrupted) as stop:  # second Ctrl-C: now
                os.kill(os.getpid(), signal.SIGINT)
            assert stop.value.status == EXIT_INTERRUPTED
    assert signal.getsignal(signal.SIGINT) is before  # restored


# ---------------------------------------------------------------- 2. another run's results

def test_a_run_directory_holding_a_run_is_refused_untouched(tmp_path):
    run_dir = tmp_path / "run"  # what an earlier run left: Hydra's files and looplib's
    for name in (".hydra/config.yaml", "train.log", "metrics.jsonl", "model.safetensors",
                 "checkpoints/step-00000002/manifest.json"):
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(f"the earlier run's {name}\n")
    before = files(run_dir)
    r = run_cli(*TINY, "max_steps=3", f"hydra.run.dir={run_dir}", cwd=tmp_path, env=ENV)
    assert r.returncode == 2, r.stderr  # before the fix: trained into it, mixing two runs
    assert looplib_lines(r.stderr) == [r.stderr.strip()], r.stderr
    assert "already holds files (checkpoints, metrics.jsonl, model.safetensors)" in r.stderr and "resume=auto" in r.stderr
    assert files(run_dir) == before  # .hydra/ and the log included: refused before Hydra wrote


def test_an_unwritable_run_directory_is_one_line_not_a_traceback(tmp_path):
    (tmp_path / "taken").write_text("a file where the run directory should be")
    r = run_cli(*TINY, f"hydra.run.dir={tmp_path / 'taken' / 'run'}", cwd=tmp_path, env=ENV)
    assert r.returncode == 2 and looplib_lines(r.stderr) == [r.stderr.strip()], r.stderr
    assert "is a file, not a directory" in r.stderr


# ---------------------------------------------------------------- 4. malformed checkpoints

def three_checkpoints(root: Path, d_model: int = 32) -> Checkpoints:
    torch.manual_seed(0)
    model = GPT(vocab_size=64, seq_len=16, n_layer=1, n_head=2, d_model=d_model)
    optimizer = lo.AdamW(lr=1e-2).build(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    epochs = Epochs(build_loader(RandomTokens(16, 16, 64), batch_size=4, seed=0))
    ckpt = Checkpoints(root, every_steps=1, keep=3, config={"model": {"d_model": d_model}})
    ckpt.bind(model=model, optimizer=optimizer, scheduler=scheduler, precision=FP32(), epochs=epochs)
    fit(model, epochs, objective=__import__("looplib").TokenCrossEntropy(), optimizer=optimizer,
        scheduler=scheduler, max_steps=3, checkpoints=ckpt)
    return ckpt


def rewrite_manifest(path: Path, edit) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps(edit(manifest)))


def refresh(path: Path, name: str) -> None:
    """Make the manifest agree with a changed file (as a careless copy or an attacker would)."""
    from looplib.store.checkpoint_dir import sha256

    def edit(m):
        m["files"][name] = {"size": (path / name).stat().st_size, "sha256": sha256(path / name)}
        return m
    rewrite_manifest(path, edit)


def drop(path: Path, name: str) -> None:
    (path / name).unlink()
    rewrite_manifest(path, lambda m: {"files": {k: v for k, v in m["files"].items() if k != name}})


MALFORMED = {
    "manifest is a list": lambda p: rewrite_manifest(p, lambda m: [m]),
    "manifest entry without size": lambda p: rewrite_manifest(
        p, lambda m: {"files": {k: {"sha256": v["sha256"]} for k, v in m["files"].items()}}),
    "empty file list": lambda p: rewrite_manifest(p, lambda m: {"files": {}}),
    "state.pt gone from disk and manifest": lambda p: drop(p, "state.pt"),
    "unparsable config.yaml": lambda p: ((p / "config.yaml").write_text("a: [1, 2\n"), refresh(p, "config.yaml")),
    "unreadable state.pt": lambda p: ((p / "state.pt").write_bytes(b"not a pickle"), refresh(p, "state.pt")),
    "weights of another model": "d_model",
}


@pytest.mark.parametrize("fault", list(MALFORMED))
def test_a_malformed_checkpoint_is_skipped_by_auto_and_refused_by_path(tmp_path, fault, caplog):
    ckpt = three_checkpoints(tmp_path)
    newest = tmp_path / "step-00000003"
    if MALFORMED[fault] == "d_model":  # a checkpoint of a wider model put in its place
        other = three_checkpoints(tmp_path / "other", d_model=48)
        for name in ("model.safetensors", "state.pt"):
            (newest / name).write_bytes((tmp_path / "other" / "step-00000003" / name).read_bytes())
            refresh(newest, name)
    else:
        MALFORMED[fault](newest)
    model = ckpt.parts["model"]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    problem = is_valid(newest, model)
    assert problem, fault
    with caplog.at_level("WARNING", logger="looplib"):
        assert resume.find(ckpt, tmp_path) == tmp_path / "step-00000002"  # resume=auto: the newest good one
    assert f"skipping checkpoint {newest}: {problem}" in caplog.text
    with pytest.raises(ConfigError, match="not a valid checkpoint") as err:  # resume=PATH: one line
        resume.load(ckpt, newest, TrainState())
    assert "\n" not in str(err.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing loaded


def test_resume_path_to_a_bad_checkpoint_is_one_line_and_leaves_no_run_directory(tmp_path):
    three_checkpoints(tmp_path / "old")
    bad = tmp_path / "old" / "step-00000003"
    rewrite_manifest(bad, lambda m: {"files": {}})
    r = run_cli(*TINY, "max_steps=3", f"resume={bad}", f"hydra.run.dir={tmp_path / 'new'}", cwd=tmp_path, env=ENV)
    assert r.returncode == 2, r.stderr
    assert looplib_lines(r.stderr) == [r.stderr.strip()] and "not a valid checkpoint" in r.stderr
    assert not (tmp_path / "new").exists()
    with pytest.raises(InvalidCheckpoint, match="not a directory"):  # resume=PATH naming a file
        find_checkpoint(bad / "state.pt")


# ---------------------------------------------------------------- 5. the environment

def test_a_corrupt_token_cache_is_rebuilt_with_a_warning(tmp_path, caplog):
    root = tmp_path / "src"
    root.mkdir()
    for i in range(3):
        (root / f"m{i}.py").write_text("def f(x):\n    return x + %d\n" % i * 20)
    corpus = PythonSource(seq_len=8, vocab_size=300, root=str(root), cache_dir=str(tmp_path / "cache"))
    tokens = corpus.train.tokens.array.copy()
    [tokenizer] = (tmp_path / "cache").glob("tokenizer-*")
    [cache] = (tmp_path / "cache").glob("pysource-*")
    (tokenizer / "tokenizer.json").write_text('{"truncated')
    (cache / "tokens.bin").write_bytes(b"\0")
    with caplog.at_level("WARNING", logger="looplib"):
        again = PythonSource(seq_len=8, vocab_size=300, root=str(root), cache_dir=str(tmp_path / "cache"))
    assert (again.train.tokens.array == tokens).all() and len(again.train.tokens.array) == len(tokens)
    assert f"the cached tokenizer {tokenizer} is unreadable" in caplog.text and "training it again" in caplog.text
    assert f"the token cache {cache} is incomplete (tokens.bin has 1 bytes, not " in caplog.text


# ---------------------------------------------------------------- 6. Ctrl-C and launchers

def test_ctrl_c_saves_exits_130_and_says_how_to_resume(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(*TINY, "max_steps=100000", "checkpoint.every_steps=0", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    wait_for(proc, "step 2/")
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == EXIT_INTERRUPTED, out
    assert "interrupted (Ctrl-C) at step" in out and "Traceback" not in out
    # the command to paste: the run's own overrides (the last value of a key), resume=auto, its directory
    said = out.split("Continue with: ", 1)[1].splitlines()[0]
    typed = [a for a in TINY if not a.startswith("checkpoint.every_steps=")]
    assert said == " ".join(["python -m looplib.train", *typed, "max_steps=100000", "checkpoint.every_steps=0",
                             "resume=auto", f"hydra.run.dir={run_dir}"]), said
    [saved] = (run_dir / "checkpoints").iterdir()  # resumes like a preempted run (test_resume_cli.py)
    assert is_valid(saved) is None and not (run_dir / "model.safetensors").exists()


def test_torchrun_preempted_every_rank_exits_75_and_the_job_script_reads_it(tmp_path):
    """SIGTERM to the training processes: every rank saves and exits 75 (torchrun's summary lists
    each rank's status), none is killed by the SIGTERM torchrun then sends to the last rank;
    torchrun itself reports 1, so the job script reads the status from LOOPLIB_EXIT_FILE."""
    run_dir, status = tmp_path / "run", tmp_path / "status"
    proc = start("--nproc_per_node", "2", "--master_port", str(free_port()), "-m", "looplib.train", "+engine=ddp",
                 *TINY, "max_steps=100000", "checkpoint.every_steps=0", f"hydra.run.dir={run_dir}", cwd=tmp_path,
                 module="torch.distributed.run", env={"LOOPLIB_EXIT_FILE": str(status)})
    seen = wait_for(proc, "step 2/")
    workers = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    assert len(workers) == 2
    for pid in workers:
        os.kill(int(pid), signal.SIGTERM)
    out = "".join(seen) + proc.communicate(timeout=300)[0]
    assert proc.returncode == 1, out  # torchrun's own status for any failed rank (docs/checkpoints.md)
    assert out.count("exitcode  : 75") == 2, out  # both ranks, and no -15
    assert status.read_text().strip() == str(EXIT_PREEMPTED)
    [saved] = (run_dir / "checkpoints").iterdir()
    assert is_valid(saved) is None
    assert out.count("preempted (SIGTERM)") == 1  # said once, by rank 0, after it saved
    assert out.index("checkpoint " + str(saved)) < out.index("preempted (SIGTERM)")
    said = out.split("Continue with: ", 1)[1].splitlines()[0]  # on the same processes: the same global batch
    assert said.startswith("torchrun --nproc_per_node 2 -m looplib.train +engine=ddp ") and said.endswith(
        f"resume=auto hydra.run.dir={run_dir}"), said


def test_a_full_disk_during_a_save_keeps_the_last_checkpoint_and_leaves_no_temporary(tmp_path, monkeypatch):
    import errno

    from looplib.errors import SaveError
    ckpt = three_checkpoints(tmp_path)
    before = files(tmp_path)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(SaveError, match="No space left on device"):
        ckpt.save(TrainState(step=4))
    assert files(tmp_path) == before  # no .tmp-* directory, the three checkpoints untouched
    assert find_checkpoint(tmp_path) == tmp_path / "step-00000003"


def test_a_full_disk_is_named_with_the_io_status_in_the_token_cache_and_in_a_checkpoint(tmp_path, monkeypatch, capsys):
    """A full disk, wherever it happens, is one line naming the disk, exit status 74: while the data
    builds its token cache (not "check the keys of the data config"), and while a checkpoint is written
    (torch's own "file write failed", on a disk with no room left), the last good checkpoint intact."""
    import errno
    import shutil

    from looplib import cli
    from looplib.cli.main import main
    from looplib.data import cache
    from looplib.errors import EXIT_IO, SaveError
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LOOPLIB_CACHE", str(tmp_path / "cache"))
    (tmp_path / "text.txt").write_text("def f(x):\n    return x\n" * 200)

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.root / "tokens.bin"))
    monkeypatch.setattr(cache.Writer, "add", full)
    with pytest.raises(SystemExit) as stop:
        cli.run(main, ["data=text", f"data.path={tmp_path / 'text.txt'}", "data.eval_fraction=0",  # one document
                       "data.vocab_size=300", "max_steps=1", f"hydra.run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("looplib:")]
    assert stop.value.code == EXIT_IO and len(said) == 1, err
    assert said[0].startswith(f"looplib: error: the disk holding {tmp_path / 'cache'}") and "is full" in said[0], said
    assert not (tmp_path / "run").exists()  # before training: nothing of the run stays
    monkeypatch.undo()

    ckpt = three_checkpoints(tmp_path / "ck")
    before = files(tmp_path / "ck")

    def write_failed(*args, **kwargs):  # torch's message on a full disk names no errno
        raise RuntimeError("[enforce fail at inline_container.cc:859] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed")
    monkeypatch.setattr(torch, "save", write_failed)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10 * 2**30, 10 * 2**30, 4096))
    with pytest.raises(SaveError) as raised:
        ckpt.save(TrainState(step=4))
    from looplib.run.endings import ending
    from looplib.run.signals import Signals
    line = ending(raised.value, Signals(), None, tmp_path)
    assert raised.value.status == EXIT_IO and "is full (No space left on device)" in line, line
    assert files(tmp_path / "ck") == before and find_checkpoint(tmp_path / "ck") == tmp_path / "ck" / "step-00000003"


def test_checkpoints_and_weights_follow_the_umask(tmp_path):
    """Not 0700 directories and 0600 weights whatever the umask (tempfile's and safetensors' own modes):
    a teammate in the group reads the run when the umask says so."""
    import os
    import stat

    from looplib.engines.local import write_safetensors
    old = os.umask(0o027)
    try:
        three_checkpoints(tmp_path / "ck")
        write_safetensors({"w": torch.ones(2)}, tmp_path / "model.safetensors")
    finally:
        os.umask(old)
    modes = {str(p.relative_to(tmp_path)): stat.S_IMODE(p.stat().st_mode) for p in tmp_path.rglob("*")}
    assert modes["model.safetensors"] == 0o640
    step = "ck/step-00000003"
    assert modes[step] == 0o750 and modes[f"{step}/model.safetensors"] == modes[f"{step}/state.pt"] == 0o640, modes



ORPHANED = """
import ctypes, json, os, signal, subprocess, sys, time
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: the orphans come here
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
seen = []
for line in proc.stdout:
    seen.append(line)
    if "step 2/" in line:
        break
workers = [int(p) for p in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()]
os.kill(proc.pid, signal.SIGKILL)  # the launcher, killed: its workers are in sessions of their own
proc.wait()
statuses, deadline = {}, time.time() + 120
while len(statuses) < len(workers) and time.time() < deadline:
    for pid in set(workers) - set(statuses):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            statuses[pid] = os.waitstatus_to_exitcode(status)
    time.sleep(0.1)
for pid in set(workers) - set(statuses):
    os.kill(pid, signal.SIGKILL)  # still training: the fault this test is about
    statuses[pid] = "still training after 120 s"
    os.waitpid(pid, 0)
print(json.dumps({"statuses": sorted(map(str, statuses.values())), "out": "".join(seen) + proc.stdout.read()}))
"""


def test_workers_whose_launcher_is_killed_save_and_exit_75(tmp_path):
    """Issue 43: SIGKILL to torchrun never reached its workers (each in a session of its own): they
    trained on, unattended, to the end. Now each worker sees that its launcher is gone and stops
    at the next step boundary with a checkpoint, exit 75, as on SIGTERM (the exit file says 75).
    The helper is the workers' subreaper, so it reads their statuses once torchrun is gone."""
    run_dir, status = tmp_path / "run", tmp_path / "status"
    launcher = warm_ranks.command([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                str(free_port()), "-m", "looplib.train", "+engine=ddp", *TINY, "max_steps=100000",
                "checkpoint.every_steps=0", f"hydra.run.dir={run_dir}"])
    r = subprocess.run([sys.executable, "-c", ORPHANED, *launcher], cwd=tmp_path, capture_output=True, text=True,
                       timeout=400, env={**os.environ, **ENV, "LOOPLIB_EXIT_FILE": str(status)})
    assert r.returncode == 0, r.stderr[-3000:]
    found = json.loads(r.stdout.splitlines()[-1])
    assert found["statuses"] == [str(EXIT_PREEMPTED)] * 2, found["out"][-3000:]
    assert status.read_text().strip() == str(EXIT_PREEMPTED)
    [saved] = (run_dir / "checkpoints").iterdir()
    assert is_valid(saved) is None
    assert "is gone: stopping at the next step boundary with a checkpoint, as on SIGTERM" in found["out"]
    assert "preempted (SIGTERM: its launcher, pid " in found["out"]


def test_a_full_disk_at_the_first_checkpoint_does_not_claim_a_checkpoint_stays(tmp_path, monkeypatch):
    """Issue 43: the disk filled at the run's first checkpoint, and the line said "the last complete
    checkpoint stays (resume=auto continues from it)" when there was none. Now it says nothing
    was saved; with a complete checkpoint before it, the line is as it was."""
    import errno

    from looplib.errors import DiskFull, SaveError
    from looplib.run.endings import ending
    root = tmp_path / "run" / "checkpoints"
    done = tmp_path / "done"
    ckpt = three_checkpoints(done / "checkpoints")  # a run with three complete checkpoints
    ckpt.root, ckpt.last_saved_step = root, -1  # the same model and state, in a run with none yet

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(SaveError) as first:
        ckpt.save(TrainState(step=1))
    line = ending(first.value, Signals(), None, tmp_path / "run")
    assert line.startswith(f"looplib: error: could not write the checkpoint {root / 'step-00000001'}: the disk holding")
    assert "last complete checkpoint stays" not in line and line.endswith(
        "no checkpoint of this run was complete before it, so nothing is saved (run the command again with "
        "resume=auto: it starts again at step 0)"), line
    disk = DiskFull(errno.ENOSPC, "the disk holding x is full (No space left on device)", "x")
    assert ending(disk, Signals(), None, tmp_path / "run").endswith("(no checkpoint of this run is complete: it starts "
                                                                      "again at step 0)")
    ckpt.root = done / "checkpoints"
    with pytest.raises(SaveError) as later:
        ckpt.save(TrainState(step=4))
    assert ending(later.value, Signals(), None, done).endswith(
        "; the last complete checkpoint stays (resume=auto continues from it)")
    assert ending(disk, Signals(), None, done).endswith("(resume=auto continues from the last complete checkpoint)")


def test_a_rank_stopped_with_the_others_before_its_own_watch_looked_still_exits_75():
    """The ranks agree on a stop at a step boundary: a rank whose watch had not yet seen its launcher
    gone (the other rank's had) looks once more as it stops, and ends preempted (75), not finished
    (0: one of two workers of a killed torchrun once did)."""
    from looplib.run.signals import LauncherWatch
    signals = Signals()
    signals.watch = LauncherWatch(os.getppid() + 100_000, every=3600)  # not this process's parent: gone
    assert signals.signum is None and not signals.watch.gone
    signals.finish()
    assert signals.signum == signal.SIGTERM and signals.status == EXIT_PREEMPTED
    assert signals.name == f"SIGTERM: its launcher, pid {os.getppid() + 100_000}, is gone"
    here = Signals()
    here.watch = LauncherWatch(os.getppid(), every=3600)  # its launcher lives: a finished run stays finished
    here.finish()
    assert here.signum is None and not here.watch.gone
