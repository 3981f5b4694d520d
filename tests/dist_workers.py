"""Training runs used by the engine tests, as plain functions: in this process (the local
reference) or in processes started by torch.multiprocessing (one per rank), forked from the tests'
warm interpreter (tests/warm.py: torch and looplib imported once, not once per rank)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.multiprocessing as mp

from conftest import random_tokens, tiny_gpt
from looplib.accumulation import Accumulation
from looplib.data import Epochs, build_loader, held_out
from looplib.engines import DDP, Engine
from looplib.engines.local import write_safetensors
from looplib.process.launcher import free_port
from looplib.loop import TrainState, fit
from looplib.loss import TokenCrossEntropy
from looplib.optim import AdamW
from looplib.schedule import WarmupCosine
from looplib.precision import FP32
from looplib.telemetry import Telemetry

GLOBAL_BATCH, ACCUM, STEPS, MORE = 8, 2, 4, 2   # 64 samples: one epoch is 4 steps, MORE crosses into epoch 2
LR, CLIP = 1e-2, 0.5


def settings(world: int, steps: int = STEPS):
    return SimpleNamespace(batch_size=GLOBAL_BATCH // world, accum_steps=ACCUM, max_grad_norm=CLIP, max_steps=steps)


class Masked(torch.utils.data.Dataset):
    """Random tokens whose labels divisible by 3 carry no loss: micro-batches, and so ranks,
    hold different item counts, which only a normalisation over every rank's items survives."""

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        sample = dict(self.data[i])
        sample["labels"] = sample["labels"].masked_fill(sample["labels"] % 3 == 0, -100)
        return sample


def loader(rank: int, world: int):
    return build_loader(Masked(random_tokens(64)), batch_size=GLOBAL_BATCH // world, seed=0, rank=rank, world=world)


class Rows(Telemetry):
    """Telemetry that keeps every logged loss (on every rank, so the test can read rank 0's)."""

    def __init__(self, engine):
        super().__init__(log_every=1, enabled=False)
        self.reduce_loss = engine.ranks.mean
        self.losses, self.grad_norms = [], []

    def write(self, row):
        super().write(row)
        if "loss" in row:
            self.losses.append(row["loss"])
            self.grad_norms.append(row.get("grad_norm"))


def train(engine: Engine, model, optimizer, scheduler, precision, max_grad_norm, epochs, steps, state=None):
    telemetry = Rows(engine)
    state = fit(model, epochs, objective=TokenCrossEntropy(), optimizer=optimizer, scheduler=scheduler,
                precision=precision, accumulation=Accumulation(ACCUM), engine=engine, max_steps=steps,
                max_grad_norm=max_grad_norm, telemetry=telemetry, state=state)
    return state, telemetry


def local_reference(steps: int = STEPS, factory=None):
    """One process, the whole global batch per step: the run every engine must reproduce
    (``factory``: the optimizer's, AdamW by default)."""
    engine = Engine("cpu")
    model = engine.setup(tiny_gpt())
    optimizer = (factory or AdamW(lr=LR, weight_decay=0.1)).build(model)
    scheduler = WarmupCosine(2, 0.1).build(optimizer, STEPS + MORE)
    _, telemetry = train(engine, model, optimizer, scheduler, FP32(), CLIP, Epochs(loader(0, 1)), steps)
    return telemetry.losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def set_env(rank: int, world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def spawn(fn, world: int, out: Path, *args, attempts: int = 2) -> None:
    """``fn(rank, world, port, out, *args)`` on ``world`` processes, each a fork of the warm interpreter
    (tests/warm.py's fork server) run in this process's environment and working directory as it is now.

    A run whose ranks hang (``watchdog``) is run once more, with a warning that carries every rank's
    stacks: CI once saw a gloo all-gather never complete after half an hour (FSDP2 on CPU, not
    reproduced in 40 runs under load); a second hang fails the test with the stacks."""
    import warm
    warm.context()  # the fork server, with torch, torch._dynamo and looplib imported (started once)
    for attempt in range(1, attempts + 1):
        for old in Path(out).glob(".stacks-rank*.txt"):
            old.unlink()
        try:
            mp.start_processes(in_env, args=(dict(os.environ), os.getcwd(), fn, world, free_port(), str(out), *args),
                               nprocs=world, join=True, start_method="forkserver")
            return
        except Exception as e:
            stacks = sorted(Path(out).glob(".stacks-rank*.txt"))
            if not any(p.stat().st_size for p in stacks):
                raise  # a rank failed: its own traceback
            report = "\n".join(f"--- {p.name}\n{p.read_text()}" for p in stacks)
            if attempt == attempts:
                raise AssertionError(f"ranks hung {attempts} times; their stacks:\n{report}") from e
            import warnings
            warnings.warn(f"ranks hung (run again); their stacks:\n{report}")


def watchdog(rank: int, out: str) -> None:
    """A rank still running after ``LOOPLIB_TEST_RANK_WATCHDOG`` seconds (default 5 minutes; every
    spawned test takes seconds) writes every thread's stack to ``out/.stacks-rank{rank}.txt``, and
    is ended by SIGALRM five seconds later (time for the other ranks to write theirs before the
    join ends them): a collective that never completes fails the test in minutes, with where each
    rank was, not after the process group's 30-minute timeout with one rank's traceback. Both
    timers are the kernel's and faulthandler's, so they fire while a rank holds the GIL."""
    import faulthandler
    import signal
    limit = int(os.environ.get("LOOPLIB_TEST_RANK_WATCHDOG", 300))
    f = open(Path(out) / f".stacks-rank{rank}.txt", "w")  # kept open: faulthandler writes to its fd
    faulthandler.dump_traceback_later(limit, exit=False, file=f)
    signal.alarm(limit + 5)  # no handler: the default action ends the process


def in_env(rank: int, env: dict, cwd: str, fn, *args) -> None:
    """In a rank: the caller's environment (a fork server's child would have the server's) then ``fn``."""
    os.environ.clear()
    os.environ.update(env)
    # as torchrun starts its ranks: one thread each unless told (the fork server imported torch already, so
    # the env var alone would not reach its thread pool); with two threads the embedding's gradient
    # summed in another order under DDP than under FSDP and the bit-equality test failed
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    os.chdir(cwd)
    watchdog(rank, args[2])  # args: world, port, out, ...
    fn(rank, *args)


# ------------------------------------------------------------------------------ DDP

def ddp_worker(rank: int, world: int, port: int, out: str) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    set_env(rank, world, port)
    engine = DDP("cpu", bucket_cap_mb=100)  # the tiny model fits one bucket: one all-reduce per sync
    model = engine.setup(tiny_gpt())
    calls = [0]

    def counting(state, bucket):
        calls[0] += 1
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting)
    optimizer = AdamW(lr=LR, weight_decay=0.1).build(model)
    scheduler = WarmupCosine(2, 0.1).build(optimizer, STEPS + MORE)
    _, telemetry = train(engine, model, optimizer, scheduler, FP32(), CLIP, Epochs(loader(engine.rank, world)), STEPS)
    eval_loss = held_out_loss(model, engine, world)
    if engine.is_main:
        torch.save({"losses": telemetry.losses, "allreduces": calls[0], "steps": telemetry.optimizer_steps,
                    "weights": engine.unwrap(model).state_dict(), "eval_loss": eval_loss}, Path(out) / "ddp.pt")
    engine.close()


def held_out_loss(model, engine: Engine, world: int = 1, batch_size: int = 4) -> float:
    """The held-out loss of ``model`` over 15 of 21 masked sequences: each rank its share, padded."""
    from looplib.evaluation import evaluate
    batches = held_out(Masked(random_tokens(21, seed=3)), 15, batch_size=batch_size, rank=engine.rank, world=world)
    return evaluate(model, batches, TokenCrossEntropy(), FP32(), engine)


# ------------------------------------------------------------------------------ DeepSpeed

def deepspeed_worker(rank: int, world: int, port: int, out: str, stages: list[int]) -> None:
    from looplib.engines.deepspeed import DeepSpeed
    from safetensors.torch import load_file
    set_env(rank, world, port)
    results = {}
    for stage in stages:
        def build():
            engine = DeepSpeed("cpu", stage=stage)
            precision = engine.precision_for(FP32())  # chosen once, for the engine (DeepSpeed's own)
            engine.check(settings(world), precision, AdamW(lr=LR, weight_decay=0.1))
            model = engine.setup(tiny_gpt())
            optimizer = AdamW(lr=LR, weight_decay=0.1).build(model)
            scheduler = WarmupCosine(2, 0.1).build(optimizer, STEPS + MORE)
            return engine, scheduler, precision, engine.prepare(model, optimizer, settings(world))

        engine, scheduler, precision, p = build()
        epochs = Epochs(loader(engine.rank, world))
        state, t1 = train(engine, p.model, p.optimizer, scheduler, precision, p.max_grad_norm, epochs, STEPS)
        counts = t1.optimizer_steps, t1.boundaries  # before t2 adds its own hook on the same optimizer
        live = engine.full_weights(p.model)
        export = Path(out) / f"stage{stage}.safetensors"
        if engine.is_main:
            write_safetensors(live, export)
        ckpt = Path(out) / f"ckpt{stage}"
        engine.checkpoints.save(ckpt, "latest", None, {"step": state.step, "scheduler": scheduler.state_dict(),
                                                       "epoch": epochs.epoch, "batches_seen": epochs.batches_seen})
        _, t2 = train(engine, p.model, p.optimizer, scheduler, precision, p.max_grad_norm, epochs, STEPS + MORE, state)
        continued = engine.full_weights(p.model)

        engine2, scheduler2, precision2, p2 = build()  # a fresh process would do the same: build, then load
        client = engine2.checkpoints.load(ckpt / "latest")
        scheduler2.load_state_dict(client["scheduler"])
        epochs2 = Epochs(loader(engine2.rank, world), client["epoch"], client["batches_seen"])
        _, t3 = train(engine2, p2.model, p2.optimizer, scheduler2, precision2, p2.max_grad_norm, epochs2,
                      STEPS + MORE, TrainState(step=client["step"]))
        resumed = engine2.full_weights(p2.model)
        if engine.is_main:
            exported = load_file(export)
            results[stage] = {
                "losses": t1.losses, "continued": t2.losses, "resumed": t3.losses,
                "optimizer_steps": counts[0], "boundaries": counts[1],
                "export_keys": sorted(exported), "live_keys": sorted(live),
                "export_equals_live": all(torch.equal(exported[k], live[k]) for k in exported),
                "resume_equals_continue": all(torch.equal(continued[k], resumed[k]) for k in continued),
                "weights": {k: v.tolist() for k, v in live.items()},
                "continued_weights": {k: v.tolist() for k, v in continued.items()},
            }
    if rank == 0:
        (Path(out) / "deepspeed.json").write_text(json.dumps(results))


# ------------------------------------------------------------------------------ FSDP2

def fsdp_worker(rank: int, world: int, port: int, out: str) -> None:
    """DDP and FSDP on the same data in the same processes; FSDP's reduce-scatters counted."""
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as group
    from looplib.engines.fsdp import FSDP
    set_env(rank, world, port)
    ddp = DDP("cpu", bucket_cap_mb=100)
    model = ddp.setup(tiny_gpt())
    optimizer = AdamW(lr=LR, weight_decay=0.1).build(model)
    scheduler = WarmupCosine(2, 0.1).build(optimizer, STEPS + MORE)
    _, telemetry = train(ddp, model, optimizer, scheduler, FP32(), CLIP, Epochs(loader(rank, world)), STEPS)
    ddp_losses, ddp_norms = telemetry.losses, telemetry.grad_norms
    ddp_weights = {k: v.detach().clone() for k, v in ddp.unwrap(model).state_dict().items()}

    calls = [0]
    reduce = group.foreach_reduce

    def counting(*args, **kwargs):  # one call per FSDP unit whose gradients are reduce-scattered
        calls[0] += 1
        return reduce(*args, **kwargs)

    group.foreach_reduce = counting
    engine = FSDP("cpu")
    precision = engine.precision_for(FP32())
    engine.check(settings(world), precision, AdamW(lr=LR, weight_decay=0.1))
    model = engine.setup(tiny_gpt())
    optimizer = AdamW(lr=LR, weight_decay=0.1, impl="fused").build(model)  # fused AdamW on DTensors
    scheduler = WarmupCosine(2, 0.1).build(optimizer, STEPS + MORE)
    p = engine.prepare(model, optimizer, settings(world))
    _, telemetry = train(engine, p.model, p.optimizer, scheduler, precision, p.max_grad_norm,
                         Epochs(loader(rank, world)), STEPS)
    weights = engine.full_weights(p.model)
    export = Path(out) / "fsdp.safetensors"
    if engine.is_main:
        write_safetensors(weights, export)
    group.foreach_reduce = reduce
    skipped = fp16_overflow_on_one_rank(rank)
    if rank == 0:
        from safetensors.torch import load_file
        torch.save({"losses": telemetry.losses, "weights": weights, "ddp_losses": ddp_losses,
                    "grad_norms": telemetry.grad_norms, "ddp_grad_norms": ddp_norms,
                    "ddp_weights": ddp_weights, "reduce_calls": calls[0], "units": engine.units,
                    "steps": telemetry.optimizer_steps, "export": load_file(export), "fp16": skipped},
                   Path(out) / "fsdp.pt")
    engine.close()


def muon(**changes):
    from looplib.muon import Muon
    return Muon(**{"lr": LR, "weight_decay": 0.1, **changes})


def muon_worker(rank: int, world: int, port: int, out: str) -> None:
    """+optim=muon under DDP and under FSDP2 (Newton-Schulz on the gathered matrix), same data."""
    from looplib.engines.fsdp import FSDP
    set_env(rank, world, port)
    result = {}
    runs = [("ddp fp32", lambda: DDP("cpu", bucket_cap_mb=100), "fp32"), ("fsdp fp32", lambda: FSDP("cpu"), "fp32"),
            ("fsdp bf16", lambda: FSDP("cpu"), "bf16")]
    for name, make, dtype in runs:
        engine = make()
        precision = engine.precision_for(FP32())
        engine.check(settings(world), precision, muon(ns_dtype=dtype))
        model = engine.setup(tiny_gpt())
        optimizer = muon(ns_dtype=dtype).build(model)
        scheduler = WarmupCosine(2, 0.1).build(optimizer, STEPS + MORE)
        p = engine.prepare(model, optimizer, settings(world))
        _, telemetry = train(engine, p.model, p.optimizer, scheduler, precision, p.max_grad_norm,
                             Epochs(loader(rank, world)), STEPS)
        weights = engine.full_weights(p.model) if name.startswith("fsdp") else \
            {k: v.detach().clone() for k, v in engine.unwrap(p.model).state_dict().items()}
        result[name] = {"losses": telemetry.losses, "weights": weights,
                        "muon": [n for n, q in engine.unwrap(p.model).named_parameters()
                                 if any(q is m for m in p.optimizer.param_groups[0]["params"])]}
    engine.close()
    if rank == 0:
        torch.save(result, Path(out) / "muon.pt")


def fp16_overflow_on_one_rank(rank: int) -> dict:
    """fp16 under FSDP: an inf in rank 1's gradient shard only. The scaler's inf check is agreed
    across ranks, so *every* rank skips the update and halves the scale (a per-rank check would
    let rank 0 step on its shards alone). The loop's verbs, one window."""
    from looplib.engines.fsdp import FSDP
    from looplib.loop import clip_grad_norm
    from looplib.precision import FP16
    engine = FSDP("cpu")
    precision = engine.precision_for(FP16(init_scale=2.0**10))  # the sharded scaler, chosen at assembly
    engine.check(settings(2), precision, None)
    model = engine.setup(tiny_gpt())
    p = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), settings(2))
    batch = random_tokens(2)[rank]
    before = [t.detach().to_local().clone() for t in model.parameters()]
    with precision.autocast():
        loss = TokenCrossEntropy()(p.model, {k: v[None] for k, v in batch.items()})
    precision.backward(loss)
    if rank == 1:
        next(iter(model.parameters())).grad.to_local().fill_(float("inf"))
    precision.unscale(p.optimizer)
    norm = clip_grad_norm(list(p.model.parameters()), CLIP)
    precision.step(p.optimizer, norm)
    return {"scaler": type(precision.scaler).__name__, "scale": precision.scaler.get_scale(),
            "param_dtype": str(engine.mp_policy.param_dtype), "norm": float(norm),
            "unchanged": all(torch.equal(a, t.detach().to_local()) for a, t in zip(before, model.parameters()))}
