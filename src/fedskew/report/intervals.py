"""Intervals of paired differences over seeds: the Student-t interval of their mean.

The same seed gives every method the same partition, initial model and clients, so a
method's difference to the reference is taken per seed; over n seeds, the interval of the
mean difference is ``mean ± t(1 - (1 - level) / 2, n - 1) * s / sqrt(n)`` with ``s`` the
sample standard deviation. With one seed there is no interval (and none is printed). No
p-values: the interval and the count of seeds where the method is ahead say as much, and
say how many seeds the claim rests on.

The t quantile is computed here rather than taken from SciPy (not a dependency of fedskew):
for an integer number of degrees of freedom the central probability P(|T| < t) has a
closed form in theta = atan(t / sqrt(df)) (Abramowitz and Stegun 26.7.3 and 26.7.4), which
is monotone in theta and is inverted by bisection to double precision.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

LEVEL = 0.95


def central_probability(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with ``df`` degrees of freedom (A&S 26.7.3-4)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    return _central(math.atan(abs(t) / math.sqrt(df)), df)


def _central(theta: float, df: int) -> float:
    s, c = math.sin(theta), math.cos(theta)
    if df % 2 == 0:
        # sin(theta) * (1 + 1/2 c^2 + 1*3/(2*4) c^4 + ... up to c^(df-2))
        term = total = 1.0
        for k in range(2, df, 2):
            term *= (k - 1) / k * c * c
            total += term
        return s * total
    if df == 1:
        return 2 * theta / math.pi
    # 2/pi * (theta + sin(theta) * (c + 2/3 c^3 + 2*4/(3*5) c^5 + ... up to c^(df-2)))
    term = total = c
    for k in range(3, df, 2):
        term *= (k - 1) / k * c * c
        total += term
    return 2 / math.pi * (theta + s * total)


def t_quantile(level: float, df: int) -> float:
    """The t with P(|T| < t) = ``level``: the half-width factor of a two-sided interval
    (``level`` 0.95 gives the 0.975 quantile: 12.706 for 1 degree of freedom, 2.776 for 4)."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    low, high = 0.0, math.pi / 2
    for _ in range(200):  # the bracket halves each step; 60 reach double precision
        mid = (low + high) / 2
        if mid in (low, high):
            break
        if _central(mid, df) < level:
            low = mid
        else:
            high = mid
    return math.sqrt(df) * math.tan((low + high) / 2)


@dataclass(frozen=True)
class PairedSummary:
    """The paired differences of one method to the reference over the seeds both ran."""

    n: int  # seeds
    mean: float
    std: float | None  # sample standard deviation; None with one seed
    low: float | None  # the interval; None with one seed
    high: float | None
    ahead: int  # seeds where the difference is > 0
    level: float = LEVEL

    @property
    def excludes_zero(self) -> bool:
        return self.low is not None and self.high is not None and (self.low > 0 or self.high < 0)

    def markdown(self) -> str:
        """``+1.23 [-0.40, +2.86]; ahead in 2/3 seeds`` (one seed: no interval)."""
        seeds = f"{self.n} seed{'s' if self.n != 1 else ''}"
        if self.low is None or self.high is None:
            value = f"{self.mean:+.2f} ({seeds}: no interval)"
        else:
            value = f"{self.mean:+.2f} [{self.low:+.2f}, {self.high:+.2f}]"
        return f"{value}; ahead in {self.ahead}/{seeds}"


def paired_summary(diffs: Sequence[float], level: float = LEVEL) -> PairedSummary | None:
    """Mean, sample std, Student-t interval and seeds ahead; None without a difference."""
    n = len(diffs)
    if n == 0:
        return None
    mean = math.fsum(diffs) / n
    ahead = sum(d > 0 for d in diffs)
    if n == 1:
        return PairedSummary(1, mean, None, None, None, ahead, level)
    std = math.sqrt(math.fsum((d - mean) ** 2 for d in diffs) / (n - 1))
    half = t_quantile(level, n - 1) * std / math.sqrt(n)
    return PairedSummary(n, mean, std, mean - half, mean + half, ahead, level)
