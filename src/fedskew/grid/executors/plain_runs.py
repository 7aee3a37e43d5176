"""Planned runs and their outcomes as plain JSON-able data: what a Ray task receives and
returns, and what a Slurm array's runs list holds (never pickled objects)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedskew.config import build_config
from fedskew.grid.launch import Outcome
from fedskew.grid.plan import Grid, PlannedRun
from fedskew.report.tables import Options


def run_data(run: PlannedRun) -> dict[str, Any]:
    return {
        "setting": run.setting,
        "method": run.method,
        "seed": run.seed,
        "folder": run.folder,
        "values": run.values,
    }


def planned_from(data: dict[str, Any]) -> PlannedRun:
    values = dict(data["values"])
    cfg = build_config(values, {})
    return PlannedRun(
        data["setting"], data["method"], int(data["seed"]), data["folder"], values, cfg
    )


def outcome_data(outcome: Outcome) -> dict[str, Any]:
    return {
        "status": outcome.status,
        "detail": outcome.detail,
        "seconds": outcome.seconds,
        "returncode": outcome.returncode,
        "round": outcome.round,
    }


def outcome_from(run: PlannedRun, data: dict[str, Any]) -> Outcome:
    return Outcome(
        run, data["status"], data["detail"], data["seconds"], data["returncode"],
        data.get("round"),
    )  # fmt: skip


def one_run_grid(root: Path, threads: int | None) -> Grid:
    """A grid of the runs in ``root`` for launch.run_grid to run one of them; ``threads``
    None: the cores this process may use (what the batch system allotted)."""
    return Grid(
        out_dir=root, base={}, methods={}, settings={}, seeds=[], options=Options(),
        jobs=1, threads=threads,
    )  # fmt: skip
