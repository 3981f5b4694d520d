"""Exporting a transformers wrapper (``looplib.hf.models``) as a directory transformers and peft
load: ``<run dir>/hf/`` with full weights (sharded beyond ``max_shard_size``), or with LoRA the
adapter whose ``base_model_name_or_path`` is a loadable base (``path``, or ``<run dir>/hf_base/``
saved beside it when the model was built from a config, or is a classifier whose head ``path``
lacks), or merged weights (``peft.merge=true``); tokenizer files beside them. A run's end reaches it through
the wrapper's ``export`` (``looplib.store.export.write_exports``, as the peft strategy declares)."""
from __future__ import annotations

import copy
import logging
import os
import shutil
from pathlib import Path

import torch

from ..quantize import dequantized, is_4bit
from .config import import_transformers

log = logging.getLogger("looplib")


def export_model(model, run_dir: Path, weights: dict[str, torch.Tensor], corpus=None, merge: bool = False) -> Path:
    """Write ``run_dir/hf`` for ``model`` (an ``HFModel``) from the trained ``weights`` (its whole
    state dict, gathered by the engine); main rank only. Written beside and renamed: never a
    half-written directory."""
    run_dir = Path(run_dir)
    weights = {k[len("hf."):]: v for k, v in weights.items() if k.startswith("hf.")}
    label_map(model.hf.config, corpus)
    target = run_dir / "hf"
    tmp = run_dir / "hf.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    if not hasattr(model.hf, "peft_config"):
        model.hf.save_pretrained(tmp, state_dict=weights, max_shard_size=model.max_shard_size)
    elif merge:  # a 4-bit base (QLoRA) dequantised first
        merged = merge_lora(model.hf, dequantized(model.hf, weights), merge=True)
        save_full_precision(model.hf.get_base_model(), tmp, merged, model.max_shard_size)
    else:
        base_path = model.path if model.path_is_base else None
        if base_path is None:  # the frozen base is saved too, and pointed at
            base_dir = run_dir / "hf_base"
            save_full_precision(model.hf.get_base_model(), base_dir,
                                merge_lora(model.hf, dequantized(model.hf, weights), merge=False), model.max_shard_size)
            save_tokenizer(base_dir, corpus, model.path)
            base_path = str(base_dir.resolve())
        model.hf.peft_config["default"].base_model_name_or_path = base_path
        model.hf.save_pretrained(str(tmp), state_dict=weights)
    save_tokenizer(tmp, corpus, model.path)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    log.info("exported for transformers%s: %s", " (LoRA adapter)" if hasattr(model.hf, "peft_config") and not merge
             else "", target)
    return target


def save_full_precision(base, directory: Path, state_dict: dict[str, torch.Tensor], max_shard_size) -> None:
    """``base.save_pretrained`` with ``state_dict``; a base holding 4-bit layers (QLoRA) is saved
    as the full-precision model its weights now are (config.json without its quantisation)."""
    if not any(is_4bit(m) for m in base.modules()):
        base.save_pretrained(directory, state_dict=state_dict, max_shard_size=max_shard_size)
        return
    config = copy.deepcopy(base.config)
    for key in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, key):
            delattr(config, key)
    with torch.device("meta"):  # a skeleton to write with: no memory
        skeleton = type(base)(config)
    skeleton.save_pretrained(directory, state_dict={k: v.contiguous() for k, v in state_dict.items()},
                             max_shard_size=max_shard_size)


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
