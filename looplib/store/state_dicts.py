"""Model and optimizer state in either form looplib's torch engines write, loaded by any of them
on any number of processes.

- looplib's own: ``model.safetensors`` (whole tensors, tied ones once) and the optimizer's
  ``state_dict()`` in ``state.pt`` (the local engine and DDP; rank 0 writes);
- sharded: ``shards/``, ``torch.distributed.checkpoint`` (FSDP2; every rank its own file).

``torch.distributed.checkpoint.state_dict`` names every tensor and every optimizer state by
the parameter's qualified name, whatever wraps it (DDP, ``fully_shard``, compile), and moves
it between whole tensors and DTensor shards: a DCP checkpoint loads into a plain or DDP model
(DCP reads each tensor whole), and looplib's files load into an FSDP2 model (every rank hands
over the whole tensor and keeps its shard).
"""
from __future__ import annotations

from pathlib import Path

from torch import nn


def sharded_state(model: nn.Module, optimizer) -> dict:
    """What a sharded checkpoint holds: model and optimizer (this rank's DTensor shards, by qualified
    name), and a 4-bit base's quantisation constants beside them (whole, written once)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from ..quantize import quant_constants
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    constants = quant_constants(model)
    if constants:
        state["quant_constants"] = constants
    return state


def save_sharded(model: nn.Module, optimizer, path: Path) -> None:
    """``sharded_state`` into ``path`` with DCP (every rank calls it; each writes its shards)."""
    import torch.distributed.checkpoint as dcp
    dcp.save(sharded_state(model, optimizer), checkpoint_id=str(path))


def stage_sharded(model: nn.Module, optimizer, stage) -> dict:
    """``sharded_state`` copied off the device by ``stage`` (``checkpoint.async``; written later by
    ``write_staged``, as ``save_sharded`` writes it)."""
    return stage(sharded_state(model, optimizer))


def write_staged(staged: dict, path: Path, group) -> None:
    """What ``stage_sharded`` copied, into ``path`` as ``save_sharded`` writes it. On a background
    thread, so DCP's collectives run on ``group``, a process group of their own (the loop's
    collectives go on meanwhile on the default one); rank 0 returns once every rank's shards and
    DCP's metadata are on disk."""
    import torch.distributed.checkpoint as dcp
    dcp.save(staged, checkpoint_id=str(path), process_group=group)


def load_sharded(model: nn.Module, optimizer, path: Path) -> None:
    """What ``save_sharded`` wrote, into ``model`` and ``optimizer`` as they are sharded now (FSDP2
    on any number of processes) or whole (the local engine, DDP): DCP reads what each needs. A
    4-bit base takes its quantisation constants from the checkpoint too, as its packed bytes: the
    two always belong together, whatever base the run was built from."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from ..quantize import quant_constants, restore_constants
    model_sd, optim_sd = get_state_dict(model, optimizer)
    loaded = {"model": model_sd, "optimizer": optim_sd}
    constants = quant_constants(model)
    if constants:
        loaded["quant_constants"] = constants
    dcp.load(loaded, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])
    if constants:
        restore_constants(model, loaded["quant_constants"])


def load_full(model: nn.Module, optimizer, weights: Path, optimizer_state: dict) -> None:
    """looplib's own files (whole tensors; the optimizer's ``state_dict()``, keyed by position)
    into a sharded model and its optimizer (FSDP2): every rank reads them and keeps its shards."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)
    whole = load_file(str(weights))
    first: dict[int, str] = {}  # tied parameters are stored once, under one of their names
    for name, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
    for name, p in model.named_parameters(remove_duplicate=False):
        if name not in whole and first[id(p)] != name and first[id(p)] in whole:
            whole[name] = whole[first[id(p)]]
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, whole, options=options)
    set_optimizer_state_dict(model, optimizer, by_name(model, optimizer, optimizer_state), options=options)


def by_name(model: nn.Module, optimizer, state: dict) -> dict:
    """``optimizer.state_dict()`` (parameters numbered in the order of the param groups) keyed by
    the parameters' qualified names, as ``get_optimizer_state_dict`` keys them."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    ordered = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    if len(ordered) != sum(len(g["params"]) for g in state["param_groups"]):
        raise ValueError(f"the checkpoint's optimizer holds {sum(len(g['params']) for g in state['param_groups'])} "
                         f"parameters, this one {len(ordered)}")
    return {"state": {ordered[i]: value for i, value in state["state"].items()},
            "param_groups": [{**group, "params": [ordered[i] for i in group["params"]]}
                             for group in state["param_groups"]]}
