"""``model.init_from=PATH`` (``train_model(..., init_from=PATH)``): a new run starts from the
weights of a finished run, or of one of its checkpoints, for any model. Only the weights: the
optimizer, the schedule, the step and the data position start afresh, so the new run may have
another objective, other data, or ``+peft=lora`` (pretrain, then fine-tune).

PATH is a run directory (its exported ``model.safetensors``, else its newest valid checkpoint's
weights: a transformers run's, whose export is ``hf/``) or a checkpoint directory
(``.../checkpoints/step-N``). Every name and shape must match the model built for the new run;
the first mismatch is refused in one line naming both. A model loaded this way counts as trained
(``weights_from``): LoRA may adapt it (``looplib.peft.untrained``).
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from ..errors import ConfigError
from .checkpoint_dir import is_valid, step_dirs

log = logging.getLogger("looplib")
KEY = "model.init_from"


def weights_file(path: Path) -> Path:
    """The safetensors file holding the whole model's weights at ``path`` (see the module's doc)."""
    if not path.is_dir():
        raise ConfigError(KEY, f"{KEY}={path} is not a directory",
                          "give a finished run's directory (outputs/DATE/TIME) or one of its checkpoints/step-N")
    if (path / "model.safetensors").is_file() and ((path / "manifest.json").is_file() or (path / "config.yaml").is_file()):
        if (path / "manifest.json").is_file() and is_valid(path) is not None:
            raise ConfigError(KEY, f"{path} is not a complete checkpoint ({is_valid(path)})",
                              "give another checkpoint, or the run's directory (its newest valid one is taken)")
        return path / "model.safetensors"
    for step in step_dirs(path / "checkpoints"):
        if is_valid(step) is None:
            if (step / "model.safetensors").is_file():
                return step / "model.safetensors"
            break
    if (path / "adapter").is_dir():
        raise ConfigError(KEY, f"{path} holds a LoRA adapter, not the model's full weights",
                          "start from the run its base came from, or train it with peft.merge=true")
    raise ConfigError(KEY, f"{path} holds neither model.safetensors nor a valid checkpoint with the whole model's "
                      "weights (a sharded FSDP/DeepSpeed checkpoint is not read here)",
                      "give a finished run's directory or one of its checkpoints/step-N; a sharded run: continue "
                      "it to its end (resume=auto), which exports model.safetensors")


def init_from(model: nn.Module, path: str | Path) -> nn.Module:
    """Load the weights at ``path`` into ``model`` (in place): names and shapes checked, one log
    line saying what was loaded. Marks the model as trained (``model.weights_from``)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    path = Path(path).expanduser()
    source = weights_file(path)
    try:
        weights = load_file(str(source))
    except (OSError, SafetensorError) as err:
        raise ConfigError(KEY, f"{source} could not be read ({err})", "give a run whose weights are whole") from None
    own = model.state_dict()
    aliases: dict[tuple, list[str]] = {}  # tied weights (the GPT's head and embedding) are saved under one name
    for name, tensor in own.items():
        aliases.setdefault((tensor.data_ptr(), tuple(tensor.shape)), []).append(name)
    missing = [k for k, t in own.items() if not any(a in weights for a in aliases[(t.data_ptr(), tuple(t.shape))])]
    extra = [k for k in weights if k not in own]
    if missing or extra:
        ours = f"the model has {missing[0]}" if missing else "the model lacks it"
        theirs = f"{source} has {extra[0]}" if extra else f"{source} lacks it"
        raise ConfigError(KEY, f"the weights at {source} do not fit the model: {ours}, {theirs} "
                          f"({len(missing)} names missing, {len(extra)} unexpected)",
                          "build the same model as the run that saved them (the same model group and sizes)")
    for name, tensor in own.items():
        if name in weights and tuple(tensor.shape) != tuple(weights[name].shape):
            raise ConfigError(KEY, f"{name} is {tuple(tensor.shape)} in the model but {tuple(weights[name].shape)} in "
                              f"{source}", "build the same model as the run that saved them (the same sizes: "
                              "model.*, data.vocab_size)")
    with torch.no_grad():
        model.load_state_dict(weights, strict=False)  # every name checked above; tied ones load once
    model.weights_from = str(source.parent)
    count = sum(t.numel() for t in weights.values())
    log.info("%s: loaded the weights only (%d tensors, %.2fM values) from %s; optimizer, schedule and step start "
             "afresh", KEY, len(weights), count / 1e6, source)
    return model

