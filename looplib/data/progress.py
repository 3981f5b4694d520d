"""Progress while data is built: a tqdm bar on a terminal, plain log lines elsewhere."""
from __future__ import annotations

import logging
import os
import sys
import time

log = logging.getLogger("looplib")

PROGRESS_BYTES = 32 << 20   # inputs of this size or more show progress
LINE_EVERY_S = 30.0         # a line this often where there is no terminal


def progress(total_bytes: int, what: str):
    """For inputs of ``PROGRESS_BYTES`` or more: a tqdm bar on a terminal (bytes, rate, time left),
    else a plain line every ``LINE_EVERY_S`` seconds (``Lines``); nothing for smaller ones."""
    from tqdm import tqdm

    if total_bytes >= PROGRESS_BYTES and not sys.stderr.isatty():
        return Lines(total_bytes, what)
    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc=what, disable=total_bytes < PROGRESS_BYTES,
                leave=False, file=sys.stderr, **bar_size())


def bar_size() -> dict:
    """tqdm's size arguments for stderr: a terminal that reports no size (a pseudo-terminal never
    sized, 0 x 0) would make tqdm hide its bar (0 rows), so such a one gets 100 x 24."""
    try:
        sized = min(os.get_terminal_size(sys.stderr.fileno())) > 0
    except (OSError, ValueError):
        sized = False
    return dict(dynamic_ncols=sized, ncols=None if sized else 100, nrows=None if sized else 24)



class Lines:
    """Progress as log lines (a log file, a batch job): what is done, the rate and the time left."""

    def __init__(self, total: int, what: str):
        self.total, self.what, self.done = total, what, 0
        self.start = self.last = time.monotonic()

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= LINE_EVERY_S:
            self.last, rate = now, self.done / max(now - self.start, 1e-9)
            log.info("%s: %d of %d MB (%.0f%%), %.1f MB/s, about %.0f s left", self.what, self.done >> 20,
                     self.total >> 20, 100 * self.done / max(self.total, 1), rate / 1e6,
                     max(self.total - self.done, 0) / max(rate, 1e-9))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
