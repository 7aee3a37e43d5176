"""A short description of the machine a run or benchmark ran on, for run folders and results."""

from __future__ import annotations

import os
import platform

import torch


def machine_facts() -> dict[str, str | int]:
    """CPU, cores, memory, OS and torch of this machine: what a run folder records."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gib = 0
    try:
        with open("/proc/meminfo", encoding="utf-8") as fh:
            mem_gib = round(int(fh.readline().split()[1]) / 1024**2)
    except (OSError, ValueError, IndexError):
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count() or 0,
        "memory_gib": mem_gib,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }
