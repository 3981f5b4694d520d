"""What to change when a job does not fit, in the guides' order, and which engine to shard with."""
from __future__ import annotations

from ..accumulation import candidates
from .activations import Activations
from .budget import USABLE, Plan
from .sharding import zero_per_rank


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def largest_micro_batch(budget: int, act: Activations, cap: int | None = None) -> int:
    """The largest micro-batch whose activations fit in ``budget`` (a multiple of 8 from 8 up)."""
    if act.per_sample <= 0:
        return cap or 0
    b = max(0, (budget - act.fixed) // act.per_sample)
    if cap:
        b = min(b, cap)
    return b - b % 8 if b >= 8 else b


def recommendations(plan: Plan) -> list[str]:
    usable = int(plan.memory * USABLE)
    if plan.four_bit and plan.engine == "fsdp":  # the 4-bit base sharded: per rank, not one device
        return sharded_4bit_advice(plan, usable)
    target = plan.global_batch or (plan.micro_batch * plan.accum_steps if isinstance(plan.micro_batch, int) else None)
    out = []
    budget = usable - plan.static
    best = largest_micro_batch(budget, plan.activations)
    if best >= 1:
        text = (f"largest micro-batch that fits at any accumulation: {best}" +
                (" (a multiple of 8)" if best >= 8 else ""))
        if target:
            eights, small = candidates(target)
            micro = max([d for d in eights if d <= best] or [d for d in small if d <= best])
            text += (f"; for the global batch of {target}: batch_size={micro} accum_steps={target // micro} "
                     f"(fill the device before accumulating; batch_size=auto global_batch_size={target} measures it)")
        out.append(text)
        if isinstance(plan.micro_batch, int):
            need = plan.peak(plan.micro_batch)
            verdict = "fits" if need <= usable else "does NOT fit"
            out.append(f"the configured micro-batch {plan.micro_batch} {verdict} ({human(need)} of {human(usable)} usable)")
        if not (isinstance(plan.micro_batch, int) and need > usable):
            return out + engine_choice(plan, usable)
    else:
        out.append(f"not even a micro-batch of 1 fits ({human(plan.static + plan.activations.at(1))} "
                   f"needed, {human(usable)} usable); in the guides' order:")
    if not plan.checkpointing_on:
        now = plan.act_plain
        for name, cost in (("selective", "recomputes the cheap ops only"), ("blocks", "about one more forward pass"),
                           ("offload", "host memory and copies instead of recomputing")):
            use = plan.uses.get(name) or (plan.act_ckpt if name == "blocks" else None)
            if use is not None and use.at(1) < now.at(1):
                out.append(f"+checkpointing={name}: activations per sample {human(now.per_sample)} -> "
                           f"{human(use.per_sample)} (saves {human(now.at(1) - use.at(1))} at micro-batch 1; {cost})")
    if plan.adam8bit_state is not None:
        out.append(f"+optim=adam8bit: optimizer state {human(plan.optim_state)} -> {human(plan.adam8bit_state)}")
    if plan.act_plain_bf16 is not None:
        out.append(f"+precision=bf16 (or fp16): activations per sample {human(plan.act_plain.per_sample)} -> "
                   f"{human(plan.act_plain_bf16.per_sample)}, at the cost of 2 bytes/param of 16-bit weight copies")
    out += engine_choice(plan, usable)
    return out


def engine_choice(plan: Plan, usable: int) -> list[str]:
    """DDP while the model state fits one device (one all-reduce per step, the least traffic);
    else the first sharding that fits, least communication first: ZeRO-1/2 (parameters whole),
    FSDP2 (everything sharded, one unit gathered at a time; about ZeRO-3's layout, PyTorch's
    own), then offload to host memory (FSDP's engine.offload=cpu, ZeRO-Offload / -Infinity)."""
    act = plan.act_ckpt.at(1)
    model_state = plan.weights + plan.gradients + min(plan.optim_state, plan.adam8bit_state or plan.optim_state)
    if model_state + act <= usable:
        return [f"engine: the model state ({human(model_state)}) fits one device: +engine=ddp over "
                f"{plan.world} rank(s) (every rank holds everything; one all-reduce per step)"] if plan.world > 1 else []
    if plan.four_bit:  # only FSDP shards a 4-bit base (DeepSpeed refuses it)
        first, *rest = sharded_4bit_advice(plan, usable)
        return [f"the model state ({human(model_state)}) with its activations does not fit one device: {first}", *rest]
    p, g, o = plan.zero_layout()
    head = f"the model state alone ({human(model_state)}) does not fit: "
    unit = f"(shards + the largest unit, {plan.fsdp_unit[0]}, gathered)"
    for what, need in [("DeepSpeed ZeRO-1 (+engine=deepspeed engine.stage=1)", zero_per_rank(p, g, o, plan.world, 1)),
                       ("DeepSpeed ZeRO-2 (+engine=deepspeed engine.stage=2)", zero_per_rank(p, g, o, plan.world, 2)),
                       (f"+engine=fsdp {unit}", plan.fsdp()),
                       (f"+engine=fsdp engine.offload=cpu {unit}", plan.fsdp(offload=True)),
                       ("DeepSpeed ZeRO-2 with optimizer offload", zero_per_rank(p, g, o, plan.world, 2, True)),
                       ("DeepSpeed ZeRO-3 with optimizer and parameter offload",
                        zero_per_rank(p, g, o, plan.world, 3, True, True))]:
        if need + act <= usable:
            return [head + f"{what} over {plan.world} rank(s) needs {human(need)} per rank"]
    return [head + f"not even FSDP / ZeRO-3 with offload over {plan.world} rank(s) fits: use more ranks (--world-size)"]


def sharded_4bit_advice(plan: Plan, usable: int) -> list[str]:
    """A 4-bit base under FSDP2 (``Plan.fsdp_4bit``): whether it fits ``plan.world`` ranks as configured,
    else what to turn on: an activation strategy that fits, else the fewest ranks that fit."""
    world = plan.world
    need = plan.fsdp_4bit(world)["peak"]
    ranks = f"over {world} rank(s)" + (" (torchrun --nproc_per_node " + str(world) + ")" if world > 1 else "")
    if need <= usable:
        return [f"+engine=fsdp {ranks} shards the 4-bit base: {human(need)} per rank of {human(usable)} usable: fits"]
    out = [f"+engine=fsdp {ranks}: {human(need)} per rank does NOT fit ({human(usable)} usable)"]
    for name in ("selective", "blocks", "offload"):
        use = plan.uses.get(name)
        if use is None or name == plan.strategy:
            continue
        with_it = plan.fsdp_4bit(world, use)["peak"]
        if with_it <= usable:
            return out + [f"+checkpointing={name}: {human(with_it)} per rank: fits"]
    best = min((plan.uses.get(n) or plan.activations for n in ("blocks", "offload", plan.strategy)),
               key=lambda u: u.at(1))
    for more in range(world + 1, 65):
        if plan.fsdp_4bit(more, best)["peak"] <= usable:
            turn_on = "" if best is plan.activations else \
                f" with +checkpointing={next(n for n, u in plan.uses.items() if u is best)}"
            return out + [f"--world-size {more} (torchrun --nproc_per_node {more}){turn_on}: "
                          f"{human(plan.fsdp_4bit(more, best)['peak'])} per rank: fits"]
    return out + ["not even 64 ranks fit it: a shorter sequence (model.seq_len), or a smaller base"]
