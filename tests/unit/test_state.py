"""Exact resume, crash-safe checkpoints, the bad-step rule: in process."""
import functools
import json
import os
import pickle

import pytest
import torch

from looplib import optim as lo
from looplib.schedule import WarmupCosine
from looplib import precision as prec
from looplib.accumulation import Accumulation
from looplib.data import Epochs, build_loader
from looplib.errors import ConfigError
from looplib.loop import fit
from looplib.models import GPT
from looplib.loss import TokenCrossEntropy
from looplib.store.checkpoint_dir import find_checkpoint, is_valid
from looplib.store import resume
from looplib.errors import NumericError
from looplib.store.saving import Checkpoints
from looplib.store.resume import check_resume_config
from looplib.train_state import TrainState
from looplib.telemetry import Telemetry

from conftest import random_tokens

N_SEQ, MICRO, ACCUM, STEPS = 20, 2, 3, 9  # 10 micro-batches an epoch: windows 3, 3, 3, 1 -> 4 steps
PRECISIONS = {"fp32": prec.FP32, "bf16": prec.BF16, "fp16": prec.FP16}
OPTIMIZERS = {"adamw": lambda: lo.AdamW(lr=1e-2, weight_decay=0.1),
              "sgd": lambda: lo.SGD(lr=0.1, weight_decay=0.1),
              "adam8bit": lambda: lo.Adam8bit(lr=1e-2, weight_decay=0.1),
              # fused kernels skip a non-finite step on the device (no sync): CUDA's default AdamW
              "adamw-fused": lambda: lo.AdamW(lr=1e-2, weight_decay=0.1, impl="fused")}
# step 4 closes epoch 0 (a short window); step 6 is mid-epoch; "mid-window" dies inside step 7
INTERRUPTIONS = {"epoch-boundary": (4, None), "mid-epoch": (6, None), "mid-window": (6, 2)}


class Crash(Exception):
    pass


class CrashingLoss(TokenCrossEntropy):
    """Raises on the n-th call: a process dying in the middle of an accumulation window."""

    def __init__(self, at_call=None):
        super().__init__()
        self.calls, self.at_call = 0, at_call

    def __call__(self, model, batch):
        self.calls += 1
        if self.calls == self.at_call:
            raise Crash
        return super().__call__(model, batch)


def session(prec_name, opt_name, root, seed, every=0, objective=None, max_bad=0):
    """Everything a run holds, built from scratch (a new process would do the same)."""
    torch.manual_seed(seed)  # a different init each time: resume must overwrite all of it
    model = GPT(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, dropout=0.1)
    precision = PRECISIONS[prec_name]()
    precision.setup("cpu")
    optimizer = OPTIMIZERS[opt_name]().build(model)
    scheduler = WarmupCosine(warmup_steps=2).build(optimizer, STEPS)
    epochs = Epochs(build_loader(random_tokens(n=N_SEQ), batch_size=MICRO, seed=5))
    rows = []
    telemetry = Telemetry(enabled=False, log_every=1)
    telemetry.write = rows.append
    ckpt = Checkpoints(root, every_steps=every, keep=2, max_bad_steps=max_bad, config={"a": 1})
    ckpt.bind(model=model, optimizer=optimizer, scheduler=scheduler, precision=precision, epochs=epochs)
    kwargs = dict(objective=objective or TokenCrossEntropy(), optimizer=optimizer, scheduler=scheduler,
                  precision=precision, accumulation=Accumulation(ACCUM), telemetry=telemetry, checkpoints=ckpt,
                  max_grad_norm=1.0)
    return model, epochs, ckpt, rows, kwargs


@functools.cache
def uninterrupted(prec_name, opt_name):
    """The uninterrupted run's losses by step and final weights: one run for the three interruption
    points of a precision x optimizer (it takes no checkpoint, so nothing of it depends on them)."""
    model, epochs, _, full_rows, kw = session(prec_name, opt_name, None, seed=0)
    fit(model, epochs, max_steps=STEPS, **kw)
    full = {r["step"]: r["loss"] for r in full_rows if "loss" in r}
    return full, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("where", list(INTERRUPTIONS))
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("prec_name", list(PRECISIONS))
def test_resume_continues_exactly(prec_name, opt_name, where, tmp_path):
    if opt_name == "adam8bit":
        pytest.importorskip("bitsandbytes")
    saved_at, crash_in_window = INTERRUPTIONS[where]
    full, final = uninterrupted(prec_name, opt_name)

    # the interrupted run: checkpoints every `saved_at` steps, dies after (or inside) the next step
    model, epochs, ckpt, _, kw = session(prec_name, opt_name, tmp_path, seed=0, every=saved_at)
    crash_call = saved_at * ACCUM + 1 + (crash_in_window or 0) if crash_in_window else None
    kw["objective"] = CrashingLoss(crash_call)
    with pytest.raises(Crash) if crash_call else _no_error():
        fit(model, epochs, max_steps=saved_at + 1 if not crash_call else STEPS, **kw)

    # a new process: fresh objects, a different init, restored from the checkpoint
    model, epochs, ckpt, rows, kw = session(prec_name, opt_name, tmp_path, seed=123)
    state = TrainState()
    path = find_checkpoint(tmp_path)
    assert path.name == f"step-{saved_at:08d}"
    resume.load(ckpt, path, state)
    assert state.step == saved_at
    fit(model, epochs, max_steps=STEPS, state=state, **kw)
    resumed = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert sorted(resumed) == list(range(saved_at + 1, STEPS + 1))
    # CPU kernels are deterministic: every precision resumes bit for bit here (tolerance 0)
    assert resumed == {s: full[s] for s in resumed}
    for k, v in model.state_dict().items():
        assert torch.equal(v, final[k]), k


class _no_error:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_rotation_keeps_exactly_keep(tmp_path):
    model, epochs, ckpt, _, kw = session("fp32", "sgd", tmp_path, seed=0, every=1)
    ckpt.keep = 3
    fit(model, epochs, max_steps=7, **kw)
    names = sorted(p.name for p in (tmp_path).iterdir())
    assert names == ["step-00000005", "step-00000006", "step-00000007"]
    assert all(is_valid(tmp_path / n) is None for n in names)


def test_partial_and_corrupt_checkpoints_are_skipped(tmp_path, caplog):
    model, epochs, ckpt, _, kw = session("fp32", "sgd", tmp_path, seed=0, every=1)
    ckpt.keep = 5
    fit(model, epochs, max_steps=3, **kw)
    (tmp_path / "step-00000003" / "manifest.json").unlink()  # killed before the manifest
    blob = tmp_path / "step-00000002" / "model.safetensors"
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF  # a flipped bit: same size, wrong checksum
    blob.write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="looplib"):
        assert find_checkpoint(tmp_path).name == "step-00000001"
    assert "no manifest" in caplog.text and "does not match its checksum" in caplog.text


def test_a_malicious_pickle_is_refused_not_executed(tmp_path):
    model, epochs, ckpt, _, kw = session("fp32", "sgd", tmp_path, seed=0, every=1)
    fit(model, epochs, max_steps=1, **kw)
    path = tmp_path / "step-00000001"
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (path / "state.pt").write_bytes(pickle.dumps({"optimizer": Evil()}))
    manifest = json.loads((path / "manifest.json").read_text())  # an attacker fixes the manifest too
    from looplib.store.checkpoint_dir import sha256
    manifest["files"]["state.pt"] = {"size": (path / "state.pt").stat().st_size, "sha256": sha256(path / "state.pt")}
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert "not unpickled" in is_valid(path)  # an invalid checkpoint: resume=auto skips it
    with pytest.raises(ConfigError, match="not unpickled"):
        resume.load(ckpt, path, TrainState())
    assert not marker.exists()


class NaNLoss(TokenCrossEntropy):
    """Returns NaN for the micro-batches of chosen optimizer steps (1-based)."""

    def __init__(self, bad_steps):
        super().__init__()
        self.calls, self.bad_steps = 0, set(bad_steps)

    def __call__(self, model, batch):
        self.calls += 1
        loss = super().__call__(model, batch)
        step = (self.calls - 1) // ACCUM + 1
        return loss * float("nan") if step in self.bad_steps else loss


@pytest.mark.parametrize("opt_name", ["adamw", "adamw-fused"])
@pytest.mark.parametrize("prec_name", ["fp32", "bf16", "fp16"])
def test_a_nan_step_is_skipped_and_counted(prec_name, opt_name):
    model, epochs, ckpt, rows, kw = session(prec_name, opt_name, None, seed=0)
    kw["objective"] = NaNLoss({2})
    state, snapshots = TrainState(), []
    for step in (1, 2, 3):
        snapshots.append([p.detach().clone() for p in model.parameters()])
        fit(model, epochs, max_steps=step, state=state, **kw)
    snapshots.append([p.detach().clone() for p in model.parameters()])
    unchanged = [all(torch.equal(a, b) for a, b in zip(x, y)) for x, y in zip(snapshots, snapshots[1:])]
    assert unchanged == [False, True, False]  # only step 2 left the weights alone
    telemetry = kw["telemetry"]
    assert rows[-1]["skipped_steps"] == 1 and int(state.bad_streak) == 0 and int(state.longest_streak) == 1
    if opt_name == "adamw-fused":  # the kernel skipped on the device: the step hook fired all the same
        assert telemetry.optimizer_steps == 3 and torch.is_tensor(state.skipped)
        assert all(int(s["step"]) == 2 for s in kw["optimizer"].state.values())  # step counts left alone
    else:
        assert telemetry.boundaries == 3 and telemetry.optimizer_steps == 2


@pytest.mark.parametrize("prec_name", ["fp32", "bf16"])  # fp16: GradScaler itself hands the flag to the kernel
def test_a_device_skip_leaves_the_same_state_as_a_host_skip(prec_name, monkeypatch):
    """A fused kernel told to skip (no sync) and a skip decided on the host (the optimizer is
    not called) leave bit-identical weights, moments and step counts for the steps after."""
    finals = []
    for on_device in (True, False):
        monkeypatch.setattr(prec, "fused_skip", lambda optimizer, dev=on_device: dev)
        model, epochs, ckpt, rows, kw = session(prec_name, "adamw-fused", None, seed=0)
        kw["objective"] = NaNLoss({2, 3})
        state = TrainState()
        fit(model, epochs, max_steps=5, state=state, **kw)
        assert torch.is_tensor(state.skipped) == on_device and int(state.skipped) == 2
        finals.append(([p.detach().clone() for p in model.parameters()], kw["optimizer"].state_dict()["state"]))
    (weights_a, opt_a), (weights_b, opt_b) = finals
    assert all(torch.equal(a, b) for a, b in zip(weights_a, weights_b))
    assert all(torch.equal(opt_a[i][k], opt_b[i][k]) for i in opt_a for k in opt_a[i])


def test_a_device_counted_streak_is_read_on_check_steps_only():
    from types import SimpleNamespace
    ckpt = Checkpoints(None, max_bad_steps=2, check_every=4)
    state, epochs = TrainState(), SimpleNamespace(epoch=0, batches_seen=0)
    one, zero = torch.ones(()), torch.zeros(())
    for flag in (one, one, zero):  # a streak of 2 that has ended before step 4
        state.end_window(epochs, updated=True, skipped=flag)
        assert ckpt.after_step(state) is False  # steps 1-3: not read (on a GPU, no sync)
    assert torch.is_tensor(state.longest_streak) and int(state.skipped) == 2 and int(state.bad_streak) == 0
    state.end_window(epochs, updated=True, skipped=zero)
    with pytest.raises(NumericError, match="2 consecutive steps"):
        ckpt.after_step(state)  # step 4: the longest streak counts, though it ended


def test_the_end_of_a_run_applies_the_bad_step_rule_and_skips_a_final_save_after_a_bad_step(tmp_path):
    from types import SimpleNamespace
    epochs, one = SimpleNamespace(epoch=0, batches_seen=0), torch.ones(())
    ckpt = Checkpoints(tmp_path, max_bad_steps=2, check_every=10)
    state = TrainState()
    for _ in range(2):  # steps 1-2 skipped on the device: no check step reached before the end
        state.end_window(epochs, updated=True, skipped=one)
        assert ckpt.after_step(state) is False
    with pytest.raises(NumericError, match="2 consecutive steps"):
        ckpt.finish(state)
    ckpt = Checkpoints(tmp_path, max_bad_steps=5, check_every=10)
    state = TrainState()
    state.end_window(epochs, updated=False)  # the last step was skipped (seen on the host)
    ckpt.finish(state)  # under max_bad_steps: no error, and no checkpoint of the skipped state
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("opt_name", ["adamw", "adamw-fused"])
def test_repeated_nans_stop_the_run_and_keep_the_last_good_checkpoint(tmp_path, opt_name):
    model, epochs, ckpt, rows, kw = session("bf16", opt_name, tmp_path, seed=0, every=2, max_bad=3)
    kw["objective"] = NaNLoss(range(4, 100))  # from step 4 on, every step is bad
    with pytest.raises(NumericError, match="3 consecutive steps had non-finite loss"):
        fit(model, epochs, max_steps=STEPS, **kw)
    newest = find_checkpoint(tmp_path)
    assert newest.name == "step-00000002"  # step 4 was bad: no checkpoint after a bad step
    before = {p.name: p.read_bytes() for p in newest.iterdir()}
    assert is_valid(newest) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002"]
    assert {p.name: p.read_bytes() for p in newest.iterdir()} == before


def test_resume_config_rules():
    saved = {"model": {"n_layer": 4}, "optim": {"_target_": "looplib.optim.AdamW"}, "max_steps": 10,
             "checkpoint": {"every_steps": 5}}
    changed = check_resume_config(saved, {**saved, "max_steps": 20, "checkpoint": {"every_steps": 2}})
    assert changed == ["checkpoint.every_steps: 5 -> 2", "max_steps: 10 -> 20"]
    with pytest.raises(ConfigError, match="changed model.n_layer from 4 to 6"):
        check_resume_config(saved, {**saved, "model": {"n_layer": 6}})
    with pytest.raises(ConfigError, match="changed optim._target_ from 'looplib.optim.AdamW' to 'looplib.optim.SGD'"):
        check_resume_config(saved, {**saved, "optim": {"_target_": "looplib.optim.SGD"}})
