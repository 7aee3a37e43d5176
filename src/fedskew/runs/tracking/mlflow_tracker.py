"""MLflow: one MLflow run per run folder, in the experiment named after the grid (or
"fedskew"), with tags setting, method and seed; metrics with step = round, the config as
params, the run folder's files and report as artifacts.

By default MLflow keeps its runs in a SQLite database, ``<track dir>/mlflow.db``, and the
artifacts under ``<track dir>/mlartifacts``; ``MLFLOW_TRACKING_URI`` names another store
(a server, another database)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from fedskew.runs.tracking.base import FAILED, KILLED, RunInfo, Tracker, flat, not_an_id, outside

# MLflow's limits: params per logging call, and characters of a param value.
PARAMS_PER_CALL = 100
PARAM_CHARS = 6000
STATUS = {FAILED: "FAILED", KILLED: "KILLED"}
SQLITE = "sqlite:///"


def tracking_uri(root: Path) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"{SQLITE}{root / 'mlflow.db'}"


def experiment_id(client: MlflowClient, name: str, root: Path) -> str:
    """The experiment called ``name``, created when missing (with the artifact store next to
    the default database)."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    location = None if os.environ.get("MLFLOW_TRACKING_URI") else (root / "mlartifacts").as_uri()
    try:
        return client.create_experiment(name, artifact_location=location)
    except MlflowException:  # another run created it meanwhile
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


class MlflowTracker(Tracker):
    name = "mlflow"

    @staticmethod
    def prepare_shared(root: Path) -> None:
        """The database (its tables), made once before runs write to it side by side."""
        root.mkdir(parents=True, exist_ok=True)
        MlflowClient(tracking_uri=tracking_uri(root)).search_experiments(max_results=1)

    @classmethod
    def saved_problem(cls, saved: dict[str, Any], run: RunInfo, folder: Path) -> str | None:
        """The store must be the one this process would use (MLFLOW_TRACKING_URI, or the
        database in the trackers' folder) or a database inside the run's folders: a store
        named in the run folder alone could be anywhere, a server elsewhere included."""
        if "run_id" in saved and not_an_id(saved["run_id"]):
            return f"names the run {not_an_id(saved['run_id'])}"
        uri = saved.get("tracking_uri")
        mine = tracking_uri(run.root)
        if uri is None or uri == mine:
            return None
        if (
            isinstance(uri, str)
            and uri.startswith(SQLITE)
            and not outside(uri[len(SQLITE) :], run, folder)
        ):
            return None
        return (
            f"names the store {uri!r}, not this run's ({mine}); to continue there, set "
            "MLFLOW_TRACKING_URI to it"
        )

    def __init__(self, run: RunInfo, saved: dict[str, Any]) -> None:
        super().__init__(run, saved)
        self.uri = saved.get("tracking_uri") or tracking_uri(run.root)
        self.client = MlflowClient(tracking_uri=self.uri)
        if saved.get("run_id"):
            self.run_id = str(saved["run_id"])
            self.client.update_run(self.run_id, status="RUNNING")
            return
        run.root.mkdir(parents=True, exist_ok=True)
        exp = experiment_id(self.client, run.project, run.root)
        tags = {**run.tags, "fedskew.run": run.name}
        self.run_id = self.client.create_run(exp, run_name=run.name, tags=tags).info.run_id
        params = [Param(k, v[:PARAM_CHARS]) for k, v in flat(run.config).items()]
        for start in range(0, len(params), PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=params[start : start + PARAMS_PER_CALL])

    def ids(self) -> dict[str, Any]:
        return {"tracking_uri": self.uri, "run_id": self.run_id}

    def log_round(self, step: int, values: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, step) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def log_finish(self, summary: dict[str, Any], files: list[Path], report: Path | None) -> None:
        for path in files:
            self.client.log_artifact(self.run_id, str(path))
        if report is not None:
            self.client.log_artifacts(self.run_id, str(report), "report")

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, STATUS.get(status, "FINISHED"))
