"""What run folders hold, read back for tables and reports: one :class:`RunRecord` per run.

Everything here comes from the files a run writes (config.json with its "resolved" facts,
metrics.jsonl, summary.json, processes.jsonl, partition.npz) and, for a grid made by
``fedskew compare``, the grid's ``compare.json``. Nothing is typed in: a fact a run folder
does not record is shown as :data:`NOT_RECORDED`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedskew.core.durable import read_jsonl
from fedskew.core.errors import FedskewError
from fedskew.data.partition import load_partition, partition_digest
from fedskew.metrics.client_spread import is_local_evaluation_key

NOT_RECORDED = "not recorded"
INCOMPLETE = ".incomplete"
MANIFEST = "compare.json"
MANIFEST_FORMAT = "fedskew-compare-1"
# Metrics lines keys that every run writes; any other number in a line is an extra metric
# of the algorithm or of an evaluation asked for (personal accuracy, feature quality, ...).
STANDARD_KEYS = frozenset(
    {
        "round", "clients", "samples", "bytes_down", "bytes_up", "exchanges", "seconds",
        "train_loss", "accuracy", "loss", "client_dist_accuracy", "per_class_accuracy",
        "eval_seconds", "skipped",
    }
)  # fmt: skip
IMAGE_PATTERN = re.compile(r"t-?sne", re.IGNORECASE)


@dataclass
class RunRecord:
    """One run folder, read back."""

    folder: Path
    setting: str  # "" when the grid has one setting
    method: str
    seed: int
    config: dict[str, Any]  # config.json without "resolved"
    resolved: dict[str, Any]
    metrics: list[dict[str, Any]]
    summary: dict[str, Any] | None  # None while the run is unfinished
    processes: list[dict[str, Any]]
    partition_digest: str | None = None  # of the clients' sample indices, None when unknown
    images: list[Path] = field(default_factory=list)  # t-SNE pictures the run wrote
    # Largest client state at the end (bytes), from the last checkpoint or else the summary;
    # filled in by whoever may read checkpoints (fedskew.apps.compare), None when neither has it.
    client_state_bytes: int | None = None
    client_state_clients: int | None = None

    @property
    def finished(self) -> bool:
        return self.summary is not None

    @property
    def rounds_planned(self) -> int:
        return int(self.config.get("rounds", 0))

    def series(self, key: str) -> list[tuple[int, float]]:
        """(round, value) of every metrics line that has a number under ``key``."""
        return [
            (int(r["round"]), float(r[key]))
            for r in self.metrics
            if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)
        ]

    @property
    def compute_seconds(self) -> float:
        """What its rounds took as recorded: training, evaluation and measurements."""
        return sum(
            float(v)
            for row in self.metrics
            for k, v in row.items()
            if (k == "seconds" or k.endswith("_seconds"))
            and isinstance(v, (int, float))
            and not isinstance(v, bool)
        )

    def extra_metric_names(self) -> list[str]:
        names: dict[str, None] = {}
        for row in self.metrics:
            for key, value in row.items():
                if key in STANDARD_KEYS or isinstance(value, bool):
                    continue
                if is_local_evaluation_key(key):  # a table of their own (client_spread)
                    continue
                if isinstance(value, (int, float)):
                    names[key] = None
        return list(names)


def estimated_seconds(records: list[RunRecord], setting: str, method: str) -> float | None:
    """What a whole run of ``method`` in ``setting`` takes, judged from the finished runs:
    the median of those of the same setting and method, else of the setting (same model and
    data, another method), else None."""
    finished = [r for r in records if r.finished]
    for like in (
        [r for r in finished if (r.setting, r.method) == (setting, method)],
        [r for r in finished if r.setting == setting],
    ):
        if like:
            times = sorted(r.compute_seconds for r in like)
            mid = len(times) // 2
            return times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2
    return None


def read_run(folder: Path, setting: str = "", method: str | None = None) -> RunRecord:
    """The run in ``folder`` (finished or ``.incomplete``)."""
    folder = Path(folder)
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FedskewError(f"cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise FedskewError(f"{path} is not a run configuration")
    resolved = config.pop("resolved", {}) or {}
    summary_path = folder / "summary.json"
    summary = None
    if summary_path.exists():
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
    seed = int(config.get("seed", 0))
    return RunRecord(
        folder=folder,
        setting=setting,
        method=method if method is not None else method_label(folder.name, config),
        seed=seed,
        config=config,
        resolved=resolved,
        metrics=read_jsonl(folder / "metrics.jsonl"),
        summary=summary,
        processes=read_jsonl(folder / "processes.jsonl"),
        partition_digest=recorded_partition_digest(folder, resolved),
        images=sorted(
            p for p in folder.rglob("*.png") if IMAGE_PATTERN.search(p.name) and p.is_file()
        ),
    )


def method_label(folder_name: str, config: dict[str, Any]) -> str:
    """A run's method: its folder name without ``-s<seed>`` (as ``fedskew compare`` names
    runs), else the algorithm with its non-default options."""
    name = folder_name.removesuffix(INCOMPLETE)
    suffix = f"-s{config.get('seed', 0)}"
    if name.endswith(suffix) and len(name) > len(suffix):
        return name[: -len(suffix)]
    label = str(config.get("algorithm", "run"))
    if config.get("feature_matching"):
        label += "+fm"
    params = config.get("params") or {}
    if params:
        label += " " + " ".join(f"{k}={v}" for k, v in sorted(params.items()))
    return label


def recorded_partition_digest(folder: Path, resolved: dict[str, Any]) -> str | None:
    """The digest of the clients' sample indices: from the folder's partition.npz (what the
    run used), else from what config.json recorded when the run started; None when neither
    has it (folders written before config.json recorded it, without partition.npz)."""
    path = folder / "partition.npz"
    if path.exists():
        return partition_digest(load_partition(path)[0])  # a bad file: a one-line error
    digest = resolved.get("partition_digest")
    return digest if isinstance(digest, str) else None


def is_run_folder(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def read_manifest(root: Path) -> dict[str, Any] | None:
    path = Path(root) / MANIFEST
    if not path.is_file():
        return None
    manifest = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise FedskewError(f"{path} is not a fedskew compare manifest")
    return manifest


def find_runs(root: Path) -> list[RunRecord]:
    """The runs under ``root``: a run folder itself, a grid written by ``fedskew compare``
    (its compare.json names settings, methods and folders), or any folder whose run folders
    sit directly in it or one level down (one setting per subfolder)."""
    root = Path(root)
    if not root.is_dir():
        raise FedskewError(f"{root} is not a folder")
    if is_run_folder(root):
        return [read_run(root)]
    manifest = read_manifest(root)
    if manifest is not None:
        records = []
        for run in manifest["runs"]:
            folder = root / run["folder"]
            if not is_run_folder(folder):
                folder = folder.with_name(folder.name + INCOMPLETE)
            if is_run_folder(folder):
                records.append(read_run(folder, run["setting"], run["method"]))
        return records
    records = []
    for child in sorted(root.iterdir()):
        if is_run_folder(child):
            records.append(read_run(child))
        elif child.is_dir():
            for grandchild in sorted(child.iterdir()):
                if is_run_folder(grandchild):
                    records.append(read_run(grandchild, setting=child.name))
    if not records:
        raise FedskewError(f"no run folders (with config.json) in {root} or its subfolders")
    return records


# ------------------------------------------------------------------------- provenance


def _fact(value: Any) -> str:
    if value is None or value == "":
        return NOT_RECORDED
    return str(value)


def machine_spans(record: RunRecord) -> str:
    """Which machine computed which rounds (a resumed run may span machines)."""
    done = len(record.metrics)
    spans: list[list[Any]] = []  # [first round, last round, description]
    for p in record.processes:
        first = int(p.get("from_round", 1))
        what = (
            f"{_fact(p.get('cpu'))}, {_fact(p.get('cores'))} cores, "
            f"{_fact(p.get('memory_gib'))} GiB"
        )
        if spans:
            spans[-1][1] = first - 1
        elif first > 1:
            spans.append([1, first - 1, NOT_RECORDED])
        if spans and spans[-1][2] == what:
            continue
        spans.append([first, done, what])
    if not spans:
        return f"{NOT_RECORDED} (no processes.jsonl)"
    spans[-1][1] = done
    return "; ".join(f"r{a}-{b}: {m}" for a, b, m in spans if b >= a)


def machines(record: RunRecord) -> list[str]:
    """The machines that computed the run's rounds, in order, without repeats: the GPU's
    name for runs on one, else the CPU model (as processes.jsonl records them)."""
    names = []
    for p in record.processes:
        on_gpu = str(p.get("device", "cpu")) != "cpu" and p.get("device_name")
        names.append(str(p["device_name"] if on_gpu else p.get("cpu") or NOT_RECORDED))
    return list(dict.fromkeys(names)) or [NOT_RECORDED]


def _distinct(values: list[str]) -> str:
    seen = list(dict.fromkeys(values))
    return ", ".join(seen) if seen else NOT_RECORDED


def provenance(record: RunRecord) -> dict[str, str]:
    """Where a run's numbers came from, as the run folder records it."""
    procs = record.processes
    git = []
    for p in procs:
        if p.get("git_commit"):
            git.append(str(p["git_commit"])[:10] + (" (modified)" if p.get("git_dirty") else ""))
        elif "git_commit" in p:
            git.append("none (not a git checkout)")
    torch = [str(p["torch"]) for p in procs if p.get("torch")]
    if not torch and record.resolved.get("torch_version"):
        torch = [str(record.resolved["torch_version"])]
    fedskew = [str(p["fedskew"]) for p in procs if p.get("fedskew")]
    if not fedskew and record.resolved.get("fedskew_version"):
        fedskew = [str(record.resolved["fedskew_version"])]
    others = []
    for package in ("numpy", "scikit-learn", "flwr"):
        found = [f"{package} {p[package]}" for p in procs if p.get(package)]
        others.extend(found)
    sources = [str(p["data_source"]) for p in procs if p.get("data_source")]
    if not sources and record.resolved.get("dataset_source"):
        sources = [str(record.resolved["dataset_source"])]
    devices = [str(p["device"]) for p in procs if p.get("device")]
    threads = [str(p["torch_threads"]) for p in procs if p.get("torch_threads")]
    return {
        "machine": machine_spans(record),
        "device": _distinct(devices),
        "torch": _distinct(torch),
        "torch threads": _distinct(threads),
        "fedskew": _distinct(fedskew),
        "git commit": _distinct(git),
        "other packages": _distinct(others),
        "data source": _distinct(sources),
        "engine": _fact(record.config.get("engine")),
    }
