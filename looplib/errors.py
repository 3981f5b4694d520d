"""How a run ends, when it does not simply finish: one exception type, ``RunEnded``, and every
exit status the command line returns for it.

    status  ending              raised as
    0       finished            (no exception; a sweep's pruned trial also ends with 0)
    0       nothing to do       ``NothingToDo``: resumed at its max_steps already; nothing written
    1       a rank was lost     ``LostRank``: another process of the run died (killed, out of memory, a node)
    2       refused             ``ConfigError``: a setting looplib cannot honour, found before it trains it;
                                ``PeerRefused``: another rank of the run refused it (its line said there)
    3       numeric             ``NumericError``: too many consecutive steps with inf/NaN
    74      I/O                 ``SaveError``: a checkpoint could not be written; the last complete one stays;
                                ``DiskFull``: a disk filled up anywhere else (the token cache, the weights)
    75      preempted           ``Interrupted``: SIGTERM/SIGUSR1, saved at the next step boundary
    130     interrupted         ``Interrupted``: Ctrl-C

``looplib.run.session.Session`` raises them (``train_model`` lets them through to Python
callers); ``python -m looplib.train`` prints ``err.line`` and exits with ``err.status``.
``RunEnded`` derives from ``BaseException`` so that ``Interrupted``, which a signal raises
wherever the process is, passes through a library's ``except Exception``; the others are also
``Exception``\\ s (``ConfigError``) or ``RuntimeError``\\ s, as before.
"""
from __future__ import annotations

import signal

EXIT_OK = 0
EXIT_LOST_RANK = 1       # a crash, elsewhere: another rank's process ended
EXIT_CONFIG = 2          # looplib's own checks: one line naming the setting and the fix
EXIT_NUMERIC = 3         # max_bad_steps consecutive non-finite steps: the run cannot go on
EXIT_IO = 74             # EX_IOERR: a checkpoint could not be written (a full disk, ...)
EXIT_PREEMPTED = 75      # EX_TEMPFAIL: a scheduler may requeue the job; resume=auto continues it
EXIT_INTERRUPTED = 130   # 128 + SIGINT: Ctrl-C


class RunEnded(BaseException):
    """A run that ended before it finished. ``status``: the command line's exit status;
    ``line``: what the command line says (set where the ending is known, "" when already said,
    or said by another rank); ``result``: what was trained so far (a ``Trained``), where saved."""

    status = 1
    line = ""
    result = None


class ConfigError(RunEnded, Exception):
    """A setting that looplib refuses. ``str(err)`` is the one line the user sees."""

    status = EXIT_CONFIG

    def __init__(self, key: str, problem: str, fix: str):
        self.key, self.problem, self.fix = key, problem, fix
        super().__init__(" ".join(f"{key}: {problem}; {fix}".split()))  # always one line


class NothingToDo(RunEnded):
    """A resumed run that is already at its ``max_steps``: nothing is trained and nothing written."""

    status = EXIT_OK


class NumericError(RunEnded, RuntimeError):
    """Too many consecutive steps with non-finite loss or gradients."""

    status = EXIT_NUMERIC


class SaveError(RunEnded, RuntimeError):
    """A checkpoint could not be written (on this rank or another); the last complete one stays."""

    status = EXIT_IO

    def __init__(self, path, cause: BaseException | None):
        self.path, self.cause = path, cause
        why = f"{type(cause).__name__}: {cause}" if cause is not None else "another rank failed to write its part"
        super().__init__(f"could not write the checkpoint {path} ({why})")


class DiskFull(RunEnded, OSError):
    """A write failed because its disk is full (``disk_full`` recognises one, wherever it happens)."""

    status = EXIT_IO


def disk_full(err: BaseException | None, where: str | None = None) -> DiskFull | None:
    """``err`` (or what caused it) as a ``DiskFull`` naming the disk, or None for any other error.
    Recognised: ENOSPC/EDQUOT, and torch's "file write failed" when the disk has under 16 MiB left."""
    import errno
    import os
    import shutil
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        path = getattr(err, "filename", None) or where
        text = str(err)
        full = getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in text
        if not full and "write failed" in text and path:
            probe = os.path.abspath(str(path))
            while probe != os.path.dirname(probe) and not os.path.exists(probe):
                probe = os.path.dirname(probe)
            try:
                full = shutil.disk_usage(probe).free < 16 * 2**20
            except OSError:
                full = False
        if full:
            return DiskFull(errno.ENOSPC, f"the disk holding {path or 'the run'} is full (No space left on device)",
                            str(path) if path else None)
        err = err.__cause__ or err.__context__
    return None


class LostRank(RunEnded, RuntimeError):
    """A collective failed because another rank of the run is gone."""

    status = EXIT_LOST_RANK


class PeerRefused(RunEnded):
    """Another rank of the run refused the job (``rank``; ``refusal``: its line, said there), so this
    rank stops too, with the refusal's status (``looplib.process.board``)."""

    status = EXIT_CONFIG

    def __init__(self, rank: int, refusal: str):
        super().__init__(f"rank {rank} refused the job")
        self.rank, self.refusal = rank, refusal


def exit_status(signum: int | None) -> int:
    return EXIT_INTERRUPTED if signum == signal.SIGINT else EXIT_PREEMPTED


def signal_name(signum: int | None) -> str:
    return signal.Signals(signum).name if signum else "a signal"


class Interrupted(RunEnded):
    """A signal stopped the run: at once (before training, or a second Ctrl-C), or at a step
    boundary after saving (``result`` then holds what was trained, its ``state.step`` the
    checkpoint's step). ``status``: 75 or 130, as the CLI exits."""

    def __init__(self, signum: int | None, result=None):
        super().__init__(signal_name(signum))
        self.signum, self.status, self.result = signum, exit_status(signum), result


def need(module: str, extra: str, setting: str, what: str | None = None, otherwise: str | None = None,
         package: str | None = None):
    """Import the optional ``module`` and return it, or raise the one ``ConfigError`` line that
    names ``setting`` and the extra that installs it (``pip install 'looplib[extra]'``).

    ``what``: who needs it, as the user chose it (default: ``setting``); ``otherwise``: a choice
    that works without it; ``package``: its name on the package index, where not ``module``'s."""
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError as err:
        package = package or module.split(".")[0]
        raise ConfigError(setting, f"{what or setting} needs the {package} package, which does not import ({err})",
                          f"pip install 'looplib[{extra}]'" + (f", or {otherwise}" if otherwise else "")) from None
