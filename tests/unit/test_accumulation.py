"""Accumulation: normalise by the window's item count, handle short windows at epoch ends."""
import torch
import torch.nn.functional as F

from looplib import optim as lo
from looplib.accumulation import Accumulation
from looplib.data import build_loader
from looplib.loop import fit
from looplib.loss import TokenCrossEntropy
from looplib.telemetry import Telemetry

from conftest import random_tokens, tiny_gpt


def padded_batches(n=8, seq_len=16, seed=0):
    """Sequences whose labels are padded (-100) by very different amounts."""
    data = random_tokens(n, seq_len, seed=seed)
    rows = [data[i] for i in range(n)]
    for i, row in enumerate(rows):
        keep = 1 + (i * 5) % seq_len  # 1, 6, 11, 16, 5, ... loss-bearing tokens
        row["labels"] = row["labels"].clone()
        row["labels"][keep:] = -100
    return rows


def collate(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def one_update(micro: int, accum: int):
    rows = padded_batches()
    batches = [collate(rows[i:i + micro]) for i in range(0, len(rows), micro)]
    model = tiny_gpt()
    opt = lo.SGD(lr=0.5, momentum=0.0).build(model)
    fit(model, batches, objective=TokenCrossEntropy(), optimizer=opt, max_steps=1,
        accumulation=Accumulation(accum))
    return model


def test_unequal_token_counts_give_the_same_update():
    full = one_update(micro=8, accum=1)
    for micro, accum in [(2, 4), (4, 2), (1, 8)]:
        split = one_update(micro, accum)
        for p, q in zip(full.parameters(), split.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_averaging_micro_batch_means_would_differ():
    """The naive loop (mean per micro-batch / k) gives another update on this data: the test
    above would catch a loop that normalised that way."""
    rows = padded_batches()
    naive, ref = tiny_gpt(), one_update(micro=8, accum=1)
    opt = torch.optim.SGD(naive.parameters(), lr=0.5)
    for i in range(0, 8, 2):
        b = collate(rows[i:i + 2])
        loss = F.cross_entropy(naive(b["input_ids"]).flatten(0, 1), b["labels"].flatten()) / 4
        loss.backward()
    opt.step()
    diff = max((p - q).abs().max().item() for p, q in zip(naive.parameters(), ref.parameters()))
    assert diff > 1e-4


def test_short_window_at_epoch_end_is_one_update():
    # 10 micro-batches per epoch, 4 per window: windows of 4, 4, 2 -> 3 updates per epoch
    data = random_tokens(n=20)
    loader = build_loader(data, batch_size=2, seed=0)
    model = tiny_gpt()
    opt = lo.SGD(lr=0.1).build(model)
    telemetry = Telemetry(enabled=False)
    state = fit(model, loader, objective=TokenCrossEntropy(), optimizer=opt, max_steps=7,
                accumulation=Accumulation(4), telemetry=telemetry)
    assert state.step == 7 and telemetry.optimizer_steps == 7
    assert state.epoch == 2  # steps 1-3 epoch 0, 4-6 epoch 1, 7 in epoch 2


def test_window_sizes_and_counts():
    epochs = [[{"input_ids": torch.zeros(2, 3), "labels": torch.tensor([[1, -100, 2], [3, 4, 5]])}] * 5]
    windows = list(Accumulation(2).windows(epochs, TokenCrossEntropy().count))
    assert [len(w) for w in windows] == [2, 2, 1]
    assert [w.items for w in windows] == [10, 10, 5]
    assert [w.samples for w in windows] == [4, 4, 2]
