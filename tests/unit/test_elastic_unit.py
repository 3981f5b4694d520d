"""Elastic runs' arithmetic in-process: the split of the global batch, the data position on any number of processes, an epoch end, DeepSpeed's universal-load slips (the multi-process tests: tests/dist/test_elastic.py)."""
import pytest
import torch
from looplib.data.loading import EpochSampler, Epochs
from looplib.errors import ConfigError
from looplib.store.elastic import Geometry, check_epoch_end, split, what_changed


def test_the_split_keeps_the_global_batch_and_names_the_counts_that_can():
    two = Geometry("ddp", "looplib", 2, 4, 2)  # 2 processes x 4 x 2 = 16
    assert split(two, 1, 4, 2) == (4, 4)    # the same command on one process: accumulation 4
    assert split(two, 4, 4, 2) == (4, 1)    # on four: the micro-batch as typed divides 16 / 4
    assert split(two, 8, 4, 2) == (2, 1)    # on eight it cannot: the largest that divides 2
    assert split(two, 1, 16, 1) == (16, 1)  # batch_size=16 accum_steps=1 keeps it: as typed
    assert split(two, 1, 16, 2) == (16, 1)  # the accumulation as saved: chosen again
    with pytest.raises(ConfigError, match=r"^resume: the checkpoint's global batch of 16 sequences \(2 process\(es\) "
                                          r"x batch_size=4 x accum_steps=2\) cannot be split over 3 processes; "
                                          r"resume on 1, 2, 4, 8 or 16 processes, or start a new run$"):
        split(two, 3, 4, 2)
    with pytest.raises(ConfigError, match=r"choose batch_size x accum_steps = 16 per process, or leave accum_steps=2"):
        split(two, 1, 4, 3)  # an accumulation typed anew that changes the global batch
    assert what_changed(two, Geometry("ddp", "looplib", 1, 4, 4)) == \
        "2 -> 1 processes: accum_steps 2 -> 4, global batch 16 kept"
    assert what_changed(two, Geometry("fsdp", "dcp", 2, 4, 2)) == "engine ddp -> fsdp: global batch 16 kept"
    assert what_changed(two, Geometry("ddp", "looplib", 2, 2, 4)) == \
        "batch_size 4 -> 2, accum_steps 2 -> 4, global batch 16 kept"
    assert what_changed(two, two) == ""


def consumed(world: int, batch: int, keep: int | None, n: int, epoch_start: int, micro: int) -> list[int]:
    """The samples ``micro`` micro-batches per rank read on ``world`` ranks from ``epoch_start``
    micro-batches into the epoch, as one list in the order of the epoch's permutation."""
    per_rank = []
    for rank in range(world):
        sampler = EpochSampler(n, seed=3, rank=rank, world=world, keep=keep)
        sampler.set_epoch(0, epoch_start * batch)
        per_rank.append(list(sampler)[: micro * batch])
    return sorted(i for r in per_rank for i in r)


def test_the_position_is_a_sample_of_the_permutation_on_any_number_of_processes():
    """2 ranks x micro-batch 4 x 3 micro-batches read the first 24 samples of the epoch's
    permutation; restored on 1 process with micro-batch 8 the stream goes on at sample 24, and
    the next 16 samples are those the 2 ranks would have read next. An epoch read to its end
    restores as ended; the epoch keeps the first run's size."""
    n = 64
    loader = torch.utils.data.DataLoader(range(n), batch_size=4, sampler=EpochSampler(n, seed=3, rank=0, world=2))
    epochs = Epochs(loader)
    epochs.batches_seen = 3
    saved = epochs.position()
    assert saved == {"epoch": 0, "batches_seen": 3, "samples": 24, "epoch_samples": 64}
    one = Epochs(torch.utils.data.DataLoader(range(n), batch_size=8, sampler=EpochSampler(n, seed=3, world=1)))
    one.restore(saved, world=2, batch_size=4)
    assert one.batches_seen == 3  # 24 samples = 3 micro-batches of 8
    assert consumed(1, 8, 64, n, one.batches_seen, 2) == consumed(2, 4, None, n, 3, 2)
    perm = consumed(1, 1, 64, n, 0, n)
    assert sorted(consumed(2, 4, None, n, 0, 3)) == sorted(perm[:0] + consumed(1, 1, 64, n, 0, 24))
    ended = {"epoch": 0, "batches_seen": 8, "samples": 64, "epoch_samples": 64}
    one.restore(ended)
    assert one.batches_seen == 8 and len(one.loader.sampler) - one.batches_seen * 8 <= 0
    odd = Epochs(torch.utils.data.DataLoader(range(63), batch_size=4, sampler=EpochSampler(63, seed=3, world=1)))
    odd.restore({"epoch": 1, "batches_seen": 2, "samples": 16, "epoch_samples": 62})  # saved by 2 ranks: 62 of 63
    assert odd.loader.sampler.keep == 62 and odd.epoch == 1 and odd.batches_seen == 4
    # a position written before samples were counted: micro-batches on the world it was saved on
    old = Epochs(torch.utils.data.DataLoader(range(n), batch_size=8, sampler=EpochSampler(n, seed=3, world=1)))
    old.restore({"epoch": 0, "batches_seen": 3}, world=2, batch_size=4)
    assert old.batches_seen == 3


def test_an_epoch_end_the_processes_cannot_reproduce_is_refused_only_when_reached():
    """62 samples per epoch (2 ranks of 63), 4 processes: the end of the epoch would differ."""
    meta = {"step": 2, "samples": 32, "epoch_samples": 62}
    four = Geometry("ddp", "looplib", 4, 2, 2)  # 16 per step: steps 3 and 4 end the epoch (62 - 32 = 30)
    check_epoch_end(meta, four, max_steps=3)  # stops before the epoch's end: exact
    with pytest.raises(ConfigError, match=r"epochs hold 62 samples, which 4 processes cannot split evenly: from step 4 "
                                          r"on, .* resume on 1 or 2 processes, or stop before the epoch's end "
                                          r"\(max_steps=3\)"):
        check_epoch_end(meta, four, max_steps=4)
    check_epoch_end(meta, Geometry("ddp", "looplib", 2, 4, 2), max_steps=100)  # 2 divides 62


def test_deepspeeds_zero3_universal_load_slips_are_put_right():
    """DeepSpeed 0.19.8's ZeRO-3 universal load gives every group the first group's
    hyperparameters and one step tensor to every partition (Adam then counts it up once per
    partition): each group gets its own back, each state its own step."""
    from looplib.engines.deepspeed.universal import fix_universal_groups
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([{"params": [a], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}], lr=1.0)
    built = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    step = torch.tensor(2.0)
    for group in opt.param_groups:  # what the slip leaves
        group.update(weight_decay=0.1, lr=5.0)
    for p in (a, b):
        opt.state[p].update(step=step, exp_avg=torch.zeros(2), exp_avg_sq=torch.zeros(2))
    fix_universal_groups(opt, built, {"scheduler": {"_last_lr": [0.25, 0.25]}})
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert [g["lr"] for g in opt.param_groups] == [0.25, 0.25]
    assert opt.state[a]["step"] is not opt.state[b]["step"] and float(opt.state[b]["step"]) == 2.0
