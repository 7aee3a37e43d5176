"""A short description of the machine a run or benchmark ran on, for run folders and results."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

import torch

from fedskew.version import __version__


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


def software_facts() -> dict[str, str | bool | None]:
    """fedskew's version and git commit (where it runs from a checkout), and the versions of
    the packages that change results: what a run folder records for each process."""
    facts: dict[str, str | bool | None] = {"fedskew": __version__}
    facts.update(git_commit(Path(__file__).resolve().parent))
    for package in ("numpy", "scikit-learn", "flwr"):
        try:
            facts[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            facts[package] = None
    return facts


def git_commit(folder: Path) -> dict[str, str | bool | None]:
    """The commit of the git checkout holding ``folder`` and whether tracked files differ
    from it; None where there is no checkout (an installed wheel) or no git."""
    try:
        head = subprocess.run(
            ["git", "-C", str(folder), "rev-parse", "HEAD"],
            capture_output=True, text=True, timeout=5, check=True,
        ).stdout.strip()  # fmt: skip
        status = subprocess.run(
            ["git", "-C", str(folder), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=5, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None, "git_dirty": None}
    return {"git_commit": head or None, "git_dirty": bool(status.strip())}
