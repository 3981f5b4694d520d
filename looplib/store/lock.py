"""One run per run directory: an OS file lock on ``<run dir>/.looplib.lock``.

Two commands started on one directory (a job submitted twice, a requeue racing its own retry)
would both train from step 0 and write over each other's checkpoints and metrics. So a run holds
its directory from before it writes anything until it ends: ``hold`` takes an exclusive
``flock`` on the lock file, and a second run is refused in one line naming the holder (host,
process id, since when), exit status 2, having written nothing.

- The kernel releases the lock when its process ends, however it ends (killed, out of memory):
  a crashed run never leaves its directory held. The file stays behind only then; it holds no
  state (the next run locks it again and writes its own name into it).
- One thread holds a directory once: ``hold`` is re-entrant within the thread that holds it (the
  command line's callback takes it before the job writes its record, ``looplib.run.session.Session``
  again, for ``train_model``, a sweep's job and tune's candidates alike) and the last
  ``release`` removes the file and unlocks it. Another thread of the same process (two
  ``train_model`` calls at once) is refused like another process.
- Several processes (torchrun): rank 0 holds the lock for every rank; the others learn the
  outcome from it (the session: the engine's broadcast; the command line: the launch's board).
- The lock file is opened without following a link (``O_NOFOLLOW``; ``O_NONBLOCK``, so a FIFO
  does not block) and must be a regular file of its own (``fstat``): a symbolic link (dangling
  or not), a directory, a FIFO, a socket, a device or a second name of another file at that path
  is refused in one line (``NotALock``, exit status 2) before anything is written, and left as
  it is: a lock that follows a link would truncate the file it points to.
- A file system without locks (Lustre mounted without ``flock``, NFS mounted ``nolock``):
  a warning says two runs in one directory are not caught there, and the run goes on.

What holds on shared file systems is in docs/run-directory.md.
"""
from __future__ import annotations

import atexit
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import threading
import time
from pathlib import Path

from ..errors import ConfigError

log = logging.getLogger("looplib")

LOCK_NAME = ".looplib.lock"
NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)  # the file system takes no locks


class DirectoryHeld(ConfigError):
    """Another run holds the run directory (refused; nothing of that run may be touched)."""


class NotALock(DirectoryHeld):
    """Something other than a lock file of looplib's own is at ``<run dir>/.looplib.lock`` (refused
    like a held directory: nothing at that path, or anywhere in the directory, is touched)."""


class Held:
    """This process's hold on one run directory (``count``: how many ``hold`` calls it answers)."""

    def __init__(self, path: Path, fd: int | None, made: bool = False):
        self.path, self.fd, self.count, self.thread = path, fd, 1, threading.get_ident()
        self.made = made  # the directory was made to hold the lock: removed again if the run left it empty


_HELD: dict[Path, Held] = {}


def lock_path(run_dir: Path) -> Path:
    return Path(run_dir) / LOCK_NAME


def holder(fd: int) -> str:
    """Who holds the lock, as its file says: ``host H, pid P, since T`` (the holder writes it just
    after taking the lock: a moment later it may still be empty)."""
    for _ in range(20):
        try:
            found = json.loads(os.pread(fd, 4096, 0).decode() or "null")
        except (OSError, ValueError, UnicodeDecodeError):
            found = None
        if isinstance(found, dict):
            return f"host {found.get('host')}, pid {found.get('pid')}, since {found.get('since')}"
        time.sleep(0.05)
    return "a process that has not said who it is yet"


def hold(run_dir: Path, key: str = "run_dir", label: str | None = None, made: bool = False) -> Held:
    """Hold ``run_dir`` for this run (made if missing: the lock file lives in it), or refuse
    (``DirectoryHeld``, one line naming the holder; nothing written). Re-entrant in one process.
    ``key``: the setting the refusal names; ``label``: how it names the directory (default: its
    path); ``made``: the caller made the directory for this run just before (see ``made_here``)."""
    run_dir = Path(run_dir).absolute()
    named = label or str(run_dir)
    held = _HELD.get(run_dir)
    if held is not None and held.thread == threading.get_ident():
        held.count += 1
        return held
    if held is not None:
        raise DirectoryHeld(key, f"{named} is held by another run of this process (pid {os.getpid()}, another "
                            "thread): two runs in one directory would write over each other's checkpoints and metrics",
                            f"wait for that run to end, or give another directory ({key}=...)")
    made = made or not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    path = lock_path(run_dir)
    while True:
        fd = open_lock(path, key)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                who = holder(fd)
                os.close(fd)
                raise DirectoryHeld(key, f"{named} is held by another run ({who}): two runs in one directory "
                                    "would write over each other's checkpoints and metrics",
                                    f"wait for that run to end, or give another directory ({key}=...)") from None
            os.close(fd)
            if err.errno not in NO_LOCKS:
                raise
            log.warning("the file system of %s takes no file locks (%s): a second run started in this directory "
                        "would not be refused", run_dir, os.strerror(err.errno))
            held = _HELD[run_dir] = Held(run_dir, None, made)
            return held
        try:  # the file we locked is still the one at the path (its last holder removes it on release)
            now, ours = os.lstat(path), os.fstat(fd)
            same = (now.st_ino, now.st_dev) == (ours.st_ino, ours.st_dev)
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                              "since": time.strftime("%Y-%m-%d %H:%M:%S %z")}).encode(), 0)
    held = _HELD[run_dir] = Held(run_dir, fd, made)
    return held


def held_by(run_dir: Path) -> str | None:
    """Who holds ``run_dir`` now (``host H, pid P, since T``), or None where no run does; a look
    that writes nothing and takes nothing (a shared lock tried, and let go at once)."""
    try:
        fd = os.open(lock_path(Path(run_dir)), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        found = os.fstat(fd)
        if what_is(found.st_mode, found.st_nlink) is not None:
            return None  # not a lock file (refused when a run takes the directory)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as err:
            return holder(fd) if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES) else None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def what_is(mode: int, links: int) -> str | None:
    """What a file of ``mode`` (``st_mode``) with ``links`` names is, where it is not a lock file."""
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    if not stat.S_ISREG(mode):
        return "not a regular file"
    if links != 1:
        return f"a regular file with {links} names (a hard link: writing the lock would write the other name's file)"
    return None


def open_lock(path: Path, key: str) -> int:
    """The lock file at ``path``, opened (made if missing) without following a link or blocking on
    a FIFO, and checked to be a regular file of one name; anything else is refused (``NotALock``)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as err:
        try:
            found = os.lstat(path)
        except OSError:
            raise err from None
        what = what_is(found.st_mode, found.st_nlink) or f"a file that cannot be opened ({os.strerror(err.errno)})"
        raise not_a_lock(path, what, key) from None
    found = os.fstat(fd)
    what = what_is(found.st_mode, found.st_nlink)
    if what is not None:
        os.close(fd)
        raise not_a_lock(path, what, key)
    return fd


def not_a_lock(path: Path, what: str, key: str) -> NotALock:
    if what == "a symbolic link":
        what += f" (to {os.readlink(path)})"
    return NotALock(key, f"{path} is {what}, not looplib's lock file: a run holds its directory by locking a regular "
                    "file of its own there, and would write into whatever that path leads to; nothing was written",
                    f"remove it if no run uses {path.parent} (rm {'-r ' if 'directory' in what else ''}{path}), "
                    f"or give another directory ({key}=...)")


def release(run_dir: Path) -> None:
    """One ``hold`` of ``run_dir`` ended; the last one removes the lock file and unlocks it."""
    run_dir = Path(run_dir).absolute()
    held = _HELD.get(run_dir)
    if held is None:
        return
    held.count -= 1
    if held.count > 0:
        return
    del _HELD[run_dir]
    if held.fd is not None:
        lock_path(run_dir).unlink(missing_ok=True)  # before unlocking: a waiting run then makes a new one
        os.close(held.fd)
    if held.made:
        try:
            run_dir.rmdir()  # a run that wrote nothing (refused before training) leaves no directory behind
        except OSError:
            pass


def made_here(run_dir: Path) -> bool:
    """Whether this process holds ``run_dir`` and made it for the run that holds it (a run that
    ended before writing a result may then remove it whole)."""
    held = _HELD.get(Path(run_dir).absolute())
    return held is not None and held.made


def holds(run_dir: Path) -> bool:
    """Whether this process holds ``run_dir``."""
    return Path(run_dir).absolute() in _HELD


@atexit.register
def release_all() -> None:
    """At exit (the kernel would unlock anyway): the lock files of a run that ended go too."""
    for run_dir in list(_HELD):
        _HELD[run_dir].count = 1
        release(run_dir)
