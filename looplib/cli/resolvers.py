"""The ``${looplib.*}`` interpolations the files under ``conf/`` use, registered with OmegaConf once.

    ${looplib.rank0_dir:PATH}       hydra.run.dir / hydra.sweep.dir: one run directory per run
                                    under torchrun (``engines.launch.rank0_dir``)
    ${looplib.vocab_size:SPEC,N}    a data group's vocabulary: the tokenizer's size when the data
                                    names one, else N (``data.tokenizer.tokenizer_size``)
    ${looplib.seq_len:CAP}          model=hf's window: the model's positions, at most CAP
                                    (``hf.config.default_seq_len``)

Part of the config layer: ``looplib.cli.instantiate`` registers them when it is imported (composing a
config needs them), so neither the launcher nor the data modules register anything.
"""
from __future__ import annotations


def register_resolvers() -> None:
    from omegaconf import OmegaConf  # here, not at import: looplib without Hydra imports no OmegaConf

    from ..data.tokenizer import tokenizer_size
    from ..engines.launch import rank0_dir
    from ..hf.config import default_seq_len
    if not OmegaConf.has_resolver("looplib.rank0_dir"):
        OmegaConf.register_new_resolver("looplib.rank0_dir", rank0_dir)
    if not OmegaConf.has_resolver("looplib.vocab_size"):
        OmegaConf.register_new_resolver("looplib.vocab_size", tokenizer_size, use_cache=True)
    if not OmegaConf.has_resolver("looplib.seq_len"):
        OmegaConf.register_new_resolver("looplib.seq_len", default_seq_len)
