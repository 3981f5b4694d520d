"""The transformers wrappers: ``CausalLM`` (``model=hf``, ``model=llama_tiny``) behaves like the
bundled GPT (``model(input_ids) -> logits``, ``generate(ids, n)``), so the usual ``loss=lm``
objective works unchanged; ``SequenceClassifier`` (``model=hf_classifier``) gives
``(batch, num_labels)`` logits for ``loss=classification``. Loading and checks live in
``looplib.hf.config``, the export in ``looplib.hf.export``."""
from __future__ import annotations

import inspect
from pathlib import Path

import torch
from torch import nn

from ..errors import ConfigError
from ..models.gpt import GPT, weights_loaded
from ..sampling import Decoding
from ..schema import Positive
from .config import (check_keys, check_model_dir, check_positions, config_class_for, config_keys, import_transformers,
                     load_config, load_weights, model_positions, window)
from .export import export_model


class HFModel(nn.Module):
    """What ``CausalLM`` and ``SequenceClassifier`` share: loading, checks, LoRA, export."""

    auto_class = "AutoModelForCausalLM"
    task_type = "CAUSAL_LM"   # peft's name for the task (adapter_config.json)
    path_is_base = True       # a LoRA adapter's base_model_name_or_path can be model.path
    own_keys: tuple[str, ...] = ()
    window_cap = 1024         # seq_len=None: the model's positions, at most this (transformers' run_clm)

    def __init__(self, seq_len: Positive[int] | None = None, path: str | None = None, model_type: str | None = None,
                 gradient_checkpointing: bool = False, attn_implementation: str = "sdpa",
                 max_shard_size: str = "2GB", config: dict | None = None, **extra):
        super().__init__()
        transformers = import_transformers()
        self.path = str(Path(path).expanduser().resolve()) if path else None
        hf_config = load_config(transformers, self.path, model_type, dict(config or {}), type(self))
        for key, value in extra.items():
            setattr(hf_config, key, value)
        if seq_len is None:  # conf/model/hf*.yaml's ${looplib.seq_len:CAP} is the same rule
            seq_len = window(model_positions(hf_config), self.window_cap)
        check_positions(hf_config, seq_len)
        self.seq_len, self.max_shard_size = seq_len, max_shard_size
        auto = getattr(transformers, self.auto_class)
        if self.path and torch.get_default_device().type != "meta":  # the planner needs no weights
            self.hf = load_weights(auto, self.path, hf_config, attn_implementation)
        else:
            self.hf = auto.from_config(hf_config, attn_implementation=attn_implementation)
        weights_loaded(self)  # trained when read from model.path, or once weights are loaded (looplib.peft.untrained)
        if self.path:  # read from it (on the meta device, the planner's: it will be)
            self.weights_from = str(self.path)
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
            raise ConfigError("data.vocab_size",
                              f"the data's tokenizer has {vocab} tokens but {where} embeds only {rows}",
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
        """Write ``run_dir/hf`` from the trained ``weights`` (``looplib.hf.export``); main rank only."""
        return export_model(self, Path(run_dir), weights, corpus, merge)


class CausalLM(HFModel):
    """A causal LM: ``AutoModelForCausalLM.from_pretrained(path)`` (``model=hf model.path=DIR``), or
    ``from_config(AutoConfig.for_model(model_type, **config))`` without a path (``model=llama_tiny``).

    Other keys are the transformers config's own (for llama: hidden_size, num_hidden_layers,
    ...), checked against its class: a misspelt one is refused with the closest name. With a
    path they override the directory's config.json (e.g. ``+model.attention_dropout=0.1``).
    ``gradient_checkpointing`` turns on transformers' own activation checkpointing
    (non-reentrant); ``attn_implementation: sdpa`` uses PyTorch's fused attention kernels.
    """

    def __init__(self, seq_len: Positive[int] | None = None, path: str | None = None, model_type: str | None = None,
                 gradient_checkpointing: bool = False, attn_implementation: str = "sdpa",
                 max_shard_size: str = "2GB", **config):
        super().__init__(seq_len, path, model_type, gradient_checkpointing, attn_implementation,
                         max_shard_size, config)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, hidden_only: bool = False,
                cache: HFCache | None = None) -> torch.Tensor:
        if cache is not None:  # decoding (looplib.sampling): transformers' own cache, its positions and padding mask
            end = cache.length + input_ids.shape[1]
            out = self.hf(input_ids=input_ids, attention_mask=cache.valid[:, :end].long(),
                          position_ids=cache.positions(input_ids.shape[1]), use_cache=True, **cache.names)
            cache.length = end  # (transformers' cache grows in place)
            return out.logits
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

    def decoding_cache(self, valid: torch.Tensor) -> HFCache:
        """An empty cache for decoding rows of ``valid``'s shape (``looplib.sampling``): transformers'
        ``DynamicCache`` (under LoRA too: peft hands ``past_key_values`` to the model inside)."""
        causal = self.hf.get_base_model() if hasattr(self.hf, "peft_config") else self.hf
        takes = inspect.signature(causal.forward).parameters  # the names changed over transformers' versions
        past = import_transformers().DynamicCache(config=self.hf.config)
        names = {"cache" if "cache" in takes else "past_key_values": past}
        keep = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in takes), None)
        if keep is not None:  # the sampler reads the last position's logits alone: the others are not computed
            names[keep] = 1
        return HFCache(valid, past, names)

    generate = GPT.generate  # the same top-k sampling loop as the bundled model (it only calls self)


class HFCache(Decoding):
    """A transformers model's decoding cache: the rows' padding and positions, and its own cache."""

    def __init__(self, valid: torch.Tensor, past, names: dict):
        super().__init__(valid)
        self.past, self.names = past, names  # names: the keyword arguments the model takes them by


class SequenceClassifier(HFModel):
    """``AutoModelForSequenceClassification`` with ``num_labels`` outputs: on a pretrained backbone
    (``model=hf_classifier model.path=DIR``: the head is new, everything else is the directory's
    weights), or built from ``model_type`` + config keys. Logits of shape (batch, num_labels)."""

    auto_class = "AutoModelForSequenceClassification"
    task_type = "SEQ_CLS"   # peft then trains the new head in full beside the adapters
    # peft loads an adapter's base with the Auto class alone: model.path would come back with
    # its own number of labels, so a classifier's adapter points at hf_base/ (num_labels, label map)
    path_is_base = False
    window_cap = 128          # transformers' run_glue example: 128 tokens unless asked

    def __init__(self, seq_len: Positive[int] | None = None, num_labels: Positive[int] = 2, path: str | None = None,
                 model_type: str | None = None,
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
