"""``fedskew compare --executor ray``: every run of the grid is one Ray task that declares the
CPUs and the GPU fraction it needs, so that the cluster, not ``--jobs``, decides how many run
at once and where. A task runs the same ``fedskew run`` process as a local compare (through
launch.run_one): crash isolation, the per-run slot lock, and resumption of an unfinished
run folder. The grid folder must be on a file system that every node sees.

A task whose worker dies, or whose run process is killed (out of memory, a node going away),
is retried up to ``retries`` times, and the retry resumes the run from its last finished
round. Ctrl-C or SIGTERM cancels the tasks; their run folders stay resumable.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fedskew.version
from fedskew.core.errors import UsageError
from fedskew.grid import launch
from fedskew.grid.executors.options import ExecutorSettings
from fedskew.grid.executors.plain_runs import outcome_data, outcome_from, planned_from, run_data
from fedskew.grid.executors.ray_reaper import Reaper
from fedskew.grid.launch import Children, Outcome
from fedskew.grid.plan import Grid, PlannedRun
from fedskew.grid.progress import GridProgress

PR_SET_PDEATHSIG = 1  # linux/prctl.h


class RunProcessKilled(Exception):
    """A run's process ended by a signal: Ray retries the task (retry_exceptions), and the
    retry resumes the run."""


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: when the Ray worker that started the run dies
    # (killed, or its task cancelled with force), the run dies too instead of training on
    # unowned, holding its folder's lock against the retry. Its finished rounds are on disk.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: an orphan finishes its run alone
        pass


def run_task(data: dict[str, Any], root: str, threads: int, gpus: float) -> dict[str, Any]:
    """One run (skipped, started or resumed) in a Ray worker; plain data in and out."""
    run = planned_from(data)
    if not gpus:
        # A run that asked for no GPU trains on the CPU even where its device is "auto": a
        # GPU it took undeclared would be another run's.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    children = Children()
    if sys.platform.startswith("linux"):
        children.popen_options = {"preexec_fn": _die_with_parent}
    outcome = launch.run_one(run, Path(root), threads, Path(root) / "logs", children)
    if outcome.status == "failed" and (outcome.returncode or 0) < 0:
        raise RunProcessKilled(f"{run.label}: {outcome.detail}")
    return {
        **outcome_data(outcome),
        "fedskew": fedskew.version.__file__,
        "node": os.uname().nodename,
    }


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise UsageError(
            f"--executor ray needs Ray: pip install 'fedskew[flower]' or 'ray' ({exc})"
        ) from None
    return ray


def runtime_env() -> dict[str, Any]:
    """Ray workers start in the environment of the node's ``ray start``, not this one's: a
    PYTHONPATH set here (a source tree in use instead of the installed package) goes with
    the tasks, so that they run the same fedskew as this compare."""
    path = os.environ.get("PYTHONPATH")
    return {"env_vars": {"PYTHONPATH": path}} if path else {}


# How long compare and tune wait for a Ray cluster's address to answer: ray.init waits for
# an unreachable one for ever (retrying, and ignoring SIGTERM meanwhile).
REACH_SECONDS = 10.0


def check_reachable(address: str | None, seconds: float = REACH_SECONDS) -> None:
    """One line of error unless something listens at the cluster's address (``auto``: the
    address Ray found on this machine) within ``seconds``."""
    if address is None:  # a cluster of this machine, started by ray.init
        return
    target: str | None = address.removeprefix("ray://")
    if target == "auto":
        try:
            from ray._private.services import canonicalize_bootstrap_address

            target = canonicalize_bootstrap_address("auto")
        except ConnectionError as exc:
            raise UsageError(f"cannot find a Ray cluster (--ray-address auto): {exc}") from None
        except Exception:  # noqa: BLE001 - Ray's own internals moved: ray.init decides
            return
        if target is None:  # none recorded: ray.init says so at once
            return
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--ray-address must be HOST:PORT or auto, got {address!r}")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=seconds) as conn:
            # A port that accepts connections is not yet a cluster: ray.init waits for ever on
            # one that never answers (a firewall's, a stopped process's backlog) or speaks
            # another protocol. Ray's GCS (and its client server) is gRPC: HTTP/2, whose
            # server answers a client's preface with a SETTINGS frame. Under TLS the first
            # bytes are the handshake's, so the probe is left to ray.init there.
            if not tls_on():
                answer = http2_answer(conn, seconds)
                if answer != "settings":
                    raise UsageError(
                        f"cannot reach the Ray cluster at {address}: something accepts "
                        f"connections there but {answer}: not a Ray cluster's GCS (gRPC); "
                        "is `ray start --head` running there, on that port?"
                    )
    except (OSError, ValueError) as exc:
        why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise UsageError(
            f"cannot reach the Ray cluster at {address}: {why} (nothing answered within "
            f"{seconds:g} s; is `ray start --head` running there?)"
        ) from None


# An HTTP/2 client's connection preface and an empty SETTINGS frame (RFC 9113, 3.4 and 6.5).
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
SETTINGS_FRAME = 4


def tls_on() -> bool:
    return os.environ.get("RAY_USE_TLS", "0").strip().lower() in ("1", "true", "yes")


def http2_answer(conn: socket.socket, seconds: float) -> str:
    """'settings' when the server at ``conn`` answers an HTTP/2 preface with its SETTINGS
    frame within ``seconds``, else what it did instead, in words."""
    conn.settimeout(seconds)
    try:
        conn.sendall(HTTP2_PREFACE)
        head = b""
        while len(head) < 9:  # a frame header: length (3), type, flags, stream id (4)
            got = conn.recv(9 - len(head))
            if not got:
                return "closed the connection without an answer"
            head += got
    except TimeoutError:
        return f"nothing answered within {seconds:g} s"
    except OSError as exc:
        return f"the connection failed ({exc.strerror or exc})"
    if head[3] == SETTINGS_FRAME and head[5:9] == bytes(4):
        return "settings"
    return f"it answered {head[:9]!r}, not as gRPC does"


# The watcher of the cluster this process started (ray_reaper), until disconnect.
_reaper: Reaper | None = None


def connect(ray: Any, address: str | None) -> None:
    global _reaper
    check_reachable(address)
    if address is None:
        _reaper = Reaper()
    options: dict[str, Any] = {"runtime_env": runtime_env(), "log_to_driver": False}
    if address is None:  # a cluster of this machine for this compare alone
        options["include_dashboard"] = False
    # Ray's notice that it will stop hiding GPUs from tasks that ask for none: run_task
    # hides them itself.
    warnings.filterwarnings("ignore", message=".*RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO")
    # ray.init takes SIGTERM for itself (it exits at once); compare's own handler turns it
    # into Ctrl-C, which cancels the tasks, so it comes back.
    own = signal.getsignal(signal.SIGTERM)
    try:
        ray.init(address=address, logging_level="WARNING", **options)
        if _reaper is not None:
            _reaper.note()
    except ConnectionError as exc:
        raise UsageError(f"cannot reach the Ray cluster at {address}: {exc}") from None
    finally:
        if threading.current_thread() is threading.main_thread() and own is not None:
            signal.signal(signal.SIGTERM, own)


def disconnect(ray: Any) -> None:
    """ray.shutdown, then the end of a cluster this process started: what it left goes."""
    global _reaper
    try:
        ray.shutdown()
    finally:
        if _reaper is not None:
            _reaper.close()
            _reaper = None


def note_cluster() -> None:
    """List the cluster's processes again (its agents and workers start after ray.init)."""
    if _reaper is not None:
        _reaper.note()


def check_fits(ray: Any, cpus: int, gpus: float) -> None:
    """A task no node can take would wait for ever: one line instead."""
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    if any(n.get("CPU", 0) >= cpus and n.get("GPU", 0) >= gpus for n in nodes):
        return
    largest = ", ".join(sorted({f"{n.get('CPU', 0):g} CPU {n.get('GPU', 0):g} GPU" for n in nodes}))
    raise UsageError(
        f"no node of the Ray cluster has {cpus} CPU and {gpus:g} GPU for a run (its nodes: "
        f"{largest or 'none'}): lower --cpus-per-run or --gpus-per-run"
    )


def run_grid_on_ray(
    grid: Grid,
    runs: list[PlannedRun],
    settings: ExecutorSettings,
    print_line: Callable[[str], None] = print,
    progress_every: float = 60.0,
) -> list[Outcome]:
    """Run (or skip, or resume) every planned run as a Ray task; outcomes in the order they
    completed. The progress line counts a run as running while its folder is held."""
    ray = import_ray()
    root = grid.out_dir.resolve()
    root.mkdir(parents=True, exist_ok=True)
    threads = settings.cpus_per_run or 1
    outcomes: list[Outcome] = []

    live = print_line is print and sys.stdout.isatty()
    progress = GridProgress(runs, root, len(runs), print_line, live, progress_every,
                            watch_locks=True)  # fmt: skip

    def report(o: Outcome) -> None:
        outcomes.append(o)
        progress.finish(o.run, o.seconds, o.status in ("finished", "resumed"))
        took = f" in {o.seconds:.0f} s" if o.seconds else ""
        detail = f": {o.detail}" if o.detail else ""
        progress.say(f"[{len(outcomes)}/{len(runs)}] {o.run.label}: {o.status}{took}{detail}")

    # Finished runs are judged here (run_one starts nothing for them): no task, no worker.
    pending = []
    for r in runs:
        if (root / r.folder / "summary.json").is_file():
            report(launch.run_one(r, root, threads, root / "logs", Children()))
        else:
            pending.append(r)
    if not pending:
        return outcomes
    launch.prefetch(pending, print_line)
    connect(ray, settings.ray_address)
    try:
        check_fits(ray, threads, settings.gpus_per_run)
        # The runs at once, for the time left: the cluster's CPUs over a run's.
        cpus = sum(n.get("Resources", {}).get("CPU", 0) for n in ray.nodes() if n.get("Alive"))
        progress.jobs = max(1, int(cpus // threads))
        task = ray.remote(run_task).options(
            num_cpus=threads,
            num_gpus=settings.gpus_per_run,
            max_retries=settings.retries,
            retry_exceptions=[RunProcessKilled],
        )
        gpus = settings.gpus_per_run
        by_ref = {task.remote(run_data(r), str(root), threads, gpus): r for r in pending}
        note_cluster()
        waiting = list(by_ref)
        terms = SigtermSeen()
        progress.start()
        try:
            while waiting:
                done, waiting = ray.wait(waiting, num_returns=1)
                for ref in done:
                    report(_outcome_of(ray, ref, by_ref[ref], progress.say))
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (fedskew.apps.cli turns it into one)
            for ref in waiting:
                ray.cancel(ref, force=True)
            raise terms.interrupt(
                f"interrupted; Ray tasks cancelled, unfinished runs keep their checkpoints in "
                f"{root}: run the same command again to resume them"
            ) from None
        finally:
            progress.close()
            terms.restore()
    finally:
        disconnect(ray)
    return outcomes


class SigtermSeen:
    """Notes a SIGTERM before the handler in place (fedskew.apps.cli's turns it into Ctrl-C) sees
    it: ray.wait replaces whatever a signal handler raises with a plain KeyboardInterrupt,
    and the exit status must still tell a SIGTERM from a Ctrl-C."""

    def __init__(self) -> None:
        self.seen = False
        self._previous: Any = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.getsignal(signal.SIGTERM)
            if callable(self._previous):
                signal.signal(signal.SIGTERM, self._note)

    def _note(self, signum: int, frame: Any) -> None:
        self.seen = True
        self._previous(signum, frame)

    def restore(self) -> None:
        if callable(self._previous) and signal.getsignal(signal.SIGTERM) == self._note:
            signal.signal(signal.SIGTERM, self._previous)

    def interrupt(self, message: str) -> KeyboardInterrupt:
        if self.seen:
            from fedskew.core.errors import Terminated

            return Terminated(message)
        return KeyboardInterrupt(message)


def _outcome_of(ray: Any, ref: Any, run: PlannedRun, print_line: Callable[[str], None]) -> Outcome:
    try:
        data = ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        last = str(exc.cause if exc.cause is not None else exc).strip().splitlines() or ["?"]
        return Outcome(run, "failed", f"task failed after its retries: {last[-1]}")
    except ray.exceptions.RayError as exc:  # the worker or its node died once too often
        first = str(exc).strip().splitlines() or [type(exc).__name__]
        return Outcome(run, "failed", f"task failed after its retries: {first[0]}")
    if data["fedskew"] != fedskew.version.__file__:
        print_line(
            f"warning: {run.label} ran on {data['node']} with fedskew from {data['fedskew']}, "
            f"not {fedskew.version.__file__} as here: install the same fedskew on every node"
        )
    return outcome_from(run, data)
