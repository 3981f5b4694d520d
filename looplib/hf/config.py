"""Loading a transformers config and checking it: the directory (``model.path``) or an
architecture (``model.model_type``), override keys checked against its config class, the window
against its positions. transformers is imported only when one of these is called
(``pip install 'looplib[hf]'``); ``default_seq_len`` reads config.json without it."""
from __future__ import annotations

import contextvars
import difflib
import inspect
import json
from contextlib import contextmanager
from pathlib import Path

import torch

from ..errors import ConfigError, need

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
# the config keys that hold a model's number of positions, in the order transformers' models use them
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def import_transformers():
    transformers = need("transformers", "hf", "model", "this model")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()  # "Loading weights", "Writing model shards"
    quiet_import("torchao")  # transformers imports it when it loads a model, if installed
    # torch's notes on the enums a library registers as pytree constants (torchao's, as transformers
    # imports more of it) are about that library's code: never the user's to act on
    import logging
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    return transformers


# what a library says while it is imported, about code the user does not own: torchao's
# "Failed to load .../_C_mxfp8...so" and "Detected no triton", torch's pytree notes on the enums
# torchao registers, bitsandbytes' missing ``kernels`` package
IMPORT_NOISE = ("torchao", "torch.utils._pytree", "bitsandbytes")


def quiet_import(module: str) -> None:
    """Import ``module`` if it is installed, with its import-time warnings and log lines kept off
    stderr (the loggers' levels put back afterwards: what the library says later is heard)."""
    import importlib
    import logging
    import sys
    import warnings
    if module in sys.modules:
        return
    loggers = [logging.getLogger(name) for name in IMPORT_NOISE]
    levels = [logger.level for logger in loggers]
    try:
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            importlib.import_module(module)
    except Exception:  # noqa: BLE001 - not installed, or broken: whoever needs it says so
        pass
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


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
        raise ConfigError("model.path", f"{path} does not exist",
                          "give a local model directory (nothing is downloaded)")
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
    limit = model_positions(config)
    if limit is not None and seq_len > limit:
        raise ConfigError("model.seq_len", f"seq_len={seq_len} is longer than the model's {limit} positions",
                          f"use model.seq_len={limit} or less")


# BitsAndBytesConfig's keys and the device, while a QLoRA job's model is built (looplib.peft.QLoRA.loading)
IN_4BIT: contextvars.ContextVar[tuple[dict, torch.device] | None] = contextvars.ContextVar("looplib_4bit", default=None)


@contextmanager
def loading_in_4bit(options: dict, device: torch.device):
    """Within the block, a model read from ``model.path`` loads its linear layers in 4 bits on
    ``device`` (transformers' ``BitsAndBytesConfig(**options)``: quantised one layer at a time
    as it loads, never whole in 16 or 32 bits on the device)."""
    token = IN_4BIT.set((options, torch.device(device)))
    try:
        yield
    finally:
        IN_4BIT.reset(token)


def load_weights(auto, path: str, config, attn_implementation: str):
    """The directory's weights in fp32 (precision strategies cast; the master copy stays fp32), or
    within ``loading_in_4bit`` its linear layers quantised to 4 bits as they load."""
    quantized = {}
    if IN_4BIT.get() is not None:
        from transformers import BitsAndBytesConfig
        options, device = IN_4BIT.get()
        where = device.index if device.type == "cuda" and device.index is not None else str(device)
        quantized = dict(quantization_config=BitsAndBytesConfig(**options), device_map={"": where})
    try:
        return auto.from_pretrained(path, config=config, local_files_only=True, dtype=torch.float32,
                                    attn_implementation=attn_implementation, **quantized)
    except (OSError, ValueError, RuntimeError) as err:
        raise ConfigError("model.path", f"the weights in {path} do not load: {one_line(err)}",
                          "check the directory, and that no config override changes a weight's shape") from None


def one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 300 else text[:297] + "..."


def model_positions(config) -> int | None:
    """How many positions the model embeds (``config`` a transformers config or config.json's dict),
    looking into ``text_config`` for models that nest it; None when the config does not say."""
    get = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)
    for key in POSITION_KEYS:
        value = get(key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    nested = get("text_config", None)
    return model_positions(nested) if nested is not None and nested is not config else None


def window(positions: int | None, cap: int) -> int:
    """The default training window: the model's positions, at most ``cap`` (as transformers'
    run_clm example does with 1024); ``cap`` when the model does not say."""
    return min(cap, positions) if positions else cap


def default_seq_len(cap: int, _parent_) -> int:
    """Resolver ``${looplib.seq_len:CAP}`` (``seq_len`` in conf/model/hf*.yaml): the window of the
    model the group describes, from the override keys beside it (``+model.max_position_embeddings``),
    else ``path``'s config.json, else the architecture's default config; never above ``cap``.
    A directory that does not load gives ``cap``: building the model then says what is wrong."""
    node = _parent_
    positions = model_positions({key: node.get(key) for key in POSITION_KEYS if key in node})
    path, model_type = node.get("path"), node.get("model_type")
    if positions is None and path:
        try:
            positions = model_positions(json.loads((Path(str(path)).expanduser() / "config.json").read_text()))
        except (OSError, ValueError):
            positions = None
    elif positions is None and model_type:
        try:
            from transformers import CONFIG_MAPPING
            positions = model_positions(CONFIG_MAPPING[str(model_type)]())
        except Exception:  # noqa: BLE001 - no transformers, or a type it lacks: building the model says so
            positions = None
    return window(positions, int(cap))
