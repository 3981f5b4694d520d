"""From a composed config to live objects: top-level checks, group defaults, instantiation.

Every check that can be made before training happens here, once, and fails with a
``ConfigError``: one line naming the key and the fix.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from importlib import resources
from typing import Any, Optional

import hydra
from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from .errors import ConfigError

# Strategy groups stay out of the defaults list (so `+group=option` works as typed); an
# absent group means this option, read from the same YAML file `+group=option` would use.
STRATEGY_DEFAULTS = {"precision": "fp32", "optim": "adamw", "schedule": "constant", "checkpointing": "none",
                     "engine": "local", "peft": "none", "compile": "none", "evaluation": "as_trained"}


def positive(key, v):
    return v > 0 or f"{key} must be at least 1"


def non_negative(key, v):
    return v is None or v >= 0 or f"{key} must not be negative"


@dataclass
class Settings:
    """The job's top-level keys, typed. OmegaConf converts strings and names the key on error."""
    device: str = field(default="auto", metadata={"fix": "use device=auto, cpu or cuda[:N]"})
    seed: int = field(default=1337, metadata={"fix": "use a whole number, e.g. seed=0"})
    max_steps: int = field(default=300, metadata={"fix": "use a whole number of optimizer steps, e.g. max_steps=300",
                                                   "rule": positive})
    batch_size: Any = field(default=32, metadata={"fix": "use the micro-batch size per device, e.g. batch_size=16, "
                                                          "or batch_size=auto with global_batch_size=N",
                                                   "rule": lambda k, v: v == "auto" or positive_int(k, v)})
    accum_steps: int = field(default=1, metadata={"fix": "use 1 for no accumulation, or k micro-batches per step",
                                                  "rule": positive})
    lr: float = field(default=2e-3, metadata={"fix": "use a positive learning rate, e.g. lr=3e-4",
                                               "rule": lambda k, v: v > 0 or "lr must be positive"})
    weight_decay: float = field(default=0.1, metadata={"fix": "use e.g. weight_decay=0.1 (0 for none)",
                                                        "rule": non_negative})
    max_grad_norm: Optional[float] = field(default=1.0, metadata={"fix": "use e.g. max_grad_norm=1.0 (0 or null: off)",
                                                                   "rule": non_negative})
    log_every: int = field(default=10, metadata={"fix": "use e.g. log_every=10", "rule": positive})
    eval_every: int = field(default=100, metadata={"fix": "use e.g. eval_every=100 (0: only at the end)",
                                                    "rule": non_negative})
    eval_batches: int = field(default=8, metadata={"fix": "use e.g. eval_batches=8", "rule": non_negative})
    sample_tokens: int = field(default=160, metadata={"fix": "use e.g. sample_tokens=100 (0: no sample)",
                                                       "rule": non_negative})
    max_bad_steps: int = field(default=25, metadata={"fix": "use e.g. max_bad_steps=25 (0: never stop)",
                                                      "rule": non_negative})
    resume: Optional[str] = field(default=None, metadata={"fix": "use resume=auto, resume=PATH or resume=null"})
    global_batch_size: Optional[int] = field(default=None, metadata={
        "fix": "use the sequences per optimizer step over all devices, e.g. global_batch_size=64 (null: off)",
        "rule": lambda k, v: v is None or v > 0 or f"{k} must be at least 1"})
    peak_tflops: Optional[float] = field(default=None, metadata={
        "fix": "use the device's peak for the training precision in TFLOP/s, e.g. peak_tflops=989 (null: auto)",
        "rule": lambda k, v: v is None or v > 0 or f"{k} must be positive"})
    progress: str = field(default="auto", metadata={
        "fix": "use progress=auto, bar or lines",
        "rule": lambda k, v: v in ("auto", "bar", "lines") or f"progress={v!r} is not a choice"})


def positive_int(key, v):
    if isinstance(v, bool) or not isinstance(v, int):
        return f"{key}={v!r} is neither a whole number nor auto"
    return positive(key, v)


TYPE_WORDS = {"int": "a whole number", "float": "a number", "str": "a string",
              "Optional[float]": "a number (or null)", "Optional[int]": "a whole number (or null)",
              "Optional[str]": "a string (or null)"}


def check_settings(cfg: DictConfig) -> Settings:
    """Type-check and range-check the top-level keys."""
    schema = OmegaConf.structured(Settings)
    for f in fields(Settings):
        value = cfg.get(f.name, f.default)
        try:
            OmegaConf.merge(schema, {f.name: value})
        except OmegaConfBaseException:
            kind = TYPE_WORDS.get(str(f.type), str(f.type))
            raise ConfigError(f.name, f"{f.name}={value!r} is not {kind}", f.metadata["fix"]) from None
    settings = OmegaConf.to_object(OmegaConf.merge(schema, {f.name: cfg.get(f.name, f.default) for f in fields(Settings)}))
    for f in fields(Settings):
        rule = f.metadata.get("rule")
        verdict = rule(f.name, getattr(settings, f.name)) if rule else True
        if verdict is not True:
            raise ConfigError(f.name, f"{verdict} (got {f.name}={getattr(settings, f.name)!r})", f.metadata["fix"])
    check_checkpoint(cfg)
    check_global_batch(settings)
    return settings


def check_checkpoint(cfg: DictConfig) -> None:
    enabled = cfg.get("checkpoint", {}).get("enabled", True)
    if not isinstance(enabled, bool):
        raise ConfigError("checkpoint.enabled", f"checkpoint.enabled={enabled!r} must be true or false",
                          "e.g. checkpoint.enabled=false")
    for key, least in (("every_steps", 0), ("keep", 1)):
        value = cfg.get("checkpoint", {}).get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ConfigError(f"checkpoint.{key}", f"checkpoint.{key}={value!r} must be a whole number >= {least}",
                              "e.g. checkpoint.every_steps=100 checkpoint.keep=2")


def check_global_batch(s: Settings) -> None:
    """``batch_size=auto`` needs ``global_batch_size`` and chooses ``accum_steps`` itself; a fixed
    batch with a global batch must agree with it (the per-rank split is checked by autobatch)."""
    if s.batch_size == "auto":
        if s.global_batch_size is None:
            raise ConfigError("global_batch_size", "batch_size=auto needs a target global batch",
                              "add global_batch_size=N (sequences per optimizer step), or set batch_size=N")
        if s.accum_steps != 1:
            raise ConfigError("accum_steps", f"batch_size=auto chooses accum_steps itself (got accum_steps={s.accum_steps})",
                              "leave accum_steps out, or set batch_size to a number")
    elif s.global_batch_size is not None and s.batch_size * s.accum_steps != s.global_batch_size:
        raise ConfigError("global_batch_size", f"global_batch_size={s.global_batch_size} but batch_size x accum_steps = "
                          f"{s.batch_size} x {s.accum_steps} = {s.batch_size * s.accum_steps}",
                          "use batch_size=auto to choose the micro-batch, or make them agree")


def fill_strategy_defaults(cfg: DictConfig) -> None:
    """Put the default option of every absent strategy group into ``cfg`` (so it is saved too)."""
    with open_dict(cfg):
        for group, option in STRATEGY_DEFAULTS.items():
            if cfg.get(group) is None:
                cfg[group] = OmegaConf.load(resources.files("looplib.conf") / group / f"{option}.yaml")


def group_choice(group: str) -> str:
    try:
        from hydra.core.hydra_config import HydraConfig
        return str(HydraConfig.get().runtime.choices.get(group) or STRATEGY_DEFAULTS.get(group, group))
    except ValueError:  # not running under Hydra
        return STRATEGY_DEFAULTS.get(group, "?")


def instantiate(cfg: DictConfig, group: str, **runtime: Any) -> Any:
    """``hydra.utils.instantiate`` of one config group, with errors that name the group."""
    node = cfg.get(group)
    if node is None or "_target_" not in node:
        raise ConfigError(group, f"the {group} config has no _target_", f"add {group}._target_=package.Class")
    try:
        target = node._target_
    except OmegaConfBaseException as err:
        raise ConfigError(group, f"the {group} config does not resolve: {err.msg}",
                          f"fix the interpolation in {group}") from None
    try:
        return hydra.utils.instantiate(node, **runtime)
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, ConfigError):
            raise cause from None
        where = f"{group}._target_={target!r} (from {group}={group_choice(group)})"
        if isinstance(cause, ImportError) or "Error locating target" in str(err):
            while cause is not None and cause.__cause__ is not None:
                cause = cause.__cause__  # the ImportError itself, not Hydra's wrapping of it
            reason = repr(cause) if cause is not None else str(err).splitlines()[0]
            raise ConfigError(f"{group}._target_", f"{where} does not import: {reason}",
                              "fix the dotted path, or install the package that provides it") from None
        raise ConfigError(group, f"{where} could not be built: {cause or err}",
                          f"check the keys of the {group} config against {target}'s arguments") from None
    except OmegaConfBaseException as err:
        raise ConfigError(group, f"the {group} config does not resolve: {err.msg}",
                          f"fix the values in {group}") from None
