"""Weights & Biases: one W&B run per run folder, in the project named after the grid (or
"fedskew"), grouped by setting, job type = method; step = round.

Offline unless the user says otherwise: with ``WANDB_MODE`` set, W&B does as it says;
without it, a run is online only when ``WANDB_API_KEY`` is set. Offline runs are kept in
``<track dir>/wandb/offline-run-*`` for ``wandb sync``. A resumed run goes on under the
same run id (offline: a further offline-run folder of that id)."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import wandb

from fedskew.runs.tracking.base import FINISHED, RunInfo, Tracker, not_an_id


def mode() -> str | None:
    """The W&B mode to ask for; None leaves it to W&B (WANDB_MODE is set)."""
    if os.environ.get("WANDB_MODE"):
        return None
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def wait_for_a_new_second(folder: Path, run_id: str) -> None:
    """W&B names a run's local folder by the second it starts in (local time): a resume in
    the same second as the process before it would share, and overwrite, that folder."""
    while any(folder.glob(f"*-{time.strftime('%Y%m%d_%H%M%S')}-{run_id}")):
        time.sleep(0.05)


class WandbTracker(Tracker):
    name = "wandb"

    @classmethod
    def saved_problem(cls, saved: dict[str, Any], run: RunInfo, folder: Path) -> str | None:
        """The id names W&B's run folders under the trackers' folder: an id only. (The
        saved project and folder are not used: they come from the run's configuration.)"""
        if "id" in saved and not_an_id(saved["id"]):
            return f"names the run {not_an_id(saved['id'])}"
        return None

    def __init__(self, run: RunInfo, saved: dict[str, Any]) -> None:
        super().__init__(run, saved)
        # The id goes to tracking.json, so that a resume reopens this W&B run.
        self.id = str(saved.get("id") or uuid.uuid4().hex[:12])
        run.root.mkdir(parents=True, exist_ok=True)
        if saved.get("id"):
            wait_for_a_new_second(run.root / "wandb", self.id)
        self.wb = wandb.init(
            project=run.project,
            dir=str(run.root),
            id=self.id,
            name=run.name,
            group=run.setting or None,
            job_type=run.method,
            tags=[f"seed-{run.seed}", str(run.config.get("dataset"))],
            config=run.config,
            mode=mode(),
            resume="allow",
            reinit="create_new",  # several runs in one process (fedskew.run from code)
            # Leave the process's output alone: fedskew prints its own.
            settings=wandb.Settings(silent=True, console="off"),
        )

    def ids(self) -> dict[str, Any]:
        return {"id": self.id, "project": self.run.project, "dir": str(self.run.root)}

    def log_round(self, step: int, values: dict[str, float]) -> None:
        self.wb.log(dict(values), step=step)

    def log_finish(self, summary: dict[str, Any], files: list[Path], report: Path | None) -> None:
        self.wb.summary.update(
            {k: v for k, v in summary.items() if isinstance(v, (int, float, str))}
        )
        # Copies in the W&B run's own files: the report's folder is temporary.
        keep = Path(self.wb.dir)
        for path in files:
            shutil.copy2(path, keep / path.name)
            self.wb.save(str(keep / path.name), base_path=str(keep), policy="now")
        if report is not None:
            shutil.copytree(report, keep / "report", dirs_exist_ok=True)
            for path in sorted((keep / "report").rglob("*")):
                if path.is_file():
                    self.wb.save(str(path), base_path=str(keep), policy="now")

    def close(self, status: str) -> None:
        self.wb.finish(exit_code=0 if status == FINISHED else 1)
