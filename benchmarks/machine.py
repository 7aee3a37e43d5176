"""The benchmarks' machine description is the package's (fedskew.core.machine)."""

from fedskew.core.machine import machine_facts

__all__ = ["machine_facts"]
