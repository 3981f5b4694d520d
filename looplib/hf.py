"""Hugging Face ``transformers`` models in looplib: pretrained from a local directory, or built
from a config; exported back as a directory transformers and peft load.

``CausalLM`` (``model=hf``, ``model=llama_tiny``) wraps a causal LM so it behaves like the
bundled GPT: ``model(input_ids) -> logits`` and ``generate(ids, n)``; the usual ``loss=lm``
objective then works unchanged. ``SequenceClassifier`` (``model=hf_classifier``) wraps
``AutoModelForSequenceClassification``: ``model(input_ids, attention_mask) -> logits`` for
``loss=classification``. With ``path`` the weights come from a local directory (config.json +
safetensors, sharded or not) with ``local_files_only``: nothing is ever downloaded.

At the end of a run ``export`` writes ``<run dir>/hf/``: full weights (sharded beyond
``max_shard_size``), or with LoRA the adapter whose ``base_model_name_or_path`` is a loadable
base (``path``, or ``<run dir>/hf_base/`` saved beside it when the model was built from a
config, or is a classifier whose head ``path`` lacks), or merged weights (``peft.merge=true``); tokenizer files beside them.

``CausalLMLoss`` is the objective for an unwrapped ``transformers`` model (whose forward returns
an output object with ``.logits``), for the Python API. transformers is imported only when one
of these is used (``pip install 'looplib[hf]'``).
"""
from __future__ import annotations

import difflib
import inspect
import json
import logging
import os
import shutil
from pathlib import Path

import torch
from torch import nn

from .errors import ConfigError
from .schema import Positive
from .models.gpt import GPT
from .objectives import TokenCrossEntropy

log = logging.getLogger("looplib")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


class HFModel(nn.Module):
    """What ``CausalLM`` and ``SequenceClassifier`` share: loading, checks, LoRA, export."""

    auto_class = "AutoModelForCausalLM"
    task_type = "CAUSAL_LM"   # peft's name for the task (adapter_config.json)
    path_is_base = True       # a LoRA adapter's base_model_name_or_path can be model.path
    own_keys: tuple[str, ...] = ()

    def __init__(self, seq_len: Positive[int], path: str | None = None, model_type: str | None = None,
                 gradient_checkpointing: bool = False, attn_implementation: str = "sdpa",
                 max_shard_size: str = "2GB", config: dict | None = None, **extra):
        super().__init__()
        transformers = import_transformers()
        self.seq_len, self.max_shard_size = seq_len, max_shard_size
        self.path = str(Path(path).expanduser().resolve()) if path else None
        hf_config = load_config(transformers, self.path, model_type, dict(config or {}), type(self))
        for key, value in extra.items():
            setattr(hf_config, key, value)
        check_positions(hf_config, seq_len)
        auto = getattr(transformers, self.auto_class)
        if self.path and torch.get_default_device().type != "meta":  # the planner needs no weights
            self.hf = load_weights(auto, self.path, hf_config, attn_implementation)
        else:
            self.hf = auto.from_config(hf_config, attn_implementation=attn_implementation)
        if gradient_checkpointing:  # transformers >= 5 renamed it activation checkpointing
            if hasattr(self.hf, "activation_checkpointing_enable"):
                self.hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    @property
    def config(self):
        return self.hf.config

    @classmethod
    def extra_keys(cls, options: dict) -> set[str]:
        """The keys ``**config`` takes (looplib.schema asks before anything is built): those of
        the transformers config class of ``path``'s config.json, or of ``model_type``."""
        transformers = import_transformers()
        path, model_type = options.get("path"), options.get("model_type")
        if path:
            check_model_dir(str(path))
            config_class = type(load_config(transformers, str(path), None, {}, cls))
        elif model_type:
            config_class = config_class_for(transformers, str(model_type))
        else:
            return set()  # the constructor says what is missing
        own = set(inspect.signature(cls.__init__).parameters)
        overrides = {k: v for k, v in options.items() if k not in own and not k.startswith("_")}
        check_keys(config_class, overrides, cls)  # a typo: this module's line, with its hint
        return config_keys(config_class, overrides)

    # ------------------------------------------------------------------ data agreement
    def check_data(self, corpus) -> None:
        """The corpus's vocabulary must fit the embeddings (a token id past them is an index error
        deep in a forward pass, or worse, on a GPU, an assert with no key named)."""
        vocab = getattr(corpus, "vocab_size", None)
        rows = self.hf.get_input_embeddings().num_embeddings
        if vocab is not None and vocab > rows:
            where = f"the model at {self.path}" if self.path else "the model"
            raise ConfigError("data.vocab_size", f"the data's tokenizer has {vocab} tokens but {where} embeds only {rows}",
                              "take the tokenizer from the model directory (data.tokenizer=${model.path}), "
                              "or build the model with vocab_size >= the tokenizer's")

    # ------------------------------------------------------------------ LoRA
    def adapt(self, peft, lora_config: dict) -> nn.Module:
        """LoRA on the transformers model inside (not on this wrapper): the adapter's keys are
        then peft's own, so ``PeftModel.from_pretrained`` loads it into the bare model."""
        self.hf = peft.get_peft_model(self.hf, peft.LoraConfig(task_type=self.task_type, **lora_config))
        return self

    def adapter_model(self):
        return self.hf

    # ------------------------------------------------------------------ export
    def export(self, run_dir: Path, weights: dict[str, torch.Tensor], corpus=None, merge: bool = False) -> Path:
        """Write ``run_dir/hf`` from the trained ``weights`` (this module's whole state dict, gathered
        by the engine); main rank only. Written beside and renamed: never a half-written directory."""
        run_dir = Path(run_dir)
        weights = {k[len("hf."):]: v for k, v in weights.items() if k.startswith("hf.")}
        label_map(self.hf.config, corpus)
        target = run_dir / "hf"
        tmp = run_dir / "hf.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        if not hasattr(self.hf, "peft_config"):
            self.hf.save_pretrained(tmp, state_dict=weights, max_shard_size=self.max_shard_size)
        elif merge:
            base = self.hf.get_base_model()
            base.save_pretrained(tmp, state_dict=merge_lora(self.hf, weights, merge=True),
                                 max_shard_size=self.max_shard_size)
        else:
            base_path = self.path if self.path_is_base else None
            if base_path is None:  # the frozen base is saved too, and pointed at
                base_dir = run_dir / "hf_base"
                self.hf.get_base_model().save_pretrained(base_dir, state_dict=merge_lora(self.hf, weights, merge=False),
                                                         max_shard_size=self.max_shard_size)
                save_tokenizer(base_dir, corpus, self.path)
                base_path = str(base_dir.resolve())
            self.hf.peft_config["default"].base_model_name_or_path = base_path
            self.hf.save_pretrained(str(tmp), state_dict=weights)
        save_tokenizer(tmp, corpus, self.path)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
        log.info("exported for transformers%s: %s", " (LoRA adapter)" if hasattr(self.hf, "peft_config") and not merge
                 else "", target)
        return target


class CausalLM(HFModel):
    """A causal LM: ``AutoModelForCausalLM.from_pretrained(path)`` (``model=hf model.path=DIR``), or
    ``from_config(AutoConfig.for_model(model_type, **config))`` without a path (``model=llama_tiny``).

    Other keys are the transformers config's own (for llama: hidden_size, num_hidden_layers,
    ...), checked against its class: a misspelt one is refused with the closest name. With a
    path they override the directory's config.json (e.g. ``+model.attention_dropout=0.1``).
    ``gradient_checkpointing`` turns on transformers' own activation checkpointing
    (non-reentrant); ``attn_implementation: sdpa`` uses PyTorch's fused attention kernels.
    """

    def __init__(self, seq_len: Positive[int], path: str | None = None, model_type: str | None = None,
                 gradient_checkpointing: bool = False, attn_implementation: str = "sdpa",
                 max_shard_size: str = "2GB", **config):
        super().__init__(seq_len, path, model_type, gradient_checkpointing, attn_implementation,
                         max_shard_size, config)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, hidden_only: bool = False) -> torch.Tensor:
        # position_ids restarting at 0 without an attention_mask: packed examples (looplib.data.Packed)
        if hidden_only:  # the decoder's last hidden states, before lm_head (loss=lm_chunked)
            causal = self.hf.get_base_model() if hasattr(self.hf, "peft_config") else self.hf  # under LoRA: peft's
            return causal.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                     use_cache=False).last_hidden_state
        return self.hf(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       use_cache=False).logits

    @property
    def lm_head(self) -> nn.Module:
        """The output projection, for losses that apply it themselves (``loss=lm_chunked``).
        Models that change logits after it (Gemma's soft-capping, Cohere's logit scale) are refused."""
        config = self.hf.config
        for key in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
            if getattr(config, key, None) not in (None, 1, 1.0):
                raise ConfigError("loss", f"{config.model_type} changes its logits after lm_head ({key}), which a "
                                  "chunked loss would skip", "use loss=lm with this model")
        return self.hf.get_output_embeddings()

    generate = GPT.generate  # the same top-k sampling loop as the bundled model (it only calls self)


class SequenceClassifier(HFModel):
    """``AutoModelForSequenceClassification`` with ``num_labels`` outputs: on a pretrained backbone
    (``model=hf_classifier model.path=DIR``: the head is new, everything else is the directory's
    weights), or built from ``model_type`` + config keys. Logits of shape (batch, num_labels)."""

    auto_class = "AutoModelForSequenceClassification"
    task_type = "SEQ_CLS"   # peft then trains the new head in full beside the adapters
    # peft loads an adapter's base with the Auto class alone: model.path would come back with
    # its own number of labels, so a classifier's adapter points at hf_base/ (num_labels, label map)
    path_is_base = False

    def __init__(self, seq_len: Positive[int], num_labels: Positive[int] = 2, path: str | None = None, model_type: str | None = None,
                 gradient_checkpointing: bool = False, attn_implementation: str = "sdpa",
                 max_shard_size: str = "2GB", **config):
        if num_labels < 1:
            raise ConfigError("model.num_labels", f"num_labels must be at least 1 (got {num_labels})",
                              "use the number of classes, e.g. model.num_labels=2")
        super().__init__(seq_len, path, model_type, gradient_checkpointing, attn_implementation,
                         max_shard_size, config, num_labels=num_labels)
        self.num_labels = num_labels

    def check_data(self, corpus) -> None:
        super().check_data(corpus)
        names = getattr(corpus, "label_names", None)
        if names is not None and len(names) != self.num_labels:
            raise ConfigError("model.num_labels", f"the data has {len(names)} classes ({', '.join(map(str, names[:5]))}"
                              f"{' ...' if len(names) > 5 else ''}) but model.num_labels={self.num_labels}",
                              f"set model.num_labels={len(names)}")
        config = self.hf.config
        if config.pad_token_id is None:  # decoder classifiers pool the last token that is not padding
            pad = getattr(corpus, "pad_id", None)
            config.pad_token_id = pad if pad is not None else getattr(corpus, "eos_id", None)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        extra = {} if position_ids is None else {"position_ids": position_ids}
        return self.hf(input_ids=input_ids, attention_mask=attention_mask, **extra).logits


class CausalLMLoss(TokenCrossEntropy):
    """Next-token cross-entropy for a model whose forward returns an object with ``.logits``.

    Labels come already shifted from looplib's datasets, so the model is *not* given labels
    (transformers would shift them again and average them per micro-batch); the loss is summed
    and counted like ``TokenCrossEntropy``'s, so accumulation stays exact.
    """

    def __call__(self, model, batch):
        out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), use_cache=False)
        return super().__call__(lambda _ids, **_: out.logits, batch)


# ---------------------------------------------------------------------- loading and checks
def load_config(transformers, path: str | None, model_type: str | None, overrides: dict, wrapper: type):
    """The transformers config: the directory's config.json (``path``) or ``model_type``'s defaults,
    with ``overrides``; every override key is checked against the config class first."""
    if path is None:
        if model_type is None:
            raise ConfigError("model.path", "neither model.path nor model.model_type is set",
                              "give a pretrained directory (model.path=DIR) or an architecture "
                              "(model.model_type=llama and its config keys)")
        config_class = config_class_for(transformers, model_type)
        check_keys(config_class, overrides, wrapper)
        return config_class(**overrides)
    check_model_dir(path)
    try:
        base = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, OSError, KeyError, json.JSONDecodeError) as err:
        raise ConfigError("model.path", f"{path} does not load as a transformers model: {one_line(err)}",
                          "point model.path at a directory save_pretrained wrote (config.json + weights)") from None
    if model_type is not None and model_type != base.model_type:
        raise ConfigError("model.model_type", f"model_type={model_type!r} but {path} holds a {base.model_type!r} model",
                          "leave model.model_type out when model.path is set")
    check_keys(type(base), overrides, wrapper)
    for key, value in overrides.items():
        setattr(base, key, value)
    return base


def config_class_for(transformers, model_type: str):
    from transformers import CONFIG_MAPPING
    try:
        return CONFIG_MAPPING[model_type]
    except KeyError:
        close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING.keys()), n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ConfigError("model.model_type", f"{model_type!r} is not a transformers model type",
                          f"{hint}use a transformers model type, e.g. llama, gpt2, mistral") from None


def config_keys(config_class, overrides: dict | None = None) -> set[str]:
    """The keys a transformers config class takes: its constructor's, its base class's, its
    defaults', and of ``overrides`` those transformers consumes (``rope_theta`` goes into
    ``rope_parameters``); a key it would only keep as a stray attribute (a typo) is not one."""
    from transformers import PretrainedConfig
    keys = set()
    for cls in (config_class, PretrainedConfig):
        keys |= {p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "kwargs")}
    try:
        keys |= set(config_class().to_dict())
    except Exception:  # noqa: BLE001 - a config that cannot be built bare: the signatures suffice
        pass
    keys |= set(getattr(config_class, "attribute_map", {}))
    rest = {k: v for k, v in (overrides or {}).items() if k not in keys}
    if rest:
        try:
            built = config_class(**rest)
        except Exception:  # noqa: BLE001 - a bad value: building the model says which
            return keys
        keys |= {k for k in rest if k not in vars(built)}
    return keys


def check_keys(config_class, overrides: dict, wrapper: type) -> None:
    """A key neither the wrapper nor the transformers config knows is a typo, not a setting to
    drop silently (``+model.pretrained_model_name_or_path=DIR`` once trained a random model)."""
    known = config_keys(config_class, overrides)
    own = [p for p in inspect.signature(wrapper.__init__).parameters if p not in ("self", "config")]
    for key in overrides:
        if key not in known:
            close = difflib.get_close_matches(key, own + sorted(k for k in known if not k.startswith("_")),
                                              n=1, cutoff=0.6)
            hint = f"did you mean model.{close[0]}?" if close else \
                f"use a key of {config_class.__name__} or one of {', '.join(own)}"
            if key in ("pretrained_model_name_or_path", "model_name_or_path", "name_or_path", "model_path"):
                hint = "use model.path=DIR for a pretrained directory"
            raise ConfigError(f"model.{key}", f"{key!r} is not a key of {config_class.__name__} "
                              f"(model_type {config_class.model_type}) nor of {wrapper.__name__}", hint)


def check_model_dir(path: str) -> None:
    where = Path(path)
    if not where.exists():
        raise ConfigError("model.path", f"{path} does not exist", "give a local model directory (nothing is downloaded)")
    if not where.is_dir() or not (where / "config.json").is_file():
        raise ConfigError("model.path", f"{path} is not a model directory (no config.json)",
                          "give a directory that save_pretrained wrote: config.json, weights, tokenizer files")
    if not any((where / name).is_file() for name in WEIGHT_FILES):
        if (where / "adapter_config.json").is_file():
            raise ConfigError("model.path", f"{path} holds a LoRA adapter, not a model",
                              "fine-tune its merged export (peft.merge=true) or its base model")
        raise ConfigError("model.path", f"{path} holds no weights (model.safetensors or its shards' index)",
                          "give a directory that save_pretrained wrote")


def check_positions(config, seq_len: int) -> None:
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if isinstance(limit, int) and seq_len > limit:
        raise ConfigError("model.seq_len", f"seq_len={seq_len} is longer than the model's {limit} positions",
                          f"use model.seq_len={limit} or less")


def load_weights(auto, path: str, config, attn_implementation: str):
    """The directory's weights in fp32 (precision strategies cast; the master copy stays fp32)."""
    try:
        return auto.from_pretrained(path, config=config, local_files_only=True, dtype=torch.float32,
                                    attn_implementation=attn_implementation)
    except (OSError, ValueError, RuntimeError) as err:
        raise ConfigError("model.path", f"the weights in {path} do not load: {one_line(err)}",
                          "check the directory, and that no config override changes a weight's shape") from None


def one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 300 else text[:297] + "..."


# ---------------------------------------------------------------------- export helpers
def merge_lora(peft_model, weights: dict[str, torch.Tensor], merge: bool) -> dict[str, torch.Tensor]:
    """The base model's state dict from a peft model's (gathered) one: with ``merge`` each
    adapted weight is W + scaling * B @ A (peft's merge, on tensors, so it works on weights
    gathered from ZeRO-3 shards), without it the frozen W; the new head
    (``modules_to_save``) is the trained copy either way."""
    prefix = "base_model.model."
    adapted = {name[len(prefix):]: m for name, m in peft_model.named_modules()
               if name.startswith(prefix) and hasattr(m, "lora_A") and "default" in m.lora_A}
    out = {}
    for key, value in weights.items():
        if not key.startswith(prefix) or ".lora_" in key or ".original_module." in key:
            continue
        key = key[len(prefix):].replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")
        out[key] = value
    if merge:
        for name, module in adapted.items():
            a = weights[f"{prefix}{name}.lora_A.default.weight"].float()
            b = weights[f"{prefix}{name}.lora_B.default.weight"].float()
            delta = (b @ a) * module.scaling["default"]
            if getattr(module, "fan_in_fan_out", False):
                delta = delta.T
            w = out[f"{name}.weight"]
            out[f"{name}.weight"] = (w.float() + delta.to(w.device)).to(w.dtype)
    return out


def label_map(config, corpus) -> None:
    """Class names into the config (id2label/label2id); the data writes labels.json itself."""
    names = getattr(corpus, "label_names", None)
    if not names:
        return
    config.id2label = {i: str(n) for i, n in enumerate(names)}
    config.label2id = {str(n): i for i, n in enumerate(names)}


def save_tokenizer(directory: Path, corpus, model_path: str | None = None) -> None:
    """The tokenizer the data used, as transformers files: the model directory's own (copied
    through ``AutoTokenizer``) or the one trained on the data (``PreTrainedTokenizerFast``).
    Data without a tokenizer (random tokens): the model directory's, if it has one."""
    transformers = import_transformers()
    source = getattr(corpus, "tokenizer_source", None)
    tokenizer = getattr(corpus, "tokenizer", None)
    if source is None and tokenizer is None and model_path and has_tokenizer(Path(model_path)):
        source = model_path
    if source and Path(source).is_dir():
        tok = transformers.AutoTokenizer.from_pretrained(source, local_files_only=True)
    elif source:
        tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(source))
    elif tokenizer is not None:
        tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    else:
        return
    for role in ("eos", "pad"):
        token_id = getattr(corpus, f"{role}_id", None)
        if getattr(tok, f"{role}_token") is None and token_id is not None:
            setattr(tok, f"{role}_token", tok.convert_ids_to_tokens(token_id))
    tok.save_pretrained(str(directory))


def has_tokenizer(directory: Path) -> bool:
    return any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))


def import_transformers():
    try:
        import transformers
    except ImportError as err:
        raise ConfigError("model", f"this model needs transformers, which does not import ({err})",
                          "pip install 'looplib[hf]'") from None
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()  # "Loading weights", "Writing model shards"
    return transformers
