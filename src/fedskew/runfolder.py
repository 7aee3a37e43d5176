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

from fedskew.data.partition import save_partition
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

    def write_config(self, config: dict[str, Any]) -> None:
        _write_json(self.path / "config.json", config)

    def write_partition(self, partition: list[np.ndarray], meta: dict[str, Any]) -> None:
        save_partition(self.path / "partition.npz", partition, meta)

    def append_metrics(self, record: dict[str, Any]) -> None:
        with open(self.path / "metrics.jsonl", "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")

    def finish(self, summary: dict[str, Any]) -> Path:
        _write_json(self.path / "summary.json", summary)
        final = self.root / self.name
        os.replace(self.path, final)
        self.path = final
        return final


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
