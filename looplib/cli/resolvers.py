"""The ``${looplib.*}`` interpolations the files under ``conf/`` use, registered with OmegaConf once.

    ${looplib.rank0_dir:PATH}       hydra.run.dir / hydra.sweep.dir: one run directory per run
                                    under torchrun (``rank0_dir``, here)
    ${looplib.vocab_size:SPEC,N}    a data group's vocabulary: the tokenizer's size when the data
                                    names one, else N (``data.tokenizer.tokenizer_size``)
    ${looplib.seq_len:CAP}          model=hf's window: the model's positions, at most CAP
                                    (``hf.config.default_seq_len``)

Part of the config layer: ``looplib.cli.instantiate`` registers them when it is imported (composing a
config needs them), so neither the launcher nor the data modules register anything.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from ..process import this
from ..process.launcher import launched_rank


def register_resolvers() -> None:
    from omegaconf import OmegaConf  # here, not at import: looplib without Hydra imports no OmegaConf

    from ..data.tokenizer import tokenizer_size
    from ..hf.config import default_seq_len
    if not OmegaConf.has_resolver("looplib.rank0_dir"):
        OmegaConf.register_new_resolver("looplib.rank0_dir", rank0_dir)
    if not OmegaConf.has_resolver("looplib.vocab_size"):
        OmegaConf.register_new_resolver("looplib.vocab_size", tokenizer_size, use_cache=True)
    if not OmegaConf.has_resolver("looplib.seq_len"):
        OmegaConf.register_new_resolver("looplib.seq_len", default_seq_len)


def rank0_dir(path: str) -> str:
    """Hydra resolver ``${looplib.rank0_dir:...}`` for hydra.run.dir and hydra.sweep.dir.

    Under torchrun every rank would resolve ``${now:...}`` itself and make its own timestamped
    directory (hydra #2070). Rank 0 keeps the real path; every other rank gets a private
    scratch directory, removed when the process exits, and writes into rank 0's directory once
    the process group is up (``engine.ranks.shared_run_dir`` broadcasts it).
    """
    rank = launched_rank()
    if rank == 0 or this().as_rank0:
        return path
    scratch = Path(tempfile.gettempdir()) / f"looplib-rank{rank}-{os.getpid()}"
    if not scratch.exists():
        scratch.mkdir(parents=True, exist_ok=True)
        atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    return str(scratch)


@contextlib.contextmanager
def resolving_as_rank0():
    """Resolve ``${looplib.rank0_dir:...}`` as rank 0 does (to check rank 0's directory on every rank)."""
    process = this()
    process.as_rank0 = True
    try:
        yield
    finally:
        process.as_rank0 = False
