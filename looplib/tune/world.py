"""The tuners under torchrun: one per rank, each starting its own child for every candidate run,
agreeing on every outcome, and stopping together however one of them is stopped.

The tuners talk through the launcher's key-value store (torchrun's rendezvous store), never a
collective: every wait polls, so a tuner waiting for the others sees a stop asked by any rank
(a signal to one tuner: ``stop`` posts it, every rank's ``stopped`` reads it) and leaves at once
instead of waiting forever in a collective its signalled peer will not join. The end of the
search is a named exchange (``end``), apart from the numbered ones a stop can leave unmatched,
and no rank leaves before rank 0 has written tune.json.
"""
from __future__ import annotations

import os
import pickle
import time
from datetime import timedelta

from ..errors import Interrupted

SEVERITY = ["measured", "diverged", "oom", "error"]   # the ranks agree on the worst


class World:
    """This tuner's rank among ``size``, and the store the tuners share."""

    POLL_S = 0.05

    def __init__(self, timeout_s: float = 1800.0):
        import torch.distributed as dist
        from ..process.launcher import export_torch_env
        export_torch_env()
        store, rank, size = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout_s)))
        self.store, self.rank, self.size = dist.PrefixStore("looplib-tune", store), rank, size
        self.timeout_s, self.seq = timeout_s, 0
        self.own = None  # a signal this rank received: () -> signum or None (the driver's Signals)
        self.posted = False

    # ------------------------------------------------------------------ a stop, from any rank
    def stopped(self) -> int | None:
        """The signal that stops the search: this rank's own (posted for the others), or one
        another rank posted."""
        own = self.own() if self.own is not None else None
        if own is not None:
            self.stop(own)
            return own
        if self.store.check(["stop"]):
            return int(self.store.get("stop").decode().split(",")[0])
        return None

    def stop(self, signum: int) -> None:
        if not self.posted:
            self.posted = True
            self.store.set("stop", f"{signum},{self.rank}")

    def stopped_by(self) -> int | None:
        """The rank whose signal stopped the search (None: not stopped)."""
        if not self.store.check(["stop"]):
            return None
        return int(self.store.get("stop").decode().split(",")[1])

    # ------------------------------------------------------------------ exchanges
    def wait(self, keys: list[str], stoppable: bool = True, timeout_s: float | None = None) -> bool:
        """Until every key is there (True); a stop asked meanwhile raises ``Interrupted``; past
        ``timeout_s`` (a rank gone without a word): False."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while not self.store.check(keys):
            if stoppable:
                signum = self.stopped()
                if signum is not None:
                    raise Interrupted(signum)
            if time.monotonic() > deadline:
                return False
            time.sleep(self.POLL_S)
        return True

    def exchange(self, obj, name: str | None = None, ranks=None, stoppable: bool = True,
                 timeout_s: float | None = None) -> list:
        """Every rank's ``obj`` (those of ``ranks`` only), in rank order (None for a rank that did
        not answer within ``timeout_s``)."""
        if name is None:
            self.seq += 1
            name = str(self.seq)
        ranks = range(self.size) if ranks is None else ranks
        if self.rank in ranks:
            self.store.set(f"{name}/{self.rank}", pickle.dumps(obj))
        keys = [f"{name}/{r}" for r in ranks]
        if not self.wait(keys, stoppable, timeout_s):
            return [pickle.loads(self.store.get(k)) if self.store.check([k]) else None for k in keys]
        return [pickle.loads(self.store.get(k)) for k in keys]

    def gather(self, obj, name: str | None = None, **kwargs) -> list:
        return self.exchange(obj, name, **kwargs)

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank."""
        return self.exchange(obj, ranks=[0])[0]

    def agree(self, outcome):
        """One outcome for every rank: the worst status, or rank 0's measurement."""
        everyone = self.gather(outcome)
        worst = max(everyone, key=lambda o: SEVERITY.index(o.status))
        return everyone[0] if worst.status == "measured" else worst

    def child_env(self) -> dict:
        """The identity of this rank's child, and a fresh port (rank 0's choice) for its group."""
        from ..process.launcher import free_port
        port = self.broadcast(free_port() if self.rank == 0 else None)
        # the child's rank 0 hosts its own store on the fresh port (under torchrun the agent hosts
        # the tuners' store, and torch would otherwise wait for an agent's store on that port)
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.size), "MASTER_PORT": str(port),
                "LOCAL_RANK": os.environ.get("LOCAL_RANK", "0"), "TORCHELASTIC_USE_AGENT_STORE": "False"}

    def close(self, together: bool = True) -> None:
        """Leave: the other ranks after rank 0 (which writes tune.json; without torchrun's agent it
        also hosts the store). ``together=False`` (an error on this rank): at once."""
        if not together:
            return
        if self.rank == 0:
            self.store.set("written", b"1")
            self.wait([f"left/{r}" for r in range(1, self.size)], stoppable=False, timeout_s=60)
        else:
            self.wait(["written"], stoppable=False, timeout_s=300)
            self.store.set(f"left/{self.rank}", b"1")
