"""A finished run's model, loaded from what the run left: ``load_finished(RUN_DIR)``, for the
Python API and ``python -m looplib.generate`` (which adds only its arguments and the sampling).

    from looplib import load_finished
    done = load_finished("outputs/2026-11-27/10-00-00")   # done.model, done.tokenizer, done.corpus()

What a run leaves, in the order it is looked for:

- ``hf/`` (a transformers model: ``model=hf``, ``llama_tiny``, ...; or any directory
  ``save_pretrained`` wrote): loaded with transformers, a LoRA adapter with peft, a QLoRA adapter
  on its base quantised to 4 bits as it trained (bitsandbytes), with its own tokenizer;
- ``config.yaml`` + ``model.safetensors`` (a bundled model, GPT): the model built from its config
  (no Hydra: the ``_target_`` classes called with their keys), its tokens from the run's data
  (``corpus()``: rebuilt from the config, the cache answers);
- neither (a run stopped before its end: preempted, interrupted): its newest valid checkpoint,
  named in the answer (``Finished.checkpoint``) and loaded the same way (its own config.yaml and
  model.safetensors; a checkpoint in FSDP's or DeepSpeed's sharded format is refused: resume it
  to its end, or export it).

Nothing is downloaded. A directory that holds none of them is refused in one line (``ConfigError``).
"""
from __future__ import annotations

import importlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from .checkpoint_dir import is_valid, read_config, step_dirs

log = logging.getLogger("looplib")


@dataclass
class Finished:
    """A loaded run. ``tokenizer``: a transformers model's own (None for a bundled model, whose
    tokens come from ``corpus()``); ``checkpoint``: the checkpoint it was loaded from (None: the
    run's exported weights)."""
    model: nn.Module
    tokenizer: Any = None
    classifier: bool = False
    run_dir: Path = Path(".")
    config: dict = field(default_factory=dict)
    checkpoint: Path | None = None

    def corpus(self):
        """The run's data, rebuilt from its config (``run_corpus``)."""
        return run_corpus(self.run_dir)


def hf_directory(run_dir: Path) -> Path | None:
    """The transformers (or peft) directory a run exported: ``hf/``, or the directory itself."""
    for candidate in (run_dir / "hf", run_dir):
        if (candidate / "config.json").is_file() or (candidate / "adapter_config.json").is_file():
            return candidate
    return None


def run_config(run_dir: Path) -> dict:
    """The run's saved config (config.yaml), or {} when there is none."""
    try:
        return read_config(run_dir / "config.yaml") if (run_dir / "config.yaml").is_file() else {}
    except Exception:  # noqa: BLE001 - a hand-made directory: as if there were none
        return {}


def build(node: Any) -> Any:
    """A saved config node made into objects without Hydra: a mapping with ``_target_`` is that
    class (or function) called with its other keys, each built the same way."""
    if isinstance(node, list):
        return [build(x) for x in node]
    if not isinstance(node, dict):
        return node
    kwargs = {k: build(v) for k, v in node.items() if not k.startswith("_")}
    target = node.get("_target_")
    if target is None:
        return kwargs
    return locate(target)(**kwargs)


def locate(target: Any) -> Any:
    """The class (or function) a dotted ``_target_`` names (None: none)."""
    if target is None:
        return None
    module, _, name = str(target).rpartition(".")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def run_corpus(run_dir: Path):
    """The run's data, rebuilt from its config.yaml (tokenised once: the cache answers), held to
    the identity its newest checkpoint recorded: data changed since the run trained are refused
    (a tokenizer trained on them would give other ids to its embeddings), and a tokenizer the run
    trained is never trained again (the cache's copy or the checkpoint's). None without a config."""
    from ..data import identity
    from .resume import expected_identity
    config = run_config(run_dir)
    if not config.get("data"):
        return None
    found = expected_identity("auto", run_dir)
    words = found and identity.Expected(
        found.fingerprint, found.checkpoint, key="RUN_DIR",
        consequence="so its tokenizer and prompts would not be the ones its weights learned",
        fix="put the files back as they were (or give --prompt to a run exported for transformers, hf/)")
    node = config["data"]
    if words and identity.takes_expected(locate(node.get("_target_"))):
        node = {**node, "expected": words}  # (a plain object: build passes it on as it is)
    return build(node)


def load_qlora(directory: Path, settings: dict, compute: torch.dtype, device: torch.device, transformers):
    """A QLoRA adapter on its base quantised as in training (``settings``: the run's ``peft`` keys)."""
    from ..optim import import_bitsandbytes
    from ..peft import import_peft
    import_bitsandbytes("RUN_DIR", "a QLoRA run's base")
    peft = import_peft()
    base_path = json.loads((directory / "adapter_config.json").read_text())["base_model_name_or_path"]
    options = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=settings.get("quant_type", "nf4"),
                                              bnb_4bit_use_double_quant=settings.get("double_quant", True),
                                              bnb_4bit_compute_dtype=compute)
    where = device.index if device.type == "cuda" and device.index is not None else str(device)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_path, quantization_config=options, dtype=torch.float32,
                                                             local_files_only=True, device_map={"": where})
    for m in base.modules():  # bitsandbytes' CPU inference kernel cannot take layers narrower than a block
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
    return peft.PeftModel.from_pretrained(base, str(directory))


def unreadable(directory: Path, err: BaseException) -> ConfigError:
    return ConfigError("RUN_DIR", f"{directory} does not load: {' '.join(str(err).split())[:300]}",
                       "give a run directory of a finished run (it holds hf/)")


def load_hf(directory: Path, device: torch.device, config: dict | None = None):
    """(model, tokenizer, is_classifier) from a transformers or peft directory, local files only;
    ``config``: the run's saved config (a QLoRA adapter then loads on its 4-bit base)."""
    from ..hf import has_tokenizer, import_transformers
    transformers = import_transformers()
    adapter = directory / "adapter_config.json"
    peft_settings = (config or {}).get("peft") or {}
    if not has_tokenizer(directory):
        raise ConfigError("RUN_DIR", f"{directory} holds no tokenizer (the run's data had none, e.g. data=random)",
                          "train on text data (data=text, data=instruct) to sample text")
    if adapter.is_file() and str(peft_settings.get("_target_", "")).endswith(".QLoRA"):
        precision = str(((config or {}).get("precision") or {}).get("_target_", ""))
        compute = {"BF16": torch.bfloat16, "FP16": torch.float16}.get(precision.rpartition(".")[2], torch.float32)
        try:
            model = load_qlora(directory, peft_settings, compute, device, transformers)
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except (OSError, ValueError) as err:
            raise unreadable(directory, err) from None
        return model.eval(), tokenizer, False
    if adapter.is_file():
        from ..peft import import_peft
        peft = import_peft()
        task = json.loads(adapter.read_text()).get("task_type")
        auto = peft.AutoPeftModelForSequenceClassification if task == "SEQ_CLS" else peft.AutoPeftModelForCausalLM
        classifier = task == "SEQ_CLS"
    else:
        hf_config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
        classifier = any(a.endswith("ForSequenceClassification") for a in hf_config.architectures or [])
        auto = transformers.AutoModelForSequenceClassification if classifier else transformers.AutoModelForCausalLM
    try:
        model = auto.from_pretrained(str(directory), local_files_only=True)
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as err:
        raise unreadable(directory, err) from None
    return model.to(device).eval(), tokenizer, classifier


def newest_checkpoint(run_dir: Path) -> Path | None:
    """The newest valid checkpoint of a run (``run_dir/checkpoints/step-N``), or ``run_dir`` itself
    when it is a checkpoint."""
    if (run_dir / "manifest.json").is_file():
        return run_dir if is_valid(run_dir) is None else None
    return next((step for step in step_dirs(run_dir / "checkpoints") if is_valid(step) is None), None)


def load_bundled(where: Path, device: torch.device, model: nn.Module | None = None) -> nn.Module:
    """A model built from ``where/config.yaml`` (or ``model``, built by the caller), its adapter
    applied as in training, with the weights of ``where/model.safetensors``."""
    from safetensors.torch import load_model
    config = run_config(where)
    if model is None and set(config.get("model") or {}) <= {"_target_"}:  # a Python run records the class only
        raise ConfigError("RUN_DIR", f"{where / 'config.yaml'} names the model's class but not its arguments (a run "
                          "of train_model)", "pass the model to load the weights into: load_finished(RUN_DIR, "
                          "model=MyModel(...))")
    peft = config.get("peft") or {}
    if str(peft.get("_target_", "")).endswith(".QLoRA"):
        raise ConfigError("RUN_DIR", f"{where} holds a QLoRA checkpoint, whose 4-bit base is not in its weights",
                          "continue the run to its end (resume=auto): it then exports its adapter (hf/)")
    try:
        model = build({k: v for k, v in config["model"].items() if k != "init_from"}) if model is None else model
        if peft.get("_target_") and not str(peft["_target_"]).endswith(".FullModel"):
            model = build(peft).wrap(model)  # a LoRA run's checkpoint holds the wrapped model's weights
        load_model(model, str(where / "model.safetensors"))
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - a class that moved, weights of another shape
        raise unreadable(where, err) from None
    return model.to(device).eval()


def load_finished(run_dir: str | Path, device: str | torch.device = "auto", model: nn.Module | None = None) -> Finished:
    """Load what the run in ``run_dir`` left (see the module's doc): its exported model, or, when it
    stopped before its end, its newest checkpoint (said in a log line). ``run_dir`` may also be a
    checkpoint directory (``.../checkpoints/step-N``) or a transformers directory. ``model``: the
    module to load a bundled run's weights into (a ``train_model`` run's config.yaml names only its
    class; the command line's names its arguments too, and it is built from them)."""
    from ..engines.local import resolve_device
    device = resolve_device(str(device)) if not isinstance(device, torch.device) else device
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError("RUN_DIR", f"{run_dir} is not a directory", "give a run directory (outputs/DATE/TIME)")
    directory = hf_directory(run_dir)
    if directory is not None:
        home = directory.parent if directory.name == "hf" else directory
        model, tokenizer, classifier = load_hf(directory, device, run_config(home))
        return Finished(model, tokenizer, classifier, home, run_config(home))
    if (run_dir / "model.safetensors").is_file() and (run_dir / "config.yaml").is_file():
        return Finished(load_bundled(run_dir, device, model), run_dir=run_dir, config=run_config(run_dir))
    if (run_dir / "adapter").is_dir():
        raise ConfigError("RUN_DIR", f"{run_dir} holds a LoRA adapter of a bundled model, not its weights",
                          "sample at the end of the run (sample_tokens=N), or load it with looplib.load_lora")
    checkpoint = newest_checkpoint(run_dir)
    if checkpoint is None:
        raise ConfigError("RUN_DIR", f"{run_dir} holds neither hf/ nor config.yaml + model.safetensors, nor a valid "
                          "checkpoint", "give the directory of a run (outputs/DATE/TIME) or of one of its checkpoints")
    if not (checkpoint / "model.safetensors").is_file():
        raise ConfigError("RUN_DIR", f"{checkpoint} holds its model in its engine's sharded format (FSDP, "
                          "DeepSpeed), which looplib.generate does not read",
                          "continue the run to its end (resume=auto): it then exports its weights")
    home = run_dir if checkpoint.parent.name != "checkpoints" else checkpoint.parent.parent
    if checkpoint != run_dir:
        log.info("%s was stopped before its end (it holds no exported weights): loading its newest checkpoint, %s",
                 run_dir, checkpoint)
    return Finished(load_bundled(checkpoint, device, model), run_dir=home, config=run_config(checkpoint),
                    checkpoint=checkpoint)
