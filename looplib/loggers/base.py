"""The logger protocol (``Logger``, the null object), ``metrics.jsonl`` (``JsonLines``), the
fan-out to several loggers (``Loggers``), and what a logger learns when a run starts (``Run``).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("looplib")


@dataclass
class Run:
    """What a logger learns when the run starts."""
    dir: Path                        # the run directory
    config: dict                     # the resolved config, plain dicts and lists
    name: str                        # a short name: the job's overrides, or the run directory's name
    group: str | None = None         # the sweep (multirun directory) this job belongs to; None: a single run
    resumed_from: int = 0            # the checkpoint step a resumed run continues after (0: a fresh run)
    logged: dict[str, int] = field(default_factory=dict)  # per key: the last step an earlier attempt wrote


class Logger:
    """The null object: keeps nothing. Subclass it and override the verbs you need."""

    def start(self, run: Run) -> None:
        pass

    def log(self, row: dict) -> None:
        pass

    def finish(self, status: str, artefacts: dict[str, str]) -> None:
        pass


class JsonLines(Logger):
    """``metrics.jsonl``: one JSON object per row, appended, line-buffered. Always on."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.file = open(self.path, "a", buffering=1)

    def log(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")

    def finish(self, status: str = "finished", artefacts: dict[str, str] | None = None) -> None:
        self.file.close()


class Loggers(Logger):
    """Several loggers as one. A logger that fails to finish does not stop the others."""

    def __init__(self, *loggers: Logger):
        self.loggers = loggers

    def start(self, run: Run) -> None:
        for logger in self.loggers:
            logger.start(run)

    def log(self, row: dict) -> None:
        for logger in self.loggers:
            logger.log(row)

    def finish(self, status: str, artefacts: dict[str, str]) -> None:
        for logger in self.loggers:
            try:
                logger.finish(status, artefacts)
            except Exception as err:  # noqa: BLE001 - the run's own outcome matters more
                log.warning("logger %s did not finish cleanly: %s", type(logger).__name__, err)


def logged_steps(metrics: Path) -> dict[str, int]:
    """Per key, the last step at which ``metrics.jsonl`` holds it: what an earlier attempt of
    this run sent its trackers (read before a resume cuts the rows past the checkpoint)."""
    last: dict[str, int] = {}
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                for key in row:
                    last[key] = max(last.get(key, 0), row.get("step", 0))
    return last
