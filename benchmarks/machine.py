"""The benchmarks' machine description is the package's (fedskew.machine)."""

from fedskew.machine import describe

__all__ = ["describe"]
