"""One job through the command line's assembly path and through ``train_model``, in the same
process(es): ``python tests/assembly_worker.py OUT ENGINE...`` (under torchrun for the
distributed engines). tests/dist/test_assembly.py compares what each wrote."""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_module
from hydra.utils import instantiate

from looplib import train_model
from looplib.cli.instantiate import check_config
from looplib.cli.main import job_spec
from looplib.groups import strategies
from looplib.run.session import Session
from looplib.run.signals import Signals

JOB = ["data=random", "data.n_train=64", "data.n_eval=16", "data.vocab_size=64", "model.n_layer=1",
       "model.d_model=32", "model.n_head=2", "model.seq_len=16", "batch_size=2", "accum_steps=2", "max_steps=4",
       "log_every=1", "eval_every=2", "eval_samples=8", "sample_tokens=0", "checkpoint.every_steps=2",
       "+schedule=cosine", "schedule.warmup_steps=2", "device=cpu", "progress=lines"]


def compose_job(engine: str):
    """``engine``: an ``+engine=`` option, ``local`` (none, one process) or ``none`` (none, under
    torchrun: the launcher rules choose DDP, checkpoints kept)."""
    saves = ["checkpoint.enabled=false"] if engine not in ("local", "none") else []  # checkpoints: tested on one process
    with initialize_config_module(config_module="looplib.conf", version_base="1.3"):
        return compose(config_name="config",
                       overrides=[*JOB, *saves, *([f"+engine={engine}"] if engine not in ("local", "none") else [])])


def through_the_cli(engine: str, run_dir: Path):
    """What ``python -m looplib.train`` does once Hydra has composed the config: its front door."""
    with Session(run_dir, Signals(), fresh=True) as session:
        spec = job_spec(compose_job(engine))
        trained = session.run(spec)
    return spec.parts.engine, trained.model


def through_python(engine: str, run_dir: Path):
    """The same strategy objects, built in Python, handed to train_model."""
    cfg = compose_job(engine)
    s = check_config(cfg)  # fills the default groups, as the CLI does, so that the same classes are built
    parts = {row.name: instantiate(cfg[row.name]) for row in strategies()}
    torch.manual_seed(s.seed)  # the CLI seeds before building the data and the model
    data = instantiate(cfg.data)
    model = instantiate(cfg.model)
    result = train_model(model, data, max_steps=s.max_steps, batch_size=s.batch_size, accum_steps=s.accum_steps,
                         objective=parts["loss"], precision=parts["precision"], optim=parts["optim"],
                         schedule=parts["schedule"], engine=None if engine == "none" else parts["engine"],
                         peft=parts["peft"],
                         compile=parts["compile"], evaluation=parts["evaluation"],
                         checkpointing=parts["checkpointing"], eval_every=s.eval_every, eval_samples=s.eval_samples,
                         max_grad_norm=s.max_grad_norm, device=s.device, seed=s.seed, run_dir=run_dir,
                         checkpoint_every=s.checkpoint.every_steps if s.checkpoint.enabled else None, log_every=s.log_every, progress="lines")
    return parts["engine"], result.model


def main(out: Path, engines: list[str]) -> None:
    for engine in engines:
        for way, how in (("cli", through_the_cli), ("api", through_python)):
            used, model = how(engine, out / engine / way)
            own = used.unwrap(model).state_dict()  # this rank's own weights (FSDP: its shards, gathered)
            torch.save({k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone()
                        for k, v in own.items()}, out / engine / way / f"rank{used.rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
