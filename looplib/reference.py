"""The reference of ``loss=dpo``, identified and, with ``loss.reference=precomputed``, computed once.

``weights_digest(model, engine)``: a sha256 over the reference's weights (names, dtypes, shapes,
bytes; under ``+peft`` the base alone, the adapters left out), taken when the run starts (before
a resumed checkpoint is loaded). Every checkpoint of a DPO run records it (``DPO.identity``),
and a resume whose starting weights differ is refused (``looplib.store.resume.check_reference``).

``precompute(objective, model, corpus, engine, precision, batch_size)``: one pass over every
training and held-out pair, before training, with the reference (the model itself in eval mode,
its adapters switched off under ``+peft``; no copy), without gradients and under the run's
autocast, gives each pair's summed log-probabilities of its chosen and rejected completions.
They are cached beside the pairs' token cache (``reference-<key>/``), the key a digest of the
reference weights' digest, the data (the token caches, which pairs are in each split,
``seq_len``, truncation) and the precision, so a resume or a sweep's next job reads them back
and never computes them again. The pairs then carry them (``PairExamples.reference``) into every
batch (``reference_logps``): training runs no reference forward and keeps no second copy.

Several processes (``+engine=ddp``) share the pass: each computes every ``world``-th micro-batch
of pairs, the ranks' arrays are summed, rank 0 writes the cache. All ranks run as many forward
passes (a sharded model's forward is collective): under ``+engine=fsdp`` every rank runs the
sharded model, which is resharded after each pass (``looplib.engines.fsdp``); ZeRO-3 is refused
for now (``DPO.attach``).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from .atomic import make_dir_beside
from .data.cache import cache_key
from .data.lock import building
from .data.tokenizer import cache_root
from .errors import ConfigError

log = logging.getLogger("looplib")
FILES = ("train.npy", "eval.npy")


def weights_digest(model: torch.nn.Module, engine=None, skip: str = "lora_") -> str:
    """sha256 over every weight and buffer of ``model`` whose name lacks ``skip`` (the adapters of
    a peft model): names, dtypes, shapes and bytes. A sharded weight (FSDP2's DTensor) is hashed
    by its local shard; the ranks' digests are then combined (every rank gets the same one)."""
    inner = engine.unwrap(model) if engine is not None else model
    h, hashed = hashlib.sha256(), 0
    for name, t in sorted(inner.state_dict(keep_vars=True).items()):
        if skip and skip in name or not isinstance(t, torch.Tensor):
            continue
        t = getattr(t, "ds_tensor", t)  # a ZeRO-3 partition: its local part (the parameter itself is empty)
        t = t.data if isinstance(t, torch.nn.Parameter) else t.detach()  # (a 4-bit weight: its packed bytes as they are)
        t = t.to_local() if hasattr(t, "to_local") else t
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        data = t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        h.update(data)  # (its buffer: no copy)
        hashed += data.nbytes
    if not hashed and any(p.numel() for p in inner.parameters()):  # never a key that two models would share
        raise ConfigError("loss", f"loss=dpo cannot read the starting weights of {type(inner).__name__} to identify its "
                          "reference (no weight held any bytes on this process)",
                          "use the local, DDP or FSDP engine, or +peft=lora")
    world = getattr(engine, "world_size", 1)
    if world == 1 or getattr(engine, "keeps_modules", True):
        return h.hexdigest()
    mine = torch.zeros(world, 32, dtype=torch.int64)
    mine[engine.rank] = torch.tensor(list(h.digest()), dtype=torch.int64)
    every = engine.ranks.sum(mine).cpu()
    return hashlib.sha256(every.to(torch.uint8).numpy().tobytes()).hexdigest()


def data_identity(examples) -> list:
    """What decides the pairs' tokens: the token cache, which of its documents, how they are cut."""
    docs = np.asarray(examples.docs, dtype=np.int64)
    return [getattr(getattr(examples.data, "path", None), "name", None), hashlib.sha256(docs.tobytes()).hexdigest(),
            examples.seq_len, examples.keep, examples.truncation]


def check_data(corpus) -> None:
    for split in (corpus.train, getattr(corpus, "eval", None)):
        if split is not None and not hasattr(split, "reference"):
            raise ConfigError("loss.reference", f"loss.reference=precomputed needs pairs it can carry log-probabilities "
                              f"with (data=preference), and the data ({type(corpus).__name__}) hold others",
                              "use data=preference, or loss.reference=live")


def precompute(objective, model, corpus, engine, precision, batch_size: int) -> str:
    """Give ``corpus.train`` and ``corpus.eval`` their reference log-probabilities (``[pairs, 2]``:
    chosen, rejected), read from the cache or computed once and cached; returns the cache key."""
    check_data(corpus)
    splits = [s for s in (corpus.train, getattr(corpus, "eval", None)) if s is not None]
    key = cache_key("dpo-reference", objective.identity["weights"], getattr(precision, "name", type(precision).__name__),
                    objective.ignore_index, [data_identity(s) for s in splits])
    where = Path(getattr(corpus.train.data, "path", None) or cache_root() / "x").parent / f"reference-{key}"
    found = read(where, splits) if engine.is_main else None
    found = engine.ranks.from_main(found) if engine.world_size > 1 else found
    if found is not None:
        log.info("DPO reference: the log-probabilities of %s read from %s (computed before)", counted(splits), where)
    else:
        start = time.perf_counter()
        found = [compute(objective, model, s, corpus.collate, engine, precision, batch_size) for s in splits]
        log.info("DPO reference: the log-probabilities of %s computed in %.1f s", counted(splits),
                 time.perf_counter() - start)
        if engine.is_main:
            write(where, found)
    for s, values in zip(splits, found):
        s.reference = values
    return key


def counted(splits) -> str:
    n = [len(s) for s in splits]
    return f"{n[0]} training" + (f" and {n[1]} held-out pairs" if len(n) > 1 and n[1] else " pairs")


def compute(objective, model, examples, collate, engine, precision, batch_size: int) -> np.ndarray:
    """Every pair's (chosen, rejected) summed log-probability under the reference, this rank's
    share computed here and the ranks' shares summed."""
    n, world, rank = len(examples), engine.world_size, engine.rank
    out = torch.zeros(n, 2, dtype=torch.float32)
    module = engine.unwrap(model) if getattr(engine, "keeps_modules", True) else model  # (DDP: no collectives)
    for step in range(math.ceil(n / (batch_size * world))):
        first = (step * world + rank) * batch_size
        rows = list(range(first, min(first + batch_size, n)))
        batch = collate([examples[i] for i in (rows or [0])])  # (an empty share: a pass all the same, dropped)
        with precision.autocast():
            logps, _ = objective.reference_logps(module, engine.to_device(batch), live=True)
        if rows:
            k = len(rows)
            out[rows] = torch.stack([logps[:k], logps[k:]], 1).float().cpu()
    if world > 1:
        out = engine.ranks.sum(out).cpu()
    return out.numpy()


def read(where: Path, splits, quiet: bool = False) -> list[np.ndarray] | None:
    """The cached arrays, when complete and of the splits' sizes (else None: computed again)."""
    sizes = [len(s) for s in splits]
    try:
        meta = json.loads((where / "meta.json").read_text())
        found = [np.load(where / f, allow_pickle=False) for f, _ in zip(FILES, sizes)]
    except (OSError, ValueError):
        return None
    if meta.get("pairs") != sizes or any(a.shape != (n, 2) or a.dtype != np.float32 for a, n in zip(found, sizes)):
        if not quiet:
            log.warning("the DPO reference cache %s does not match the pairs: computing it again", where)
        return None
    return found


def write(where: Path, arrays: list[np.ndarray]) -> None:
    """Beside, then renamed into place (a reader sees all of it or nothing); one writer at a time;
    a cache that did not read back whole is replaced. Best effort: a failure is a warning."""
    try:
        with building(where.parent, where.name, f"the DPO reference cache {where}"):
            if read(where, arrays, quiet=True) is not None:  # written meanwhile by another run
                return
            shutil.rmtree(where, ignore_errors=True)  # (an incomplete or damaged one)
            tmp = make_dir_beside(where, where.name + ".tmp")
            for f, a in zip(FILES, arrays):
                np.save(tmp / f, a, allow_pickle=False)
            (tmp / "meta.json").write_text(json.dumps({"pairs": [len(a) for a in arrays]}))
            tmp.rename(where)
    except OSError as err:
        log.warning("the DPO reference cache %s could not be written (%s): the next run computes it again", where, err)
