"""The plan as text: one row per kind of memory, the ZeRO and FSDP tables, the advice."""
from __future__ import annotations

from .advice import human, recommendations
from .budget import USABLE, Plan
from .sharding import zero_per_rank


def row(label: str, value: int) -> str:
    return f"  {label:<62} {value:>18,} B  {human(value):>11}"


def render(plan: Plan) -> str:
    mb = plan.micro_batch if isinstance(plan.micro_batch, int) else 1
    total = plan.n_total or plan.n_params
    of = f" of {total:,}" if total != plan.n_params else ""
    lines = [f"memory plan: {plan.model_name} ({plan.n_params:,} trainable parameters{of}), precision {plan.precision}, "
             f"optimizer {plan.optimizer}, activation checkpointing {'on' if plan.checkpointing_on else 'off'}, "
             f"micro-batch {plan.micro_batch} x accumulation {plan.accum_steps}",
             "static (exact):",
             row(f"weights ({plan.weights / max(total, 1):.3g} bytes/param)", plan.weights),
             row("16-bit copies of matmul weights (autocast)", plan.copies),
             row("gradients", plan.gradients),
             row(f"optimizer state ({plan.optimizer})", plan.optim_state),
             *([row(f"{plan.reference_of}: {plan.reference_kind}", plan.reference)] if plan.reference_kind else []),
             row(f"static total ({plan.static / max(total, 1):.2f} bytes/param)", plan.static),
             "activations saved for backward (estimate, meta-device run):",
             row("per sample, without checkpointing", plan.act_plain.per_sample),
             row(f"per sample, with checkpointing ({len(plan.chosen)} modules)", plan.act_ckpt.per_sample),
             row(f"micro-batch {mb}, without checkpointing", plan.act_plain.at(mb)),
             row(f"micro-batch {mb}, with checkpointing", plan.act_ckpt.at(mb)),
             *([row(f"micro-batch {mb}, offloaded to host memory", plan.host.at(mb))] if plan.host.at(mb) else []),
             row(f"peak at micro-batch {mb} x accumulation {plan.accum_steps} (as configured)", plan.peak(mb)),
             row(f"device memory ({plan.memory_name}); {USABLE:.0%} usable", plan.memory)]
    if plan.uses:
        lines.append(f"activations by strategy (+checkpointing=...) at micro-batch {mb}, on {len(plan.chosen)} modules: "
                     "held on the device from forward into backward, + at most in backward, in host memory:")
        for name, use in plan.uses.items():
            mark = " (configured)" if name == plan.strategy else ""
            lines.append(f"  {name + mark:<22}{human(use.device.at(mb)):>14} +{human(use.transient.at(mb)):>12}"
                         f"{human(use.host.at(mb)) + ' host' if use.host.at(mb) else '':>20}")
    if plan.four_bit:  # FSDP2 shards the packed base; DeepSpeed would refuse it
        lines += sharded_4bit_rows(plan, mb)
    else:
        p, g, o = plan.zero_layout()
        lines.append(f"DeepSpeed ZeRO model state per rank, {plan.world} rank(s) "
                     f"(params {human(p)}, grads {human(g)}, optimizer + master {human(o)}):")
        lines.append(f"  {'stage':<10}{'on device':>20}{'optimizer offload':>20}{'+ param offload':>20}")
        for stage in (0, 1, 2, 3):
            cells = [zero_per_rank(p, g, o, plan.world, stage), zero_per_rank(p, g, o, plan.world, stage, True)]
            cells.append(zero_per_rank(p, g, o, plan.world, stage, True, True) if stage == 3 else None)
            lines.append(f"  {stage:<10}" + "".join(f"{human(c) if c is not None else '-':>20}" for c in cells))
        lines.append(f"FSDP2 (+engine=fsdp) per rank, {plan.world} rank(s): parameters, gradients and optimizer state "
                     f"/ {plan.world} + 2 x the largest unit ({plan.fsdp_unit[0]}, {human(plan.fsdp_unit[1])}) = "
                     f"{human(plan.fsdp())}; with engine.offload=cpu {human(plan.fsdp(offload=True))}")
    lines.append("recommendations:")
    lines += [f"  - {r}" for r in recommendations(plan)]
    return "\n".join(lines)


def sharded_4bit_rows(plan: Plan, mb: int) -> list[str]:
    """The 4-bit base under FSDP2, per rank (``Plan.fsdp_4bit``); DeepSpeed refuses it."""
    world, r = plan.world, plan.fsdp_4bit()
    usable = int(plan.memory * USABLE)
    half = plan.precision in ("bf16", "fp16")
    return [f"FSDP2 (+engine=fsdp) per rank, {world} rank(s), the 4-bit base sharded (DeepSpeed ZeRO: refused with "
            "+peft=qlora):",
            row(f"packed 4-bit weights (in {plan.precision if half else 'fp32'}) / {world}", r["packed"]),
            row("quantisation constants (whole on every rank)", r["constants"]),
            row(f"frozen embeddings, norms, head (in {plan.precision if half else 'fp32'}) / {world}", r["frozen"]),
            row(f"adapters (fp32) / {world}", r["adapters"]),
            row(f"adapter gradients / {world}", r["gradients"]),
            row(f"optimizer state ({plan.optimizer}) / {world}", r["optimizer"]),
            row("gathered at once: the root + 2 x the largest block", r["gathered"]),
            row(f"activations at micro-batch {mb} ({plan.strategy if plan.checkpointing_on else 'none'})",
                r["activations"]),
            row(f"peak per rank: {'fits' if r['peak'] <= usable else 'does NOT fit'} in {human(usable)} usable",
                r["peak"])]
