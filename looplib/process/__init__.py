"""The process wing: what one process of a launch knows and says to the others, whatever engine
trains in it (engines keep placement and gradient sync: ``looplib.engines``).

    launcher     who this process is (rank, world, local rank) as the launcher said, the command
                 that starts it again, and a rank lost during the run
    group        the process group: started once per process, torn down at exit
    collectives  the verbs that talk to the other ranks of a job (``Ranks``: one process;
                 ``GroupRanks``: a process group), named by each engine (``Engine.collectives``)
    board        the launch's refusal board: a refusal one rank finds, heard by every rank

What a process remembers between jobs (the board's store and job count; whether the
``${looplib.rank0_dir:...}`` resolver answers as rank 0) is held by one ``Process``, made once
per process: ``this()``. A process is one process, so it is a singleton rather than an argument
handed through the command line, the session, the data lock and the run's endings, which all
read it; ``reset()`` starts a fresh one (tests).
"""
from __future__ import annotations

from .board import Board


class Process:
    """This process's part in a launch: its view of the refusal board, and whether the run
    directory resolver answers as rank 0 does (``looplib.cli.resolvers.resolving_as_rank0``)."""

    def __init__(self):
        self.board = Board()
        self.as_rank0 = False


_THIS = Process()


def this() -> Process:
    """The one ``Process`` of this process."""
    return _THIS


def reset() -> Process:
    """A fresh ``Process`` in place of this one (a test that runs several launches in one process)."""
    global _THIS
    _THIS = Process()
    return _THIS


__all__ = ["Board", "Process", "this", "reset"]
