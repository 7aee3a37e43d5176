"""How a metric spreads over clients: mean, std, the worst tenth and the fairness gap."""

from __future__ import annotations

import math

import numpy as np


def client_spread(values: list[float | None]) -> dict[str, float]:
    """Unweighted statistics over the clients with a value (None: no value): ``mean``,
    ``std`` (population), ``worst10`` (mean of the ceil(n/10) lowest) and ``gap`` (mean of
    the ceil(n/10) highest minus ``worst10``). Empty when no client has a value."""
    present = np.sort(np.array([v for v in values if v is not None], dtype=np.float64))
    if present.size == 0:
        return {}
    tenth = math.ceil(present.size / 10)
    worst = float(present[:tenth].mean())
    return {
        "mean": float(present.mean()),
        "std": float(present.std()),
        "worst10": worst,
        "gap": float(present[-tenth:].mean()) - worst,
    }
