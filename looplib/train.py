"""Hydra entry point: ``python -m looplib.train [+group=option ...] [key=value ...]``.

Compose the config, check it, build the pieces (cheap checks first, so bad input fails
before a tokenizer is trained or a model is built), run the loop, write the run directory:
metrics.jsonl, config.yaml (resolved), model.safetensors.
"""
from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from . import autobatch, loggers, rundir, sweep
from .accumulation import Accumulation
from .build import Settings, blame, check_config, check_sequences_fit, instantiate
from .data import Epochs, build_loader
from .engines import Engine
from .engines.launch import launched_rank, register_resolvers, strip_launcher_args
from .errors import EXIT_CONFIG, ConfigError
from .loop import fit
from .signals import EXIT_INTERRUPTED, Interrupted, Signals
from .state import EXIT_IO, EXIT_NUMERIC, Checkpoints, InvalidCheckpoint, NumericError, SaveError, TrainState
from .plan import optimizer_state_bytes
from .telemetry import Telemetry, peak_flops

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
    peft: Any = None          # looplib.adapters: FullModel (null) or LoRA
    compile: Any = None       # looplib.compile: Compile (eager, null) or TorchCompile
    evaluation: Any = None    # looplib.evaluation: Evaluation (null) or HalfWeights
    logger: Any = None        # looplib.loggers: Loggers of the +logger= choices (none: the null Logger)


def build_job(cfg: DictConfig) -> Job:
    """Checks first (cheap), then the expensive pieces (data, model)."""
    settings = check_config(cfg)  # every key, top level and in every group: type, range, existence
    # +logger= choices (keys checked, libraries imported: a missing one is a ConfigError), and in a pruned
    # search the trial's reporter (looplib.sweep)
    trackers = loggers.Loggers(loggers.build(cfg), *sweep.reporting(cfg))
    engine = instantiate(cfg, "engine")
    precision = instantiate(cfg, "precision")
    precision.setup(engine.device)
    job = Job(cfg, settings, engine, precision, optim=instantiate(cfg, "optim"),
              schedule=instantiate(cfg, "schedule"), objective=instantiate(cfg, "loss"))
    engine.check(settings, precision, job.optim)
    job.logger = trackers
    torch.manual_seed(settings.seed)
    job.peft, job.compile, job.evaluation = (instantiate(cfg, g) for g in ("peft", "compile", "evaluation"))
    engine.check_evaluation(job.evaluation)
    job.corpus = instantiate(cfg, "data")
    job.compile.check(job.corpus)  # CUDA graphs: fixed shapes only
    checkpointing = instantiate(cfg, "checkpointing")  # activation checkpointing (not state)
    model = instantiate(cfg, "model")
    getattr(model, "check_data", lambda corpus: None)(job.corpus)  # vocabulary, labels (looplib.hf)
    check_sequences_fit(job.corpus, model)
    model = checkpointing.apply(precision.convert(job.peft.wrap(model)))  # fp8: Float8Linear
    job.model = engine.setup(model)
    if settings.batch_size == "auto":  # the largest micro-batch that fits, then accumulation
        # probed eager, before compiling: probing a compiled model with several batch sizes would
        # leave it a dynamic-shape graph (slower kernels) for the size finally chosen
        autobatch.resolve(job, reserve_bytes=optimizer_state_bytes(job, default=0))
    job.model = job.compile.wrap(job.model)  # compile last: it sees the final module
    job.objective = job.compile.wrap_loss(job.objective)  # compile.loss=true: forward + loss, one graph
    return job


def run(job: Job, run_dir: Path, signals: Signals | None = None) -> TrainState:
    s, engine, signals = job.settings, job.engine, signals or Signals()
    run_dir.mkdir(parents=True, exist_ok=True)
    config_yaml = OmegaConf.to_yaml(job.cfg, resolve=True)
    loader_args = dict(OmegaConf.to_container(job.cfg.loader, resolve=True))
    collate = getattr(job.corpus, "collate", None)  # padded data: the corpus pads each batch
    with blame("loader"):
        train = build_loader(job.corpus.train, batch_size=s.batch_size, seed=s.seed, device=engine.device,
                             rank=engine.rank, world=engine.world_size, collate_fn=collate, **loader_args)
    epochs, state = Epochs(train), TrainState()  # training data that yields no batch is refused here
    held_out = build_loader(job.corpus.eval, batch_size=s.batch_size, seed=s.seed, shuffle=False,
                            device=engine.device, collate_fn=collate)
    eval_batches = [b for _, b in zip(range(s.eval_batches), held_out)]
    if s.eval_batches and not eval_batches:
        log.warning("the held-out split yields no batch (%d sequences for batch_size=%d): no evaluation",
                    len(job.corpus.eval), s.batch_size)
    with blame("optim", job.cfg):
        optimizer = job.optim.build(job.model)
    with blame("schedule", job.cfg):
        scheduler = job.schedule.build(optimizer, s.max_steps)
    job.model, optimizer, job.precision, max_grad_norm = engine.prepare(job.model, optimizer, job.precision, s)
    ckpt = job.cfg.checkpoint
    root = run_dir / "checkpoints" if ckpt.get("enabled", True) else None  # checkpoint.enabled=false: none
    checkpoints = Checkpoints(root, ckpt.every_steps, ckpt.keep, s.max_bad_steps,
                              config_yaml, engine.is_main, engine, check_every=s.log_every)
    checkpoints.bind(model=job.model, optimizer=optimizer, scheduler=scheduler,
                     precision=job.precision, epochs=epochs, preemption=signals)
    logged = loggers.logged_steps(run_dir / "metrics.jsonl") if s.resume else {}  # before resume() cuts it
    if s.resume:
        resume(checkpoints, state, s.resume, run_dir)
    if engine.is_main:
        write_atomic(run_dir / "config.yaml", config_yaml)
        if hasattr(job.corpus, "save"):
            job.corpus.save(run_dir)  # e.g. labels.json
    telemetry = Telemetry(run_dir / "metrics.jsonl", log_every=s.log_every, total_steps=s.max_steps,
                          device=engine.device, enabled=engine.is_main, progress=s.progress,
                          **mfu_settings(job), logger=job.logger if engine.is_main else None,
                          run=loggers.describe(job.cfg, run_dir, state.step, logged))
    telemetry.resumed_from = state.step or None
    telemetry.reduce_loss = engine.mean_across_ranks  # logged losses: the mean over every rank
    telemetry.items = getattr(job.objective, "items", "tokens")  # tokens/s, or sequences/s
    n_params = sum(p.numel() for p in job.model.parameters())
    log.info("training %s (%.2fM parameters) on %s: steps %d-%d of %d x %d sequences, precision %s, "
             "optimizer %s", type(job.model).__name__, n_params / 1e6, engine.device, state.step + 1,
             s.max_steps, s.batch_size, s.accum_steps,
             getattr(job.precision, "name", type(job.precision).__name__), type(optimizer).__name__)
    first_step = state.step  # a resumed run that had already finished evaluates nothing again
    with signals.deferred():  # from here a signal saves at the next step boundary (see looplib.signals)
        try:
            fit(job.model, epochs, objective=job.objective, optimizer=optimizer, scheduler=scheduler,
                precision=job.precision, accumulation=Accumulation(s.accum_steps), engine=engine,
                max_steps=s.max_steps, max_grad_norm=max_grad_norm, telemetry=telemetry,
                eval_data=eval_batches or None, eval_every=s.eval_every, evaluator=job.evaluation,
                checkpoints=checkpoints, state=state)
            if state.preempted:
                telemetry.finish("preempted", loggers.artefacts(run_dir))
                report_stop(signals, state, run_dir, saved=checkpoints.root is not None, main=engine.is_main)
                return state
            if eval_batches and not (s.eval_every and state.step % s.eval_every == 0) and state.step > first_step:
                telemetry.eval(state.step, job.evaluation(job.model, eval_batches, job.objective,
                                                          job.precision, engine))
            checkpoints.finish(state)  # the bad-step rule once more, then the final checkpoint
            if job.compile.report():  # compile_s: seconds spent compiling (forward and backward)
                telemetry.write({"step": state.step, **job.compile.report()})
            # model.safetensors, or hf/ for a transformers model (every rank: ZeRO-3 gathers), or the adapter
            job.peft.save(job.model, run_dir, engine, job.corpus)
            telemetry.finish("finished", loggers.artefacts(run_dir))
        finally:
            telemetry.close()  # trackers not finished above end as failed
        if s.sample_tokens and hasattr(engine.unwrap(job.model), "generate") and not signals.requested:
            print_sample(job, s.sample_tokens)  # every rank generates (ZeRO-3 gathers), rank 0 prints
    log.info("done: %s", run_dir)
    return state


def report_stop(signals: Signals, state: TrainState, run_dir: Path, saved: bool, main: bool) -> None:
    """The run stopped early on a signal, after saving: say how to continue (rank 0 only)."""
    if not main:
        return
    what = "interrupted (Ctrl-C)" if signals.status == EXIT_INTERRUPTED else f"preempted ({signals.name})"
    if not saved:
        log.warning("%s at step %d: checkpoint.enabled=false, so nothing was saved; exit %d", what, state.step,
                    signals.status)
        return
    log.warning("%s at step %d: checkpoint saved; exit %d. Continue with: python -m looplib.train ... "
                "resume=auto hydra.run.dir=%s", what, state.step, signals.status, run_dir)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def resume(checkpoints: Checkpoints, state: TrainState, where: str, run_dir: Path) -> None:
    """``resume=auto``: the newest valid checkpoint of this run directory (none: start afresh);
    ``resume=PATH``: a checkpoint, or a run directory holding some. Invalid checkpoints (see
    ``state.inspect_checkpoint``) are skipped with a warning, or refused when named directly."""
    found: dict = {}
    try:
        path = checkpoints.find(run_dir if where == "auto" else Path(where), found)
    except InvalidCheckpoint as err:
        raise ConfigError("resume", f"{where} is not a valid checkpoint: {err}",
                          "give a complete checkpoint (.../checkpoints/step-N) or a run directory, or use "
                          "resume=auto") from None
    if path is None:
        if where != "auto":
            raise ConfigError("resume", f"no valid checkpoint at {where}",
                              "give a checkpoint directory (.../checkpoints/step-N) or a run directory")
        log.warning("resume=auto: no valid checkpoint in %s yet, starting at step 0 (to continue an earlier "
                    "run, pass its directory: hydra.run.dir=...)", run_dir)
    else:
        accepted = checkpoints.load(path, state, found.get(path))
        log.info("resumed from %s at step %d (epoch %d, batch %d)%s", path, state.step, state.epoch,
                 state.batches_seen, "; changed: " + ", ".join(accepted) if accepted else "")
    metrics = run_dir / "metrics.jsonl"  # (a run killed before its first checkpoint restarts at 0)
    if checkpoints.is_main and metrics.exists():  # rows past the checkpoint came from the run that died
        import json
        rows = []
        for line in metrics.read_text().splitlines():
            try:
                if line.strip() and json.loads(line).get("step", 0) <= state.step:
                    rows.append(line)
            except (ValueError, AttributeError):  # a row cut short by a kill: dropped
                pass
        write_atomic(metrics, "".join(row + "\n" for row in rows))


def mfu_settings(job: Job) -> dict:
    """FLOPs of one training sample (bundled models know theirs) and the device's peak."""
    flops = getattr(job.engine.unwrap(job.model), "flops_per_sequence", None)
    precision = getattr(job.precision, "name", "fp32")
    return {"flops_per_sample": flops() if flops else None,
            "peak_flops": peak_flops(job.engine.device, precision, job.settings.peak_tflops)}


def print_sample(job: Job, n_tokens: int) -> None:
    prompt = job.corpus.sample_prompt() if hasattr(job.corpus, "sample_prompt") else "def "
    ids = torch.tensor([job.corpus.encode(prompt)], device=job.engine.device)
    gen = torch.Generator(job.engine.device).manual_seed(job.settings.seed)
    with job.precision.autocast():
        out = job.engine.unwrap(job.model).generate(ids, n_tokens, generator=gen)
    text = job.corpus.decode(out[0].tolist())
    if job.engine.is_main:
        print(f"\n--- a sample from the trained model ---\n{text}\n---", flush=True)


def say(line: str) -> None:
    """One line on stderr, from one rank (every rank finds the same error)."""
    if launched_rank() == 0:
        print(line, file=sys.stderr, flush=True)


def execute(cfg: DictConfig, run_dir: Path, signals: Signals) -> int:
    """Build and run the job; every way it can end becomes one line and an exit status."""
    fresh = False
    try:
        fresh = not rundir.results(run_dir)  # held nothing before this run (RunDirGuard refused otherwise)
        job = build_job(cfg)
        shared = job.engine.shared_run_dir(run_dir)  # rank 0's: one directory per run, not per rank
        if shared != run_dir:
            rundir.forget(run_dir, fresh=True)  # this rank's scratch directory
            run_dir, fresh = shared, fresh and not rundir.results(shared)
        state = run(job, run_dir, signals)
    except ConfigError as err:  # found before training: nothing of this run stays behind
        signals.finish()
        say(f"looplib: error: {err}")
        rundir.forget(run_dir, fresh and not signals.training)
        return EXIT_CONFIG
    except NumericError as err:
        signals.finish()
        say(f"looplib: stopped: {err}")
        return EXIT_NUMERIC
    except SaveError as err:
        signals.finish()
        say(f"looplib: error: {err}; the last complete checkpoint stays (resume=auto continues from it)")
        return EXIT_IO
    except Interrupted as sig:
        signals.finish()
        if signals.training:  # a second Ctrl-C while training
            say(f"looplib: stopped at once ({sig}); the last complete checkpoint stays. Continue with: "
                f"python -m looplib.train ... resume=auto hydra.run.dir={run_dir}")
        else:
            say(f"looplib: stopped ({sig}) before training started; nothing was saved")
            rundir.forget(run_dir, fresh)
        return sig.status
    status = signals.status if state.preempted else 0
    signals.finish()
    job.engine.close()  # a collective (DDP, DeepSpeed): only when every rank got here
    return status


@hydra.main(version_base="1.3", config_path="pkg://looplib.conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    signals = Signals().__enter__()  # not restored: a late signal (a launcher's) must not kill the exit
    status = sweep.job(lambda: execute(cfg, run_dir, signals))  # in a sweep, a crash is a failed trial
    signals.finish()                 # from here on a signal changes nothing
    rundir.write_exit_status(status)
    return sweep.outcome(cfg, run_dir, status, signals)  # the objective for a sweeper; exits on failure


if __name__ == "__main__":
    sys.argv = strip_launcher_args(sys.argv)  # deepspeed --module looplib.train adds --local_rank=N
    main()
