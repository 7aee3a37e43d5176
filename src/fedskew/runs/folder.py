"""The run folder: config, partition, per-round metrics and a final summary.

A run is written under ``<name>.incomplete`` and renamed to ``<name>`` only when it
finishes, so a crashed or killed run never looks like a finished one.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fedskew.config import (
    LEGACY,
    RESUME_MAY_CHANGE,
    ExperimentConfig,
    build_config,
    normalise_keys,
)
from fedskew.core.durable import (
    append_line_durably,
    fsync_dir,
    read_jsonl,
    refuse_non_regular,
    remove_stale_temps,
    write_bytes_durably,
)
from fedskew.core.errors import FedskewError, UsageError
from fedskew.core.locks import Busy, holder, lock, unlock
from fedskew.data.partition import load_partition, save_partition
from fedskew.report.run_status import STOPPED

INCOMPLETE = ".incomplete"
LOCK = "lock"


def check_writable(out_dir: Path) -> None:
    """Fail early, with one line, when the output directory cannot be written."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".fedskew-write-probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise FedskewError(f"cannot write to output dir {out_dir}: {exc.strerror or exc}") from None


def read_config_json(path: Path) -> dict[str, Any]:
    """A run folder's config.json as written, with one-line errors for what is not one."""
    refuse_non_regular(path, "run configuration")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise FedskewError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FedskewError(f"{path} is not a JSON file: {str(exc).splitlines()[0]}") from None
    if not isinstance(config, dict):
        raise FedskewError(f"{path} is not a run configuration (not a JSON object)")
    return config


def saved_config(
    folder: Path, changes: Mapping[str, Any] | None = None, who: str = "a resumed run"
) -> ExperimentConfig:
    """The configuration run folder ``folder`` (finished or not) ran with, as it continues:
    its config.json without the facts it recorded ("resolved"), the folder's own
    partition.npz where the partition file it named is gone (the same clients), and
    ``changes``, which may only be the execution options a resumed run may change
    (RESUME_MAY_CHANGE): anything else is a one-line error naming it. Every way back from a
    run folder (the CLI, the API, compare, the report, Flower) goes through here."""
    path = folder / "config.json"
    return config_from_saved(read_config_json(path), folder, changes, who)


def config_from_saved(
    saved: Mapping[str, Any],
    folder: Path,
    changes: Mapping[str, Any] | None = None,
    who: str = "a resumed run",
) -> ExperimentConfig:
    """:func:`saved_config` of a config.json already read (``saved``, as written)."""
    path = folder / "config.json"
    saved = dict(saved)
    saved.pop("resolved", None)
    saved = normalise_keys(saved, str(path))
    # Options added since the folder was written: the value it ran with.
    saved = {**LEGACY, **saved}
    changes = normalise_keys(dict(changes or {}), who)
    others = sorted(k for k in changes if k not in RESUME_MAY_CHANGE)
    if others:
        raise UsageError(
            f"{who} takes its configuration from the run folder; drop: {', '.join(others)}"
        )
    named = saved.get("partition_file")
    if isinstance(named, str) and named and not Path(named).exists():
        saved["partition_file"] = str(folder / "partition.npz")
    return build_config({**saved, **changes}, {})


class RunFolder:
    def __init__(self, root: Path, name: str) -> None:
        self.root = root
        self.name = name
        self.path = root / (name + INCOMPLETE)
        self._lock: int | None = None

    @classmethod
    def create(cls, root: Path, name: str) -> RunFolder:
        candidate, n = name, 1
        while (root / candidate).exists() or (root / (candidate + INCOMPLETE)).exists():
            n += 1
            candidate = f"{name}-{n}"
        folder = cls(root, candidate)
        try:
            folder.path.mkdir(parents=True)
        except OSError as exc:
            raise FedskewError(f"cannot create run folder {folder.path}: {exc.strerror}") from None
        return folder

    @classmethod
    def reopen(cls, path: Path) -> RunFolder:
        """An unfinished run folder (``<name>.incomplete``), to continue it."""
        path = Path(path)
        if not path.name.endswith(INCOMPLETE):
            if (path / "summary.json").exists():
                raise FedskewError(f"{path} is a finished run; nothing to resume")
            raise FedskewError(f"{path} is not an unfinished run folder (*{INCOMPLETE})")
        if not (path / "config.json").is_file():
            raise FedskewError(f"{path} has no config.json; cannot resume it")
        remove_stale_temps(path)  # durable writes cut by a kill, never put in place
        folder = cls(path.parent, path.name[: -len(INCOMPLETE)])
        return folder

    @property
    def checkpoint_path(self) -> Path:
        return self.path / "checkpoint.npz"

    def read_config(self) -> dict[str, Any]:
        return read_config_json(self.path / "config.json")

    def read_partition(self) -> list[np.ndarray]:
        return load_partition(self.path / "partition.npz")[0]

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    def read_metrics(self) -> list[dict[str, Any]]:
        """The metrics lines of the finished rounds, in order, checked: line N must be the
        JSON record of round N. A last line without its newline was cut by a kill while it
        was written and is left out; any other bad line is an error."""
        path = self.metrics_path
        if not path.exists():
            return []
        refuse_non_regular(path, "metrics file")
        try:
            text = path.read_bytes().decode("utf-8")
        except OSError as exc:
            raise FedskewError(f"cannot read {path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise FedskewError(f"{path} is not a metrics file (not UTF-8 text)") from None
        lines = text.split("\n")
        lines.pop()  # what follows the last newline: empty, or a line cut mid-write
        rows: list[dict[str, Any]] = []
        for number, line in enumerate(lines, start=1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if not is_round_record(row, number):
                raise FedskewError(
                    f"{path}: line {number} is not the metrics record of round {number}"
                )
            rows.append(row)
        return rows

    def keep_metrics(self, rows: list[dict[str, Any]]) -> None:
        """Rewrite metrics.jsonl with exactly ``rows`` (before a resume continues)."""
        text = "".join(json.dumps(r) + "\n" for r in rows)
        write_bytes_durably(self.metrics_path, text.encode("utf-8"))

    def write_config(self, config: dict[str, Any]) -> None:
        _write_json(self.path / "config.json", config)

    def write_partition(self, partition: list[np.ndarray], meta: dict[str, Any]) -> None:
        save_partition(self.path / "partition.npz", partition, meta)

    def append_metrics(self, record: dict[str, Any]) -> None:
        append_line_durably(self.metrics_path, json.dumps(record))

    def append_process(self, record: dict[str, Any]) -> None:
        """One line per process that worked on this run (a resumed run has several), so a
        result says which machine computed which rounds."""
        append_line_durably(self.path / "processes.jsonl", json.dumps(record, default=_jsonable))

    def read_processes(self) -> list[dict[str, Any]]:
        return read_jsonl(self.path / "processes.jsonl")

    def claim(self) -> None:
        """Hold the unfinished folder for this process until the run finishes or the process
        ends. A second process that would run it meanwhile (a second ``fedskew compare`` on
        the grid, a repeated ``--resume``) stops with the holder's pid instead of writing
        its rounds into the same files."""
        if self._lock is not None:
            return
        try:
            fd = lock(self.path / LOCK)
        except Busy as busy:
            raise FedskewError(
                f"{self.path} is being run by another process ({busy.holder}); wait for it "
                "to finish, or stop it and resume"
            ) from None
        except FileNotFoundError:
            raise FedskewError(f"{self.path} is gone (finished by another process?)") from None
        if fd is None:
            return
        try:  # the holder may have finished (removed the lock, renamed the folder) meanwhile
            same = os.path.samestat(os.fstat(fd), os.stat(self.path / LOCK))
        except OSError:
            same = False
        if not same:
            unlock(fd)
            raise FedskewError(f"{self.path} was just finished by another process")
        self._lock = fd

    def release(self) -> None:
        unlock(self._lock)
        self._lock = None

    def record_stop(self, state: str, round: int | None, rounds_done: int, reason: str) -> None:
        """Say in the unfinished folder why the run stopped (``fedskew.report.run_status``):
        ``state`` "diverged" or "failed", the round being played (1-based; None outside
        the rounds), the rounds finished and the error, so that tables and ``compare`` name
        a diverged or failed run instead of taking it for one still running."""
        record = {
            "state": state,
            "round": round,
            "rounds_done": rounds_done,
            "reason": reason,
            "stopped": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        _write_json(self.path / STOPPED, record)

    def clear_stop(self) -> None:
        """A resumed run goes on: the record of how it stopped before no longer holds."""
        (self.path / STOPPED).unlink(missing_ok=True)

    def finish(self, summary: dict[str, Any]) -> Path:
        _write_json(self.path / "summary.json", summary)
        if self._lock is not None:
            # Before the rename, so that a kill at any point leaves a finished folder that
            # holds what an uninterrupted run's does. A process that opens the lock between
            # this unlink and the rename gets the folder renamed under it and stops there.
            (self.path / LOCK).unlink(missing_ok=True)
        final = self.root / self.name
        os.replace(self.path, final)
        fsync_dir(self.root)
        self.path = final
        self.release()
        return final


def running_elsewhere(path: Path) -> str | None:
    """Who holds the unfinished run folder ``path`` ("pid N on HOST"), or None when no
    live process does."""
    return holder(Path(path) / LOCK)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_round_record(row: Any, number: int) -> bool:
    """Whether ``row`` is round ``number``'s metrics line with the fields that a resumed run
    adds up in its summary (a line that parses but lost or changed one of them is damaged)."""
    if not isinstance(row, dict) or row.get("round") != number or isinstance(row["round"], bool):
        return False
    clients = row.get("clients")
    if not isinstance(clients, list) or not all(_number(c) for c in clients):
        return False
    if not all(_number(row.get(k)) for k in ("bytes_down", "bytes_up", "seconds")):
        return False
    if any(k in row and not _number(row[k]) for k in ("samples", "eval_seconds")):
        return False
    if "accuracy" in row:  # an evaluated round: a resume continues from its values
        scores = ("accuracy", "loss", "client_dist_accuracy")
        if not all(k in row and (row[k] is None or _number(row[k])) for k in scores):
            return False
        if not isinstance(row.get("per_class_accuracy"), list):
            return False
    return True


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    text = json.dumps(obj, indent=2, default=_jsonable) + "\n"
    write_bytes_durably(path, text.encode("utf-8"))


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
