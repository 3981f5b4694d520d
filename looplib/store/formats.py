"""How a checkpoint holds model and optimizer state: one object per format, named by the engine.

An engine names its format with ``checkpoint_format`` (a class attribute; ``meta.json``'s
geometry records it), and ``of(engine)`` gives the object that writes and reads it, made once
per engine and kept as ``engine.checkpoints``:

    looplib    ``Whole``: model.safetensors (whole tensors, tied ones once) and the optimizer's
               ``state_dict()`` in state.pt, written by rank 0 (``looplib.store.saving``);
               the local engine and DDP
    dcp        ``Sharded``: torch.distributed.checkpoint shards (``shards/``, every rank its own
               file) and ``client.pt``; FSDP2
    deepspeed  DeepSpeed's ZeRO partitions: ``looplib.engines.deepspeed.checkpoints`` (it drives
               the ``DeepSpeedEngine``), set by the DeepSpeed engine itself

Every format object answers the same verbs (the callers, ``looplib.store.saving`` and
``looplib.store.resume``, never ask which it is):

    own_files   True: it writes model and optimizer state itself, every rank its part, straight
                into the checkpoint directory (``save`` / ``stage``); False: looplib writes them
    save(directory, tag, parts, client_state)         write ``directory/tag`` (own_files only)
    stage(directory, tag, parts, client_state, stage) ``save`` in two halves (checkpoint.async):
                this rank's part copied off the device now, the returned function writes it
    load(path, parts, saved_format, state)            restore a checkpoint in ``saved_format`` (one
                this engine reads: ``looplib.store.elastic.check_engine``) into ``parts`` (model,
                optimizer, precision); return looplib's client state
    resuming(checkpoint, saved_world, scratch)        told before ``prepare`` which checkpoint the
                run resumes and how many processes wrote it

The local engine, DDP and FSDP read both torch formats (``looplib.store.state_dicts``); DeepSpeed
only its own.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..engines.local import innermost
from .checkpoint_dir import load_state
from .state_dicts import load_full, load_sharded, save_sharded, stage_sharded, write_staged


class Whole:
    """looplib's own format: whole tensors, written by rank 0 (``looplib.store.saving``); loads a
    checkpoint of its own or FSDP's shards (DCP reads each tensor whole)."""

    name = "looplib"
    own_files = False

    def __init__(self, engine):
        self.engine = engine

    def save(self, directory: Path, tag: str, parts: dict, client_state: dict) -> None:
        raise NotImplementedError(f"the {self.name} format is written by looplib, not by the format itself")

    def stage(self, directory: Path, tag: str, parts: dict, client_state: dict, stage) -> Callable[[], None]:
        raise NotImplementedError(f"the {self.name} format is written by looplib, not by the format itself")

    def load(self, path: Path, parts: dict, saved_format: str, state: dict | None) -> dict:
        """``state``: state.pt as ``inspect_checkpoint`` read it (looplib's format; None for the others)."""
        if saved_format == "dcp":  # FSDP's shards, into FSDP on any number of processes, DDP or one process
            load_sharded(parts["model"], parts["optimizer"], path / "shards")
            blob = load_state(path / "client.pt")
            parts["precision"].load_state_dict(blob.pop("precision"))
            return blob
        self.load_whole(parts["model"], parts["optimizer"], path / "model.safetensors", state["optimizer"])
        parts["precision"].load_state_dict(state["precision"])
        return state

    def load_whole(self, model: nn.Module, optimizer, weights: Path, optimizer_state: dict) -> None:
        """looplib's own files (``weights``: model.safetensors; the optimizer's ``state_dict()``)
        into the model and optimizer the engine prepared."""
        from safetensors.torch import load_model
        load_model(innermost(model), str(weights))
        optimizer.load_state_dict(optimizer_state)

    def resuming(self, checkpoint: Path, saved_world: int, scratch: Path) -> None:
        """Nothing to prepare (DeepSpeed's format makes a universal checkpoint then)."""


class Sharded(Whole):
    """FSDP2's format: ``directory/tag/shards/`` (torch.distributed.checkpoint: model and optimizer,
    every rank its own file, written in parallel) and ``client.pt`` (rank 0: looplib's step,
    schedule, RNG, data position, loss scale). Loads on any number of processes (DCP re-shards),
    and loads looplib's whole tensors too (every rank keeps its shards)."""

    name = "dcp"
    own_files = True

    def __init__(self, engine):
        super().__init__(engine)
        self.writer_group = None  # checkpoint.async: DCP's collectives on a background thread (gloo)

    def save(self, directory: Path, tag: str, parts: dict, client_state: dict) -> None:
        """Every rank calls it."""
        path, ranks = Path(directory) / tag, self.engine.ranks
        ranks.barrier()  # every rank has cleared the directory (Checkpoints.save) before any writes
        save_sharded(parts["model"], parts["optimizer"], path / "shards")
        if self.engine.is_main:
            write_client(path, {**client_state, "precision": parts["precision"].state_dict()})
        ranks.barrier()  # the manifest (rank 0, next) lists every rank's files

    def stage(self, directory: Path, tag: str, parts: dict, client_state: dict, stage) -> Callable[[], None]:
        """This rank's shards copied off the device now; the returned function writes them with
        DCP on a process group of its own (a background thread's collectives never mix with the
        loop's), and rank 0's ``client.pt``. DCP returns on rank 0 only after every rank's shards
        and its metadata are written."""
        import torch.distributed as dist
        path = Path(directory) / tag
        self.engine.ranks.barrier()  # every rank has cleared the directory (Checkpoints.save) before any writes
        staged = stage_sharded(parts["model"], parts["optimizer"], stage)
        client = {**client_state, "precision": stage(parts["precision"].state_dict())} if self.engine.is_main else None
        if self.writer_group is None:  # made once, by every rank at the same checkpoint
            from datetime import timedelta
            self.writer_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.engine.timeout_s))
        group = self.writer_group

        def write() -> None:
            write_staged(staged, path / "shards", group)
            if client is not None:
                write_client(path, client)
        return write

    def load_whole(self, model: nn.Module, optimizer, weights: Path, optimizer_state: dict) -> None:
        """A checkpoint of the local engine or DDP (whole tensors): every rank keeps its shards."""
        load_full(model, optimizer, weights, optimizer_state)


def write_client(path: Path, client: dict) -> None:
    """``client.pt``: looplib's step, schedule, RNG, data position and loss scale (rank 0)."""
    import os
    with open(path / "client.pt", "wb") as f:
        torch.save(client, f)
        f.flush()
        os.fsync(f.fileno())


FORMATS = {Whole.name: Whole, Sharded.name: Sharded}


def of(engine):
    """The object that writes and reads ``engine``'s checkpoints (made once, kept as
    ``engine.checkpoints``; an engine whose format looplib does not know sets it itself)."""
    if getattr(engine, "checkpoints", None) is None:
        fmt = engine.checkpoint_format
        if fmt not in FORMATS:
            raise TypeError(f"{type(engine).__name__}.checkpoint_format is {fmt!r}, which looplib does not write; "
                            f"name one of {', '.join(FORMATS)}, or set the engine's checkpoints object")
        engine.checkpoints = FORMATS[fmt](engine)
    return engine.checkpoints
