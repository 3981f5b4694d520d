"""``train_model(..., engine=DDP())`` under torchrun, always with ``resume="auto"`` (the same command
starts the run and continues it): ``torchrun --nproc_per_node 2 tests/api_torchrun_worker.py RUN_DIR``.
tests/dist/test_elastic.py stops one launch with SIGTERM and compares the continued run with an
uninterrupted one. Exits with the run's status (75 when preempted)."""
from __future__ import annotations

import sys

import torch

from looplib import RunEnded, train_model
from looplib.data import RandomTokens
from looplib.engines import DDP
from looplib.models import GPT


def main(run_dir: str) -> int:
    torch.manual_seed(0)
    model = GPT(vocab_size=64, seq_len=16, n_layer=1, n_head=2, d_model=32)
    try:
        train_model(model, RandomTokens(256, 16, 64), max_steps=40, batch_size=4, accum_steps=2, engine=DDP("cpu"),
                    run_dir=run_dir, checkpoint_every=2, resume="auto", log_every=1, progress="lines")
    except RunEnded as end:
        return end.status
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
