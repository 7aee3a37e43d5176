"""Planned runs and their outcomes as plain JSON-able data: what a Ray task receives and
returns, and what a Slurm array's runs list holds (never pickled objects)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedskew.config import build_config
from fedskew.core.errors import UsageError
from fedskew.grid.launch import Outcome
from fedskew.grid.plan import Grid, PlannedRun, folder_of
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


def checked_run(data: Any, root: Path, where: str) -> PlannedRun:
    """A runs list's entry as a planned run, refused in one line (``where`` names it) unless
    it is one a compare of the grid ``root`` could have written: a file edited by hand, or
    planted, must not crash with a traceback, nor train a run whose folder lies outside the
    grid (its out_dir is what the run writes into)."""
    if not isinstance(data, dict):
        raise UsageError(f"{where} is not an object")
    kinds = {"setting": str, "method": str, "seed": int, "folder": str, "values": dict}
    for key, kind in kinds.items():
        value = data.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise UsageError(f"{where}: '{key}' must be a {kind.__name__}, got {value!r}")
    setting, method, seed, folder = data["setting"], data["method"], data["seed"], data["folder"]
    if (
        folder != folder_of(setting, method, seed)
        or ".." in Path(folder).parts
        or (Path(folder).is_absolute())
    ):
        raise UsageError(
            f"{where}: folder {folder!r} is not {method}-s{seed} of setting {setting!r}"
        )
    values = data["values"]
    grid = root.resolve()
    for key in ("out_dir", "name", "track_dir"):
        if not isinstance(values.get(key), str) or "\x00" in values[key]:
            raise UsageError(f"{where}: values.{key} must be a path, got {values.get(key)!r}")
    target = (Path(values["out_dir"]) / values["name"]).resolve()
    if target != (grid / folder).resolve() or Path(values["name"]).name != values["name"]:
        raise UsageError(
            f"{where}: its run folder {values['out_dir']}/{values['name']} is not {folder} "
            f"inside the grid {grid}"
        )
    track = Path(values["track_dir"]).resolve()
    if track != grid and grid not in track.parents:
        raise UsageError(f"{where}: values.track_dir {values['track_dir']!r} is outside {grid}")
    if values.get("seed") != seed:
        raise UsageError(f"{where}: values.seed {values.get('seed')!r} is not its seed {seed}")
    return planned_from(data)


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
