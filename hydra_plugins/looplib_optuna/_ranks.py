"""The ranks of a ``hydra/sweeper=optuna`` sweep under a launcher of several processes (torchrun).

Rank 0 alone asks the study and tells it the results; it hands each batch of trials' overrides to
the other ranks, which launch the same jobs (a trial trains one configuration on every rank).
However rank 0's sweep ends, the others hear it: the end of the sweep, or a stop with rank 0's
exit status (a refusal: 2), on which each of them says in one line that it stopped because
rank 0 did, and exits with the same status (never a gloo traceback of a rank left waiting).
"""
from __future__ import annotations

import sys

from omegaconf import DictConfig, OmegaConf


class Ranks:
    """One process: nothing to hand out. Several: rank 0 decides, the others follow."""

    def __init__(self, config: DictConfig):
        from looplib.process import collectives, group, launcher
        world, _ = launcher.launched_world()
        self.collectives, self.group, self.several = collectives, group, world > 1
        self.rank = launcher.launched_rank()
        self.main = self.rank == 0
        self.told = not self.several  # the others know how the sweep ended (or there are none)
        self.in_jobs = False          # rank 0 is inside a batch of jobs the others run too
        if self.several:
            from looplib.engines.local import resolve_device
            device = launcher.process_device(resolve_device(str(OmegaConf.select(config, "device", default="auto"))))
            group.init_process_group(device)  # the run's own: every trial's engine finds it started

    def hand_out(self, jobs: list[list[str]], first: int) -> None:
        if self.several:
            self.collectives.broadcast_object(("jobs", jobs, first))

    def follow(self, launcher) -> None:
        """Launch what rank 0 hands out, until it says the sweep is over (or stopped)."""
        while True:
            kind, *rest = self.collectives.broadcast_object(None)
            if kind == "jobs":
                launcher.launch(rest[0], initial_job_idx=rest[1])
                continue
            self.close()
            if kind == "stop":
                status = rest[0]
                what = "refused this sweep" if status == 2 else f"stopped this sweep (exit {status})"
                print(f"looplib: stopped: rank 0 {what}, its line says why; rank {self.rank} stopped with it",
                      file=sys.stderr, flush=True)
                sys.exit(status)
            return

    def end(self) -> None:
        """The sweep is over: the others told, then every rank's process group closed together
        (rank 0 hosts the group's store: a rank still tearing down after it exits aborts)."""
        self.tell("end")

    def stop(self, status: int) -> None:
        """Rank 0's sweep stops with ``status``: the others stop with it (once; not while they run
        the jobs of the batch that stopped it: those end on every rank alike)."""
        if not self.in_jobs:
            self.tell("stop", status)

    def tell(self, *message) -> None:
        if self.told:
            return
        self.told = True
        self.collectives.broadcast_object(message)
        self.close()

    def close(self) -> None:
        if self.several:
            self.collectives.barrier()
            self.group.destroy_process_group()


def status_of(err: BaseException) -> int:
    """The exit status an exception ends rank 0's sweep with."""
    if isinstance(err, SystemExit):
        return err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
    if isinstance(err, KeyboardInterrupt):
        return 130
    return 1
