"""One assembly: the strategy objects of a job -> a ready run -> the loop -> the run directory.

Every way in builds the same run through this module:

    python -m looplib.train ...      Hydra instantiates the config groups (looplib.train), then this
    train_model(model, data, ...)    the same objects given in Python (looplib.api), then this
    batch_size=auto, looplib.tune    probe and measure through the same pieces

``build(parts, settings, record)`` checks and sets up, in the order the command line always
used: the precision on the device, the engine's checks, the adapter, the precision's
conversion, activation checkpointing, the engine's setup, ``batch_size=auto``, compile.
``run(job, run_dir)`` makes the optimizer, schedule and loaders, lets the engine prepare them,
binds the checkpoints, resumes, starts telemetry and trackers, calls ``looplib.fit``, evaluates
a last time, saves the final checkpoint and exports. Every way a run ends is a return value
(``Trained``; ``state.preempted`` after a signal, saved) or an exception (``ConfigError``,
``NumericError``, ``SaveError``, ``Interrupted``): the command line turns them into exit
statuses, the Python API lets them through.
"""
from __future__ import annotations

import json
import logging
import shlex
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from . import autobatch
from .accumulation import Accumulation
from .peft import FullModel
from .checkpointing import Checkpointing
from .compile import Compile
from .data import Corpus, Epochs, build_loader
from .data.loading import small_data
from .engines import Engine
from .errors import ConfigError
from .evaluation import Evaluation
from .loggers import Logger, Run, artefacts, logged_steps
from .loop import fit
from .loss import TokenCrossEntropy
from .optim import AdamW, OptimizerFactory, Schedule
from .precision import Precision
from .plots import end_of_run_plot
from .settings import Settings
from .signals import EXIT_INTERRUPTED, Signals
from .checkpoint_files import write_atomic
from .checkpoints import Checkpoints
from .resume import resume
from .train_state import TrainState
from .telemetry import Telemetry, peak_flops

log = logging.getLogger("looplib")


@dataclass
class Parts:
    """The strategy objects of one job: each is what a config group builds (``conf/<group>/``);
    one left out is that group's plain-PyTorch default."""
    model: nn.Module
    data: Corpus                                   # train and held-out splits (looplib.data.Corpus)
    objective: TokenCrossEntropy = field(default_factory=TokenCrossEntropy)   # group loss
    precision: Precision = field(default_factory=Precision)
    optim: OptimizerFactory = field(default_factory=AdamW)
    schedule: Schedule = field(default_factory=Schedule)
    engine: Engine | None = None                   # None: the local engine on settings.device
    peft: FullModel = field(default_factory=FullModel)
    compile: Compile = field(default_factory=Compile)
    evaluation: Evaluation = field(default_factory=Evaluation)
    checkpointing: Checkpointing = field(default_factory=Checkpointing)   # activations, not saved state
    logger: Logger = field(default_factory=Logger)


def as_json(config: dict) -> str:
    return json.dumps(config, indent=1) + "\n"  # JSON is YAML too: config.yaml reads back either way


@dataclass
class Record:
    """What a run says about itself: the config saved as config.yaml and in every checkpoint
    (compared on resume), sent to trackers as hyperparameters."""
    config: dict                       # plain values
    render: Callable[[dict], str] = as_json  # config.yaml's text (the CLI writes YAML)
    name: str = ""                     # trackers' run name ("": the run directory's name)
    group: str | None = None           # a sweep's directory (trackers group its jobs)
    resume_hint: str = "resume=auto"   # how to continue, said after a signal ({run_dir} is filled in)
    origins: dict[str, str] = field(default_factory=dict)  # group -> " (Class, from group=option)"

    @property
    def text(self) -> str:
        return self.render(self.config)


@dataclass
class Job:
    """A built run: the parts after ``build`` (model set up on the engine, adapters, compile)."""
    settings: Settings
    record: Record
    engine: Engine
    model: nn.Module
    data: Corpus
    objective: TokenCrossEntropy
    precision: Precision
    optim: OptimizerFactory
    schedule: Schedule
    peft: FullModel
    compile: Compile
    evaluation: Evaluation
    logger: Logger


@dataclass
class Trained:
    model: nn.Module                 # on the device; wrapped by the engine, compile, or peft when chosen
    optimizer: torch.optim.Optimizer
    scheduler: Any
    state: TrainState                # ``state.preempted``: stopped by a signal, after saving
    eval_loss: float | None          # on the held-out data after the last step (None without any)
    run_dir: Path | None = None      # None: no run directory (train_model without run_dir)
    last_row: dict = field(default_factory=dict)  # the last value of every metric logged


@contextmanager
def refused(group: str, record: Record):
    """A library's ``ValueError``/``TypeError`` while building ``group``'s object becomes the one
    line naming the group (and the option that chose its class)."""
    try:
        yield
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:
        reason = " ".join(str(err).split()) or type(err).__name__
        raise ConfigError(group, f"{group}{record.origins.get(group, '')} was refused: {reason}",
                          f"check the {group} settings") from None


def check_sequences_fit(corpus: Any, model: Any) -> None:
    """A training sample longer than the model's ``seq_len`` would fail in the first forward pass
    (position embeddings run out): refuse it now. Models and data without these are not asked."""
    limit = getattr(model, "seq_len", None)
    try:
        length = corpus.train[0]["input_ids"].shape[-1] if len(corpus.train) else 0
    except (AttributeError, IndexError, KeyError, TypeError):
        return
    if isinstance(limit, int) and length > limit:
        raise ConfigError("data.seq_len", f"the data's sequences hold {length} tokens, more than model.seq_len={limit}",
                          "leave data.seq_len as ${model.seq_len}, or make model.seq_len at least as long")


def check(settings: Settings, engine: Engine | None, precision: Precision, optim: OptimizerFactory,
          evaluation: Evaluation) -> Engine:
    """The checks between strategies that need no data and no model (so bad input fails before a
    tokenizer is trained or a model is built): the precision on the engine's device, the engine
    with the precision and optimizer, the held-out evaluation. Returns the engine (None: local)."""
    engine = engine or Engine(settings.device)
    precision.setup(engine.device)
    engine.check(settings, precision, optim)
    engine.check_evaluation(evaluation)
    return engine


def build(parts: Parts, settings: Settings, record: Record) -> Job:
    """Check the data against the model and set the parts up (``check`` has passed: ``parts.engine``
    is its engine). ``batch_size=auto`` is resolved here: ``settings`` and ``record`` then hold the
    chosen micro-batch and accumulation."""
    engine = parts.engine
    parts.compile.check(parts.data)  # CUDA graphs: fixed shapes only
    check_data = getattr(parts.model, "check_data", None)  # a model may check the data (looplib.hf)
    if check_data is not None:
        check_data(parts.data)
    check_sequences_fit(parts.data, parts.model)
    model = parts.checkpointing.apply(parts.precision.convert(parts.peft.wrap(parts.model)))  # fp8: Float8Linear
    job = Job(settings, record, engine, engine.setup(model), parts.data, parts.objective, parts.precision,
              parts.optim, parts.schedule, parts.peft, parts.compile, parts.evaluation, parts.logger)
    if settings.batch_size == "auto":  # the largest micro-batch that fits, then accumulation
        # probed eager, before compiling: probing a compiled model with several batch sizes would
        # leave it a dynamic-shape graph (slower kernels) for the size finally chosen
        from .plan import optimizer_state_bytes  # the planner (and OmegaConf) only when asked
        settings.batch_size, settings.accum_steps = autobatch.resolve(job, optimizer_state_bytes(job, default=0))
        record.config.update(batch_size=settings.batch_size, accum_steps=settings.accum_steps)
    job.model = job.compile.wrap(job.model)  # compile last: it sees the final module
    job.objective = job.compile.wrap_loss(job.objective)  # compile.loss=true: forward + loss, one graph
    return job


def run(job: Job, run_dir: Path | None, signals: Signals | None = None, metrics: Path | None = None,
        export: bool = True) -> Trained:
    """Train ``job``, writing into ``run_dir`` (metrics.jsonl, config.yaml, checkpoints/, the
    exported weights unless ``export`` is False); ``run_dir=None`` writes nothing but ``metrics``.
    However it ends, the precision puts back what it changed in the process (TF32's flags)."""
    try:
        return train(job, run_dir, signals, metrics, export)
    finally:
        job.precision.close()


def train(job: Job, run_dir: Path | None, signals: Signals | None, metrics: Path | None, export: bool) -> Trained:
    s, engine, signals = job.settings, job.engine, signals or Signals()
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        metrics = run_dir / "metrics.jsonl"
    collate = job.data.collate  # padded data: the corpus pads each batch
    with refused("loader", job.record):
        train = build_loader(job.data.train, batch_size=s.batch_size, seed=s.seed, device=engine.device,
                             rank=engine.rank, world=engine.world_size, collate_fn=collate, **vars(s.loader))
    epochs, state = Epochs(train), TrainState()  # training data that yields no batch is refused here
    micro_batch = small_data(len(job.data.train) if hasattr(job.data.train, "__len__") else None,
                             s.batch_size, s.accum_steps, engine.world_size)  # warned when the data is smaller
    eval_batches = held_out(job)
    with refused("optim", job.record):
        optimizer = job.optim.build(job.model)
    with refused("schedule", job.record):
        scheduler = job.schedule.build(optimizer, s.max_steps)
    job.model, optimizer, job.precision, max_grad_norm = engine.prepare(job.model, optimizer, job.precision, s)
    saving = run_dir is not None and s.checkpoint.enabled  # checkpoint.enabled=false: none at all
    checkpoints = Checkpoints(run_dir / "checkpoints" if saving else None, s.checkpoint.every_steps, s.checkpoint.keep,
                              s.max_bad_steps, job.record.text if run_dir else "", engine.is_main, engine,
                              check_every=s.log_every)
    checkpoints.bind(model=job.model, optimizer=optimizer, scheduler=scheduler,
                     precision=job.precision, epochs=epochs, preemption=signals)
    logged = logged_steps(metrics) if s.resume and metrics else {}  # before resume() cuts the rows
    if s.resume:  # the Python API refuses resume without run_dir before building anything
        resume(checkpoints, state, s.resume, run_dir)
    if engine.is_main and run_dir is not None:
        write_atomic(run_dir / "config.yaml", job.record.text)
        job.data.save(run_dir)  # e.g. labels.json
    telemetry = Telemetry(metrics, log_every=s.log_every, total_steps=s.max_steps, device=engine.device,
                          enabled=engine.is_main, progress=s.progress, **mfu_settings(job),
                          logger=job.logger if engine.is_main else None,
                          run=Run(run_dir or Path(metrics or ".").parent, job.record.config,
                                  job.record.name or (run_dir or Path.cwd()).name, job.record.group,
                                  state.step, logged if state.step else {}))
    telemetry.resumed_from = state.step or None
    telemetry.reduce_loss = engine.mean_across_ranks  # logged losses: the mean over every rank
    telemetry.items = getattr(job.objective, "items", "tokens")  # tokens/s, or sequences/s (a user's own objective)
    ranks = f" x {engine.world_size} processes" if engine.world_size > 1 else ""  # batch_size is per process
    log.info("training %s (%.2fM parameters) on %s: steps %d-%d of %d x %d sequences%s, precision %s, "
             "optimizer %s", type(engine.unwrap(job.model)).__name__,
             sum(p.numel() for p in job.model.parameters()) / 1e6, engine.device, state.step + 1, s.max_steps,
             micro_batch, s.accum_steps, ranks, job.precision.name, type(optimizer).__name__)
    first_step = state.step  # a resumed run that had already finished evaluates nothing again
    trained = Trained(job.model, optimizer, scheduler, state, None, run_dir, telemetry.last_row)
    with signals.deferred():  # from here a signal saves at the next step boundary (see looplib.signals)
        try:
            fit(job.model, epochs, objective=job.objective, optimizer=optimizer, scheduler=scheduler,
                precision=job.precision, accumulation=Accumulation(s.accum_steps), engine=engine,
                max_steps=s.max_steps, max_grad_norm=max_grad_norm, telemetry=telemetry,
                eval_data=eval_batches or None, eval_every=s.eval_every, evaluator=job.evaluation,
                checkpoints=checkpoints, state=state)
            trained.model = job.model
            if state.preempted:
                telemetry.finish("preempted", artefacts(run_dir) if run_dir else {})
                report_stop(signals, state, job.record, run_dir, saved=checkpoints.root is not None,
                            main=engine.is_main)
                return trained
            if eval_batches and not (s.eval_every and state.step % s.eval_every == 0) and state.step > first_step:
                telemetry.eval(state.step, job.evaluation(job.model, eval_batches, job.objective,
                                                          job.precision, engine))
            checkpoints.finish(state)  # the bad-step rule once more, then the final checkpoint
            if job.compile.report():  # compile_s: seconds spent compiling (forward and backward)
                telemetry.write({"step": state.step, **job.compile.report()})
            if run_dir is not None and export:  # model.safetensors, hf/ for a transformers model, or the adapter
                job.peft.save(job.model, run_dir, engine, job.data)  # every rank: ZeRO-3 and FSDP gather
            telemetry.finish("finished", artefacts(run_dir) if run_dir else ({"metrics": str(metrics)} if metrics else {}))
        finally:
            telemetry.close()  # trackers not finished above end as failed
        if engine.is_main and run_dir is not None:
            end_of_run_plot(run_dir)  # loss.png, with matplotlib (LOOPLIB_PLOT=0: none)
        if s.sample_tokens and hasattr(engine.unwrap(job.model), "generate") and not signals.requested:
            with signals.at_once():  # a signal stops the sample at once; the run ends as finished
                print_sample(job, s.sample_tokens, run_dir)  # every rank generates (ZeRO-3 gathers), rank 0 prints
    trained.eval_loss = telemetry.last_row.get("eval_loss")
    if run_dir is not None:
        log.info("done: %s", run_dir)
    return trained


def held_out(job: Job) -> list:
    """The first ``eval_batches`` batches of the held-out split (the same ones at every evaluation)."""
    s, engine = job.settings, job.engine
    if not s.eval_batches or job.data.eval is None:
        return []
    loader = build_loader(job.data.eval, batch_size=s.batch_size, seed=s.seed, shuffle=False,
                          device=engine.device, collate_fn=job.data.collate)
    batches = [b for _, b in zip(range(s.eval_batches), loader)]
    if not batches:
        log.warning("the held-out split yields no batch (%d sequences for batch_size=%d): no evaluation",
                    len(job.data.eval), s.batch_size)
    return batches


def report_stop(signals: Signals, state: TrainState, record: Record, run_dir: Path | None, saved: bool,
                main: bool) -> None:
    """The run stopped early on a signal, after saving: say how to continue (rank 0 only)."""
    if not main:
        return
    if signals.signum is None and signals.reason:  # the run's own stop (a sweep's pruner): nothing to continue
        log.warning("stopped at step %d: %s%s", state.step, signals.reason, "; checkpoint saved" if saved else "")
        return
    what = "interrupted (Ctrl-C)" if signals.status == EXIT_INTERRUPTED else f"preempted ({signals.name})"
    if not saved:
        log.warning("%s at step %d: no checkpoints (checkpoint.enabled=false or no run directory), so nothing "
                    "was saved", what, state.step)
        return
    log.warning("%s at step %d: checkpoint saved. Continue with: %s", what, state.step,
                record.resume_hint.format(run_dir=shlex.quote(str(run_dir))))


def mfu_settings(job: Job) -> dict:
    """FLOPs of one training sample (bundled models know theirs) and the device's peak."""
    flops = getattr(job.engine.unwrap(job.model), "flops_per_sequence", None)
    return {"flops_per_sample": flops() if flops else None,
            "peak_flops": peak_flops(job.engine.device, job.precision.name, job.settings.peak_tflops)}


def print_sample(job: Job, n_tokens: int, run_dir: Path | None = None) -> None:
    """A sample from the trained model: printed, and saved as ``<run dir>/sample.txt``."""
    log.info("sampling %d tokens from the trained model", n_tokens)
    prompt = job.data.sample_prompt()
    ids = torch.tensor([job.data.encode(prompt)], device=job.engine.device)
    gen = torch.Generator(job.engine.device).manual_seed(job.settings.seed)
    with job.precision.autocast():
        out = job.engine.unwrap(job.model).generate(ids, n_tokens, generator=gen)
    text = job.data.decode(out[0].tolist())
    if job.engine.is_main:
        print(f"\n--- a sample from the trained model ---\n{text}\n---", flush=True)
        if run_dir is not None:
            write_atomic(run_dir / "sample.txt", text + "\n")
