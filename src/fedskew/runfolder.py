"""The run folder: config, partition, per-round metrics and a final summary.

A run is written under ``<name>.incomplete`` and renamed to ``<name>`` only when it
finishes, so a crashed or killed run never looks like a finished one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from fedskew.data.partition import load_partition, save_partition
from fedskew.errors import FedskewError

INCOMPLETE = ".incomplete"


def check_writable(out_dir: Path) -> None:
    """Fail early, with one line, when the output directory cannot be written."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".fedskew-write-probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise FedskewError(f"cannot write to output dir {out_dir}: {exc.strerror or exc}") from None


class RunFolder:
    def __init__(self, root: Path, name: str) -> None:
        self.root = root
        self.name = name
        self.path = root / (name + INCOMPLETE)

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
        folder = cls(path.parent, path.name[: -len(INCOMPLETE)])
        return folder

    @property
    def checkpoint_path(self) -> Path:
        return self.path / "checkpoint.npz"

    def read_config(self) -> dict[str, Any]:
        return json.loads((self.path / "config.json").read_text(encoding="utf-8"))

    def read_partition(self) -> list[np.ndarray]:
        return load_partition(self.path / "partition.npz")[0]

    def read_metrics(self, up_to_round: int) -> list[dict[str, Any]]:
        """Metrics of rounds 1..up_to_round; later lines (from after the last checkpoint)
        are dropped from the file, since those rounds will be run again."""
        path = self.path / "metrics.jsonl"
        rows = []
        for row in read_jsonl(path):
            if row.get("round", 0) > up_to_round:
                break
            rows.append(row)
        if path.exists():
            path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        return rows

    def write_config(self, config: dict[str, Any]) -> None:
        _write_json(self.path / "config.json", config)

    def write_partition(self, partition: list[np.ndarray], meta: dict[str, Any]) -> None:
        save_partition(self.path / "partition.npz", partition, meta)

    def append_metrics(self, record: dict[str, Any]) -> None:
        _append_jsonl(self.path / "metrics.jsonl", record)

    def append_process(self, record: dict[str, Any]) -> None:
        """One line per process that worked on this run (a resumed run has several), so a
        result says which machine computed which rounds."""
        _append_jsonl(self.path / "processes.jsonl", record)

    def read_processes(self) -> list[dict[str, Any]]:
        return read_jsonl(self.path / "processes.jsonl")

    def finish(self, summary: dict[str, Any]) -> Path:
        _write_json(self.path / "summary.json", summary)
        final = self.root / self.name
        os.replace(self.path, final)
        self.path = final
        return final


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file up to the first line that does not parse (one cut by a
    kill mid-write, or being written now); none if the file does not exist."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def _append_jsonl(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=_jsonable) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
