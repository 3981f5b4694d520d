"""``python -m looplib.plan [--world-size N] [--memory-gib G] <train overrides>``: the planner
(``looplib.plan``) on the job a command line describes."""
from __future__ import annotations

import argparse
import math
import sys

from ..plan.budget import Plan, plan_job
from ..plan.render import render


def build_plan(cfg, world: int = 1, memory: int | None = None) -> Plan:
    """The plan of the job ``cfg`` describes (every key checked first; nothing built but on meta)."""
    from .instantiate import check_config, instantiate
    from ..engines.local import Engine
    settings = check_config(cfg)
    parts = {name: instantiate(cfg, name) for name in ("precision", "optim", "checkpointing", "loss", "peft")}
    blocks = cfg.engine.get("blocks") if cfg.get("engine") is not None else None
    # the engine as configured (on the CPU: only its kind matters here); the adapter refuses what it
    # cannot run under it as the run would (QLoRA: DeepSpeed), and learns how the base is held
    engine = instantiate(cfg, "engine", device="cpu") if cfg.get("engine") is not None else Engine("cpu")
    parts["peft"].check(engine, parts["precision"])
    plan = plan_job(settings, parts["precision"], parts["optim"], parts["checkpointing"], parts["loss"], parts["peft"],
                    lambda: instantiate(cfg, "model"), cfg.data.get("seq_len"),
                    list(blocks) if blocks else None, world, memory)
    plan.engine = engine.label
    return plan


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad argument is looplib's one-line error (exit 2), not a usage screen."""

    def error(self, message: str):
        from ..errors import ConfigError
        flag = message.split("argument ")[-1].split(":")[0] if "argument " in message else "arguments"
        raise ConfigError(flag.split("/")[0], " ".join(message.split()), "see python -m looplib.plan --help")


def main(argv: list[str] | None = None) -> int:
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from ..errors import EXIT_CONFIG, ConfigError

    import looplib.plan
    parser = OneLineParser(prog="python -m looplib.plan", description=looplib.plan.__doc__.split("\n\n")[0],
                           epilog="Other arguments are the overrides `python -m looplib.train` takes.")
    parser.add_argument("--world-size", type=int, default=1, help="ranks for the ZeRO rows (default 1)")
    parser.add_argument("--memory-gib", type=float, default=None,
                        help="device memory to plan for (default: this machine's GPU, else its RAM)")
    try:
        args, overrides = parser.parse_known_args(argv)
        if args.world_size < 1:
            raise ConfigError("--world-size", f"must be at least 1 (got {args.world_size})", "use e.g. --world-size 8")
        if args.memory_gib is not None and not (math.isfinite(args.memory_gib) and args.memory_gib > 0):
            raise ConfigError("--memory-gib", f"must be a positive number of GiB (got {args.memory_gib})",
                              "use e.g. --memory-gib 80, or leave it out to plan for this machine")
        flags = [o for o in overrides if o.startswith("-")]
        if flags:
            raise ConfigError(flags[0], "is not an option of python -m looplib.plan",
                              "use --world-size N, --memory-gib G, and python -m looplib.train's overrides")
        with initialize_config_module(config_module="looplib.conf", version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
        memory = int(args.memory_gib * 2**30) if args.memory_gib is not None else None
        print(render(build_plan(cfg, args.world_size, memory)))
    except ConfigError as err:
        print(f"looplib: error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    except (HydraException, OmegaConfBaseException) as err:
        print(f"looplib: error: {' '.join(str(err).split())}", file=sys.stderr)
        return EXIT_CONFIG
    return 0

