"""What run folders hold, read back for tables and reports: one :class:`RunRecord` per run.

Everything here comes from the files a run writes (config.json with its "resolved" facts,
metrics.jsonl, summary.json, processes.jsonl, partition.npz) and, for a grid made by
``fedskew compare``, the grid's ``compare.json``. Nothing is typed in: a fact a run folder
does not record is shown as :data:`NOT_RECORDED`.

Every file is read here, through :class:`fedskew.report.files.FolderFiles` (regular files
inside the folder given, nothing else), and checked here (``fedskew.report.checks``): a run
with a file that is not what it should be is left out of :func:`scan_runs` with a line that
names it, so that what the tables and plots get holds numbers where numbers belong.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedskew.core.errors import FedskewError
from fedskew.data.partition import load_partition, partition_digest
from fedskew.metrics.client_spread import is_local_evaluation_key
from fedskew.report.checks import (
    check_config,
    check_manifest,
    check_metrics,
    check_processes,
    check_summary,
)
from fedskew.report.files import Damaged, FolderFiles
from fedskew.report.run_status import RunStatus, live_holder, read_stop, status_from

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
    files: FolderFiles | None = None  # what may be read for it; None: its own folder's files
    stop: dict[str, Any] | None = None  # stopped.json of an unfinished run (run_status)
    holder: str | None = None  # the live process training it when it was read, if any

    @property
    def reader(self) -> FolderFiles:
        return self.files if self.files is not None else FolderFiles(self.folder)

    @property
    def finished(self) -> bool:
        return self.summary is not None

    @property
    def status(self) -> RunStatus:
        """Finished, diverged, failed, running or unfinished (``fedskew.report.run_status``)."""
        return status_from(self.summary, self.stop, self.holder)

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


def read_run(
    folder: Path, setting: str = "", method: str | None = None, files: FolderFiles | None = None
) -> RunRecord:
    """The run in ``folder`` (finished or ``.incomplete``), read through ``files`` (default:
    the folder's own files only); :class:`Damaged` names a file that is not what it
    should be."""
    folder = Path(folder)
    files = files if files is not None else FolderFiles(folder)
    path = folder / "config.json"
    config = check_config(files.json(path, "run configuration"), files.name(path))
    resolved = config.pop("resolved", None) or {}
    summary = None
    path = folder / "summary.json"
    if files.exists(path):
        summary = check_summary(files.json(path, "run summary"), files.name(path))
    metrics, processes = [], []
    path = folder / "metrics.jsonl"
    if files.exists(path):
        metrics = check_metrics(files.json_lines(path, "metrics file"), files.name(path))
    path = folder / "processes.jsonl"
    if files.exists(path):
        processes = check_processes(files.json_lines(path, "processes file"), files.name(path))
    stop = holder = None
    if summary is None:
        stop = read_stop(folder, files)
        holder = live_holder(folder, files)
    return RunRecord(
        folder=folder,
        setting=setting,
        method=method if method is not None else method_label(folder.name, config),
        seed=int(config.get("seed", 0)),
        config=config,
        resolved=resolved,
        metrics=metrics,
        summary=summary,
        processes=processes,
        partition_digest=recorded_partition_digest(folder, resolved, files),
        images=pictures(folder),
        files=files,
        stop=stop,
        holder=holder,
    )


def pictures(folder: Path) -> list[Path]:
    """The t-SNE pictures in the run folder and its subfolders (a linked subfolder is not
    entered; a picture is checked when it is read: :meth:`FolderFiles.picture`)."""
    found = []
    for where, subfolders, names in os.walk(folder):
        subfolders.sort()
        found += [Path(where) / n for n in names if n.endswith(".png") and IMAGE_PATTERN.search(n)]
    return sorted(found)


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


def recorded_partition_digest(
    folder: Path, resolved: dict[str, Any], files: FolderFiles | None = None
) -> str | None:
    """The digest of the clients' sample indices: from the folder's partition.npz (what the
    run used), else from what config.json recorded when the run started; None when neither
    has it (folders written before config.json recorded it, without partition.npz)."""
    path = folder / "partition.npz"
    files = files if files is not None else FolderFiles(folder)
    if files.exists(path):
        files.check(path, "partition file")
        try:
            return partition_digest(load_partition(path)[0])
        except FedskewError as exc:
            raise Damaged(str(exc)) from None
    digest = resolved.get("partition_digest")
    return digest if isinstance(digest, str) else None


def is_run_folder(path: Path) -> bool:
    """A folder with a config.json (whatever that is: reading it says whether it is one)."""
    return path.is_dir() and os.path.lexists(path / "config.json")


def read_manifest(root: Path, files: FolderFiles | None = None) -> dict[str, Any] | None:
    """The grid's compare.json, checked; None where the folder has none."""
    path = Path(root) / MANIFEST
    files = files if files is not None else FolderFiles(root)
    if not files.exists(path):
        return None
    return check_manifest(files.json(path, "compare record"), files.name(path), MANIFEST_FORMAT)


@dataclass
class Scan:
    """The runs found under a folder, and what was not read or not used, one line each."""

    files: FolderFiles
    records: list[RunRecord] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)
    manifest: dict[str, Any] | None = None  # the grid's compare.json, where it has a good one

    def add(self, folder: Path, setting: str = "", method: str | None = None) -> None:
        """The run in ``folder``, or a line saying why it is left out."""
        name = self.files.name(folder)
        if name == ".":
            name = self.files.given.name
        if self.files.outside(folder):
            self.left_out.append(f"run {name} leads outside {self.files.given}; not read")
            return
        try:
            self.records.append(read_run(folder, setting, method, self.files))
        except FedskewError as exc:
            self.left_out.append(f"run {name} left out: {exc}")

    def leave_out(self, record: RunRecord, reason: str) -> None:
        """Drop a run read earlier (a file read later was damaged)."""
        self.records.remove(record)
        self.left_out.append(f"run {self.files.name(record.folder)} left out: {reason}")

    def folders(self, folder: Path, setting: str | None = None) -> None:
        """Run folders directly in ``folder`` and, at the top (``setting`` None), one level
        down (one setting per subfolder)."""
        try:
            children = sorted(folder.iterdir())
        except OSError as exc:
            self.left_out.append(f"{self.files.name(folder)} not read: {exc.strerror or exc}")
            return
        for child in children:
            if not child.is_dir():
                continue
            if is_run_folder(child):
                self.add(child, setting or "")
            elif setting is not None:
                continue
            elif self.files.outside(child):
                self.left_out.append(
                    f"{self.files.name(child)} leads outside {self.files.given}; not read"
                )
            else:
                self.folders(child, child.name)

    def planned(self, run: dict[str, Any]) -> None:
        """A run compare.json names, where its folder exists inside the grid folder."""
        folder = self.files.given / run["folder"]
        if self.files.outside(folder):
            self.left_out.append(
                f"{MANIFEST} names the run folder {run['folder']!r}, outside "
                f"{self.files.given}; not read"
            )
            return
        if not is_run_folder(folder):
            folder = folder.with_name(folder.name + INCOMPLETE)
        if is_run_folder(folder):
            self.add(folder, run["setting"], run["method"])


def scan_runs(root: Path) -> Scan:
    """The runs under ``root``: a run folder itself, a grid written by ``fedskew compare``
    (its compare.json names settings, methods and folders), or any folder whose run folders
    sit directly in it or one level down (one setting per subfolder). Only files inside
    ``root`` are read (:class:`FolderFiles`); a run with a damaged file, a link out or a
    damaged compare.json are left out with a line each in ``Scan.left_out`` (without a good
    compare.json the folders are looked for as in a folder without one)."""
    root = Path(root)
    if not root.is_dir():
        raise FedskewError(f"{root} is not a folder")
    scan = Scan(FolderFiles(root))
    if is_run_folder(root):
        scan.add(root)
        return scan
    try:
        scan.manifest = read_manifest(root, scan.files)
    except Damaged as exc:
        scan.left_out.append(f"{exc}; its run folders were looked for by name")
    if scan.manifest is not None:
        for run in scan.manifest.get("runs", []):
            scan.planned(run)
    else:
        scan.folders(root)
    if not scan.records and not scan.left_out:
        raise FedskewError(f"no run folders (with config.json) in {root} or its subfolders")
    return scan


def find_runs(root: Path) -> list[RunRecord]:
    """The runs under ``root`` as :func:`scan_runs` finds them, for tables that must have
    every run: the first line of what was left out as a one-line error."""
    scan = scan_runs(root)
    if scan.left_out:
        raise FedskewError(scan.left_out[0])
    return scan.records


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
