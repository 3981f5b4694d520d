"""What the bundled trackers share (``Tracker``): the run id kept in ``<run dir>/trackers.json``
for resumed runs, the rows an earlier attempt already sent left out, the config flattened."""
from __future__ import annotations

import json
from typing import Any

from ..atomic import write_atomic
from ..errors import need
from .base import Logger, Run

IDS = "trackers.json"  # in the run directory: each tracker's run id, for resumed runs


class Tracker(Logger):
    """What the bundled trackers share: the run id kept in the run directory, and on resume
    the rows an earlier attempt already sent left out (a tracker cannot take rows back). A
    tracker first chosen when a run is resumed gets the rows before the checkpoint first."""
    name = "tracker"  # the key in trackers.json

    def start(self, run: Run) -> None:
        self.run = run
        self.continued = self.stored_id() is not None
        self.skip = dict(run.logged) if self.continued else {}

    def catch_up(self) -> None:
        """A resumed run this tracker did not see start: send it metrics.jsonl's rows so far."""
        metrics = self.run.dir / "metrics.jsonl"
        if self.run.resumed_from and not self.continued and metrics.exists():
            for line in metrics.read_text().splitlines():
                if line.strip():
                    self.log(json.loads(line))

    def stored_id(self) -> str | None:
        """This tracker's run id from an earlier attempt of this run (resumed runs only)."""
        path = self.run.dir / IDS
        if not self.run.resumed_from or not path.exists():
            return None
        return json.loads(path.read_text()).get(self.name)

    def store_id(self, run_id: str) -> None:
        path = self.run.dir / IDS
        ids = json.loads(path.read_text()) if path.exists() else {}
        ids[self.name] = run_id
        write_atomic(path, json.dumps(ids, indent=1) + "\n")

    def fresh(self, row: dict) -> dict:
        """The row's numbers the tracker does not have yet (``step`` left out)."""
        step = row["step"]
        return {k: v for k, v in row.items()
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
                and step > self.skip.get(k, 0)}


def flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 1e-3}}`` -> ``{"optim.lr": 1e-3}``; lists and None as text."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        elif isinstance(value, (bool, int, float, str)):
            out[name] = value
        else:
            out[name] = json.dumps(value) if isinstance(value, list) else str(value)
    return out


def need_tracker(module: str, extra: str, option: str):
    """Import a tracker library, or refuse with the one line that says what to install."""
    return need(module, extra, f"logger.{option}", f"+logger={option}", f"leave out +logger={option}")
