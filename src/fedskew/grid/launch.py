"""Running a grid's planned runs: each its own ``fedskew run`` process, ``jobs`` at a time,
a finished run skipped and an unfinished one resumed, one slot lock per run so that two
compares on one grid do not start the same run, and the run processes stopped on a signal."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedskew.config import config_differences, config_hash, plural
from fedskew.core.device import cuda_count
from fedskew.core.errors import FedskewError, UsageError
from fedskew.core.gpu_sharing import gpu_sharing_env
from fedskew.core.locks import Busy, lock, unlock
from fedskew.core.machine import usable_cores
from fedskew.data.sources import load_dataset
from fedskew.grid.plan import Grid, PlannedRun
from fedskew.report.run_status import DIVERGED, read_stop
from fedskew.report.runs import INCOMPLETE
from fedskew.runs.folder import running_elsewhere, saved_config
from fedskew.runs.tracking import prepare as prepare_tracking

# One lock file per planned run that a compare is starting or training (see run_one).
SLOTS = ".compare-locks"


def available_cores() -> int:
    """The cores runs may use: the affinity, within a container's CPU quota."""
    return usable_cores()


# Torch threads of a run whose grid names none, on every executor (local, Ray, Slurm): the
# thread count changes the low bits of a run's sums, so a default that followed the
# machine's cores (as the local one did, cores / jobs, while Ray and Slurm took 1) made the
# same grid compute other numbers on each. --threads (or --cpus-per-run) asks for more.
DEFAULT_THREADS = 1


def threads_per_run(jobs: int, threads: int | None, cores: int) -> int:
    if threads is None:
        return DEFAULT_THREADS
    if jobs * threads > cores:
        raise UsageError(
            f"{jobs} jobs x {threads} threads = {jobs * threads} threads on {cores} cores: "
            "lower --jobs or --threads (jobs x threads <= cores)"
        )
    return threads


class GpuSlots:
    """The visible GPUs a local grid's runs take turns on, as the Ray and Slurm executors
    give each run its own: without this every run of ``--jobs N`` resolved ``auto`` to
    cuda:0 (and with several GPUs each started a worker on every one of them).

    The GPUs are split into groups, one per job where there are enough (8 GPUs and 2 jobs:
    4 each), and a run that trains on CUDA (device ``cuda`` or ``auto``) gets the least busy
    group, in turn when equal, as the CUDA_VISIBLE_DEVICES of its process. A run on ``cpu``
    or on a GPU it names (``cuda:N``, of the GPUs compare sees) keeps the environment as it
    is.

    More jobs than GPUs pack runs onto the GPUs on purpose: round-robin, least busy first,
    at most ``runs_per_gpu`` = ceil(jobs / GPUs) at once on one GPU (2 GPUs and 4 jobs: two
    runs per GPU; 1 GPU and 3 jobs: all three on it). Small models leave most of a GPU idle,
    so several runs at once give more samples per second in all; a run's own speed drops.
    Each run's process is told how many share (fedskew.core.gpu_sharing), and its
    processes.jsonl records it. ``--jobs`` equal to the GPU count gives each run its own."""

    def __init__(self, ids: list[str], jobs: int) -> None:
        size = max(1, len(ids) // max(1, jobs))
        self.groups = [ids[i : i + size] for i in range(0, len(ids) - size + 1, size)]
        self.busy = [0] * len(self.groups)
        self.runs_per_gpu = -(-max(1, jobs) // len(self.groups)) if self.groups else 0
        self._next = 0
        self._lock = threading.Lock()

    @classmethod
    def visible(cls, jobs: int) -> GpuSlots:
        """The GPUs this process sees, named as its CUDA_VISIBLE_DEVICES names them."""
        count = cuda_count()
        named = [x.strip() for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
        named = [x for x in named if x]
        ids = named[:count] if len(named) >= count else [str(i) for i in range(count)]
        return cls(ids, jobs)

    def take(self, device: str) -> str | None:
        """The CUDA_VISIBLE_DEVICES of a run on ``device``, or None to leave it as it is."""
        if not self.groups or device not in ("auto", "cuda"):
            return None
        with self._lock:
            order = [(self._next + k) % len(self.groups) for k in range(len(self.groups))]
            chosen = min(order, key=lambda g: self.busy[g])
            self.busy[chosen] += 1
            self._next = chosen + 1
        return ",".join(self.groups[chosen])

    def sharing(self, visible: str) -> dict[str, str]:
        """The variables that tell the run on ``visible`` how many of compare's runs share
        its GPUs: at most, and now (this run included)."""
        with self._lock:
            now = self.busy[self.groups.index(visible.split(","))]
        return gpu_sharing_env(self.runs_per_gpu, now)

    def give(self, visible: str) -> None:
        """The run on ``visible`` (what :meth:`take` gave) has ended."""
        with self._lock:
            self.busy[self.groups.index(visible.split(","))] -= 1

    def describe(self) -> str:
        per_run = len(self.groups[0]) if self.groups else 0
        text = f"{len(self.groups) * per_run} GPU(s), {per_run} per run (CUDA_VISIBLE_DEVICES)"
        if self.runs_per_gpu > 1:
            text += f"; up to {self.runs_per_gpu} runs at once on each, round-robin"
        return text


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
    # "done before", "finished", "resumed", "diverged before", "diverged", "running
    # elsewhere", "failed" (OUTCOME_KINDS says which are results)
    status: str
    detail: str = ""
    seconds: float = 0.0
    returncode: int | None = None  # of the run's process, when it failed; < 0: a signal
    round: int | None = None  # where a diverged run diverged


# What each outcome is, for compare's closing line and exit status: a diverged run is a
# result of its method (fedskew.report.run_status), a failed one is not.
OUTCOME_KINDS = {
    "done before": "finished",
    "finished": "finished",
    "resumed": "finished",
    "diverged before": "diverged",
    "diverged": "diverged",
    "running elsewhere": "running elsewhere",
    "failed": "failed",
}


def closing_line(outcomes: list[Outcome]) -> str:
    """The line compare ends with, such as "4 runs: 2 finished, 1 diverged (hot-s0 at round
    3), 1 failed (prox-s1)": finished, diverged and failed always counted, the runs another
    process trains where there are."""
    named: dict[str, list[str]] = {k: [] for k in ("finished", "diverged", "failed")}
    named["running elsewhere"] = []
    for o in outcomes:
        kind = OUTCOME_KINDS.get(o.status, "failed")
        at = f" at round {o.round}" if kind == "diverged" and o.round is not None else ""
        named[kind].append(o.run.label + at)
    parts = []
    for kind, labels in named.items():
        if kind == "running elsewhere" and not labels:
            continue
        listed = f" ({', '.join(labels)})" if labels and kind != "finished" else ""
        parts.append(f"{len(labels)} {kind}{listed}")
    return f"{plural(len(outcomes), 'run')}: " + ", ".join(parts)


def stop_of(folder: Path) -> dict[str, Any] | None:
    """The stop record of an unfinished run folder; None where it has none, or one that
    cannot be read (the run resumes, which replaces it)."""
    try:
        return read_stop(folder) if folder.is_dir() else None
    except FedskewError:
        return None


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

    def stop(self, own_grace: float | None = None, term_grace: float = 60.0) -> None:
        """Start nothing more, and end what runs: first give the runs ``own_grace`` seconds
        to stop on a Ctrl-C they got themselves, then SIGTERM (which a run takes as Ctrl-C:
        it keeps its finished rounds and frees its folder), then SIGKILL after
        ``term_grace`` seconds. A second Ctrl-C or SIGTERM meanwhile goes straight to the
        SIGKILL, so that an impatient user ends compare and its runs together rather than
        compare alone. A run's finished rounds are on disk before its next one starts, so
        even the kill loses none."""
        if own_grace is None:
            own_grace = stop_grace()
        with self._lock:
            self.stopping = True
            running = list(self._running)
        hurry = threading.Event()
        restore = _hurry_on_signals(hurry)
        alive = sum(p.poll() is None for p in running)
        if alive:
            # Said once the second signal is ours to take (above): from here a further
            # Ctrl-C or SIGTERM kills the runs, and a test may send it on this line.
            print(
                f"fedskew: stopping {plural(alive, 'run')}: {own_grace:g} s to stop on their "
                "own, then SIGTERM (Ctrl-C again: kill them now)",
                file=sys.stderr,
                flush=True,
            )
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


def stop_grace() -> float:
    """Seconds a run gets to stop on its own Ctrl-C before compare sends SIGTERM:
    FEDSKEW_STOP_GRACE, default 5."""
    text = os.environ.get("FEDSKEW_STOP_GRACE", "")
    try:
        value = float(text) if text else 5.0
    except ValueError:
        value = 5.0
    return value if value >= 0 else 5.0


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


def run_one(
    run: PlannedRun,
    root: Path,
    threads: int,
    logs: Path,
    children: Children,
    gpus: GpuSlots | None = None,
) -> Outcome:
    finished = root / run.folder
    unfinished = finished.with_name(finished.name + INCOMPLETE)
    want = config_hash(run.cfg)
    for existing in (finished, unfinished):
        if existing.is_dir():
            try:
                saved = saved_config(existing)
            except (OSError, ValueError, FedskewError) as exc:
                return Outcome(run, "failed", f"{existing} cannot be read: {exc}")
            if config_hash(saved) != want:
                differences = config_differences(saved, run.cfg)
                return Outcome(
                    run,
                    "failed",
                    f"{existing} holds a run with another configuration ({differences}); "
                    "move it away or change the grid",
                )
    if (finished / "summary.json").is_file():
        return Outcome(run, "done before")
    before = diverged_before(run, unfinished)
    if before is not None:
        return before
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
        before = diverged_before(run, unfinished)
        if before is not None:  # the other compare saw it diverge just now
            return before
        holder = running_elsewhere(unfinished)
        if holder is not None:  # `fedskew run --resume` by hand is training it now
            return Outcome(run, "running elsewhere", holder)
        return launch(run, threads, logs, finished, unfinished, children, gpus)
    finally:
        unlock(slot)


def diverged_before(run: PlannedRun, unfinished: Path) -> Outcome | None:
    """The outcome of a run that diverged in an earlier attempt: a result, as a finished run
    is, so it is not run again (the same seed diverges again); None otherwise."""
    stop = stop_of(unfinished)
    if stop is None or stop["state"] != DIVERGED or running_elsewhere(unfinished) is not None:
        return None
    reason = stop.get("reason") or "NaN or Inf"
    detail = f"{reason} (not run again: remove {unfinished} to run it anew)"
    return Outcome(run, "diverged before", detail, round=stop.get("round"))


def launch(
    run: PlannedRun,
    threads: int,
    logs: Path,
    finished: Path,
    unfinished: Path,
    children: Children,
    gpus: GpuSlots | None = None,
) -> Outcome:
    """Run (or resume) one planned run in its own process (on its GPUs, see GpuSlots)."""
    visible = gpus.take(run.cfg.device) if gpus is not None else None
    try:
        gpu_env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
        if visible is not None:
            assert gpus is not None
            gpu_env.update(gpus.sharing(visible))
        return _launch(run, threads, logs, finished, unfinished, children, gpu_env)
    finally:
        if visible is not None:
            assert gpus is not None
            gpus.give(visible)


def _launch(
    run: PlannedRun,
    threads: int,
    logs: Path,
    finished: Path,
    unfinished: Path,
    children: Children,
    gpu_env: dict[str, str],
) -> Outcome:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    for variable in gpu_sharing_env(0, 0):  # not this compare's: not the run's to record
        env.pop(variable, None)
    env.update(gpu_env)  # its GPUs, and how many of compare's runs share them
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
        stop = stop_of(unfinished)
        if stop is not None and stop["state"] == DIVERGED:
            # What the run's folder says, not its exit status: divergence is a result.
            reason = stop.get("reason") or last
            return Outcome(run, "diverged", f"{reason} (log: {log})", seconds,
                           proc.returncode, stop.get("round"))  # fmt: skip
        return Outcome(run, "failed", f"{last} (log: {log})", seconds, proc.returncode)
    # An earlier attempt's failure log would otherwise outlive the run that succeeded.
    log.unlink(missing_ok=True)
    summary = json.loads((finished / "summary.json").read_text(encoding="utf-8"))
    acc = summary.get("final_accuracy")
    detail = "" if acc is None else f"final accuracy {100 * acc:.2f} %"
    return Outcome(run, status, detail, seconds)


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
    progress_every: float = 60.0,
) -> list[Outcome]:
    """Run (or skip, or resume) every planned run, ``grid.jobs`` at a time, each in its own
    process; returns the outcomes in the order they completed. Meanwhile a progress line
    (fedskew.grid.progress): live on a terminal, else every ``progress_every`` seconds."""
    from fedskew.grid.progress import GridProgress

    cores = available_cores()
    threads = threads_per_run(grid.jobs, grid.threads, cores)
    root = grid.out_dir.resolve()
    root.mkdir(parents=True, exist_ok=True)
    todo = [r for r in runs if not (root / r.folder / "summary.json").is_file()]
    prepare_tracking([r.cfg for r in todo])  # a missing tracker package stops all, up front
    prefetch(todo, print_line)
    children = Children()
    gpus = GpuSlots.visible(grid.jobs)
    if gpus.groups:
        print_line(f"gpus: {gpus.describe()}")
    outcomes: list[Outcome] = []
    live = print_line is print and sys.stdout.isatty()
    progress = GridProgress(runs, root, grid.jobs, print_line, live, progress_every)

    def one(r: PlannedRun) -> Outcome:
        progress.begin(r)
        o = run_one(r, root, threads, root / "logs", children, gpus)
        progress.finish(r, o.seconds, o.status in ("finished", "resumed"))
        return o

    pool = ThreadPoolExecutor(max_workers=grid.jobs)
    try:
        futures = [pool.submit(one, r) for r in runs]
        if todo:  # a grid of finished runs only has no progress to show
            progress.start()
        for n, fut in enumerate(as_completed(futures), start=1):
            o = fut.result()
            outcomes.append(o)
            took = f" in {o.seconds:.0f} s" if o.seconds else ""
            detail = f": {o.detail}" if o.detail else ""
            progress.say(f"[{n}/{len(runs)}] {o.run.label}: {o.status}{took}{detail}")
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (fedskew.apps.cli turns it into one)
        progress.close()
        children.stop()
        pool.shutdown(wait=True, cancel_futures=True)
        raise KeyboardInterrupt(
            f"interrupted; unfinished runs keep their checkpoints in {root}: run the same "
            "command again to resume them"
        ) from None
    finally:
        progress.close()
    pool.shutdown(wait=True)
    return outcomes
