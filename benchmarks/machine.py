"""The benchmarks' machine description is the package's (fedskew.core.machine), and the
load average the timing results record beside it."""

import os

from fedskew.core.machine import machine_facts

__all__ = ["load1", "machine_facts"]


def load1() -> float:
    """The 1-minute load average, rounded: how busy the machine was around a timing."""
    return round(os.getloadavg()[0], 2)
