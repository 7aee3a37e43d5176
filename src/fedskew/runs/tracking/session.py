"""The trackers of one run, fed from the run loop: the run folder stays the source of truth.

A tracker that fails (a full disk, a database gone, a server away) is warned about once and
then left alone: the run goes on and changes in nothing. What each tracker has logged is kept
in the run folder's ``tracking.json``, so that a resumed run continues each tracker's run
(the same MLflow run, W&B run id and TensorBoard folder) from the first round it lacks:
rounds are never logged twice, and rounds a tracker missed (it failed, or was added on
resume) are logged from metrics.jsonl.
"""

from __future__ import annotations

import importlib
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from fedskew.config import ExperimentConfig
from fedskew.core.durable import write_bytes_durably
from fedskew.core.errors import FedskewError, UsageError
from fedskew.runs.folder import RunFolder
from fedskew.runs.tracking.base import FAILED, FINISHED, RunInfo, Tracker, run_info, scalars

log = logging.getLogger("fedskew")

STATE = "tracking.json"
STATE_FORMAT = "fedskew-tracking-1"
# name: (module, class, what pip installs it)
BACKENDS = {
    "tensorboard": (
        "fedskew.runs.tracking.tensorboard_tracker",
        "TensorBoardTracker",
        "TensorBoard",
    ),
    "mlflow": ("fedskew.runs.tracking.mlflow_tracker", "MlflowTracker", "MLflow"),
    "wandb": ("fedskew.runs.tracking.wandb_tracker", "WandbTracker", "Weights & Biases"),
}
# Files of the finished run folder that trackers keep as artifacts (those that exist).
ARTIFACTS = ("summary.json", "config.json", "metrics.jsonl", "processes.jsonl")


def tracker_class(name: str) -> type[Tracker]:
    """The backend of ``name``, its package imported; a one-line UsageError naming the extra
    to install when the package is missing."""
    module, cls, package = BACKENDS[name]
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as exc:
        raise UsageError(
            f"--track {name} needs {package}, which is not installed here: "
            f"pip install 'fedskew[{name}]' ({exc})"
        ) from None


def check_available(names: list[str]) -> None:
    for name in names:
        tracker_class(name)


def prepare(cfgs: list[ExperimentConfig]) -> None:
    """Before runs start side by side (fedskew compare): check the packages, and create
    what they would otherwise all create at once (the MLflow database and experiment)."""
    seen: set[tuple[str, ...]] = set()
    for cfg in cfgs:
        for name in cfg.track:
            key = (name, str(cfg.track_dir or cfg.out_dir))
            if key in seen:
                continue
            seen.add(key)
            backend = tracker_class(name)
            shared = getattr(backend, "prepare_shared", None)
            if shared is not None:
                shared(Path(cfg.track_dir or cfg.out_dir).resolve())


def read_state(folder: Path) -> dict[str, dict[str, Any]]:
    path = folder / STATE
    if not path.is_file():
        return {}
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        log.warning("%s cannot be read (%s): trackers start new runs", path, exc)
        return {}
    trackers = state.get("trackers") if isinstance(state, dict) else None
    return {k: v for k, v in (trackers or {}).items() if isinstance(v, dict)}


def check_saved_trackers(cfg: ExperimentConfig, folder: RunFolder) -> None:
    """Refuse, in one line, to continue the tracker runs that tracking.json names where one
    of this run's trackers would write elsewhere than the run's folders (a log folder
    outside them, another MLflow store) or under a name that is not an id: the file is an
    input of the resume, like the checkpoint."""
    saved = read_state(folder.path) if cfg.track else {}
    info: RunInfo | None = None
    for name in cfg.track:
        if not saved.get(name):
            continue
        info = info or run_info(cfg, folder)
        why = tracker_class(name).saved_problem(saved[name], info, folder.path)
        if why:
            raise FedskewError(
                f"{folder.path / STATE}: its {name} entry {why}; remove the entry to start "
                f"a new {name} run"
            )


class TrackingSession:
    """Feeds the trackers of ``cfg.track``; an empty session (no trackers) does nothing."""

    def __init__(self, folder: RunFolder | None = None) -> None:
        self.folder = folder
        self.trackers: dict[str, Tracker] = {}
        self.state: dict[str, dict[str, Any]] = {}
        self.closed = False

    @classmethod
    def start(
        cls, cfg: ExperimentConfig, folder: RunFolder, history: list[dict[str, Any]]
    ) -> TrackingSession:
        """Open each tracker of ``cfg.track`` and log the rounds of ``history`` (those of an
        earlier process) it has not logged yet."""
        session = cls(folder)
        if not cfg.track:
            return session
        saved = read_state(folder.path)
        session.state = dict(saved)  # a tracker that fails to start here keeps its ids
        info: RunInfo | None = None
        for name in cfg.track:
            try:
                info = info or run_info(cfg, folder)
                session.trackers[name] = tracker_class(name)(info, saved.get(name, {}))
            except Exception as exc:  # noqa: BLE001 - a tracker never stops the run
                session._warn(name, "could not start", exc)
                continue
            done = int(saved.get(name, {}).get("logged_through", 0))
            session.state[name] = {**session.trackers[name].ids(), "logged_through": done}
        session._write_state()
        for record in history:
            session.log_round(record)
        return session

    def log_round(self, record: dict[str, Any]) -> None:
        step = int(record["round"])
        values = scalars(record)
        changed = False
        for name, tracker in list(self.trackers.items()):
            if step <= self.state[name]["logged_through"]:
                continue  # logged by an earlier process of this run
            if self._call(name, "could not log a round", tracker.log_round, step, values):
                self.state[name]["logged_through"] = step
                changed = True
        if changed:
            self._write_state()

    def finish(self, folder: Path, summary: dict[str, Any]) -> None:
        """The finished run folder's summary, files and report, then each run closed."""
        if self.trackers:
            files = [folder / name for name in ARTIFACTS if (folder / name).is_file()]
            with tempfile.TemporaryDirectory(prefix="fedskew-report-") as tmp:
                report = self._report(folder, Path(tmp))
                for name, tracker in list(self.trackers.items()):
                    self._call(name, "could not log the summary", tracker.log_finish,
                               summary, files, report)  # fmt: skip
        self.close(FINISHED)

    def close(self, status: str) -> None:
        """End each tracker's run with ``status`` (finished, failed, killed); once."""
        if self.closed:
            return
        self.closed = True
        for name, tracker in list(self.trackers.items()):
            self._call(name, "could not close its run", tracker.close, status)
        self.trackers.clear()

    def _report(self, folder: Path, out: Path) -> Path | None:
        try:  # imported here: the report draws with matplotlib, which a run may not need
            from fedskew.runs.tracking.run_report import write_run_report

            write_run_report(folder, out)
        except Exception as exc:  # noqa: BLE001 - the report is an extra for the trackers
            log.warning("tracking: no report of %s for the trackers: %s", folder, exc)
            return None
        return out

    def _call(self, name: str, what: str, method: Any, *args: Any) -> bool:
        try:
            method(*args)
        except Exception as exc:  # noqa: BLE001 - a tracker never stops the run
            self._warn(name, what, exc)
            tracker = self.trackers.pop(name, None)
            if tracker is not None and what != "could not close its run":
                try:  # let it release what it holds (files, a service process)
                    tracker.close(FAILED)
                except Exception:  # noqa: BLE001, S110 - already warned about this tracker
                    pass
            return False
        return True

    def _warn(self, name: str, what: str, exc: Exception) -> None:
        text = str(exc).strip().splitlines()
        log.warning(
            "tracking with %s stopped: it %s (%s: %s); the run goes on, and its folder keeps "
            "every round (a resume logs the rounds it missed)",
            name, what, type(exc).__name__, text[0] if text else "",
        )  # fmt: skip

    def _write_state(self) -> None:
        if self.folder is None or not self.state:
            return
        text = json.dumps({"format": STATE_FORMAT, "trackers": self.state}, indent=2) + "\n"
        try:
            write_bytes_durably(self.folder.path / STATE, text.encode("utf-8"))
        except OSError as exc:
            log.warning("tracking: cannot write %s: %s", self.folder.path / STATE, exc)
