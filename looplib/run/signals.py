"""Signals: preemption (SIGTERM, SIGUSR1) and Ctrl-C (SIGINT), one handler for a whole run.

    before training starts   nothing is worth saving: the signal stops the run at once
                             (``Interrupted`` is raised wherever the process is: building data,
                             a model, loading a checkpoint) and what this run wrote is removed
    while training           a flag (no I/O in the handler): at the next optimizer-step
                             boundary the run saves a checkpoint and stops
    a second Ctrl-C          stops at once (``Interrupted``); checkpoints are written beside
                             their place and renamed, so the last complete one stays intact
                             (under torchrun, whose agent forwards each Ctrl-C to its workers,
                             the agent stops them: it kills them after its grace period)
    after the last step      the final checkpoint and weights are written; the run ends as
                             finished (its work is done), without the sample (a signal during
                             the sample stops it at once: ``Signals.at_once``)

Exit statuses: 75 (EX_TEMPFAIL) after SIGTERM/SIGUSR1, so a scheduler may requeue the job with
``resume=auto``; 130 (128 + SIGINT, the shell's convention) after Ctrl-C.

A worker of a launcher (torchrun, the ``deepspeed`` launcher) whose launcher dies (SIGKILL, out of
memory) is told nothing: torchrun starts each worker in a session of its own, so a signal to the
launcher's process group does not reach it, and it would train on, unattended, to the end. So a
worker watches its launcher (``LauncherWatch``: a thread that compares ``os.getppid()`` with the
launcher's pid once a second) and, once the launcher is gone, sends itself SIGTERM: it saves at
the next step boundary and exits 75, as on a preemption. Why not ``prctl(PR_SET_PDEATHSIG)``: it
fires when the *thread* that started the worker ends, not its process (a launcher that starts
workers from a helper thread would stop them while it lives), it is Linux only, and it is set
only once the worker runs Python (a launcher dead before then is never signalled); the parent's
pid, read at import and compared, has none of these gaps.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
from contextlib import contextmanager

from ..errors import Interrupted, exit_status, signal_name

log = logging.getLogger("looplib")
PARENT = os.getppid()  # read as early as looplib is imported: the launcher, for a launcher's worker
WATCH_S = 1.0  # how often a launcher's worker looks for its launcher


def launcher_pid() -> int | None:
    """The pid of the launcher that started this process as one of its workers (torchrun, the
    ``deepspeed`` launcher: its parent), or None (started by hand, by a shell or by SLURM, whose
    step daemon ends its tasks itself)."""
    if "TORCHELASTIC_RUN_ID" in os.environ or ("CROSS_RANK" in os.environ and "LOCAL_SIZE" in os.environ):
        return PARENT
    return None


class LauncherWatch:
    """A daemon thread that sends this process SIGTERM once its launcher ``pid`` is gone (the
    process was re-parented: ``os.getppid()`` changed); ``stop`` ends it."""

    def __init__(self, pid: int, every: float = WATCH_S):
        self.pid, self.every, self.gone = pid, every, False
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.watch, name="looplib-launcher-watch", daemon=True)
        self.thread.start()

    def watch(self) -> None:
        while not self.done.wait(self.every):
            if os.getppid() != self.pid:
                self.gone = True
                log.warning("the launcher that started this process (pid %d) is gone: stopping at the next step "
                            "boundary with a checkpoint, as on SIGTERM", self.pid)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    def stop(self) -> None:
        self.done.set()


class Signals:
    """The run's handler for SIGTERM, SIGUSR1 and SIGINT; ``deferred()`` marks the training
    phase, where a signal only sets a flag that the loop reads at step boundaries."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    current: "Signals | None" = None     # the process's handler, like the OS handlers it installs

    def __init__(self):
        self.signum: int | None = None   # the first signal received (decides the exit status)
        self.ctrl_c = 0                  # Ctrl-C presses
        # torchrun's agent forwards the terminal's Ctrl-C to its workers, which then get it twice:
        # there the agent owns "stop at once" (it kills its workers after a grace period)
        self.second_stops = "TORCHELASTIC_RUN_ID" not in os.environ
        self.defer = False
        self.training = False            # deferred() was entered: the run got as far as training
        self.finished = False            # set by finish(): later signals are ignored
        self.reason: str | None = None   # stop(): the run's own reason to stop early (no signal)
        self.peer_signalled = False      # the stop was agreed with a rank that got a signal (Checkpoints)
        self._previous: dict = {}
        self.watch: LauncherWatch | None = None  # a launcher's worker: its launcher, watched

    def _handler(self, signum, frame):
        if self.finished:  # the run is over (cleaning up, exiting): nothing left to interrupt
            return
        self.signum = self.signum or signum
        self.ctrl_c += signum == signal.SIGINT
        if not self.defer or (self.ctrl_c >= 2 and self.second_stops):  # nothing to save yet, or a second Ctrl-C
            raise Interrupted(signum)

    def __enter__(self) -> "Signals":
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handler)
        Signals.current = self
        launcher = launcher_pid()
        if launcher is not None and self.watch is None:
            self.watch = LauncherWatch(launcher)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        if self.watch is not None:
            self.watch.stop()

    @contextmanager
    def deferred(self):
        """While training: a signal sets the flag; the loop saves and stops at the next boundary.
        A signal that arrived just before is acted on at the first boundary."""
        self.defer = self.training = True
        try:
            yield self
        finally:
            self.defer = False

    @contextmanager
    def at_once(self):
        """Work that is worth nothing once a stop is asked for (the end-of-run sample): a signal
        ends it at once (``Interrupted`` inside it, swallowed here), and the run ends as after a
        signal following its last step. ``requested`` tells whether it was cut short."""
        defer, self.defer = self.defer, False
        try:
            yield self
        except Interrupted:
            pass
        finally:
            self.defer = defer

    def finish(self) -> None:
        """The run has ended (or is reporting how it ended): a signal now changes nothing, and
        cannot kill the process on its way out. Ignored by the OS, not by a Python handler:
        the interpreter puts the default action (death) back while it shuts down, and a
        launcher's SIGTERM to a rank still exiting would otherwise end it with -15."""
        self.finished = True
        if self.watch is not None:
            self.watch.stop()
        self.launcher_lost()
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_IGN)

    def launcher_lost(self) -> None:
        """A stop the ranks agreed at a step boundary before this rank's watch looked: where its
        launcher is gone too, this rank stops as the others do (SIGTERM, exit 75), not as finished."""
        if self.signum is None and self.watch is not None and os.getppid() != self.watch.pid:
            self.watch.gone, self.signum = True, signal.SIGTERM

    def stop(self, reason: str) -> None:
        """Stop at the next step boundary, after saving, as on SIGTERM, for a reason of the run's
        own (``looplib.cli.sweep``: the study pruned this trial). The exit status stays 0."""
        self.reason = self.reason or reason

    @property
    def requested(self) -> bool:
        return self.signum is not None or self.reason is not None

    @property
    def status(self) -> int:
        return exit_status(self.signum) if self.signum is not None or self.reason is None else 0

    @property
    def name(self) -> str:
        if self.signum is None and self.reason:
            return self.reason
        gone = self.watch is not None and self.watch.gone and self.signum == signal.SIGTERM
        return signal_name(self.signum) + (f": its launcher, pid {self.watch.pid}, is gone" if gone else "")


@contextmanager
def held():
    """A few instructions that no signal may split (e.g. two renames that swap a checkpoint):
    SIGTERM, SIGUSR1 and SIGINT are blocked, and delivered when the block ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, Signals.SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
