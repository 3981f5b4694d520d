"""How sure tune is: an interval for each candidate's job time as a multiple of the reference's.

Each measuring run of a candidate predicts the job's time (``objective.predict``); a candidate
measured in n runs and the reference in m runs give a ratio of their geometric means and a 95%
interval for it: Welch's t-interval on the logarithms of the predicted times (unequal variances,
Welch-Satterthwaite degrees of freedom, rounded down). The runs of the leaders are interleaved
with the reference's (``search``), so a drift of the machine hits both sides. The verdict:

    faster                  the whole interval is below 1
    slower                  the whole interval is above 1
    the same within noise   the interval holds 1 and lies within 1 +- resolution
    too noisy to decide     the interval holds 1 and reaches beyond the resolution
    measured once           one side has a single run: no interval
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

FASTER, SLOWER, SAME, NOISY, ONCE = "faster", "slower", "the same within noise", "too noisy to decide", "measured once"

# Student's t, two-sided 95% (0.975 quantile), by degrees of freedom; beyond 30 the normal's
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
        20: 2.086, 22: 2.074, 24: 2.064, 26: 2.056, 28: 2.048, 30: 2.042}


def t975(df: float) -> float:
    """The 0.975 quantile of Student's t at ``df`` degrees of freedom (rounded down: conservative)."""
    if df >= 31:
        return 1.96
    whole = max(int(math.floor(df)), 1)
    return T975[max(k for k in T975 if k <= whole)]


@dataclass(frozen=True)
class Ratio:
    """A candidate's job time over the reference's: ``ratio`` (the geometric means'), and its 95%
    interval [``low``, ``high``] (None when either side was measured once)."""
    ratio: float
    low: float | None
    high: float | None
    runs: int
    reference_runs: int

    def verdict(self, resolution: float) -> str:
        if self.low is None or self.high is None:
            return ONCE
        if self.high < 1:
            return FASTER
        if self.low > 1:
            return SLOWER
        if self.low >= 1 / (1 + resolution) and self.high <= 1 + resolution:
            return SAME
        return NOISY

    def text(self) -> str:
        if self.low is None:
            return f"{self.ratio:.2f}x (one run)"
        return f"{self.ratio:.2f}x [{self.low:.2f}, {self.high:.2f}]"

    def to_dict(self) -> dict:
        return {"ratio": round(self.ratio, 4), "low": None if self.low is None else round(self.low, 4),
                "high": None if self.high is None else round(self.high, 4), "runs": self.runs,
                "reference_runs": self.reference_runs}


def ratio(times: list[float], reference: list[float]) -> Ratio:
    """``times`` (a candidate's predicted job seconds, one per run) over ``reference``'s."""
    a, b = [math.log(x) for x in times], [math.log(x) for x in reference]
    diff = statistics.fmean(a) - statistics.fmean(b)
    if len(a) < 2 or len(b) < 2:
        return Ratio(math.exp(diff), None, None, len(a), len(b))
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return Ratio(math.exp(diff), math.exp(diff), math.exp(diff), len(a), len(b))
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    half = t975(df) * se
    return Ratio(math.exp(diff), math.exp(diff - half), math.exp(diff + half), len(a), len(b))


def geometric_mean(times: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in times))
