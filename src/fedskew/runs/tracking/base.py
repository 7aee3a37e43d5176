"""What every tracker backend gets: the run it tracks (:class:`RunInfo`) and one interface
(:class:`Tracker`) for the session that feeds it the rounds."""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from fedskew.config import ExperimentConfig
from fedskew.runs.folder import RunFolder

# How a run that stops ends in a tracker that knows run states (MLflow's, W&B's exit code).
FINISHED, FAILED, KILLED = "finished", "failed", "killed"


@dataclass(frozen=True)
class RunInfo:
    """One run as the trackers name and group it.

    ``name`` is the run folder's path under ``root`` without ``.incomplete``: for fedskew
    compare's layout (``<grid>/<setting>/<method>-s<seed>``, with ``root`` the grid folder)
    that is ``setting/method-s<seed>``, which also gives ``setting`` and ``method``."""

    root: Path  # where trackers keep their files
    name: str
    project: str  # MLflow experiment, W&B project
    setting: str  # "" outside a grid with settings
    method: str
    seed: int
    config: dict[str, Any]  # config.json of the run folder, "resolved" facts included

    @property
    def tags(self) -> dict[str, str]:
        tags = {
            "method": self.method,
            "seed": str(self.seed),
            "algorithm": str(self.config.get("algorithm")),
            "dataset": str(self.config.get("dataset")),
            "partition": str(self.config.get("partition")),
        }
        if self.setting:
            tags["setting"] = self.setting
        return tags


def run_info(cfg: ExperimentConfig, folder: RunFolder) -> RunInfo:
    out = folder.root.resolve()
    root = Path(cfg.track_dir).resolve() if cfg.track_dir else out
    try:
        rel = (out / folder.name).relative_to(root)
    except ValueError:  # a track_dir that does not hold the run folder
        rel = Path(folder.name)
    setting = "" if rel.parent == Path(".") else rel.parent.as_posix()
    suffix = f"-s{cfg.seed}"
    method = rel.name[: -len(suffix)] if rel.name.endswith(suffix) else cfg.algorithm
    return RunInfo(
        root=root,
        name=rel.as_posix(),
        project=root.name if cfg.track_dir else "fedskew",
        setting=setting,
        method=method,
        seed=cfg.seed,
        config=folder.read_config(),
    )


# Lists of a metrics line that trackers get one scalar per entry of, named
# ``<list>/<index>`` (TensorBoard groups them under the list's name). Per-client lists
# (``clients``, ``client_accuracy``) stay out: a federation of thousands of clients would
# make thousands of series; their statistics (``client_accuracy_mean``, ...) are numbers.
PER_ENTRY = ("per_class_accuracy",)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics.jsonl line, the round (the step) left out, and the entries of
    its PER_ENTRY lists as ``per_class_accuracy/<class index>`` (a class without test
    samples, None, has none); other lists and flags are not scalars."""
    out = {key: value for key, value in record.items() if key != "round" and _number(value)}
    for key in PER_ENTRY:
        values = record.get(key)
        if isinstance(values, list):
            out.update({f"{key}/{i}": v for i, v in enumerate(values) if _number(v)})
    return out


def flat(values: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config tables as dotted keys with text values (MLflow params)."""
    out: dict[str, str] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat(value, name + "."))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value, default=str)
    return out


class Tracker(ABC):
    """One backend's view of one run. The session calls ``log_round`` for each round not
    yet logged (also rounds of an earlier process, on resume), ``log_finish`` once the run
    folder is finished, and ``close`` once, however the run ends. Any of them may raise:
    the session then warns and stops using the tracker, never the run."""

    name: ClassVar[str]

    @classmethod
    def saved_problem(cls, saved: dict[str, Any], run: RunInfo, folder: Path) -> str | None:
        """Why this tracker's entry of tracking.json (``saved``) must not be used to continue
        its run, or None. tracking.json is a file of the run folder ``folder``, read back
        like the checkpoint: a path it names must stay inside the trackers' folder
        (``run.root``) or the run folder, an id must be one this tracker makes."""
        return None

    def __init__(self, run: RunInfo, saved: dict[str, Any]) -> None:
        """Start the run in the backend, or reopen the one ``saved`` names (this tracker's
        entry of the run folder's tracking.json; empty for a new run)."""
        self.run = run

    @abstractmethod
    def ids(self) -> dict[str, Any]:
        """What finds this run in the backend again (kept in tracking.json)."""

    @abstractmethod
    def log_round(self, step: int, values: dict[str, float]) -> None: ...

    @abstractmethod
    def log_finish(self, summary: dict[str, Any], files: list[Path], report: Path | None) -> None:
        """The summary, the run folder's ``files`` and the folder of its report (report.md,
        its pictures, report.html) as artifacts, where the backend keeps files."""

    @abstractmethod
    def close(self, status: str) -> None: ...


def outside(value: Any, run: RunInfo, folder: Path) -> str | None:
    """Why a path read back from tracking.json is not one a tracker may write to: not a
    string, or outside both the trackers' folder and the run folder once links are
    followed (as the paths of a run configuration); None when it is inside."""
    if not isinstance(value, str) or not value or "\x00" in value:
        return f"{value!r}, which is not a path"
    path = Path(value).resolve()
    for root in (run.root, folder):
        if path.is_relative_to(Path(root).resolve()):
            return None
    return f"{value}, outside this run's folders ({run.root})"


def not_an_id(value: Any) -> str | None:
    """Why a run id read back from tracking.json is not one (letters, digits, - and _)."""
    if isinstance(value, str) and re.fullmatch(r"[A-Za-z0-9_-]{1,64}", value):
        return None
    return f"{value!r}, which is not a run id"
