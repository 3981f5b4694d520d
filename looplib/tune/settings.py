"""``tune.*`` settings and the split of the command line into the job and the tuner's own keys.

    python -m looplib.tune model=bert_large data=classification loss=classification \\
        tune.numerics=allow tune.memory_gib=16 tune.search=[batch,checkpointing,precision]

Everything that is not ``tune.*`` (nor ``hydra.run.dir``) is the job: the overrides
``python -m looplib.train`` would take (``looplib.cli.tune.split`` reads the command line). The measurement's own keys (steps, logging, checkpoints,
evaluation, sample) are set by the tuner for every candidate, so the job's values of them are
dropped from what each candidate runs and kept in the best command.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..errors import ConfigError
from ..groups import tuned
from ..schema import Fraction, NonNegative, Positive, check_options, refuse_unknown

# the micro-batch, then every config group tune searches (looplib.groups: same math first), then the
# optimizer's implementation (foreach, fused)
DIMENSIONS = ("batch", *tuned("exact"), "optim_impl", *tuned("numerics"))
NUMERICS = tuple(tuned("numerics"))  # dimensions that change the numbers: searched with tune.numerics=allow
# keys each candidate run sets itself (the measurement), not taken from the job
MEASUREMENT = ("max_steps", "log_every", "eval_every", "eval_samples", "sample_tokens", "progress", "resume",
               "checkpoint.enabled", "checkpoint.every_steps", "checkpoint.keep")


@dataclass
class Tune:
    """The ``tune.*`` keys."""
    search: list[Literal[DIMENSIONS]] | None = field(default=None, metadata={  # type: ignore[valid-type]
        "fix": f"use a list of {', '.join(DIMENSIONS)}, e.g. tune.search=[batch,checkpointing]"})
    options: dict = field(default_factory=dict, metadata={
        "fix": "use e.g. tune.options.engine=[ddp,fsdp] to try only those options of a dimension"})
    numerics: Literal["keep", "allow"] = "keep"
    memory_gib: Positive[float] | None = field(default=None, metadata={
        "fix": "use the device memory to fit in GiB, e.g. tune.memory_gib=16 (null: the device's own)"})
    margin: Fraction = field(default=0.1, metadata={"fix": "use the share of memory kept free, e.g. tune.margin=0.1"})
    budget_s: Positive[float] = field(default=1800.0, metadata={"fix": "use seconds for the whole search, e.g. tune.budget_s=600"})
    timeout_s: Positive[float] = field(default=600.0, metadata={"fix": "use seconds per candidate, e.g. tune.timeout_s=300"})
    steps: Positive[int] = field(default=4, metadata={"fix": "use optimizer steps per timed repeat, e.g. tune.steps=4"})
    repeats: Positive[int] = field(default=3, metadata={"fix": "use timed repeats per candidate, e.g. tune.repeats=3"})
    tolerance: Positive[float] = field(default=1e-3, metadata={
        "fix": "use the relative loss difference allowed where the math is the same, e.g. tune.tolerance=1e-3"})
    loss_tolerance: Positive[float] = field(default=0.05, metadata={
        "fix": "use the relative loss difference allowed for precision/optimizer changes, e.g. tune.loss_tolerance=0.05"})
    fresh: bool = False
    dry_run: bool = False
    speed_margin: NonNegative[float] = field(default=0.02, metadata={
        "fix": "use the relative speed-up a change must bring to be kept, e.g. tune.speed_margin=0.02"})

    def __post_init__(self):
        for dim, chosen in self.options.items():
            if dim not in DIMENSIONS:
                refuse_unknown("tune.options.", dim, chosen, list(DIMENSIONS))
            if not isinstance(chosen, list) or not all(isinstance(o, str) for o in chosen):
                raise ConfigError(f"tune.options.{dim}", f"tune.options.{dim}={chosen!r} is not a list of option names",
                                  f"use e.g. tune.options.{dim}=[a,b]")


def key_of(override: str) -> str:
    """``+optim.impl=fused`` -> ``optim.impl``."""
    return override.lstrip("+~").partition("=")[0]


def pinned(job: list[str]) -> set[str]:
    """The config groups the job chose on its command line (never varied by the search)."""
    return {key_of(o).split(".")[0] for o in job}


def job_without_measurement(job: list[str]) -> list[str]:
    return [o for o in job if key_of(o) not in MEASUREMENT]


def without(job: list[str], overrides: list[str]) -> list[str]:
    """The job's overrides less those a candidate sets itself (one value per key)."""
    keys = {key_of(o) for o in overrides}
    return [o for o in job if key_of(o) not in keys]
