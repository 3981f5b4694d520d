"""One builder per cache entry: an operating-system lock (``flock``) on ``ROOT/locks/NAME``.

Every process that needs an entry that is not built yet (the ranks of a launch, several runs on
one machine, the nodes of a cluster on a shared file system whose locks reach every node) asks
for the entry's lock. The first to get it builds; the others wait, with one line saying so, and
then open what it built. The kernel releases the lock when its holder exits in any way (a crash,
SIGKILL), so a builder that died blocks nobody: the next one to get the lock finds no entry and
builds it. A waiting rank stops when another rank of its launch refused (``looplib.process.board``),
as it would anywhere else: a rank that refuses while it builds keeps the lock until it exits, so
the ranks waiting for it read its refusal rather than build the same entry to refuse it again.
A cache where no lock file can be made (read-only) is used unlocked.

The lock files stay (empty; removing one while another process waits on it would let two
builders in). The digests of a list of files (``index.py``) have one lock per list (two lists
that share a file do not wait on each other).
"""
from __future__ import annotations

import fcntl
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path

from ..errors import RunEnded

log = logging.getLogger("looplib")

POLL_S = 0.2   # a waiter tries the lock again this often (in Python: signals and refusals are heard)


@contextmanager
def building(root: Path, name: str, what: str):
    """Hold the lock of the entry ``name`` under ``root`` for the block (waiting for it first)."""
    fd, path = None, root / "locks" / name
    if path in _KEPT:  # this process refused while building it (a sweep's next job): let go of it
        os.close(_KEPT.pop(path))
    try:
        (root / "locks").mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError:
        pass  # (no lock to be had: build unlocked, as before)
    try:
        if fd is not None:
            wait(fd, what)
        yield
    except RunEnded:
        if fd is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            _KEPT[path], fd = fd, None  # held until this rank exits: the waiting ranks read its refusal first
        raise
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


_KEPT: dict[Path, int] = {}   # locks kept by a rank that refused while building (released when it exits)


def wait(fd: int, what: str) -> None:
    from ..process import this

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    except OSError:
        return  # (a file system without locks: unlocked)
    rank = os.environ.get("RANK")
    log.warning("%swaiting for another process that is building %s (it holds the lock; it is built once)",
                f"rank {rank}: " if rank is not None else "", what)
    start = time.monotonic()
    while True:
        refused = this().board.refusal()
        if refused is not None:
            raise refused
        time.sleep(POLL_S)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue
        log.info("%s: ready after waiting %.0f s", what, time.monotonic() - start)
        return
