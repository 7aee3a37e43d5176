"""A short description of the machine a run or benchmark ran on, for run folders and results."""

from __future__ import annotations

import importlib.metadata
import math
import os
import platform
import subprocess
from pathlib import Path

from fedskew.version import __version__

# /proc/cpuinfo flags that decide which kernels torch runs: bf16 is native only with the
# AVX-512 BF16 or AMX instructions, else torch emulates it (far slower than fp32).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_features() -> dict[str, object]:
    """What this CPU offers torch: its kernel level (``torch_cpu_capability``: DEFAULT,
    AVX2, AVX512...), the CPU_FLAGS it shows, and whether it computes bf16 natively."""
    import torch  # here, not above: fedskew.config uses usable_cores, --help needs no torch

    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return {
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "flags": {f: f in flags for f in CPU_FLAGS},
        "native_bf16": any(f in flags for f in BF16_FLAGS),
    }


def machine_facts() -> dict[str, str | int]:
    """CPU, cores, memory, OS and torch of this machine: what a run folder records."""
    import torch  # as in cpu_features

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
    features = cpu_features()
    shown = [f for f, present in features["flags"].items() if present]  # type: ignore[union-attr]
    return {
        "cpu": cpu,
        # Two hosts named alike ("AMD EPYC") may differ in what decides speed: record it.
        "cpu_kernels": str(features["torch_cpu_capability"]),
        "cpu_flags": " ".join(shown) or "-",
        "cores": os.cpu_count() or 0,
        "memory_gib": mem_gib,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (``os.sched_getaffinity``: a
    Slurm allocation, ``taskset``, a cpuset), lowered to a container's CPU quota (cgroup
    ``cpu.max`` or ``cpu.cfs_quota_us``, rounded up) where one is set."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


def cgroup_cpu_quota() -> float | None:
    """CPUs' worth of time the cgroup of this process may use per period, or None (no
    quota, or not readable)."""
    try:  # cgroup v2: "max 100000" or "200000 100000"
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:  # cgroup v1: -1 when there is no quota
        base = Path("/sys/fs/cgroup/cpu")
        quota_us = int((base / "cpu.cfs_quota_us").read_text())
        period_us = int((base / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def available_memory_bytes() -> int | None:
    """Memory this process can still take: the kernel's MemAvailable, lowered to what the
    cgroup's limit leaves (a container, a Slurm job) where one is set; None where neither
    can be read."""
    available = None
    try:
        with open("/proc/meminfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    left = cgroup_memory_left()
    if left is not None:
        available = left if available is None else min(available, left)
    return available


def cgroup_memory_left() -> int | None:
    """The cgroup's memory limit minus its usage, or None (no limit, or not readable)."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # v2
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        try:
            limit_text = Path(limit_file).read_text().strip()
            if limit_text == "max":
                return None
            limit = int(limit_text)
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit >= 2**60:  # v1 writes "no limit" as a huge number
            return None
        return max(0, limit - usage)
    return None


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
