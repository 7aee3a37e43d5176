"""``fedskew compare``: a grid of methods x settings x seeds, run, skipped or resumed, then
tables in the papers' form.

A compare file (TOML, YAML or JSON) has up to five tables::

    [compare]                  # how the grid runs and is summarised (all optional)
    out_dir = "runs/methods"   # the grid folder (default runs/<file name>)
    seeds = [0, 1, 2]
    reference = "fedavg"       # paired differences are taken against this method
    last = 10                  # evaluated rounds averaged in the "last rounds" column
    target = 80                # rounds to reach 80 % accuracy (optional)
    jobs = 2                   # runs at once; jobs x threads <= cores
    threads = 1                # torch threads per run
    track = ["mlflow"]         # experiment trackers of every run (fedskew.tracking)

    [experiment]               # the base experiment: keys of `fedskew run` config files
    dataset = "fmnist"
    [experiment.partition_params]
    beta = 0.1

    [methods.fedavg]           # one table per method; `algorithm` defaults to its name
    [methods.fedfm-lam10]
    algorithm = "fedfm"
    params = { lam = 10 }

    [settings.cifar100]        # optional named settings: overrides of the experiment
    dataset = "cifar100"

    [axes]                     # optional: settings as the product of these values
    "partition_params.beta" = [0.3, 0.1]

Every (setting, method, seed) is one run folder, ``<out_dir>/<setting>/<method>-s<seed>``
(``<out_dir>/<method>-s<seed>`` when there are no settings). Methods may not change what
decides the partition and the clients of each round (dataset, clients, partition,
participation, seed): those belong to settings, so every method of a (setting, seed) has the
same partition and the same client stream. Each run is its own ``fedskew run`` process, so a
crash of one leaves the others running; a finished run with the planned configuration is
skipped, an unfinished one resumes from its checkpoint, one with another configuration is
refused. ``compare.json`` in the grid folder records the plan, so ``fedskew report`` knows
the grid from the folder alone.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedskew.algorithms import get_algorithm
from fedskew.building import check_names
from fedskew.checkpoint import read_checkpoint
from fedskew.config import (
    TABLES,
    ExperimentConfig,
    build_config,
    config_hash,
    normalise_keys,
)
from fedskew.data.sources import load_dataset
from fedskew.durable import remove_stale_temps, write_bytes_durably
from fedskew.errors import FedskewError, UsageError
from fedskew.grid_executors import EXECUTOR_KEYS
from fedskew.locks import Busy, holder, lock, unlock
from fedskew.protocol import largest_state
from fedskew.report.document import Block, Heading, Para, write_report
from fedskew.report.runs import (
    INCOMPLETE,
    MANIFEST,
    MANIFEST_FORMAT,
    RunRecord,
    estimated_seconds,
    find_runs,
)
from fedskew.report.tables import (
    Options,
    comparison_blocks,
    comparison_csv,
    configuration_blocks,
    explanation,
    per_run_table,
    provenance_table,
    runs_csv,
)
from fedskew.runfolder import read_jsonl, running_elsewhere, saved_config
from fedskew.tracking import prepare as prepare_tracking

# One lock file per planned run that a compare is starting or training (see run_one).
SLOTS = ".compare-locks"

SECTIONS = ("compare", "experiment", "methods", "settings", "axes")
COMPARE_KEYS = ("out_dir", "seeds", "reference", "last", "target", "jobs", "threads", "track",
                *EXECUTOR_KEYS)  # fmt: skip
# What decides a (setting, seed)'s partition and the clients of each round: a setting's,
# never a method's, so that all methods of a setting see the same clients.
SHARED_KEYS = (
    "dataset", "data_dir", "download", "num_clients", "partition", "partition_params",
    "partition_file", "partition_overlap", "seed", "synthetic_alpha", "synthetic_beta",
    "participation", "clients_per_round",
)  # fmt: skip
# The scheme a layer without `partition` inherits when no earlier layer names one.
DEFAULT_PARTITION = ExperimentConfig.partition
# Set by compare for each run.
RUN_KEYS = ("seed", "out_dir", "name", "quiet", "track_dir")


@dataclass
class Grid:
    """What to run: the base experiment, settings, methods and seeds."""

    out_dir: Path
    base: dict[str, Any]
    methods: dict[str, dict[str, Any]]
    settings: dict[str, dict[str, Any]]  # {"": {}} when the grid has one unnamed setting
    seeds: list[int]
    options: Options
    jobs: int = 1
    threads: int | None = None
    source: str = ""  # the compare file, if any
    executor: dict[str, Any] = field(default_factory=dict)  # fedskew.grid_executors checks it


@dataclass
class PlannedRun:
    setting: str
    method: str
    seed: int
    folder: str  # relative to the grid folder
    values: dict[str, Any]  # config values of `fedskew run`
    cfg: ExperimentConfig = field(repr=False, default=None)  # type: ignore[assignment]

    @property
    def label(self) -> str:
        return self.folder


# ------------------------------------------------------------------------ reading a grid


def read_file(path: str | Path) -> dict[str, Any]:
    """The tables of a compare file, or of a plain experiment file (then it is the base)."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"config file not found: {p}")
    try:
        text = p.read_text(encoding="utf-8")
        suffix = p.suffix.lower()
        if suffix == ".toml":
            raw = tomllib.loads(text)
        elif suffix in {".yaml", ".yml"}:
            import yaml

            raw = yaml.safe_load(text) or {}
        elif suffix == ".json":
            raw = json.loads(text)
        else:
            raise UsageError(f"config file must end in .toml, .yaml, .yml or .json: {p}")
    except UnicodeDecodeError:
        raise UsageError(f"cannot parse {p}: not UTF-8 text") from None
    except (tomllib.TOMLDecodeError, ValueError) as exc:
        raise UsageError(f"cannot parse {p}: {str(exc).splitlines()[0]}") from None
    except Exception as exc:  # yaml.YAMLError
        if type(exc).__module__.startswith("yaml"):
            raise UsageError(f"cannot parse {p}: {str(exc).splitlines()[0]}") from None
        raise
    if not isinstance(raw, dict):
        raise UsageError(f"{p}: the top level must be a table")
    if not any(k in raw for k in SECTIONS):
        return {"experiment": raw}  # a `fedskew run` config file: the base experiment
    unknown = [k for k in raw if k not in SECTIONS]
    if unknown:
        raise UsageError(
            f"{p}: unknown table '{unknown[0]}' (a compare file has {', '.join(SECTIONS)}; "
            "experiment keys go under [experiment])"
        )
    for key in SECTIONS:
        if key in raw and not isinstance(raw[key], dict):
            raise UsageError(f"{p}: '{key}' must be a table")
    return raw


def _typed_values(values: dict[str, Any], where: str) -> dict[str, Any]:
    """Experiment keys checked (names; tables as tables), dotted keys expanded."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = str(key).replace("-", "_")
        if "." in name:
            table, _, leaf = name.partition(".")
            if table not in TABLES:
                raise UsageError(f"{where}: '{key}': only {', '.join(TABLES)} have sub-keys")
            out.setdefault(table, {})[leaf] = value
            continue
        out.update(normalise_keys({name: value}, where))
    return out


def merge(*layers: dict[str, Any]) -> dict[str, Any]:
    """Later layers win; tables (params, partition_params, model_options) merge by key,
    except that a layer which changes the partition scheme starts its partition_params
    afresh: an earlier layer's parameters were given for another scheme (the base's Dirichlet
    beta means nothing to a setting's ``niid2``)."""
    merged: dict[str, Any] = {}
    for layer in layers:
        scheme = layer.get("partition")
        if scheme is not None and scheme != merged.get("partition", DEFAULT_PARTITION):
            merged.pop("partition_params", None)
        for key, value in layer.items():
            if value is None:
                continue
            if key in TABLES:
                merged[key] = {**merged.get(key, {}), **value}
            else:
                merged[key] = value
    return merged


def _short(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def setting_name(parts: list[tuple[str, Any]]) -> str:
    """``cifar10-beta0.3`` from (("dataset", "cifar10"), ("partition_params.beta", 0.3))."""
    words = []
    for key, value in parts:
        leaf = key.split(".")[-1]
        words.append(value if isinstance(value, str) else f"{leaf}{_short(value)}")
    return re.sub(r"[^A-Za-z0-9._+-]", "-", "-".join(str(w) for w in words))


def grid_from(
    raw: dict[str, Any],
    source: str,
    cli_base: dict[str, Any],
    methods: list[str] | None,
    overrides: dict[str, Any],
) -> Grid:
    """The grid of a compare file's tables, with command-line base options and overrides
    of [compare] keys (seeds, reference, ...) applied."""
    where = source or "the command line"
    settings_raw = raw.get("compare", {})
    unknown = [k for k in settings_raw if k.replace("-", "_") not in COMPARE_KEYS]
    if unknown:
        raise UsageError(
            f"{where}: [compare] has no key '{unknown[0]}' (valid: {', '.join(COMPARE_KEYS)})"
        )
    conf = {k.replace("-", "_"): v for k, v in settings_raw.items()}
    conf.update({k: v for k, v in overrides.items() if v is not None})

    base = merge(_typed_values(raw.get("experiment", {}), f"{where} [experiment]"), cli_base)
    for key in RUN_KEYS:
        if key in base and key != "seed":
            raise UsageError(f"{where}: '{key}' is set by compare for each run; drop it")
    if "track" in conf and "track" not in cli_base:  # [compare] track, under --track
        base["track"] = conf["track"]
    if "seed" in base and "seeds" not in conf:
        conf["seeds"] = [base["seed"]]
    base.pop("seed", None)

    file_methods = raw.get("methods", {})
    chosen: dict[str, dict[str, Any]] = {}
    if file_methods:
        if "algorithm" in cli_base:
            raise UsageError(f"{where} names the methods; -a/--algorithm cannot replace them")
        names = methods or list(file_methods)
        missing = [m for m in names if m not in file_methods]
        if missing:
            raise UsageError(
                f"{where} has no method '{missing[0]}' (it has: {', '.join(file_methods)})"
            )
        for name in names:
            value = file_methods[name] or {}
            if not isinstance(value, dict):
                raise UsageError(f"{where}: [methods.{name}] must be a table")
            chosen[name] = _typed_values(value, f"{where} [methods.{name}]")
    elif methods:
        chosen = {name: {} for name in methods}
    else:
        name = str(base.get("algorithm", ExperimentConfig.algorithm))
        chosen = {name: {}}
    for name, values in chosen.items():
        _check_name(name, "method")
        values.setdefault("algorithm", name)
        bad = [k for k in values if k in SHARED_KEYS or k in RUN_KEYS]
        if bad:
            raise UsageError(
                f"method '{name}' sets '{bad[0]}', which decides the partition or the clients "
                "of each round (or is set by compare): put it in [experiment], a setting or "
                "an axis, so that every method sees the same clients"
            )

    named = {
        name: _typed_values(v or {}, f"{where} [settings.{name}]")
        for name, v in raw.get("settings", {}).items()
    }
    for name in named:
        _check_name(name, "setting")
    axes = raw.get("axes", {})
    for key, values in axes.items():
        if not isinstance(values, list) or not values:
            raise UsageError(f"{where}: axis '{key}' must be a non-empty list of values")
        _typed_values({key: values[0]}, f"{where} [axes]")
    settings: dict[str, dict[str, Any]] = {}
    combos = list(itertools.product(*[[(k, v) for v in vals] for k, vals in axes.items()]))
    for sname, svalues in (named or {"": {}}).items():
        for combo in combos:
            axis_values = _typed_values(dict(combo), f"{where} [axes]")
            name = "-".join(p for p in (sname, setting_name(list(combo))) if p)
            if name in settings:
                raise UsageError(f"{where}: two settings are both named '{name}'")
            settings[name] = merge(svalues, axis_values)
    for name, values in settings.items():
        if any(k in RUN_KEYS for k in values):
            raise UsageError(
                f"setting '{name}' sets seed, out_dir, name, quiet or track_dir: drop it"
            )

    seeds = conf.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(_is_int(s) and s >= 0 for s in seeds):
        raise UsageError(f"seeds must be a list of integers >= 0, got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise UsageError(f"seeds repeat: {seeds}")
    last = conf.get("last", 10)
    if not _is_int(last) or last < 1:
        raise UsageError(f"last must be a positive integer, got {last!r}")
    target = conf.get("target")
    if target is not None:
        if isinstance(target, bool) or not isinstance(target, (int, float)):
            raise UsageError(f"target is an accuracy in percent, got {target!r}")
        if not 1 <= target <= 100:
            raise UsageError(f"target is an accuracy in percent (e.g. 80), got {target!r}")
    reference = conf.get("reference", "fedavg")
    if reference is not None and reference not in chosen:
        reference = None  # no paired column when the reference is not among the methods
    jobs = conf.get("jobs", 1)
    threads = conf.get("threads")
    if not _is_int(jobs) or jobs < 1:
        raise UsageError(f"jobs must be a positive integer, got {jobs!r}")
    if threads is not None and (not _is_int(threads) or threads < 1):
        raise UsageError(f"threads must be a positive integer, got {threads!r}")
    out = conf.get("out_dir")
    if out is None:
        out = Path("runs") / (Path(source).stem if source else "compare")
    return Grid(
        out_dir=Path(out),
        base=base,
        methods=chosen,
        settings=settings,
        seeds=[int(s) for s in seeds],
        options=Options(
            reference=reference,
            last=int(last),
            target=None if target is None else float(target),
        ),
        jobs=int(jobs),
        threads=None if threads is None else int(threads),
        source=source,
        executor={k: conf[k] for k in EXECUTOR_KEYS if conf.get(k) is not None},
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_name(name: str, what: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]*", name):
        raise UsageError(
            f"{what} name '{name}' must be letters, digits and . _ + - (it names folders)"
        )


def folder_of(setting: str, method: str, seed: int) -> str:
    """A planned run's folder relative to its grid folder ('' is the one unnamed setting)."""
    name = f"{method}-s{seed}"
    return f"{setting}/{name}" if setting else name


def plan(grid: Grid) -> list[PlannedRun]:
    """Every run of the grid, its configuration built and checked before anything runs."""
    single = list(grid.settings) == [""]
    runs = []
    out = grid.out_dir.resolve()
    for setting, svalues in grid.settings.items():
        for seed in grid.seeds:
            for method, mvalues in grid.methods.items():
                name = f"{method}-s{seed}"
                folder = folder_of(setting, method, seed)
                values = merge(grid.base, svalues, mvalues)
                values.update(
                    seed=seed,
                    out_dir=str(out if single else out / setting),
                    name=name,
                    quiet=True,
                    track_dir=str(out),  # trackers group the runs by grid, setting, method
                )
                values.setdefault("workers", 0)  # one process per run; jobs run them side by side
                where = f"run {folder}"
                try:
                    cfg = build_config(values, {})
                    check_names(cfg)
                    get_algorithm(cfg.algorithm, feature_matching=cfg.feature_matching).make_params(
                        cfg.params
                    )
                except UsageError as exc:
                    raise UsageError(f"{where}: {exc}") from None
                runs.append(PlannedRun(setting, method, seed, folder, values, cfg))
    return runs


def manifest(grid: Grid, runs: list[PlannedRun], command: str) -> dict[str, Any]:
    return {
        "format": MANIFEST_FORMAT,
        "command": command,
        "source": grid.source,
        "seeds": grid.seeds,
        "reference": grid.options.reference,
        "last": grid.options.last,
        "target": grid.options.target,
        "base": grid.base,
        "settings": grid.settings,
        "methods": grid.methods,
        "runs": [
            {"setting": r.setting, "method": r.method, "seed": r.seed, "folder": r.folder}
            for r in runs
        ],
    }


# ----------------------------------------------------------------------------- running


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def threads_per_run(jobs: int, threads: int | None, cores: int) -> int:
    if threads is None:
        return max(1, cores // jobs)
    if jobs * threads > cores:
        raise UsageError(
            f"{jobs} jobs x {threads} threads = {jobs * threads} threads on {cores} cores: "
            "lower --jobs or --threads (jobs x threads <= cores)"
        )
    return threads


def saved_hash(folder: Path) -> str:
    """The configuration hash of a run folder's config.json, as it would rerun."""
    return config_hash(saved_config(folder))


def slot_of(root: Path, run: PlannedRun) -> Path:
    """The lock file a compare holds while it starts and trains ``run`` (see run_one)."""
    return root / SLOTS / (run.folder.replace("/", "__") + ".lock")


def log_of(logs: Path, folder: str) -> Path:
    """Where a failed attempt at the run of ``folder`` (relative to the grid) leaves its
    output."""
    return logs / (folder.replace("/", "__") + ".log")


@dataclass
class Outcome:
    run: PlannedRun
    status: str  # "done before", "finished", "resumed", "running elsewhere", "failed"
    detail: str = ""
    seconds: float = 0.0
    returncode: int | None = None  # of the run's process, when it failed; < 0: a signal


class Children:
    """The run processes this compare has started. A Ctrl-C in a terminal reaches them all
    (one process group), but a SIGTERM or a ``kill -INT`` to compare alone does not: without
    this, compare would wait for hours while its runs go on, or die and leave them running
    with nobody to report them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: set[subprocess.Popen[str]] = set()
        self.stopping = False  # set once, under the lock; then no run starts
        self.popen_options: dict[str, Any] = {}  # more subprocess.Popen arguments

    def start(self, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[str] | None:
        """The run's process, or None once compare is stopping (no new run starts then)."""
        with self._lock:
            if self.stopping:
                return None
            proc = subprocess.Popen(
                cmd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                **self.popen_options,
            )
            self._running.add(proc)
            return proc

    def ended(self, proc: subprocess.Popen[str]) -> None:
        with self._lock:
            self._running.discard(proc)

    def stop(self, own_grace: float = 5.0, term_grace: float = 60.0) -> None:
        """Start nothing more, and end what runs: first give the runs ``own_grace`` seconds
        to stop on a Ctrl-C they got themselves, then SIGTERM (which a run takes as Ctrl-C:
        it keeps its finished rounds and frees its folder), then SIGKILL after
        ``term_grace`` seconds. A second Ctrl-C or SIGTERM meanwhile goes straight to the
        SIGKILL, so that an impatient user ends compare and its runs together rather than
        compare alone. A run's finished rounds are on disk before its next one starts, so
        even the kill loses none."""
        with self._lock:
            self.stopping = True
            running = list(self._running)
        hurry = threading.Event()
        restore = _hurry_on_signals(hurry)
        try:
            steps = ((None, own_grace), (subprocess.Popen.terminate, term_grace),
                     (subprocess.Popen.kill, 0.0))  # fmt: skip
            for send, grace in steps:
                alive = [p for p in running if p.poll() is None]
                if not alive:
                    return
                if hurry.is_set():
                    send, grace = subprocess.Popen.kill, 0.0
                for proc in alive:
                    if send is not None:
                        send(proc)
                if send is subprocess.Popen.kill:
                    for proc in alive:
                        proc.wait()
                    return
                deadline = time.monotonic() + grace
                while (time.monotonic() < deadline and not hurry.is_set()
                       and any(p.poll() is None for p in alive)):  # fmt: skip
                    time.sleep(0.1)
        finally:
            restore()


def _hurry_on_signals(hurry: threading.Event) -> Callable[[], None]:
    """While compare stops its runs, a further SIGINT or SIGTERM sets ``hurry`` instead of
    ending compare at once (which would leave the runs it has not yet signalled running,
    with nobody to stop them). Returns what puts the previous handlers back. Handlers can
    be set from the main thread only; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {
        sig: signal.signal(sig, lambda _signum, _frame: hurry.set())
        for sig in (signal.SIGINT, signal.SIGTERM)
    }

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore


def run_one(run: PlannedRun, root: Path, threads: int, logs: Path, children: Children) -> Outcome:
    finished = root / run.folder
    unfinished = finished.with_name(finished.name + INCOMPLETE)
    want = config_hash(run.cfg)
    for existing in (finished, unfinished):
        if existing.is_dir():
            try:
                same = saved_hash(existing) == want
            except (OSError, ValueError, FedskewError) as exc:
                return Outcome(run, "failed", f"{existing} cannot be read: {exc}")
            if not same:
                return Outcome(
                    run,
                    "failed",
                    f"{existing} holds a run with another configuration; move it away or "
                    "change the grid",
                )
    if (finished / "summary.json").is_file():
        return Outcome(run, "done before")
    if children.stopping:
        return Outcome(run, "failed", "not started (interrupted)")
    # Another compare on this grid may be starting this very run: its folder appears only
    # seconds later, from the run's own process, so the grid holds a slot per run meanwhile.
    slot_path = slot_of(root, run)
    try:
        slot_path.parent.mkdir(exist_ok=True)
        slot = lock(slot_path)
    except Busy as busy:
        return Outcome(run, "running elsewhere", f"{busy.holder}, another fedskew compare")
    except OSError as exc:
        return Outcome(run, "failed", f"cannot lock {slot_path}: {exc.strerror or exc}")
    try:
        if (finished / "summary.json").is_file():  # the other compare finished it just now
            return Outcome(run, "done before")
        holder = running_elsewhere(unfinished)
        if holder is not None:  # `fedskew run --resume` by hand is training it now
            return Outcome(run, "running elsewhere", holder)
        return launch(run, threads, logs, finished, unfinished, children)
    finally:
        unlock(slot)


def launch(
    run: PlannedRun,
    threads: int,
    logs: Path,
    finished: Path,
    unfinished: Path,
    children: Children,
) -> Outcome:
    """Run (or resume) one planned run in its own process."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fedskew-compare-") as tmp:
        if unfinished.is_dir():
            status = "resumed"
            cmd = [sys.executable, "-m", "fedskew", "run", "--resume", str(unfinished), "-q"]
            cmd += ["--workers", str(run.cfg.workers)]
            for name in run.cfg.track:  # the grid's trackers, also for a run begun without
                cmd += ["--track", name]
        else:
            status = "finished"
            path = Path(tmp) / "run.json"
            path.write_text(json.dumps(run.values), encoding="utf-8")
            cmd = [sys.executable, "-m", "fedskew", "run", "-c", str(path)]
        proc = children.start(cmd, env)
        if proc is None:
            return Outcome(run, "failed", "not started (interrupted)")
        try:
            stdout, stderr = proc.communicate()
        finally:
            children.ended(proc)
    seconds = time.perf_counter() - started
    if proc.returncode != 0 and children.stopping:
        # Ended by this compare's own interrupt, not a failure of the run: no failure log,
        # which would claim one; the folder resumes.
        return Outcome(run, "failed", "interrupted", seconds)
    log = log_of(logs, run.folder)
    if proc.returncode != 0:
        logs.mkdir(parents=True, exist_ok=True)
        log.write_text(
            f"$ {shlex.join(cmd)}\n(exit {proc.returncode})\n{stdout}\n{stderr}",
            encoding="utf-8",
        )
        last = (stderr.strip().splitlines() or ["no message"])[-1]
        return Outcome(run, "failed", f"{last} (log: {log})", seconds, proc.returncode)
    # An earlier attempt's failure log would otherwise outlive the run that succeeded.
    log.unlink(missing_ok=True)
    summary = json.loads((finished / "summary.json").read_text(encoding="utf-8"))
    acc = summary.get("final_accuracy")
    detail = "" if acc is None else f"final accuracy {100 * acc:.2f} %"
    return Outcome(run, status, detail, seconds)


def status_lines(grid: Grid, runs: list[PlannedRun]) -> list[str]:
    """Where each planned run stands, who is training it, and the CPU time left, judged from
    the grid's finished runs; reads the grid folder and changes nothing."""
    root = grid.out_dir
    try:
        records = find_runs(root) if root.is_dir() else []
    except FedskewError:  # a grid folder without any run yet
        records = []
    width = max((len(r.label) for r in runs), default=0)
    lines, counts = [], dict.fromkeys(("finished", "training", "unfinished", "not run"), 0)
    left, unknown, failed = 0.0, 0, 0
    for run in runs:
        finished = root / run.folder
        unfinished = finished.with_name(finished.name + INCOMPLETE)
        rounds = run.cfg.rounds
        done = 0
        if (finished / "summary.json").is_file():
            summary = json.loads((finished / "summary.json").read_text(encoding="utf-8"))
            acc = summary.get("final_accuracy")
            state = "finished" + ("" if acc is None else f", final accuracy {100 * acc:.2f} %")
            counts["finished"] += 1
            lines.append(f"{run.label:<{width}}  {state}")
            continue
        if unfinished.is_dir():
            done = sum(1 for row in read_jsonl(unfinished / "metrics.jsonl") if "round" in row)
            who = running_elsewhere(unfinished)
            kind = "training" if who else "unfinished"
            state = f"{kind}, {done} of {rounds} rounds" + (f" ({who})" if who else "")
        else:
            who = holder(slot_of(root, run))
            kind = "training" if who else "not run"
            state = f"starting ({who})" if who else "not run"
        counts[kind] += 1
        log = log_of(root / "logs", run.folder)
        if not who and log.is_file():
            tail = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()
            last = tail[-1] if tail else "no message"
            state += f"; last attempt failed: {last[:117] + '...' if len(last) > 120 else last}"
            failed += 1
        whole = estimated_seconds(records, run.setting, run.method)
        if whole is None:
            unknown += 1
        else:
            left += whole * max(0.0, 1 - done / max(rounds, 1))
        lines.append(f"{run.label:<{width}}  {state}")
    lines.append(", ".join(f"{n} {k}" for k, n in counts.items()) + (
        f" ({failed} failed at their last attempt)" if failed else ""
    ))  # fmt: skip
    pending = len(runs) - counts["finished"]
    if pending and unknown == pending:
        lines.append("left: unknown (no finished run in these runs' settings to judge from)")
    elif pending:
        known = pending - unknown
        text = (
            f"left: about {left / 3600:.1f} CPU hours for {known} of the {pending} not finished "
            "runs, from the finished runs' recorded time (same setting and method, else same "
            "setting; one run per core as they ran)"
        )
        if unknown:
            text += f"; {unknown} have no finished run in their setting to judge from"
        lines.append(text)
    return lines


def prefetch(runs: list[PlannedRun], print_line: Callable[[str], None]) -> None:
    """Find (or download) each dataset once here, before runs start side by side: parallel
    runs would otherwise all download, or all decode into the cache, at once. A dataset that
    cannot be had stops nothing here: its runs fail with the reason."""
    seen = set()
    for r in runs:
        cfg = r.cfg
        key = (cfg.dataset, cfg.data_dir, cfg.download)
        if key in seen or cfg.dataset in ("digits", "synthetic"):
            continue
        seen.add(key)
        print_line(f"data: {cfg.dataset} ...")
        try:
            data = load_dataset(cfg.dataset, cfg.data_dir, download=cfg.download)
        except Exception as exc:  # noqa: BLE001 - each run reports its own failure
            print_line(f"data: {cfg.dataset}: {str(exc).splitlines()[0] if str(exc) else exc!r}")
            continue
        print_line(f"data: {cfg.dataset}: {data.source}")


def run_grid(
    grid: Grid,
    runs: list[PlannedRun],
    print_line: Callable[[str], None] = print,
) -> list[Outcome]:
    """Run (or skip, or resume) every planned run, ``grid.jobs`` at a time, each in its own
    process; returns the outcomes in the order they completed."""
    cores = available_cores()
    threads = threads_per_run(grid.jobs, grid.threads, cores)
    root = grid.out_dir.resolve()
    root.mkdir(parents=True, exist_ok=True)
    todo = [r for r in runs if not (root / r.folder / "summary.json").is_file()]
    prepare_tracking([r.cfg for r in todo])  # a missing tracker package stops all, up front
    prefetch(todo, print_line)
    children = Children()
    outcomes: list[Outcome] = []
    pool = ThreadPoolExecutor(max_workers=grid.jobs)
    try:
        futures = [pool.submit(run_one, r, root, threads, root / "logs", children) for r in runs]
        for n, fut in enumerate(as_completed(futures), start=1):
            o = fut.result()
            outcomes.append(o)
            took = f" in {o.seconds:.0f} s" if o.seconds else ""
            detail = f": {o.detail}" if o.detail else ""
            print_line(f"[{n}/{len(runs)}] {o.run.label}: {o.status}{took}{detail}")
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (fedskew.cli turns it into one)
        children.stop()
        pool.shutdown(wait=True, cancel_futures=True)
        raise KeyboardInterrupt(
            f"interrupted; unfinished runs keep their checkpoints in {root}: run the same "
            "command again to resume them"
        ) from None
    pool.shutdown(wait=True)
    return outcomes


# ------------------------------------------------------------------------------ tables


def client_state_memory(folder: Path) -> tuple[int, int] | None:
    """(largest client's state in bytes, clients with state) in the folder's checkpoint,
    or None when it has no checkpoint."""
    path = folder / "checkpoint.npz"
    if not path.is_file():
        return None
    return largest_state(read_checkpoint(path).clients)


def recorded_client_state(rec: RunRecord) -> tuple[int, int] | None:
    """The same pair from the finished run's summary, which holds it from the end of the run
    without loading the checkpoint's arrays; else from the checkpoint (runs whose summary
    predates the record); else None."""
    summary = rec.summary or {}
    size, count = summary.get("client_state_bytes_max"), summary.get("clients_with_state")
    if isinstance(size, int) and isinstance(count, int):
        return size, count
    return client_state_memory(rec.folder)


def collect(root: Path) -> list[RunRecord]:
    """The grid's run folders read back, with each run's largest client state."""
    records = find_runs(root)
    for rec in records:
        memory = recorded_client_state(rec)
        if memory is not None:
            rec.client_state_bytes, rec.client_state_clients = memory
    return records


def table_blocks(records: list[RunRecord], options: Options, command: str) -> list[Block]:
    blocks: list[Block] = [
        Heading(1, "Comparison"),
        Para(
            f"Computed from the run folders by `{command}`: every number below comes from "
            "their config.json, metrics.jsonl, summary.json, processes.jsonl, partition.npz "
            "and checkpoint.npz."
        ),
        Para(explanation(options)),
    ]
    blocks += comparison_blocks(records, options)
    blocks += configuration_blocks(records)
    blocks += [Heading(2, "Every run"), per_run_table(records, options)]
    blocks += [Heading(2, "Where each run's numbers came from"), provenance_table(records)]
    return blocks


def write_tables(root: Path, records: list[RunRecord], options: Options, command: str) -> Path:
    """``comparison.md`` (+ .html), ``comparison.csv`` and ``runs.csv`` in the grid folder."""
    md, _ = write_report(table_blocks(records, options, command), root, "comparison", "Comparison")
    write_bytes_durably(root / "comparison.csv", comparison_csv(records, options).encode())
    write_bytes_durably(root / "runs.csv", runs_csv(records, options).encode())
    return md


def options_from_manifest(root: Path, fallback: Options) -> Options:
    path = root / MANIFEST
    if not path.is_file():
        return fallback
    m = json.loads(path.read_text(encoding="utf-8"))
    return Options(reference=m.get("reference"), last=m.get("last", 10), target=m.get("target"))


def command_line(argv: list[str]) -> str:
    """The command as typed (``argv`` from the subcommand on)."""
    return shlex.join(["fedskew", *argv])


def write_manifest(root: Path, plan_record: dict[str, Any]) -> None:
    remove_stale_temps(root)  # of a compare killed mid-write; another compare's live ones stay
    text = json.dumps(plan_record, indent=2, default=str) + "\n"
    write_bytes_durably(root / MANIFEST, text.encode("utf-8"))
