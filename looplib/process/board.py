"""The launch's board: what one rank says that every other rank of the launch must hear, also
before the process group exists or after a rank has gone: a refusal.

Under torchrun a rank that exits makes the launcher stop the others (SIGTERM, then SIGKILL after
its grace period). A refusal found by one rank (rank 1 refusing a setting first, rank 0 refusing
a run directory another run holds) would otherwise reach the others only as "stopped (SIGTERM)"
or a lost rank, and a job script reading ``LOOPLIB_EXIT_FILE`` would requeue a refused command
forever. So a refusing rank posts its line here before it exits; a rank that stops for any
reason first looks here, and says it stopped because rank N refused (exit status 2).

- The board is a key-value store every rank reaches: torchrun's own (its agent's store, there
  from the start, alive while any worker lives), else the process group's (from the moment it is
  up). One process: no board; a refusal is said where it is found.
- Identical lines from several ranks are said once (by the first rank to post it); a different
  line is said too. Never lost: the rank that refuses says it, whatever rank it is.
- ``check_in``: before the process group starts, every rank waits here, in Python, for the others
  (a refusal posted meanwhile ends the wait). A process blocked in the group's rendezvous in C++
  never runs its signal handler, so a rank waiting for a peer that refused would be killed
  silently by the launcher 30 s later.

What the board remembers (the store it reached, the jobs this process has run, the key under
which it counted itself as knowing of a refusal) lives in one ``Board``, held by this process's
``looplib.process.Process`` (``looplib.process.this().board``).
"""
from __future__ import annotations

import datetime
import hashlib
import os
import time

import torch.distributed as dist

from ..errors import PeerRefused


def world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def agent_store() -> bool:
    """torchrun's workers reach their agent's store from the start (it hosts the rendezvous)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_ADDR" in os.environ \
        and "MASTER_PORT" in os.environ


class Board:
    """The launch's board as this process sees it. One per process (``looplib.process.this()``)."""

    def __init__(self):
        self.agent = None          # torchrun's agent store, once reached
        self.jobs = 0              # jobs this process has run to their end (a sweep's, or train_model called again): each its own keys
        self.knowing: str | None = None  # the key under which this process counted itself as knowing of a refusal

    def key(self, name: str, per_job: bool = True) -> str:
        """One key space per launch and restart (torchrun --max-restarts starts a fresh one), and per
        job within them (every rank runs the same jobs in the same order)."""
        return "looplib/{}/{}/{}{}".format(os.environ.get("TORCHELASTIC_RUN_ID", "run"),
                                           os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
                                           f"job{self.jobs}/" if per_job else "", name)

    def job_done(self) -> None:
        """This process's job has ended (``looplib.run.session.Session``): the next one reads a clean board."""
        self.jobs += 1

    def store(self):
        """The store of this launch, or None (one process; another launcher before the group is up)."""
        if world() <= 1:
            return None
        if self.agent is None and agent_store():
            try:
                self.agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                           timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
            except Exception:  # noqa: BLE001 - no board: the refusal is still said by the rank that found it
                return None
        if self.agent is not None:
            return self.agent
        if dist.is_initialized():
            try:
                from torch.distributed.distributed_c10d import _get_default_store
                return _get_default_store()
            except Exception:  # noqa: BLE001
                return None
        return None

    def knows(self, s) -> None:
        """This rank refused, or has read another's refusal: counted once (``heard`` waits for all)."""
        if self.knowing != self.key("knows"):
            self.knowing = self.key("knows")
            try:
                s.add(self.knowing, 1)
            except Exception:  # noqa: BLE001
                pass

    def post_refusal(self, line: str) -> bool:
        """This rank refuses the job with ``line`` (the first refusal of the launch is the one the others
        name). True when this rank says the line: no rank has said that exact line yet."""
        s = self.store()
        if s is not None:
            try:
                s.compare_set(self.key("refused"), "", f"{rank()}\n{line}")  # the first one stays
            except Exception:  # noqa: BLE001 - the board is gone (the launcher is stopping)
                pass
            self.knows(s)
        return self.says(line)

    def heard(self, timeout_s: float = 60.0) -> None:
        """A refusing rank, its line said, waits before it exits until every rank of the launch knows
        of the refusal (refused itself, or read it here), at most ``timeout_s``: torchrun stops the
        others the moment one exits, and a rank still importing or composing its config when the
        launcher's SIGTERM comes dies without a word."""
        s = self.store()
        if s is None or self.knowing is None:  # (this rank neither refused nor read a refusal)
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if s.add(self.knowing, 0) >= world():
                    return
            except Exception:  # noqa: BLE001 - the board is gone: nobody left to wait for
                return
            time.sleep(0.05)

    def says(self, line: str) -> bool:
        """True when this rank is the first of the launch to say ``line`` (identical lines said once)."""
        s = self.store()
        if s is None:
            return True
        try:
            return s.add(self.key("said/" + hashlib.sha1(line.encode()).hexdigest()), 1) == 1
        except Exception:  # noqa: BLE001 - no board to ask: say it
            return True

    def refusal(self) -> PeerRefused | None:
        """A refusal another rank of this launch posted (None: none, or no board)."""
        s = self.store()
        if s is None:
            return None
        try:
            if not s.check([self.key("refused")]):
                return None
            who, _, line = s.get(self.key("refused")).decode().partition("\n")
        except Exception:  # noqa: BLE001
            return None
        if int(who) == rank():
            return None
        self.knows(s)
        return PeerRefused(int(who), line)

    def check_in(self, timeout_s: float) -> None:
        """Before the process group starts (torchrun): wait until every rank of the launch has come
        this far, or one has refused (``PeerRefused``). Waits in Python, so a signal is handled."""
        s = self.store() if agent_store() else None
        if s is None:
            return
        try:
            s.add(self.key("checked_in", per_job=False), 1)
        except Exception:  # noqa: BLE001 - the group's rendezvous will report what is wrong
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            refused = self.refusal()
            if refused is not None:
                raise refused
            try:
                if s.add(self.key("checked_in", per_job=False), 0) >= world():
                    return
            except Exception:  # noqa: BLE001
                return
            time.sleep(0.05)
