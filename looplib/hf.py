"""Hugging Face ``transformers`` models in looplib, built from a config (no download).

``CausalLM`` wraps a ``transformers`` causal LM so it behaves like the bundled GPT:
``model(input_ids) -> logits`` and ``generate(ids, n)``; the usual ``loss=lm`` objective then
works unchanged. ``CausalLMLoss`` is the objective for an unwrapped ``transformers`` model
(whose forward returns an output object with ``.logits``), for the Python API.
transformers is imported only when one of these is used (``pip install 'looplib[hf]'``).
"""
from __future__ import annotations

import torch
from torch import nn

from .errors import ConfigError
from .schema import Positive
from .models.gpt import GPT
from .objectives import TokenCrossEntropy


class CausalLM(nn.Module):
    """``transformers.AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config))``.

    ``config`` holds the architecture's own keys (for llama: hidden_size, num_hidden_layers,
    ...); ``gradient_checkpointing`` turns on transformers' own activation checkpointing
    (non-reentrant); ``attn_implementation: sdpa`` uses PyTorch's fused attention kernels.
    """

    def __init__(self, model_type: str, seq_len: Positive[int], gradient_checkpointing: bool = False,
                 attn_implementation: str = "sdpa", **config):
        super().__init__()
        transformers = import_transformers()
        try:
            hf_config = transformers.AutoConfig.for_model(model_type, **config)
        except ValueError as err:
            raise ConfigError("model.model_type", str(err).splitlines()[0],
                              "use a transformers model type, e.g. llama, gpt2, mistral") from None
        self.seq_len = seq_len
        self.hf = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn_implementation)
        if gradient_checkpointing:  # transformers >= 5 renamed it activation checkpointing
            if hasattr(self.hf, "activation_checkpointing_enable"):
                self.hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    @classmethod
    def extra_keys(cls, options: dict) -> set[str]:
        """The keys ``**config`` takes: those of the model type's transformers config (looplib.schema
        refuses any other, where transformers would keep a misspelt key as a silent attribute)."""
        transformers = import_transformers()
        try:
            hf_config = transformers.AutoConfig.for_model(str(options.get("model_type")))
        except ValueError as err:
            raise ConfigError("model.model_type", " ".join(str(err).split()),
                              "use a transformers model type, e.g. llama, gpt2, mistral") from None
        import inspect
        taken = set(inspect.signature(type(hf_config).__init__).parameters) - {"self", "kwargs"}
        return taken | set(hf_config.to_dict()) | set(getattr(hf_config, "attribute_map", {}))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.hf(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    generate = GPT.generate  # the same top-k sampling loop as the bundled model (it only calls self)


class CausalLMLoss(TokenCrossEntropy):
    """Next-token cross-entropy for a model whose forward returns an object with ``.logits``.

    Labels come already shifted from looplib's datasets, so the model is *not* given labels
    (transformers would shift them again and average them per micro-batch); the loss is summed
    and counted like ``TokenCrossEntropy``'s, so accumulation stays exact.
    """

    def __call__(self, model, batch):
        out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), use_cache=False)
        return super().__call__(lambda _ids: out.logits, batch)


def import_transformers():
    try:
        import transformers
    except ImportError as err:
        raise ConfigError("model", f"this model needs transformers, which does not import ({err})",
                          "pip install 'looplib[hf]'") from None
    transformers.logging.set_verbosity_error()
    return transformers
