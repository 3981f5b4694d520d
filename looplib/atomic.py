"""Files a reader never sees half-written: written beside their place, then renamed over it.

Every small file looplib writes (config.yaml, labels.json, tracker ids, tune.json, the exit-status
file, a checkpoint's metadata) goes through ``write_atomic``; a checkpoint's files are also
flushed to disk (``write_file``, ``fsync_dir``) before the rename that makes it count.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Replace ``path`` by ``data`` in one rename: a reader sees the old file or the new one."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")  # two writers never share one
    try:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def as_umask(*paths: Path) -> None:
    """Give files and directories the permissions the umask gives a new one (``tempfile.mkdtemp``
    makes 0700 directories and safetensors 0600 files: a teammate could not read the run)."""
    mask = umask()
    for path in paths:
        os.chmod(path, (0o777 if Path(path).is_dir() else 0o666) & ~mask)


def make_dir_beside(target: Path, prefix: str) -> Path:
    """A temporary directory beside ``target`` (renamed onto it once complete), as the umask makes any."""
    import tempfile
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=prefix))
    as_umask(tmp)
    return tmp


def write_file(path: Path, data: bytes) -> None:
    """Write and flush to disk (a checkpoint's file, before its directory is renamed into place)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
