"""Hydra entry point: ``python -m looplib.train [+group=option ...] [key=value ...]``.

Compose the config, check it, build the pieces (cheap checks first, so bad input fails
before a tokenizer is trained or a model is built), run the loop, write the run directory:
metrics.jsonl, config.yaml (resolved), model.safetensors.
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from . import autobatch
from .accumulation import Accumulation
from .build import Settings, check_settings, fill_strategy_defaults, instantiate
from .data import Epochs, build_loader
from .engines import Engine
from .errors import EXIT_CONFIG, ConfigError
from .loop import TrainState, evaluate, fit
from .plan import optimizer_state_bytes
from .telemetry import Telemetry, peak_flops

log = logging.getLogger("looplib")


@dataclass
class Job:
    """Everything a run needs, built and checked."""
    cfg: DictConfig
    settings: Settings
    engine: Engine
    precision: Any
    optim: Any
    schedule: Any
    objective: Any
    corpus: Any = None
    model: Any = None


def build_job(cfg: DictConfig) -> Job:
    """Checks first (cheap), then the expensive pieces (data, model)."""
    settings = check_settings(cfg)
    fill_strategy_defaults(cfg)
    engine = Engine(settings.device)
    precision = instantiate(cfg, "precision")
    precision.setup(engine.device)
    job = Job(cfg, settings, engine, precision, optim=instantiate(cfg, "optim"),
              schedule=instantiate(cfg, "schedule"), objective=instantiate(cfg, "loss"))
    torch.manual_seed(settings.seed)
    job.corpus = instantiate(cfg, "data")
    checkpointing = instantiate(cfg, "checkpointing")  # activation checkpointing (not state)
    job.model = engine.setup(checkpointing.apply(instantiate(cfg, "model")))
    if settings.batch_size == "auto":  # the largest micro-batch that fits, then accumulation
        autobatch.resolve(job, reserve_bytes=optimizer_state_bytes(job, default=0))
    return job


def run(job: Job, run_dir: Path) -> TrainState:
    s, engine = job.settings, job.engine
    run_dir.mkdir(parents=True, exist_ok=True)
    if engine.is_main:
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(job.cfg, resolve=True))
    loader_args = dict(OmegaConf.to_container(job.cfg.loader, resolve=True))
    train = build_loader(job.corpus.train, batch_size=s.batch_size, seed=s.seed, device=engine.device,
                         rank=engine.rank, world=engine.world_size, **loader_args)
    held_out = build_loader(job.corpus.eval, batch_size=s.batch_size, seed=s.seed, shuffle=False,
                            device=engine.device)
    eval_batches = [b for _, b in zip(range(s.eval_batches), held_out)]
    optimizer = job.optim.build(job.model)
    scheduler = job.schedule.build(optimizer, s.max_steps)
    telemetry = Telemetry(run_dir / "metrics.jsonl", log_every=s.log_every, total_steps=s.max_steps,
                          device=engine.device, enabled=engine.is_main,
                          progress=s.progress, **mfu_settings(job))
    n_params = sum(p.numel() for p in job.model.parameters())
    log.info("training %s (%.2fM parameters) on %s: %d steps of %d x %d sequences, precision %s, optimizer %s",
             type(job.model).__name__, n_params / 1e6, engine.device, s.max_steps, s.batch_size,
             s.accum_steps, getattr(job.precision, "name", type(job.precision).__name__), type(optimizer).__name__)
    try:
        state = fit(job.model, Epochs(train), objective=job.objective, optimizer=optimizer,
                    scheduler=scheduler, precision=job.precision, accumulation=Accumulation(s.accum_steps),
                    engine=engine, max_steps=s.max_steps, max_grad_norm=s.max_grad_norm,
                    telemetry=telemetry, eval_data=eval_batches, eval_every=s.eval_every)
        if eval_batches and not (s.eval_every and state.step % s.eval_every == 0):
            telemetry.eval(state.step, evaluate(job.model, eval_batches, job.objective, job.precision, engine))
    finally:
        telemetry.close()
    if engine.is_main:
        save_weights(job.model, run_dir / "model.safetensors")
        if s.sample_tokens and hasattr(job.model, "generate"):
            print_sample(job, s.sample_tokens)
    log.info("done: %s", run_dir)
    return state


def mfu_settings(job: Job) -> dict:
    """FLOPs of one training sample (bundled models know theirs) and the device's peak."""
    flops = getattr(job.model, "flops_per_sequence", None)
    precision = getattr(job.precision, "name", "fp32")
    return {"flops_per_sample": flops() if flops else None,
            "peak_flops": peak_flops(job.engine.device, precision, job.settings.peak_tflops)}


def save_weights(model: torch.nn.Module, path: Path) -> None:
    """safetensors, written beside the target and renamed: never a half-written file."""
    from safetensors.torch import save_model
    tmp = path.with_name(path.name + ".tmp")
    save_model(model, str(tmp))
    os.replace(tmp, path)


def print_sample(job: Job, n_tokens: int) -> None:
    prompt = "def "
    ids = torch.tensor([job.corpus.encode(prompt)], device=job.engine.device)
    gen = torch.Generator(job.engine.device).manual_seed(job.settings.seed)
    with job.precision.autocast():
        out = job.model.generate(ids, n_tokens, generator=gen)
    text = job.corpus.decode(out[0].tolist())
    print(f"\n--- a sample from the trained model ---\n{text}\n---", flush=True)


def forget_run_dir(run_dir: Path) -> None:
    """After a configuration error: remove what Hydra wrote for this run, nothing else."""
    shutil.rmtree(run_dir / ".hydra", ignore_errors=True)
    for log_file in run_dir.glob("*.log"):
        log_file.unlink(missing_ok=True)
    try:
        run_dir.rmdir()  # only if now empty: a directory holding anything else is left alone
    except OSError:
        pass


@hydra.main(version_base="1.3", config_path="pkg://looplib.conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        job = build_job(cfg)
    except ConfigError as err:
        forget_run_dir(run_dir)
        print(f"looplib: error: {err}", file=sys.stderr, flush=True)
        sys.exit(EXIT_CONFIG)
    run(job, run_dir)


if __name__ == "__main__":
    main()
