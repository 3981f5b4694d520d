"""checkpoint.async=true: the state is copied off the device at the step boundary and written by a
thread while training goes on (looplib.run.background). What is written equals a synchronous
checkpoint of the same moment byte for byte, whatever the steps after it do; one write at a time;
rotation keeps the last complete checkpoint while the next is in flight; a failed write is a
SaveError (74) at the next step boundary. (Resume after SIGTERM and after SIGKILL mid-write:
tests/cli/test_resume_cli.py; two processes: tests/dist/test_engines_ddp.py, tests/dist/test_engines_fsdp.py.)"""
import errno
import threading
from pathlib import Path

import pytest
import torch

from looplib import TokenCrossEntropy
from looplib import optim as lo
from looplib.data import Epochs, RandomTokens, build_loader
from looplib.errors import EXIT_IO, ConfigError, SaveError
from looplib.loop import fit
from looplib.models import GPT
from looplib.precision import FP32
from looplib.run.checkpoint_dir import find_checkpoint, is_valid
from looplib.run.saving import Checkpoints
from looplib.run.settings import as_config, settings_from
from looplib.train_state import TrainState

from conftest import gpu, run_cli
from looplib.engines import Engine
from test_faults import ENV, TINY, files, looplib_lines


class Run:
    """A tiny model, optimizer and data; checkpoints of it, synchronous or not."""

    def __init__(self, device: str = "cpu"):
        torch.manual_seed(0)
        self.engine = Engine(device)
        self.model = GPT(vocab_size=64, seq_len=16, n_layer=1, n_head=2, d_model=32).to(device)
        self.optimizer = lo.AdamW(lr=1e-2).build(self.model)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda _: 1.0)
        self.epochs = Epochs(build_loader(RandomTokens(16, 16, 64), batch_size=4, seed=0))
        self.state = TrainState()

    def checkpoints(self, root: Path, asynchronous: bool, keep: int = 3) -> Checkpoints:
        ckpt = Checkpoints(root, every_steps=0, keep=keep, config={"model": {"d_model": 32}}, engine=self.engine,
                           asynchronous=asynchronous)
        return ckpt.bind(model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, precision=FP32(),
                         epochs=self.epochs)

    def train(self, steps: int) -> None:
        fit(self.model, self.epochs, objective=TokenCrossEntropy(), optimizer=self.optimizer, engine=self.engine,
            scheduler=self.scheduler, max_steps=self.state.step + steps, state=self.state)


@pytest.fixture
def gate(monkeypatch):
    """Background writes of the checkpoints named in ``gate.held`` wait at their first file until
    ``gate.open`` is set; ``gate.log`` records each write's start and end, in order."""
    from safetensors import torch as st
    save_model = st.save_model

    class Gate:
        held, log, open, reached, pinned = set(), [], threading.Event(), threading.Event(), []

    def gated(model, path, *args, **kwargs):
        name = Path(path).parent.name.split("-")[2]  # .tmp-step-0000000N-xxxx
        Gate.log.append(("start", name))
        Gate.pinned.append(all(t.device.type == "cpu" and t.is_pinned() for t in model.state_dict().values()))
        if threading.current_thread() is not threading.main_thread() and name in Gate.held:
            Gate.reached.set()
            assert Gate.open.wait(60)
        save_model(model, path, *args, **kwargs)
        Gate.log.append(("end", name))
    monkeypatch.setattr(st, "save_model", gated)
    return Gate


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_what_is_written_in_the_background_is_the_state_at_the_step_byte_for_byte(tmp_path, gate, device):
    """The steps that run while a checkpoint is written update weights and Adam's moments in place:
    the checkpoint still holds the state of its step, the same bytes a synchronous save writes.
    On CUDA the copy is in pinned host memory."""
    run = Run(device)
    run.train(3)
    sync, background = run.checkpoints(tmp_path / "sync", False), run.checkpoints(tmp_path / "async", True)
    sync.save(run.state)
    gate.held.add("00000003")
    background.save(run.state)
    assert gate.reached.wait(60)  # the thread is at its first file: the copy was taken, nothing written yet
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    run.train(2)  # two optimizer steps while the write waits
    assert not all(torch.equal(v, before[k]) for k, v in run.model.state_dict().items())
    gate.open.set()
    background.settle()
    a, b = tmp_path / "sync" / "step-00000003", tmp_path / "async" / "step-00000003"
    assert is_valid(b, run.model) is None
    for name in ("model.safetensors", "state.pt", "config.yaml"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert background.write_seconds and not sync.write_seconds  # checkpoint_write_s: asynchronous only
    assert gate.pinned == [False, device == "cuda"]  # the synchronous save's live tensors; the staged copy


def test_one_write_at_a_time_and_the_last_complete_checkpoint_stays_while_the_next_is_written(tmp_path, gate):
    run = Run()
    run.train(1)
    ckpt = run.checkpoints(tmp_path, True, keep=1)
    for step in (1, 2):
        ckpt.save(TrainState(step=step))  # step 2 waits for step 1's write before its own starts
    gate.held.add("00000003")
    ckpt.save(TrainState(step=3))
    assert gate.reached.wait(60)
    # step 3 in flight: step 2, complete, stays (keep=1 counts complete checkpoints); step 1 went after 2 was complete
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[0].startswith(".tmp-step-00000003-") and names[1:] == ["step-00000002"], names
    assert find_checkpoint(tmp_path, run.model) == tmp_path / "step-00000002"
    gate.open.set()
    ckpt.settle()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003"]
    assert is_valid(tmp_path / "step-00000003", run.model) is None
    # never two writes at once: each started after the one before it ended
    assert gate.log == [(what, f"0000000{n}") for n in (1, 2, 3) for what in ("start", "end")]


def test_a_failed_background_write_stops_the_run_at_the_next_step_boundary(tmp_path, monkeypatch):
    """A full disk while the thread writes: nothing is lost silently. The next step boundary raises
    SaveError (74) naming the checkpoint and the disk; the last complete checkpoint stays, and
    the half-written one leaves nothing behind."""
    from looplib.run.lifecycle import ending
    from looplib.run.signals import Signals
    run = Run()
    run.train(1)
    ckpt = run.checkpoints(tmp_path, True)
    ckpt.save(TrainState(step=1))
    ckpt.settle()
    before = files(tmp_path)
    save = torch.save

    def full(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(*args, **kwargs)
    monkeypatch.setattr(torch, "save", full)
    ckpt.save(TrainState(step=2))  # returns at once: the write fails on its thread
    ckpt.background.thread.join()
    assert ckpt.background.failed
    with pytest.raises(SaveError) as raised:
        ckpt.after_step(TrainState(step=3))
    assert raised.value.status == EXIT_IO
    line = ending(raised.value, Signals(), None, tmp_path)
    assert line.startswith(f"looplib: error: could not write the checkpoint {tmp_path / 'step-00000002'}: the disk "
                           "holding") and "is full (No space left on device)" in line and "\n" not in line, line
    assert files(tmp_path) == before  # no .tmp-* directory; step 1 untouched
    assert find_checkpoint(tmp_path) == tmp_path / "step-00000001"


def test_a_failed_background_write_through_the_command_line_is_one_line_and_status_74(tmp_path, monkeypatch, capsys):
    from looplib import cli
    from looplib.cli.main import main
    monkeypatch.chdir(tmp_path)
    save, calls = torch.save, []

    def full(*args, **kwargs):  # the disk fills up during the second background write
        if threading.current_thread() is not threading.main_thread():
            calls.append(1)
            if len(calls) >= 2:
                raise OSError(errno.ENOSPC, "No space left on device")
        return save(*args, **kwargs)
    monkeypatch.setattr(torch, "save", full)
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as stop:
        cli.run(main, [*TINY, "max_steps=40", "checkpoint.async=true", f"hydra.run.dir={run_dir}"])
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("looplib:")]
    assert stop.value.code == EXIT_IO and len(said) == 1 and "Traceback" not in err, err
    assert said[0].startswith(f"looplib: error: could not write the checkpoint {run_dir / 'checkpoints' / 'step-00000002'}")
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-00000001"]  # nothing half-written
    assert find_checkpoint(run_dir) == run_dir / "checkpoints" / "step-00000001"
    assert not (run_dir / "model.safetensors").exists()  # the run did not go on to its end


def test_checkpoint_async_is_a_checked_setting_and_deepspeed_refuses_it_in_one_line(tmp_path):
    settings = settings_from({"checkpoint": {"async": True}})
    assert settings.checkpoint.asynchronous is True and as_config(settings)["checkpoint"]["async"] is True
    with pytest.raises(ConfigError, match="^checkpoint.async: checkpoint.async='sometimes' is not true or false"):
        settings_from({"checkpoint": {"async": "sometimes"}})
    with pytest.raises(ConfigError, match="did you mean checkpoint.async"):
        settings_from({"checkpoint": {"asynch": True}})
    r = run_cli("+engine=deepspeed", *TINY, "checkpoint.async=true", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path,
                env=ENV)
    assert r.returncode == 2 and looplib_lines(r.stderr) == [r.stderr.strip()], r.stderr
    assert r.stderr.startswith("looplib: error: checkpoint.async: +engine=deepspeed writes its ZeRO partitions itself")
    assert not (tmp_path / "run").exists()


def test_a_run_that_crashes_lets_its_directory_go_only_once_the_write_in_flight_is_complete(tmp_path, gate):
    """A step that raises while step 2's checkpoint is being written in the background: ``train_model``
    raises only after that write is complete (its manifest written), so nothing of the run is still
    being written once the directory is released to the next run."""
    from conftest import random_tokens, tiny_gpt
    from looplib import train_model

    class Crash(TokenCrossEntropy):
        calls = 0

        def __call__(self, model, batch):
            Crash.calls += 1
            if Crash.calls == 3:  # step 3: the write of step 2 is still held at its first file
                assert gate.reached.wait(60)
                threading.Timer(0.5, gate.open.set).start()
                raise RuntimeError("a step that crashes")
            return super().__call__(model, batch)

    gate.held.add("00000002")
    run_dir = tmp_path / "run"
    with pytest.raises(RuntimeError, match="a step that crashes"):
        train_model(tiny_gpt(), random_tokens(), objective=Crash(), max_steps=4, batch_size=4, run_dir=run_dir,
                    checkpoint_every=2, checkpoint_async=True, sample_tokens=0)
    assert ("end", "00000002") in gate.log  # the write ended before train_model returned
    assert is_valid(run_dir / "checkpoints" / "step-00000002") is None  # complete: manifest and all
