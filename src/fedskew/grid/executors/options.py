"""The executor options of ``fedskew compare``: on the command line and in a compare file's
[compare] table, checked into one :class:`ExecutorSettings`."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from typing import Any

from fedskew.core.errors import UsageError
from fedskew.grid.executors import EXECUTOR_KEYS, EXECUTORS


@dataclass
class ExecutorSettings:
    executor: str = "local"
    cpus_per_run: int | None = None  # ray; default: the grid's threads, else 1
    gpus_per_run: float = 0.0  # ray; a fraction lets several runs share one GPU
    ray_address: str | None = None  # ray; None: a cluster of this machine, for this compare
    retries: int = 3  # ray: attempts after a worker or run process died
    slurm_partition: str | None = None
    slurm_time: str | None = None
    slurm_cpus: int | None = None  # default: the grid's threads, else 1
    slurm_gpus: int = 0
    slurm_mem: str | None = None
    slurm_extra: list[str] = field(default_factory=list)  # raw #SBATCH options


def add_executor_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("executor (where the runs execute; docs/comparing.md: Running a grid)")
    g.add_argument(
        "--executor",
        choices=EXECUTORS,
        help="local (default): --jobs processes here; ray: one Ray task per run; "
        "slurm: one Slurm job array task per run",
    )
    g.add_argument(
        "--cpus-per-run", type=int, metavar="N",
        help="CPUs a run takes, also its torch threads (default: --threads, else 1); "
        "local: the same as --threads",
    )  # fmt: skip
    g.add_argument(
        "--gpus-per-run", type=float, metavar="F",
        help="ray: GPUs a run takes, e.g. 0.25 for four runs per GPU (default 0)",
    )  # fmt: skip
    g.add_argument(
        "--ray-address", metavar="ADDR",
        help="ray: the cluster, HOST:PORT or auto (default: start one on this machine)",
    )  # fmt: skip
    g.add_argument(
        "--retries", type=int, metavar="N",
        help="ray: attempts after a run's worker or process died, each resuming (default 3)",
    )  # fmt: skip
    g.add_argument("--slurm-partition", metavar="NAME", help="slurm: partition (-p)")
    g.add_argument("--slurm-time", metavar="TIME", help="slurm: time limit per run, e.g. 4:00:00")
    g.add_argument(
        "--slurm-cpus", type=int, metavar="N",
        help="slurm: CPUs per run (default: --threads, else 1)",
    )  # fmt: skip
    g.add_argument("--slurm-gpus", type=int, metavar="N", help="slurm: GPUs per run (default 0)")
    g.add_argument("--slurm-mem", metavar="SIZE", help="slurm: memory per run, e.g. 8G")
    g.add_argument(
        "--slurm-extra", action="append", metavar="OPTION",
        help="slurm: another #SBATCH option, e.g. --qos=low (repeatable)",
    )  # fmt: skip
    g.add_argument(
        "--dry-run", action="store_true",
        help="slurm: write the job scripts into the grid folder, submit nothing",
    )  # fmt: skip


def executor_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The executor options given on the command line (None where not given)."""
    return {key: getattr(args, key, None) for key in EXECUTOR_KEYS}


def _positive_int(key: str, value: Any, zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero else 1):
        least = "0" if zero else "1"
        raise UsageError(f"{key.replace('_', '-')} must be an integer >= {least}, got {value!r}")
    return value


def _text(key: str, value: Any, pattern: str, example: str) -> str:
    if not isinstance(value, str) or not re.fullmatch(pattern, value):
        raise UsageError(f"{key.replace('_', '-')} must look like {example}, got {value!r}")
    return value


def settings_of(values: dict[str, Any], threads: int | None) -> ExecutorSettings:
    """Checked settings from [compare] and command-line values; ``threads`` is the grid's."""
    s = ExecutorSettings()
    executor = values.get("executor") or "local"
    if executor not in EXECUTORS:
        raise UsageError(f"executor must be one of {', '.join(EXECUTORS)}, got {executor!r}")
    s.executor = executor
    if values.get("cpus_per_run") is not None:
        s.cpus_per_run = _positive_int("cpus_per_run", values["cpus_per_run"])
    if values.get("gpus_per_run") is not None:
        gpus = values["gpus_per_run"]
        if isinstance(gpus, bool) or not isinstance(gpus, (int, float)) or not gpus >= 0:
            raise UsageError(f"gpus-per-run must be a number >= 0, got {gpus!r}")
        s.gpus_per_run = float(gpus)
    if values.get("ray_address") is not None:
        s.ray_address = _text("ray_address", values["ray_address"], r"\S+", "HOST:PORT or auto")
    if values.get("retries") is not None:
        s.retries = _positive_int("retries", values["retries"], zero=True)
    if values.get("slurm_partition") is not None:
        s.slurm_partition = _text("slurm_partition", values["slurm_partition"],
                                  r"[A-Za-z0-9_.,-]+", "gpu")  # fmt: skip
    if values.get("slurm_time") is not None:
        s.slurm_time = _text("slurm_time", values["slurm_time"], r"[0-9:-]+", "4:00:00")
    if values.get("slurm_cpus") is not None:
        s.slurm_cpus = _positive_int("slurm_cpus", values["slurm_cpus"])
    if values.get("slurm_gpus") is not None:
        s.slurm_gpus = _positive_int("slurm_gpus", values["slurm_gpus"], zero=True)
    if values.get("slurm_mem") is not None:
        s.slurm_mem = _text("slurm_mem", values["slurm_mem"], r"[0-9]+[KMGT]?", "8G")
    extra = values.get("slurm_extra")
    if extra is not None:
        extra = [extra] if isinstance(extra, str) else extra
        if not isinstance(extra, list):
            raise UsageError(f"slurm-extra must be a list of #SBATCH options, got {extra!r}")
        for line in extra:
            # One option per line, no shell text: the script runs what follows the #SBATCH.
            _text("slurm_extra", line, r"--?[A-Za-z][^\n\r]*", "--qos=low")
        s.slurm_extra = list(extra)
    if s.cpus_per_run is None:
        s.cpus_per_run = threads or 1
    if s.slurm_cpus is None:
        s.slurm_cpus = threads or 1
    return s
