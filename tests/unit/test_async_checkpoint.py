"""checkpoint.async=true: the state is copied off the device at the step boundary and written by a
thread while training goes on (looplib.store.background). What is written equals a synchronous
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
from looplib.errors import EXIT_IO, SaveError
from looplib.loop import fit
from looplib.models import GPT
from looplib.precision import FP32
from looplib.store.checkpoint_dir import find_checkpoint, is_valid
from looplib.store.saving import Checkpoints
from looplib.train_state import TrainState

from conftest import gpu
from looplib.engines import Engine
from test_faults import files


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
    from looplib.run.endings import ending
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
