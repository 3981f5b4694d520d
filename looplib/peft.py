"""Parameter-efficient fine-tuning: ``+peft=lora`` wraps the model with the peft library's LoRA.

Only the adapter weights require gradients, so the optimizer (built from trainable
parameters only, ``looplib.optim.param_groups``) holds state for them alone, and the run
exports them alone (``adapter/adapter_model.safetensors`` + ``adapter_config.json``, peft's
own format) instead of ``model.safetensors``: a strategy declares what the run exports
(``exports()``, an ``Exports``), and ``looplib.store.export`` writes it. ``load_lora(fresh_model, run_dir / "adapter")``
loads them back. Which layers get adapters, unless ``target_modules`` names them: for a
transformers model (``looplib.hf``) peft's own choice for its architecture (llama: q_proj,
v_proj; gpt2: c_attn; a type peft has no entry for: every Linear but the output layer), for
the bundled GPT its attention and MLP linears (``GPT_LINEARS``). A transformers model is
adapted inside its wrapper, so the adapter's keys are peft's own, and the run writes ``hf/``
instead: the adapter ``peft.AutoPeftModelFor...`` loads, or with ``merge: true`` the merged
full weights. This module is the config group ``peft``; inside it ``import peft`` is the
library (absolute imports), imported only when LoRA is chosen (``pip install 'looplib[peft]'``).

``+peft=qlora`` (``QLoRA``) is LoRA on a frozen base whose linear layers are held in 4 bits
(NF4, bitsandbytes ``Linear4bit``; ``looplib.quantize``): a transformers model read from
``model.path`` is quantised while it loads, any other model when it is wrapped.
"""
from __future__ import annotations

import logging
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from .errors import ConfigError, need
from .precision import Precision
from .schema import Beta, Positive

log = logging.getLogger("looplib")

# The bundled GPT's attention and MLP linears (looplib/models/gpt.py); peft matches a name
# when it equals a module's full name or ends it after a dot ("mlp.0" -> "blocks.3.mlp.0").
GPT_LINEARS = ("attn.qkv", "attn.proj", "mlp.0", "mlp.2")
ALL_LINEAR = "all-linear"
# the layer types peft's LoRA adapts (plus transformers' Conv1D, recognised by name)
ADAPTABLE = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention)


@dataclass(frozen=True)
class Exports:
    """What a run exports at its end, as its adapter strategy declares it (``exports()``);
    ``looplib.store.export.write_exports`` writes it. ``weights``: ``full`` (every weight:
    ``model.safetensors``), ``adapter`` (the adapter alone: ``adapter/``, peft's format) or
    ``merged`` (the adapter merged into its base: ``model.safetensors`` with the base's keys); a
    transformers model writes each as ``hf/`` instead."""
    weights: Literal["full", "adapter", "merged"] = "full"


class FullModel:
    """Train and export every parameter: the null object."""

    def check(self, engine, precision) -> None:
        """Refuse an engine or a precision this adapter cannot train under (build time)."""

    def check_base(self, model: nn.Module) -> None:
        """Refuse a base this adapter should not train on (build time, before it is wrapped)."""

    def loading(self):
        """The context the model is built in (QLoRA: a transformers model loads in 4 bits)."""
        return nullcontext()

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def exports(self) -> Exports:
        """What the run writes at its end (``looplib.store.export`` writes it): every weight."""
        return Exports("full")


class LoRA(FullModel):
    """Low-rank adapters (``peft.LoraConfig``) on the modules named by ``target_modules``."""

    def __init__(self, r: Positive[int] = 8, alpha: Positive[float] = 16, dropout: Beta = 0.0,
                 target_modules: list[str] | tuple[str, ...] | None = None,
                 bias: Literal["none", "all", "lora_only"] = "none", merge: bool = False,
                 allow_random_base: bool = False):
        if r < 1:
            raise ConfigError("peft.r", f"the LoRA rank must be at least 1 (got r={r})", "use e.g. peft.r=8")
        self.peft = import_peft()
        self.target_modules = None if target_modules is None else list(target_modules)
        self.config = dict(r=r, lora_alpha=alpha, lora_dropout=dropout, bias=bias)
        self.merge = merge
        self.allow_random_base = allow_random_base  # true: adapters on a base never trained, knowingly
        self.adapted = None   # the peft model, once wrapped

    def check_base(self, model):
        """Adapters fine-tune a trained base: one looplib knows was never trained (random weights:
        ``looplib.store.init_from.untrained``) is refused unless ``allow_random_base``."""
        if self.allow_random_base or not untrained(model):
            return
        name = "qlora" if isinstance(self, QLoRA) else "lora"
        raise ConfigError("peft", f"+peft={name} on a {type(model).__name__} that was never trained (its weights are "
                          "the random initialisation): the adapter would fine-tune noise, and only the adapter is saved",
                          "start from trained weights: model.init_from=RUN_DIR (a finished looplib run or one of its "
                          "checkpoints; train_model(..., init_from=...)), or model=hf model.path=DIR; or say so: "
                          "peft.allow_random_base=true (LoRA(allow_random_base=True))")

    def targets_for(self, model: nn.Module) -> list[str] | str:
        """The modules to adapt: ``target_modules`` as given, else the model's own defaults.
        [all-linear] is peft's own choice, every Linear but the output layer (transformers models)."""
        if self.target_modules is not None:
            return ALL_LINEAR if self.target_modules == [ALL_LINEAR] else self.target_modules
        declared = getattr(model, "lora_targets", None)  # a model's own defaults (the bundled GPT's: GPT_LINEARS)
        if declared:
            return list(declared)
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if isinstance(model_type, str):  # a transformers model (looplib.hf's wrappers pass its config on)
            defaults = self.peft.utils.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
            return list(defaults[model_type]) if model_type in defaults else ALL_LINEAR
        linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)][:2]
        raise ConfigError("peft.target_modules", f"looplib has no default LoRA targets for {type(model).__name__}",
                          "name its Linear layers, e.g. peft.target_modules=[" + ",".join(linears or ["NAME"]) + "]")

    def wrap(self, model):
        modules = dict(model.named_modules())
        targets = self.targets_for(model)
        for target in [] if targets == ALL_LINEAR else targets:
            matched = [n for n in modules if n == target or n.endswith("." + target)]
            if not matched:
                raise ConfigError("peft.target_modules", f"no module of {type(model).__name__} is named {target!r}",
                                  "name Linear layers of the model, e.g. peft.target_modules=[attn.qkv,mlp.0] "
                                  "(a transformers model: [q_proj,v_proj]), or leave peft.target_modules out "
                                  "for the model's defaults")
            for name in matched:
                if not isinstance(modules[name], ADAPTABLE) and type(modules[name]).__name__ != "Conv1D":
                    raise ConfigError("peft.target_modules",
                                      f"{target!r} names {name}, a {type(modules[name]).__name__}, "
                                      "which LoRA cannot adapt",
                                      "name Linear (or Embedding/Conv) layers, e.g. mlp.0 rather than mlp")
        config = dict(self.config, target_modules=targets)
        try:  # a transformers wrapper (looplib.hf) adapts the model inside it: peft's own key names
            adapt = getattr(model, "adapt", None)
            with quiet_peft():
                wrapped = adapt(self.peft, config) if adapt else self.peft.get_peft_model(
                    model, self.peft.LoraConfig(**config))
        except ValueError as err:  # anything peft refuses that the checks above did not catch
            raise ConfigError("peft.target_modules", str(err).splitlines()[0],
                              "name Linear (or Embedding/Conv) layers of the model") from None
        self.adapted = wrapped.adapter_model() if adapt else wrapped
        trainable, total = self.adapted.get_nb_trainable_parameters()
        log.info("LoRA r=%d on %s: %s of %s parameters train (%.2f%%)", self.config["r"],
                 ",".join(targets) if targets != ALL_LINEAR else ALL_LINEAR, f"{trainable:,}", f"{total:,}",
                 100 * trainable / total)
        return wrapped

    def exports(self) -> Exports:
        """The adapter alone (``adapter/``, peft's format; a transformers model: ``hf/``), or with
        ``merge`` the weights with the adapter merged in (4-bit layers dequantised)."""
        return Exports("merged" if self.merge else "adapter")


class QLoRA(LoRA):
    """LoRA on a frozen base held in 4 bits: every linear layer but the output one becomes a
    bitsandbytes ``Linear4bit`` (``quant_type`` nf4 or fp4, blocks of 64 weights; with
    ``double_quant`` the blocks' scales are quantised too: 0.127 bits of scales per weight, not 0.5),
    computing in the precision strategy's dtype (fp32 without autocast, else bf16 / fp16). A
    transformers model read from ``model.path`` is quantised while it loads (transformers'
    ``BitsAndBytesConfig``, one layer at a time, on the run's device); any other model when it
    is wrapped. Adapters go on every linear layer unless ``target_modules`` says otherwise (the
    QLoRA paper's choice). The adapter saved loads with peft on the 4-bit base or on the
    full-precision one; ``merge: true`` writes the dequantised base with the adapter merged.

    Under FSDP (an engine with ``shards_4bit``) the packed weights are stored in the compute
    dtype (bitsandbytes' ``quant_storage``: the same bytes, two weights a byte, in a float
    tensor FSDP shards like any parameter), quantised on the device and left in host memory for
    FSDP to shard one unit at a time; each layer's quantisation constants stay whole on every
    rank (bitsandbytes puts them back on the gathered weight). The frozen rest (embeddings,
    norms, head) is stored in a 16-bit compute dtype, to which FSDP casts it for every forward
    anyway. DeepSpeed is refused, and so is FSDP's CPU offload."""

    def __init__(self, r: Positive[int] = 8, alpha: Positive[float] = 16, dropout: Beta = 0.0,
                 target_modules: list[str] | tuple[str, ...] | None = None,
                 bias: Literal["none", "all", "lora_only"] = "none", merge: bool = False,
                 quant_type: Literal["nf4", "fp4"] = "nf4", double_quant: bool = True, allow_random_base: bool = False):
        import importlib.util
        missing = [name for name in ("peft", "bitsandbytes") if importlib.util.find_spec(name) is None]
        if missing:  # both named at once: not one install, then another refusal
            raise ConfigError("peft", f"+peft=qlora needs {' and '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
                              "not installed", "pip install 'looplib[peft,bnb]', or use +peft=lora (needs peft only)")
        super().__init__(r, alpha, dropout, target_modules, bias, merge, allow_random_base)
        from .optim import import_bitsandbytes
        self.bnb = import_bitsandbytes("peft", "+peft=qlora", "use +peft=lora")
        self.quant_type, self.double_quant = quant_type, double_quant
        self.device, self.compute_dtype = torch.device("cpu"), torch.float32  # check() says where and in what
        self.sharded = False  # under FSDP (check): float storage, quantised into host memory

    def check(self, engine, precision) -> None:
        self.sharded = not getattr(engine, "keeps_modules", True)
        if self.sharded and not getattr(engine, "shards_4bit", False):
            raise ConfigError("peft", f"+engine={engine.label} with +peft=qlora: ZeRO flattens parameters into its own "
                              "partitions and casts them to its compute dtype, and knows nothing of the quantisation "
                              "constants bitsandbytes keeps beside the packed 4-bit weights",
                              "use +engine=fsdp (it shards the 4-bit base), or +engine=ddp / the local engine")
        if self.sharded and getattr(engine, "offload", "none") != "none":
            raise ConfigError("engine.offload", "engine.offload=cpu with +peft=qlora: FSDP's CPU offload of a 4-bit "
                              "base is not supported (the quantisation constants live beside the module, outside "
                              "FSDP's offload, and the combination has not been checked on a GPU)",
                              "use engine.offload=none (the base is already 4 bits) with more processes, or "
                              "+checkpointing=offload to move activations to host memory")
        dtype = precision.dtype or torch.float32
        converts = type(precision).convert is not Precision.convert  # fp8: its own linear layers
        if dtype not in (torch.float32, torch.bfloat16, torch.float16) or converts:
            raise ConfigError("peft", f"the 4-bit base computes in fp32, bf16 or fp16, not under "
                              f"+precision={precision.name}", "use +precision=bf16 (or fp32, fp16) with +peft=qlora")
        self.device, self.compute_dtype = engine.device, dtype

    @property
    def storage(self) -> torch.dtype:
        """The packed weights' dtype: uint8, or under FSDP the compute dtype (mixed precision then
        leaves them as they are: FSDP casts only parameters whose dtype differs from its own)."""
        return self.compute_dtype if self.sharded else torch.uint8

    @property
    def place(self) -> torch.device:
        """Where the quantised base is held until the engine takes it: under FSDP host memory (no
        rank holds the whole base on its device), else the device it computes on."""
        return torch.device("cpu") if self.sharded else self.device

    def loading(self):
        from .hf.config import loading_in_4bit
        return loading_in_4bit(self.bnb_options(), self.place)

    def bnb_options(self) -> dict:
        """transformers' ``BitsAndBytesConfig`` keys for this base."""
        return dict(load_in_4bit=True, bnb_4bit_quant_type=self.quant_type, bnb_4bit_use_double_quant=self.double_quant,
                    bnb_4bit_compute_dtype=self.compute_dtype, bnb_4bit_quant_storage=self.storage)

    def targets_for(self, model):
        if self.target_modules is None and isinstance(getattr(getattr(model, "config", None), "model_type", None), str):
            return ALL_LINEAR  # every linear layer but the output one
        return super().targets_for(model)

    def wrap(self, model):
        from .quantize import quantize
        if getattr(model, "task_type", "CAUSAL_LM") != "CAUSAL_LM":
            raise ConfigError("peft", f"+peft=qlora quantises causal language models, not a {type(model).__name__}",
                              "use +peft=lora for a classifier")
        quantize(model, self.bnb, self.quant_type, self.double_quant, self.compute_dtype, self.device, self.storage,
                 self.place)
        if self.sharded and self.compute_dtype != torch.float32:
            frozen_in(model, self.compute_dtype)
        return super().wrap(model)


def untrained(model: nn.Module) -> bool:
    """True for a model looplib knows was built with random weights and never loaded any: one that
    keeps ``weights_from`` (``looplib.models.gpt.weights_loaded``: the bundled models, and a
    transformers model built from a config without ``model.path``) while it is still None. Any
    other model: False (looplib cannot tell)."""
    return getattr(model, "weights_from", "not kept") is None


def frozen_in(model: nn.Module, dtype: torch.dtype) -> None:
    """The frozen full-precision parameters (embeddings, norms, head) stored in ``dtype``: under FSDP's
    mixed precision each is cast to it for every forward anyway, so the same numbers in half the bytes."""
    with torch.no_grad():
        for p in model.parameters():
            packed = type(p).__name__ == "Params4bit" or hasattr(p, "fourbit")  # real, or planned on meta
            if p.is_floating_point() and p.dtype == torch.float32 and not packed:
                p.data = p.data.to(dtype)


def load_lora(model: nn.Module, path: str | Path, trainable: bool = False) -> nn.Module:
    """``model`` (the same base weights the adapter was trained on) with the adapter at ``path``;
    a transformers wrapper (looplib.hf) takes it on the model inside, as it was trained."""
    peft = import_peft()
    with quiet_peft():
        if hasattr(model, "adapt"):
            model.hf = peft.PeftModel.from_pretrained(model.hf, str(path), is_trainable=trainable)
            return model
        return peft.PeftModel.from_pretrained(model, str(path), is_trainable=trainable)


@contextmanager
def quiet_peft():
    """peft asks a transformers 5 model for ``is_gradient_checkpointing``, which transformers has
    deprecated: a FutureWarning on every LoRA run about code the user does not own."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def import_peft():
    # peft imports torchao and bitsandbytes when they are installed; both warn at import about each
    # compiled kernel their wheels cannot load here (CUDA-only, another Python's ABI, no triton, no
    # `kernels` package for bitsandbytes' CPU 4-bit ops), and torchao registers enums with torch's
    # pytree (two deprecation warnings): noise on every LoRA run's stderr that LoRA never uses
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    loggers = [logging.getLogger(name) for name in ("torchao", "bitsandbytes")]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        return need("peft", "peft", "peft", "LoRA")
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)
