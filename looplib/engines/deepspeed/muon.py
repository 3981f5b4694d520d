"""``+optim=muon`` under ``+engine=deepspeed``: DeepSpeed's own Muon (deepspeed >= 0.19.8,
``"optimizer": {"type": "Muon"}``), which orthogonalises each matrix's update inside ZeRO's
partitioning (ZeRO 1-3), with its auxiliary Adam for the rest.

DeepSpeed's Muon is not torch's, so looplib maps what it can and refuses the rest, in one line:

- the update's scale is Keller Jordan's ``sqrt(max(1, rows / cols))`` (torch's ``adjust_lr=original``);
  Nesterov momentum, 5 Newton-Schulz steps with the default coefficients and eps are fixed. Any
  other ``optim.adjust_lr`` / ``nesterov`` / ``ns_steps`` / ``ns_coefficients`` / ``eps`` / ``ns_dtype``
  is refused (``optim.adjust_lr=original`` with an lr on its scale, e.g. ``optim.lr=0.02``);
- DeepSpeed picks Muon's matrices by *name*: every 2-D parameter whose name holds neither
  ``embed`` nor ``lm_head``. Where that differs from looplib's choice (the 2-D weights inside the
  repeated blocks) the run is refused, naming the first parameter they disagree on (the bundled
  GPT's ``tok_emb``; a transformers Llama agrees);
- looplib's param groups (Muon's; AdamW's decayed and not: each with its lr and weight decay) are
  handed to ``deepspeed.initialize``, and DeepSpeed's groups replace them in looplib's optimizer,
  so the schedule built on it scales DeepSpeed's learning rates (each group its own);
- under ZeRO (stage >= 1) DeepSpeed writes Muon's orthogonalised update into the gradient
  partitions and computes the clipping norm over them: clipping would shrink Muon's steps, not
  the gradients (measured on a tiny Llama: 0.03 off after 4 steps at lr 0.02, the gradient norm
  under 1), so ``max_grad_norm`` must be 0 there; ZeRO-3 runs with ``reduce_scatter: false``
  (DeepSpeed's Muon needs whole matrices);
- Newton-Schulz runs DeepSpeed's "standard" iteration (bf16 where the accelerator has it, as
  torch's), not its fp16 "gram" default; optimizer offload is refused (not tried here). On the
  CPU DeepSpeed compiles its Newton-Schulz with torch.compile at the first step (a C++ compiler,
  minutes); ``TORCHDYNAMO_DISABLE=1`` runs it eagerly.
"""
from __future__ import annotations

from ...errors import ConfigError

# what DeepSpeed 0.19.8's Muon fixes (deepspeed/runtime/zero/muon/original_muon.py)
FIXED = {"nesterov": True, "ns_steps": 5, "ns_coefficients": (3.4445, -4.775, 2.0315), "eps": 1e-7,
         "ns_dtype": "bf16", "adjust_lr": "original"}
GROUP_KEYS = ("params", "lr", "weight_decay", "momentum", "betas", "eps")  # what its param groups take


def check(factory, engine, settings) -> None:
    """Build time: the settings DeepSpeed's Muon has (``factory``: ``looplib.muon.Muon``)."""
    for key, fixed in FIXED.items():
        value = getattr(factory, key)
        if (tuple(value) if isinstance(value, (list, tuple)) else value) != fixed:
            extra = ", and an lr on its scale (e.g. optim.lr=0.02)" if key == "adjust_lr" else ""
            raise ConfigError(f"optim.{key}", f"+engine=deepspeed runs DeepSpeed's own Muon, which has "
                              f"{key}={show(fixed)} only (got optim.{key}={show(value)})",
                              f"set optim.{key}={show(fixed)}{extra}, or use +engine=fsdp / ddp for torch's Muon")
    if engine.stage >= 1 and settings.max_grad_norm:
        raise ConfigError("max_grad_norm", f"+optim=muon under ZeRO stage {engine.stage}: DeepSpeed 0.19.8 writes Muon's "
                          "orthogonalised update into the gradient partitions and then clips by their norm, so "
                          f"max_grad_norm={settings.max_grad_norm:g} would shrink Muon's steps, not clip the gradients",
                          "set max_grad_norm=0 (no clipping), or engine.stage=0, or +engine=fsdp / ddp")
    if engine.offload_optimizer != "none":
        raise ConfigError("engine.offload_optimizer", "+optim=muon with optimizer offload: DeepSpeed's Muon on "
                          "offloaded partitions is not supported by looplib (not tried)",
                          "use engine.offload_optimizer=none, or +optim=cpu_adam")


def show(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value)


def deepspeed_routing(model) -> dict[int, bool]:
    """DeepSpeed's choice (``deepspeed.set_optimizer_flags``): 2-D and no embed / lm_head in the name."""
    return {id(p): p.ndim >= 2 and not any(k in name.lower() for k in ("embed", "lm_head"))
            for name, p in model.named_parameters()}


def prepare(model, optimizer) -> tuple[dict, list[dict]]:
    """The ``optimizer`` section and the param groups for ``deepspeed.initialize``, from looplib's
    ``MuonAdamW``; refused where DeepSpeed would route a parameter otherwise."""
    theirs = deepspeed_routing(model)
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if theirs[id(p)] != group["use_muon"]:
                ours, other = ("Muon", "AdamW") if group["use_muon"] else ("AdamW", "Muon")
                raise ConfigError("optim", f"+engine=deepspeed chooses Muon's matrices by name (2-D, no 'embed' or "
                                  f"'lm_head' in it): it would give {names[id(p)]} to {other}, which looplib "
                                  f"gives to {ours} (the 2-D weights inside the repeated blocks)",
                                  "use +engine=fsdp or +engine=ddp with +optim=muon for this model")
    muon = next(g for g in optimizer.param_groups if g["use_muon"])
    # torch_adam: torch's AdamW for the other half (DeepSpeed's default, its FusedAdam, is an op it
    # compiles on first use: 1-2 minutes on a CPU, and not the update looplib's AdamW half makes)
    section = {"type": "Muon", "params": {"lr": muon["lr"], "momentum": muon["momentum"],
                                          "weight_decay": muon["weight_decay"], "ns_method": "standard",
                                          "torch_adam": True}}
    return section, [{k: g[k] for k in GROUP_KEYS if k in g} for g in optimizer.param_groups]


def adopt(optimizer, ds_optimizer) -> None:
    """DeepSpeed's param groups (one per looplib group, in its order) become ``optimizer``'s, so the
    schedule built on ``optimizer`` sets DeepSpeed's learning rates."""
    inner = getattr(ds_optimizer, "optimizer", ds_optimizer)  # ZeRO wraps the Muon it built
    if len(inner.param_groups) != len(optimizer.param_groups) or \
            [g["use_muon"] for g in inner.param_groups] != [g["use_muon"] for g in optimizer.param_groups]:
        raise RuntimeError("DeepSpeed's Muon grouped the parameters otherwise than looplib's groups")
    for ours, theirs in zip(optimizer.param_groups, inner.param_groups):
        theirs.update({k: v for k, v in ours.items() if k not in theirs and k != "params"})  # initial_lr, ...
    optimizer.param_groups = inner.param_groups
