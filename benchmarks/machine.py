"""The benchmarks' machine description is the package's (fedskew.machine)."""

from fedskew.machine import machine_facts

__all__ = ["machine_facts"]
