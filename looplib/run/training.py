"""Training a built job: loaders, optimizer, schedule, the engine's preparation, resume,
telemetry and trackers, ``looplib.fit``, a last evaluation, the final checkpoint, the export
and the end-of-run sample. ``looplib.run.session.Session`` calls it once the job is built.
"""
from __future__ import annotations

import logging
import shlex
import time
from pathlib import Path

import torch

from ..accumulation import Accumulation
from ..atomic import write_atomic
from ..data import Epochs, build_loader, held_out as held_out_batches, identity
from ..data.loading import small_data
from ..process.launcher import launcher
from ..errors import EXIT_INTERRUPTED
from ..loggers import JsonLines, Run, logged_steps
from ..loop import fit
from ..telemetry import Telemetry, peak_flops
from ..train_state import TrainState
from .assembly import Job, Record, Trained, parameter_counts, refused
from ..store.checkpoint_dir import config_text, seed_host_rngs
from .plots import end_of_run_plot
from ..store.elastic import current
from ..store.export import write_exports
from ..store.resume import Resumed, resume
from ..store.rundir import artefacts
from ..store.saving import Checkpoints
from .signals import Signals

log = logging.getLogger("looplib")
DRAIN_S = 120.0  # how long a run that crashed waits for its checkpoint write in flight (checkpoint.async)


def train(job: Job, run_dir: Path | None, signals: Signals | None = None, metrics: Path | None = None,
          export: bool = True, resumed: Resumed | None = None) -> Trained:
    """Train ``job``, writing into ``run_dir`` (metrics.jsonl, config.yaml, checkpoints/, the
    exported weights unless ``export`` is False); ``run_dir=None`` writes nothing but ``metrics``.
    ``resumed``: the checkpoint to continue from, found before the job was built (``resume.plan``)."""
    s, engine, signals = job.settings, job.engine, signals or Signals()
    seed_host_rngs(s.seed)  # before anything draws from them (a resume then restores the saved states)
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        metrics = run_dir / "metrics.jsonl"
    collate = job.data.collate  # padded data: the corpus pads each batch
    with refused("loader", job.record):
        train = build_loader(job.data.train, batch_size=s.batch_size, seed=s.seed, device=engine.device,
                             rank=engine.rank, world=engine.world_size, collate_fn=collate, **vars(s.loader))
    rollouts = getattr(job.objective, "rollouts", None)
    if rollouts is not None:  # loss=grpo: the prompts' completions, sampled from the current policy (looplib.grpo)
        train = rollouts(train, lambda: job.model, job.reward, job.data, engine, job.precision, s.seed)
    epochs, state = Epochs(train), TrainState()  # training data that yields no batch is refused here
    micro_batch = small_data(len(job.data.train) if hasattr(job.data.train, "__len__") else None,
                             s.batch_size, s.accum_steps, engine.world_size)  # warned when the data is smaller
    eval_set = held_out(job)
    with refused("optim", job.record):
        optimizer = job.optim.build(job.model)
    optimizer_name = type(optimizer).__name__  # the header names it, not the engine's adapter around it (DeepSpeed)
    with refused("schedule", job.record):
        scheduler = job.schedule.build(optimizer, s.max_steps)
    job.model, optimizer, max_grad_norm = engine.prepare(job.model, optimizer, s)
    job.compile.compile_step(optimizer)  # compile.optimizer=true: its step compiled for the loop's clip_and_step
    saving = run_dir is not None and s.checkpoint.enabled  # checkpoint.enabled=false: none at all
    checkpoints = Checkpoints(run_dir / "checkpoints" if saving else None, s.checkpoint.every_steps, s.checkpoint.keep,
                              s.max_bad_steps, job.record.config if run_dir else None, engine.is_main, engine,
                              check_every=s.log_every, asynchronous=s.checkpoint.asynchronous)
    checkpoints.bind(model=job.model, optimizer=optimizer, scheduler=scheduler,
                     precision=job.precision, epochs=epochs, preemption=signals)
    geometry = current(engine, s.batch_size, s.accum_steps)
    checkpoints.geometry = geometry.as_dict()  # what a resume may change
    checkpoints.identity = getattr(job.data, "fingerprint", lambda: None)()  # kept in every checkpoint, compared on resume
    taught = getattr(job.objective, "fingerprint", lambda: None)()  # loss=distill: its teacher's weights, compared too
    if taught is not None:
        checkpoints.identity = {**(checkpoints.identity or {}), "teacher": taught}
    reference = getattr(job.objective, "identity", None)  # DPO's reference: its weights' digest or precomputed cache key
    if isinstance(reference, dict):
        checkpoints.identity = {**(checkpoints.identity or {}), "reference": reference}
    checkpoints.files = identity.checkpoint_files(job.data, checkpoints.identity)
    logged = logged_steps(metrics) if s.resume and metrics else {}  # before resume() cuts the rows
    if s.resume:  # the Python API refuses resume without run_dir before building anything
        resume(checkpoints, state, s.resume, run_dir, s.max_steps, resumed)
        saved_max = ((resumed.checked or {}).get("config") or {}).get("max_steps") if resumed and resumed.path else None
        said = getattr(job.schedule, "moved", None)  # (a schedule of the user's own may have no such verb)
        moved = said(state.step, saved_max, s.max_steps) if said and saved_max and state.step else None
        if moved and engine.is_main:  # the schedule's own curve (one voice), said rather than left to a changed key
            log.warning("resume: %s", moved)
    windows = getattr(job.objective, "accumulation", None)  # loss.updates_per_rollout: each window trained that often
    accumulation = windows(s.accum_steps, state, engine) if windows else Accumulation(s.accum_steps)  # (after resume)
    if engine.is_main and run_dir is not None:
        # what ran, and on how many processes by which launcher: a sweep's trials, a report, a study compare it
        write_atomic(run_dir / "config.yaml", config_text({**job.record.config, "launch": launched(geometry)}))
        job.data.save(run_dir)  # e.g. labels.json
    telemetry = Telemetry(metrics, log_every=s.log_every, total_steps=s.max_steps, device=engine.device,
                          enabled=engine.is_main, progress=s.progress, **mfu_settings(job),
                          logger=job.logger if engine.is_main else None,
                          run=Run(run_dir or Path(metrics or ".").parent, job.record.config,
                                  job.record.name or (run_dir or Path.cwd()).name, job.record.group,
                                  state.step, logged if state.step else {}))
    telemetry.resumed_from = state.step or None
    telemetry.reduce_loss = engine.ranks.mean  # logged losses: the mean over every rank
    telemetry.items = getattr(job.objective, "items", "tokens")  # tokens/s, or sequences/s (a user's own objective)
    if hasattr(job.objective, "train_metrics"):  # e.g. DPO's rewards, summed over every rank (a collective)
        job.objective.train_metrics()  # this rank's tally so far dropped (batch_size=auto's probes: not training)
        telemetry.objective_metrics = lambda: job.objective.train_metrics(reduce=engine.ranks.sum)
    telemetry.compiled = job.compile.report  # compile_s so far on every row: recompiles show where they happen
    dropout = max((m.p for m in job.model.modules() if isinstance(m, torch.nn.Dropout)), default=0.0)
    telemetry.about = {"dropout": dropout} if dropout else {}  # its masks change with the micro-batch (looplib.tune)
    telemetry.about.update({k: launched(geometry)[k] for k in ("launcher", "world_size", "global_batch")})
    ranks = f" x {engine.world_size} processes" if engine.world_size > 1 else ""  # batch_size is per process
    total, trained_count, four_bit = getattr(job, "counts", None) or parameter_counts(job.model)  # before sharding
    if state.step >= s.max_steps:  # a finished run whose weights were never written (looplib.store.resume.check_steps)
        log.info("nothing left to train (step %d of %d): writing the end of the run", state.step, s.max_steps)
    else:
        log.info("training %s (%.2fM parameters%s) on %s: steps %d-%d of %d x %d %s%s, precision %s, "
                 "optimizer %s", getattr(job, "model_name", None) or type(engine.unwrap(job.model)).__name__,
                 total / 1e6, (f", {trained_count / 1e6:.2f}M trained" if trained_count < total else "") +
                 (f", the base's {four_bit / 1e6:.2f}M held in 4 bits" if four_bit else ""), engine.device,
                 state.step + 1, s.max_steps, micro_batch, s.accum_steps,
                 "pairs" if getattr(job.objective, "pairs", False) else
                 "prompts" if hasattr(job.objective, "rollouts") else "sequences", ranks, job.precision.name,
                 optimizer_name)
    first_step = state.step  # a resumed run that had already finished evaluates nothing again
    trained = Trained(job.model, optimizer, scheduler, state, None, run_dir, telemetry.last_row)
    with signals.deferred():  # from here a signal saves at the next step boundary (see looplib.run.signals)
        try:
            fit(job.model, epochs, objective=job.objective, optimizer=optimizer, scheduler=scheduler,
                precision=job.precision, accumulation=accumulation, engine=engine,
                max_steps=s.max_steps, max_grad_norm=max_grad_norm, telemetry=telemetry,
                eval_data=eval_set or None, eval_every=s.eval_every, evaluator=job.evaluation,
                checkpoints=checkpoints, state=state, compile=job.compile)
            trained.model = job.model
            if state.preempted:
                telemetry.finish("preempted", artefacts(run_dir) if run_dir else {})
                report_stop(signals, state, job.record, run_dir, saved=checkpoints.root is not None,
                            main=engine.is_main)
                return trained
            if eval_set and not (s.eval_every and state.step % s.eval_every == 0) and state.step > first_step:
                t0 = time.perf_counter()
                loss = job.evaluation(job.model, eval_set, job.objective, job.precision, engine)
                telemetry.eval(state.step, loss, seconds=time.perf_counter() - t0)
            checkpoints.finish(state)  # the bad-step rule once more, then the final checkpoint
            # the run's one-off costs: compile_s (forward and backward, recompiles), checkpoint_s (the time
            # every save held the loop up) and, with checkpoint.async, checkpoint_write_s (written meanwhile)
            saved = {"checkpoint_s": round(sum(checkpoints.save_seconds), 3),
                     "checkpoints": len(checkpoints.save_seconds)} if checkpoints.save_seconds else {}
            if checkpoints.write_seconds:
                saved["checkpoint_write_s"] = round(sum(checkpoints.write_seconds), 3)
            if job.compile.report() or saved:
                telemetry.write({"step": state.step, **job.compile.report(), **saved})
            if run_dir is not None and export:  # model.safetensors, hf/ for a transformers model, or the adapter
                write_exports(job.model, run_dir, job.peft.exports(), engine, job.data)  # every rank (gathers)
            telemetry.finish("finished", artefacts(run_dir) if run_dir else ({"metrics": str(metrics)} if metrics else {}))
        except BaseException:
            checkpoints.drain(timeout=DRAIN_S)  # a write in flight ends before the run lets its directory go
            raise
        finally:
            telemetry.close()  # trackers not finished above end as failed
        if engine.is_main and run_dir is not None:
            end_of_run_plot(run_dir)  # loss.png, with matplotlib (LOOPLIB_PLOT=0: none)
        if s.sample_tokens and hasattr(engine.unwrap(job.model), "generate") and not signals.requested:
            t0 = time.perf_counter()
            with signals.at_once():  # a signal stops the sample at once; the run ends as finished
                print_sample(job, s.sample_tokens, run_dir)  # every rank generates (ZeRO-3 gathers), rank 0 prints
            if engine.is_main and metrics is not None and not signals.requested:  # its seconds, after the rows
                rows = JsonLines(metrics)  # metrics.jsonl's own writer (telemetry closed it above)
                rows.log({"step": state.step, "sample_s": round(time.perf_counter() - t0, 3)})
                rows.finish()
    trained.eval_loss = telemetry.last_row.get("eval_loss")
    if run_dir is not None:
        log.info("done: %s", run_dir)
    return trained


def launched(geometry) -> dict:
    """The run's launch record (config.yaml's ``launch:``, the first metrics row): the launcher, the
    process count and the global batch (``batch_size`` x ``accum_steps`` x processes)."""
    return {"launcher": launcher(), "world_size": geometry.world_size, "batch_size": geometry.batch_size,
            "accum_steps": geometry.accum_steps, "global_batch": geometry.global_batch}


def held_out(job: Job) -> list:
    """This rank's batches of the fixed held-out set (``eval_samples`` sequences spread over the
    held-out split, the same at every evaluation, for any batch size and process count)."""
    s, engine = job.settings, job.engine
    if s.eval_samples == 0 or job.data.eval is None or hasattr(job.objective, "rollouts"):
        return []  # (loss=grpo: held-out prompts have no completions to take a loss on)
    batches = held_out_batches(job.data.eval, s.eval_samples, batch_size=s.batch_size, rank=engine.rank,
                               world=engine.world_size, collate_fn=job.data.collate, device=engine.device)
    if not batches:
        log.warning("the held-out split is empty: no evaluation")
    return batches


def report_stop(signals: Signals, state: TrainState, record: Record, run_dir: Path | None, saved: bool,
                main: bool) -> None:
    """The run stopped early on a signal, after saving: say how to continue (rank 0 only)."""
    signals.launcher_lost()  # stopped with the other ranks before this one saw its launcher gone
    if not main:
        return
    if signals.signum is None and signals.reason:  # the run's own stop (a sweep's pruner): nothing to continue
        log.warning("stopped at step %d: %s%s", state.step, signals.reason, "; checkpoint saved" if saved else "")
        return
    what = "interrupted (Ctrl-C)" if signals.status == EXIT_INTERRUPTED else \
        f"preempted ({signals.name})" if signals.signum is not None else "stopped with another rank, which a signal stopped"
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
    """A sample from the trained model: printed, and saved as ``<run dir>/sample.txt``. A model
    trained on chat records answers a held-out conversation, rendered with the tokenizer's chat
    template up to the assistant's turn, and stops at the end of its turn."""
    log.info("sampling %d tokens from the trained model", n_tokens)
    prompt = job.data.sample_prompt()
    ids = torch.tensor([job.data.encode(prompt)], device=job.engine.device)
    gen = torch.Generator(job.engine.device).manual_seed(job.settings.seed)
    chat = {"stop": job.data.eos_id} if getattr(job.data, "chat_records", False) and job.data.eos_id is not None else {}
    # never through the training compile (+compile=): a prompt that grows by one token a step would
    # recompile, and a few tokens are not worth compiling for
    with job.precision.autocast(), torch.compiler.set_stance("force_eager"):
        out = job.engine.unwrap(job.model).generate(ids, n_tokens, generator=gen, **chat)
    text = job.data.decode(out[0].tolist())
    if job.engine.is_main:
        print(f"\n--- a sample from the trained model ---\n{text}\n---", flush=True)
        if run_dir is not None:
            write_atomic(run_dir / "sample.txt", text + "\n")
