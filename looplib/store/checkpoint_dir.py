"""What a checkpoint directory holds, and the one check every checkpoint passes before it is read.

A checkpoint is a directory ``checkpoints/step-00000120/`` holding

    model.safetensors   the weights (safetensors: no code runs when they are loaded)
    state.pt            optimizer, scheduler, precision (GradScaler) state, step/epoch/position,
                        RNG states: loaded with ``torch.load(weights_only=True)`` only
    config.yaml         the resolved config it was made with (and its hash in meta.json)
    meta.json           step, epoch, data position, config hash, looplib/torch versions
    manifest.json       written last: size and sha256 of every other file

This module reads and checks such directories (``inspect_checkpoint``, ``find_checkpoint``) and
holds the file-level helpers the writer uses; ``looplib.store.saving`` decides when and what to
save, ``looplib.store.resume`` what a resumed run may change.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import random
import sys
from pathlib import Path

import warnings

import torch

from ..engines.local import innermost as unwrap  # noqa: F401 - the user's module inside wrappers
from ..errors import ConfigError
from .elastic import damaged

log = logging.getLogger("looplib")

FORMAT = 1


def seed_host_rngs(seed: int) -> None:
    """Python's ``random`` and NumPy's global generator seeded from the run's ``seed`` (torch's is
    seeded where the model is built): a strategy of one's own may draw from them, and a checkpoint
    saves their state, so two runs of one config write the same ``state.pt``."""
    random.seed(seed)
    if "numpy" in sys.modules:  # (torch imports it where it is installed)
        sys.modules["numpy"].random.seed(seed % 2**32)


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:  # only if something uses it; kept as plain tensors and ints
        kind, keys, pos, has_gauss, gauss = sys.modules["numpy"].random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss)
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state and "numpy" in sys.modules:
        np = sys.modules["numpy"]
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


def config_text(config: dict) -> str:
    """The config as the run directory's and every checkpoint's config.yaml holds it: YAML is only
    how the dict is written to disk (keys in their order; read back by ``read_config``)."""
    import yaml
    return yaml.safe_dump(config, sort_keys=False, default_flow_style=False, allow_unicode=True)


def read_config(path: Path) -> dict:
    """A config.yaml as plain values (``ValueError`` when it is not a YAML mapping)."""
    import yaml
    try:
        config = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(" ".join(str(err).split())) from None
    if not isinstance(config, dict):
        raise ValueError("not a mapping")
    return config


def config_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


LOCAL_FILES = ("model.safetensors", "state.pt")   # what a checkpoint in looplib's own format needs
ALWAYS = ("config.yaml", "meta.json")


class InvalidCheckpoint(Exception):
    """A directory that is not a complete, readable checkpoint; ``str(err)`` says why."""


def inspect_checkpoint(path: Path, model: torch.nn.Module | None = None, own_format: bool | None = None,
                       check_config=None) -> dict:
    """The one validation every checkpoint goes through before anything is loaded from it.

    Checks, in order of cost: a directory with a manifest of the right shape that lists every
    file a checkpoint needs (looplib's own, or those the engine wrote, named in meta.json); each
    file's size and sha256; config.yaml and meta.json parse; state.pt unpickles with
    ``weights_only=True``; the weights' names, shapes and dtypes fit ``model``. Given
    ``check_config(saved_config, path)``, a config change that would alter the run is refused
    (``ConfigError``, not skipped) before the weights are compared, so that the message names
    the setting. Returns what was
    read (``config``, ``meta``, ``state``) so that loading does not read it twice; raises
    ``InvalidCheckpoint`` naming the first problem."""
    path = Path(path)
    if not path.is_dir():
        raise InvalidCheckpoint("not a directory" if path.exists() else "does not exist")
    manifest = path / "manifest.json"
    if not manifest.is_file():
        raise InvalidCheckpoint("no manifest (an interrupted write)")
    try:
        files = json.loads(manifest.read_text())["files"]
        entries = [(str(name), int(e["size"]), str(e["sha256"])) for name, e in files.items()]
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise InvalidCheckpoint(f"unreadable manifest ({type(err).__name__}: {err})") from None
    for name, size, digest in entries:
        f = path / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise InvalidCheckpoint(f"the manifest names {name}, outside the checkpoint")
        if not f.is_file():
            raise InvalidCheckpoint(f"{name} is missing")
        if f.stat().st_size != size:
            raise InvalidCheckpoint(f"{name} has {f.stat().st_size} bytes, the manifest says {size}")
        if sha256(f) != digest:
            raise InvalidCheckpoint(f"{name} does not match its checksum")
    unlisted = [name for name in ALWAYS if name not in files]
    if unlisted:
        raise InvalidCheckpoint(f"the manifest does not list {', '.join(unlisted)}")
    try:
        meta = json.loads((path / "meta.json").read_text())
        step = int(meta["step"])
        if not isinstance(meta.get("needs", []), list):
            raise TypeError("needs is not a list")
    except (ValueError, KeyError, TypeError) as err:
        raise InvalidCheckpoint(f"unreadable meta.json ({type(err).__name__}: {err})") from None
    why = damaged(meta)  # its geometry: what a resume on other processes reads
    if why:
        raise InvalidCheckpoint(f"{path / 'meta.json'}: its geometry record is damaged ({why})")
    if own_format is None:  # not told which engine reads it: what the checkpoint says it needs
        own_format = "needs" in meta and "state.pt" not in meta["needs"]
    needs = set(ALWAYS) | set(meta.get("needs", ())) | (set() if own_format else set(LOCAL_FILES))
    unlisted = sorted(needs - set(files))
    if unlisted:
        raise InvalidCheckpoint(f"the manifest does not list {', '.join(unlisted)}")
    try:
        saved = read_config(path / "config.yaml")
    except ValueError as err:
        raise InvalidCheckpoint(f"unreadable config.yaml ({str(err).splitlines()[0]})") from None
    out = {"config": saved, "meta": meta, "step": step, "state": None,
           "accepted": check_config(saved, path) if check_config is not None else []}
    if own_format:  # the engine reads its own files (DeepSpeed checks its partitions itself)
        return out
    out["state"] = read_state(path / "state.pt")
    missing = [k for k in ("position", "scheduler", "rng", "optimizer", "precision") if k not in out["state"]]
    if missing:
        raise InvalidCheckpoint(f"state.pt lacks {', '.join(missing)}")
    if model is not None:
        check_weights(path / "model.safetensors", unwrap(model))
    return out


def read_state(path: Path) -> dict:
    """``torch.load`` with ``weights_only=True``: tensors and plain containers, never code."""
    try:
        with warnings.catch_warnings():  # torch's "Detected pickle protocol N" note: the refusal below says it
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            blob = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise InvalidCheckpoint(f"state.pt holds objects other than tensors and plain containers and was "
                                f"not unpickled ({str(err).splitlines()[0]})") from None
    except Exception as err:  # noqa: BLE001 - a truncated or foreign file
        raise InvalidCheckpoint(f"unreadable state.pt ({type(err).__name__}: {str(err).splitlines()[0]})") from None
    if not isinstance(blob, dict):
        raise InvalidCheckpoint(f"{path.name} does not hold a mapping")
    return blob


def check_weights(path: Path, model: torch.nn.Module) -> None:
    """Names, shapes and dtypes of the saved tensors against ``model``, read from the file's
    header only (nothing is loaded, so a mismatch leaves the model untouched)."""
    from safetensors import safe_open
    from safetensors.torch import _TYPES
    own = model.state_dict()
    try:
        with safe_open(str(path), framework="pt") as f:
            saved = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    except Exception as err:  # noqa: BLE001
        raise InvalidCheckpoint(f"unreadable model.safetensors ({str(err).splitlines()[0]})") from None
    for key, (shape, dtype) in saved.items():
        if key not in own:
            raise InvalidCheckpoint(f"model.safetensors holds {key}, which this model does not have "
                                    "(a checkpoint of another model)")
        if shape != tuple(own[key].shape) or _TYPES.get(dtype, own[key].dtype) != own[key].dtype:
            raise InvalidCheckpoint(f"model.safetensors holds {key} as {dtype}{list(shape)}, this model "
                                    f"has {own[key].dtype}{list(own[key].shape)} (a checkpoint of another model)")
    stored = {own[k].data_ptr() for k in saved}  # tied weights are stored once, under one name
    absent = [k for k in own if k not in saved and own[k].data_ptr() not in stored]
    if absent:
        raise InvalidCheckpoint(f"model.safetensors lacks {absent[0]}" + (f" and {len(absent) - 1} more"
                                                                          if len(absent) > 1 else ""))


def is_valid(path: Path, model: torch.nn.Module | None = None, own_format: bool | None = None) -> str | None:
    """None if ``path`` is a complete, readable checkpoint, else why not."""
    try:
        inspect_checkpoint(path, model, own_format)
    except InvalidCheckpoint as err:
        return str(err)
    return None


def step_dirs(root: Path) -> list[Path]:
    """Checkpoint directories under ``root``, newest first (valid or not)."""
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-")]
    return sorted(dirs, key=lambda p: p.name, reverse=True)


def find_checkpoint(where: Path, model: torch.nn.Module | None = None, own_format: bool | None = None,
                    found: dict | None = None, check_config=None) -> Path | None:
    """The newest valid checkpoint at ``where``: a checkpoint, its parent, or a run directory.
    Invalid ones are skipped with a warning; a single checkpoint named directly that is
    invalid raises ``InvalidCheckpoint``. ``found``, if given, receives what was read from the
    one returned (so that loading it does not read it again)."""
    where = Path(where)
    if (where / "manifest.json").exists() or where.name.startswith("step-") or where.is_file():
        candidates, single = [where], True
    else:
        candidates, single = step_dirs(where / "checkpoints" if (where / "checkpoints").is_dir() else where), False
    for path in candidates:
        try:
            checked = inspect_checkpoint(path, model, own_format, check_config)
        except InvalidCheckpoint as err:
            if single:
                raise
            log.warning("skipping checkpoint %s: %s", path, err)
            continue
        if found is not None:
            found[path] = checked
        return path
    return None


def load_state(path: Path) -> dict:
    """``torch.load`` with ``weights_only=True`` (see ``read_state``), refused with one line."""
    try:
        return read_state(path)
    except InvalidCheckpoint as err:
        raise ConfigError("resume", f"{path}: {err}", "resume from a checkpoint looplib wrote, or delete this one") from None
