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

from .accumulation import Accumulation
from .build import Settings, check_settings, fill_strategy_defaults, instantiate
from .data import Epochs, build_loader
from .engines import Engine
from .engines.launch import launched_rank, register_resolvers, strip_launcher_args
from .errors import EXIT_CONFIG, ConfigError
from .loop import TrainState, evaluate, fit
from .telemetry import Telemetry

log = logging.getLogger("looplib")
register_resolvers()  # ${looplib.rank0_dir:...}: one run directory per run under torchrun


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
    engine = instantiate(cfg, "engine")
    precision = instantiate(cfg, "precision")
    precision.setup(engine.device)
    job = Job(cfg, settings, engine, precision, optim=instantiate(cfg, "optim"),
              schedule=instantiate(cfg, "schedule"), objective=instantiate(cfg, "loss"))
    engine.check(settings, precision, job.optim)
    torch.manual_seed(settings.seed)
    job.corpus = instantiate(cfg, "data")
    job.model = engine.setup(instantiate(cfg, "model"))
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
                          progress=s.progress)
    telemetry.reduce_loss = engine.mean_across_ranks  # logged losses: the mean over every rank
    n_params = sum(p.numel() for p in job.model.parameters())
    log.info("training %s (%.2fM parameters) on %s: %d steps of %d x %d sequences, precision %s, optimizer %s",
             type(job.model).__name__, n_params / 1e6, engine.device, s.max_steps, s.batch_size,
             s.accum_steps, getattr(job.precision, "name", type(job.precision).__name__), type(optimizer).__name__)
    job.model, optimizer, job.precision, max_grad_norm = engine.prepare(job.model, optimizer, job.precision, s)
    try:
        state = fit(job.model, Epochs(train), objective=job.objective, optimizer=optimizer,
                    scheduler=scheduler, precision=job.precision, accumulation=Accumulation(s.accum_steps),
                    engine=engine, max_steps=s.max_steps, max_grad_norm=max_grad_norm,
                    telemetry=telemetry, eval_data=eval_batches, eval_every=s.eval_every)
        if eval_batches and not (s.eval_every and state.step % s.eval_every == 0):
            telemetry.eval(state.step, evaluate(job.model, eval_batches, job.objective, job.precision, engine))
    finally:
        telemetry.close()
    engine.export_weights(job.model, run_dir / "model.safetensors")  # every rank: ZeRO-3 gathers
    if s.sample_tokens and hasattr(engine.unwrap(job.model), "generate"):
        print_sample(job, s.sample_tokens)  # every rank generates (ZeRO-3 gathers), rank 0 prints
    log.info("done: %s", run_dir)
    return state


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
        out = job.engine.unwrap(job.model).generate(ids, n_tokens, generator=gen)
    text = job.corpus.decode(out[0].tolist())
    if job.engine.is_main:
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
        if launched_rank() == 0:  # every rank finds the same error: one says it
            print(f"looplib: error: {err}", file=sys.stderr, flush=True)
        sys.exit(EXIT_CONFIG)
    shared = job.engine.shared_run_dir(run_dir)  # rank 0's: one directory per run, not per rank
    if shared != run_dir:
        forget_run_dir(run_dir)
    try:
        run(job, shared)
    finally:
        job.engine.close()


if __name__ == "__main__":
    sys.argv = strip_launcher_args(sys.argv)  # deepspeed --module looplib.train adds --local_rank=N
    main()
