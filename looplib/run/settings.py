"""The job's top-level settings, typed: the command line's keys (conf/config.yaml) and
``train_model``'s keyword arguments are the same fields, with the same defaults (``Settings`` is
their one source: one test, tests/unit/test_config_unit.py, holds conf/config.yaml,
``train_model``'s signature and the docs' settings table equal to it), checked by the same rules (``looplib.schema``: constructor annotations are the
schema). Imports neither Hydra nor OmegaConf.
"""
from __future__ import annotations

import typing
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Literal, Optional

from ..errors import ConfigError
from ..optim import LR, WEIGHT_DECAY
from ..schema import NonNegative, Positive, Seed, check_options, default_of, show


@dataclass
class Loader:
    """The ``loader`` keys: ``torch.utils.data.DataLoader`` settings (``looplib.data.build_loader``)."""
    num_workers: NonNegative[int] = 0
    pin_memory: bool | Literal["auto"] = "auto"  # auto: pinned when training on CUDA
    persistent_workers: bool = False
    prefetch_factor: Positive[int] | None = None

    def __post_init__(self):
        for key, value, off in (("persistent_workers", self.persistent_workers, False),
                                ("prefetch_factor", self.prefetch_factor, None)):
            if value != off and self.num_workers == 0:  # torch refuses these without workers
                raise ConfigError(f"loader.{key}", f"loader.{key}={show(value)} needs worker processes "
                                  "(loader.num_workers=0)", f"set loader.num_workers=N (N >= 1), or leave loader.{key} out")


@dataclass
class Checkpoint:
    """The ``checkpoint`` keys: crash-safe checkpoints of the run (``looplib.store.saving``)."""
    enabled: bool = True
    every_steps: NonNegative[int] = field(default=100, metadata={"fix": "use e.g. checkpoint.every_steps=100 (0: only at the end)"})
    keep: Positive[int] = field(default=2, metadata={"fix": "use e.g. checkpoint.keep=2"})
    # the key is ``checkpoint.async`` (a Python keyword: the field is named otherwise, see ``config_key``)
    asynchronous: bool = field(default=False, metadata={
        "key": "async", "fix": "use checkpoint.async=true (written in the background) or false"})


# the keys of metrics.jsonl a job can return to a sweeper (looplib.telemetry writes them)
SWEEP_METRICS = ("eval_loss", "eval_perplexity", "eval_accuracy", "loss", "tokens_per_s", "sequences_per_s",
                 "samples_per_s", "step_time_s", "peak_mem_mb", "tflops", "mfu")


@dataclass
class Sweep:
    """The ``sweep`` keys: what each job returns to a Hydra sweeper (``looplib.cli.sweep``)."""
    metric: str = field(default="eval_loss", metadata={"fix": "use e.g. sweep.metric=eval_loss"})
    direction: Literal["minimize", "maximize"] = "minimize"

    def __post_init__(self):
        if self.metric not in SWEEP_METRICS:
            import difflib
            near = difflib.get_close_matches(self.metric, SWEEP_METRICS, n=1)
            raise ConfigError("sweep.metric", f"sweep.metric={show(self.metric)} is not a key of the job's "
                              "metrics" + (f" (did you mean {near[0]}?)" if near else ""),
                              "use one of " + ", ".join(SWEEP_METRICS))

    def check_job(self, eval_samples: Any) -> None:
        """Refuse a search whose metric no trial can log: an ``eval_*`` metric with the held-out
        evaluation off (``eval_samples=0``). Every trial would train to its end and fail. (With
        ``eval_every=0`` the run still evaluates once, at its end: the metric exists.)"""
        if self.metric.startswith("eval_") and eval_samples == 0 and not isinstance(eval_samples, bool):
            raise ConfigError("sweep.metric", f"sweep.metric={self.metric} comes from the held-out evaluation, which "
                              "eval_samples=0 turns off: every trial would train to its end without it",
                              "give eval_samples (e.g. eval_samples=64, or null: the whole held-out split), or "
                              "search another metric (e.g. sweep.metric=loss)")


@dataclass
class Settings:
    """The job's top-level keys, typed (``looplib.schema``); ``fix`` is the advice on a bad value."""
    device: str = field(default="auto", metadata={"fix": "use device=auto, cpu or cuda[:N]"})
    seed: Seed = field(default=1337, metadata={"fix": "use a whole number from 0 to 2**64-1, e.g. seed=0"})
    max_steps: Positive[int] = field(default=300, metadata={"fix": "use a whole number of optimizer steps, e.g. max_steps=300"})
    batch_size: Positive[int] | Literal["auto"] = field(default=32, metadata={
        "fix": "use the micro-batch size per device, e.g. batch_size=16, or batch_size=auto with global_batch_size=N"})
    accum_steps: Positive[int] = field(default=1, metadata={"fix": "use 1 for no accumulation, or k micro-batches per step"})
    lr: Positive[float] = field(default=LR, metadata={"fix": "use a positive learning rate, e.g. lr=3e-4"})
    weight_decay: NonNegative[float] = field(default=WEIGHT_DECAY, metadata={"fix": "use e.g. weight_decay=0.1 (0 for none)"})
    max_grad_norm: NonNegative[float] | None = field(default=1.0, metadata={"fix": "use e.g. max_grad_norm=1.0 (0 or null: off)"})
    log_every: Positive[int] = field(default=10, metadata={"fix": "use e.g. log_every=10"})
    eval_every: NonNegative[int] = field(default=100, metadata={"fix": "use e.g. eval_every=100 (0: only at the end)"})
    eval_samples: NonNegative[int] | None = field(default=512, metadata={
        "fix": "use the held-out sequences per evaluation, e.g. eval_samples=512 (0: none, null: the whole held-out split)"})
    sample_tokens: NonNegative[int] = field(default=160, metadata={"fix": "use e.g. sample_tokens=100 (0: no sample)"})
    max_bad_steps: NonNegative[int] = field(default=25, metadata={"fix": "use e.g. max_bad_steps=25 (0: never stop)"})
    resume: Optional[str] = field(default=None, metadata={"fix": "use resume=auto, resume=PATH or resume=null"})
    global_batch_size: Positive[int] | None = field(default=None, metadata={
        "fix": "use the sequences per optimizer step over all devices, e.g. global_batch_size=64 (null: off)"})
    peak_tflops: Positive[float] | None = field(default=None, metadata={
        "fix": "use the device's peak for the training precision in TFLOP/s, e.g. peak_tflops=989 (null: auto)"})
    progress: Literal["auto", "bar", "lines"] = "auto"
    loader: Loader = field(default_factory=Loader)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    sweep: Sweep = field(default_factory=Sweep)


class Default(int):
    """A whole-number default as ``train_model`` gives it: the command line's value, which also
    tells a value left as it is from the same one passed (``sample_tokens``)."""


SAMPLE_TOKENS = Default(Settings.sample_tokens)  # train_model: the CLI's sample, where the data can encode a prompt
# settings of the command line that are not train_model's arguments (the optimizer object carries
# its own lr and weight decay): left out of a Python run's config.yaml, which records what ran
NOT_ARGUMENTS = ("lr", "weight_decay")


# settings that were renamed: (the new key, what it means), refused with the fix naming it
RENAMED = {"eval_batches": ("eval_samples", "the held-out loss is taken over a fixed set of held-out sequences, the "
                            "same whatever the batch size, accumulation or process count")}


def refuse_renamed(values: dict[str, Any]) -> None:
    """An old setting (``RENAMED``): one line naming the new key (``eval_batches=2`` with
    ``batch_size=4`` evaluated 8 sequences: ``eval_samples=8``)."""
    for old, (new, why) in RENAMED.items():
        if old not in values:
            continue
        value, batch = values[old], values.get("batch_size", Settings.batch_size)
        same = value * batch if old == "eval_batches" and isinstance(value, int) and isinstance(batch, int) else None
        raise ConfigError(old, f"{old} is now {new}: {why}",
                          f"use {new}={same if same is not None else 'N'}" + (f" (the {same} sequences {old}={value} "
                                                                              f"took at batch_size={batch})" if same is not None else ""))


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


def config_key(f) -> str:
    """A field's key in the config: its name, or ``metadata["key"]`` where the key is a Python
    keyword (``checkpoint.async``, the field ``asynchronous``)."""
    return f.metadata.get("key", f.name)


def section(cls: type, values: dict[str, Any]):
    """A section of settings (``checkpoint``, ``loader``) from its config keys."""
    names = {config_key(f): f.name for f in fields(cls)}
    return cls(**{names.get(k, k): v for k, v in values.items()})


def as_config(settings: Settings) -> dict[str, Any]:
    """The settings as the config holds them: plain values under their config keys."""
    def plain(obj):
        return {config_key(f): plain(getattr(obj, f.name)) if is_dataclass(getattr(obj, f.name))
                else getattr(obj, f.name) for f in fields(obj)}
    return plain(settings)


def settings_from(values: dict[str, Any]) -> Settings:
    """``Settings`` from plain values (the config's top level, or ``train_model``'s arguments),
    each checked against its annotation first: one line naming the key on a bad value."""
    refuse_renamed(values)
    check_options("", Settings, values)
    hints = typing.get_type_hints(Settings)
    chosen = {f.name: values.get(f.name, default_of(f)) for f in fields(Settings)}
    for name, value in chosen.items():
        if is_dataclass(hints[name]) and isinstance(value, dict):  # a section: loader, checkpoint, sweep
            chosen[name] = section(hints[name], value)
    settings = Settings(**chosen)
    check_global_batch(settings)
    return settings
