"""A run's final exports: what its adapter strategy declares (``peft.exports()``, a
``looplib.peft.Exports``), written from the engine's ``full_weights``. The peft strategy says
what; this module writes it, for every run that ends with its weights (``looplib.run.training``:
a run that trained to its end, and a ``resume=auto`` of a run stopped between its final
checkpoint and its exports, which trains nothing and writes them now).

What is written, by the weights declared and the model (a transformers wrapper, ``looplib.hf``,
is one with ``export``):

    declared  a bundled model                           a transformers model
    full      model.safetensors                         hf/ (``looplib.hf.export``)
    adapter   adapter/ (peft's format: load_lora)        hf/ holding the adapter
    merged    model.safetensors, the adapter merged     hf/ holding the merged weights
              into the base (a 4-bit base dequantised)

Every file is written beside its target and renamed: never a half-written export.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from torch import nn

from ..engines.local import Engine, write_safetensors
from ..peft import Exports


def write_exports(model: nn.Module, run_dir: Path, declared: Exports | None = None, engine: Engine | None = None,
                  corpus=None) -> None:
    """Write ``declared`` (None: the whole model) for ``model`` into ``run_dir``. Every rank calls
    it (``engine.full_weights`` gathers under ZeRO-3 and FSDP); the main rank writes. ``corpus``:
    the run's data (a transformers export saves its tokenizer and class names)."""
    declared, engine, run_dir = declared or Exports(), engine or Engine(), Path(run_dir)
    unwrapped = engine.unwrap(model)
    weights = engine.full_weights(model)
    if not engine.is_main:
        return
    if hasattr(unwrapped, "export"):  # a transformers model: hf/, which transformers (and peft) load
        if declared.weights == "full":
            unwrapped.export(run_dir, weights, corpus)
        else:
            unwrapped.export(run_dir, weights, corpus, merge=declared.weights == "merged")
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    if declared.weights == "full":
        write_safetensors(weights, run_dir / "model.safetensors")
    elif declared.weights == "merged":  # the plain model's keys: what looplib.generate and load_model read
        from ..hf.export import merge_lora
        from ..quantize import dequantized
        write_safetensors(merge_lora(unwrapped, dequantized(unwrapped, weights), merge=True),
                          run_dir / "model.safetensors")
    else:  # the adapter alone, peft's own format (safetensors); written beside and renamed
        target, tmp = run_dir / "adapter", run_dir / "adapter.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        unwrapped.save_pretrained(str(tmp), state_dict=weights)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
