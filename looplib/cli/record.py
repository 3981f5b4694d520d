"""The record a command-line job keeps beside its results: ``<run dir>/.hydra/`` (config.yaml,
hydra.yaml, overrides.yaml, as Hydra would write them; written by the job once its directory is
held: ``looplib.cli.guard``). No Hydra import here: ``python -m looplib.report`` finds a sweep's
jobs and their overrides through it.
"""
from __future__ import annotations

from pathlib import Path

RECORD = ".hydra"           # hidden: never a result (looplib.store.rundir)
OVERRIDES = "overrides.yaml"


def jobs(root: Path) -> list[tuple[Path, Path]]:
    """(job directory, its overrides file) of every command-line job under ``root`` (``root``
    itself included), in path order (no sorting of their own: the caller orders them)."""
    return [(p.parent.parent, p) for p in Path(root).glob(f"**/{RECORD}/{OVERRIDES}")]


def read_overrides(path: Path) -> dict[str, str]:
    """``overrides.yaml`` is a YAML list of ``key=value`` strings (one per line, ``- ``)."""
    out = {}
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line.startswith("- "):
            item = line[2:].strip().strip("'\"")
            key, _, value = item.partition("=")
            out[key] = value
    return out
