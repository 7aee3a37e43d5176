"""graph_step_check.py's paths that train several clients at once on one device without
stacking them (issue 47): K model replicas on K CUDA streams in one process, and N processes
started together, each training its own replica, with and without CUDA's Multi-Process
Service (MPS).

* **streams**: K clients, each its own model and :class:`LocalStep` (graph-safe; captured
  as a CUDA graph on CUDA), driven step by step, client by client, each client's loads and
  replays issued on its own ``torch.cuda.Stream``, so the GPU may run one client's kernels
  while another's wait. Samples/s are those of all K clients together over the wall time.
  On the CPU there are no streams: the same loop runs the K clients' steps one after another
  (the row says so).
* **N processes**: N copies of this file started as processes at once, each building its
  replica, warming up (and capturing) and then saying "ready"; when all are, each is told
  "go" and times ``repeats`` passes of its own step. Aggregate samples/s = all processes'
  samples over the time from the first start to the last end, as ``fedskew compare --jobs N``
  packs N runs onto one GPU. Each process reports its peak memory. The processes get
  ``OMP_NUM_THREADS=1``, as compare gives its runs.
* **MPS**: the same, under a Multi-Process Service daemon this path starts with a private
  pipe and log directory (``nvidia-cuda-mps-control -d``) and always stops after
  (``echo quit | nvidia-cuda-mps-control``, also on failure or SIGTERM); where it cannot
  start, or does not exist, the row says why and has no numbers.

Parent and processes speak JSON lines over stdin/stdout; nothing is pickled.

    python benchmarks/concurrent_paths.py child '<setting as JSON>' REPEATS   # one process
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_setting import (  # noqa: E402
    Setting,
    client_data,
    fresh_model,
    peak_memory,
    sync,
    train_config,
)

from fedskew.training.graph_step import LocalStep, resolve_graphs  # noqa: E402

MPS_CONTROL = "nvidia-cuda-mps-control"
# A process that has not said "ready" (or its result) by then is stopped and the row fails:
# on a GPU a process starts, builds and captures in seconds (the dry run's 4 on 2 busy
# cores: about 5 s), so this only bounds a hang, such as an MPS server that never answers.
PROCESS_DEADLINE_S = 60.0


# ---------------------------------------------------------------------------- streams


def replicas(s: Setting, count: int) -> tuple[list[LocalStep], list[torch.Tensor], str]:
    """``count`` clients' graph-safe steps from the same initial weights over the same
    images, each with its own batch order (seed 10 + k): their steps and their epoch's
    permutation on the device, and why they run eagerly ("" when graphed)."""
    graphs, reason = resolve_graphs("on", s.device, fresh_model(s))
    n = s.batch * s.timed_steps
    data = client_data(s, n)  # read only: the clients share it
    steps, perms = [], []
    for k in range(count):
        steps.append(LocalStep(fresh_model(s), data, train_config(s), graphs=graphs))
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(10 + k))
        perms.append(perm.to(s.device))
    return steps, perms, reason


def interleaved(
    steps: list[LocalStep], perms: list[torch.Tensor], batch: int, streams: list[Any] | None
) -> int:
    """One epoch of every client, step i of each client before step i + 1 of any, each
    client's work issued on its own stream (None: the current one). A step is what
    ``LocalStep.train`` does for a full batch (load the static buffers, then replay, warm
    up or capture), without its end-of-epoch read of the loss, which would wait for the
    GPU. Returns the samples trained."""
    n_steps = min(p.numel() for p in perms) // batch
    for i in range(n_steps):
        for k, step in enumerate(steps):
            with torch.cuda.stream(streams[k]) if streams is not None else nullcontext():
                size = step.load(perms[k][i * batch : (i + 1) * batch], None, i)
                step.run(size, batch)
    return n_steps * batch * len(steps)


def streams_path(s: Setting) -> dict[str, Any]:
    """K = ``s.clients`` replicas, each on its own CUDA stream (on the CPU one after another)."""
    out: dict[str, Any] = {}
    with peak_memory(s.device, out):
        steps, perms, reason = replicas(s, s.clients)
        for step in steps:
            step.model.train()
        streams = None
        if s.device.type == "cuda":
            current = torch.cuda.current_stream(s.device)
            streams = [torch.cuda.Stream(device=s.device) for _ in steps]
            for st in streams:  # the replicas and permutations were made on this one
                st.wait_stream(current)
        interleaved(steps, perms, s.batch, streams)  # warm-up and capture, as other paths get
        sync(s.device)
        t0 = time.perf_counter()
        samples = interleaved(steps, perms, s.batch, streams)
        sync(s.device)
        seconds = time.perf_counter() - t0
    if streams is not None:
        how = f"{len(steps)} replicas, each on its own CUDA stream"
    else:
        how = f"{len(steps)} replicas one after another (no streams on {s.device.type})"
    graphed = all(step._graph for step in steps)
    note = how + ("; steps replayed as CUDA graphs" if graphed else f"; eager: {reason}")
    out.update(
        samples_per_second=round(samples / seconds, 1),
        ms_per_step=round(1000 * seconds / (samples // s.batch), 3),  # per client step
        graph=graphed,
        note=note,
    )
    return out


# ---------------------------------------------------------------------------- one process


def child(s: Setting, repeats: int) -> None:
    """A measuring process: build, warm up (and capture), say ready, wait for go, time
    ``repeats`` epochs of the step, say the result; all JSON lines on stdout."""
    out: dict[str, Any] = {}
    with peak_memory(s.device, out):
        steps, perms, reason = replicas(s, 1)
        steps[0].model.train()
        interleaved(steps, perms, s.batch, None)  # warm-up, capture
        sync(s.device)
        print(json.dumps({"ready": True}), flush=True)
        if sys.stdin.readline().strip() != "go":
            return
        start = time.time()  # wall clock: compared across processes
        samples = sum(interleaved(steps, perms, s.batch, None) for _ in range(repeats))
        sync(s.device)
        end = time.time()
    print(json.dumps({"samples": samples, "start": start, "end": end,
                      "peak_mib": out["peak_mib"], "graph": bool(steps[0]._graph),
                      "reason": reason}), flush=True)  # fmt: skip


# ---------------------------------------------------------------------------- N processes


def repeats_for(s: Setting) -> int:
    """Epochs each process times: on CUDA enough that its timed stretch (about a second
    for ResNet-18) is long against the go messages' spread; one in the dry run."""
    return 5 if s.device.type == "cuda" else 1


def _line(
    proc: subprocess.Popen[str], errors: Path, what: str, expired: threading.Event
) -> dict[str, Any]:
    """The process's next JSON object on stdout (other lines, a library's print, skipped);
    a process that ended or was stopped at the deadline is a failure that says why."""
    assert proc.stdout is not None
    for text in proc.stdout:
        try:
            said = json.loads(text)
        except ValueError:
            continue
        if isinstance(said, dict):
            return said
    if expired.is_set():
        raise RuntimeError(f"a process had not said {what} after {PROCESS_DEADLINE_S:.0f} s "
                           "and was stopped")  # fmt: skip
    tail = errors.read_text(errors="replace").strip().splitlines()[-1:] or ["no message"]
    raise RuntimeError(f"a process ended before {what} (exit {proc.wait()}): {tail[0]}")


def child_command(s: Setting, repeats: int) -> list[str]:
    """The command of one measuring process (this file, ``child``)."""
    return [sys.executable, str(Path(__file__).resolve()), "child", json.dumps(s.to_json()),
            str(repeats)]  # fmt: skip


def run_processes(s: Setting, count: int, env: dict[str, str] | None = None) -> dict[str, Any]:
    """``count`` measuring processes at once (see the module's docstring)."""
    env = {**(env or os.environ), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = child_command(s, repeats_for(s))
    procs: list[subprocess.Popen[str]] = []
    with tempfile.TemporaryDirectory(prefix="fedskew-processes-") as tmp:
        logs = [Path(tmp) / f"{i}.err" for i in range(count)]
        # A hung process would hold the check: past the deadline every one is killed,
        # which ends the reads below with a clear failure.
        expired = threading.Event()

        def stop_all() -> None:
            expired.set()
            for p in procs:
                p.kill()

        timer = threading.Timer(PROCESS_DEADLINE_S, stop_all)
        timer.start()
        try:
            for log in logs:
                with log.open("w") as err:
                    procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE,
                                                  stdout=subprocess.PIPE, stderr=err,
                                                  text=True, env=env))  # fmt: skip
            for p, log in zip(procs, logs, strict=True):
                _line(p, log, "it was ready", expired)
            for p in procs:  # all are ready: go, as close together as the host can
                assert p.stdin is not None
                p.stdin.write("go\n")
                p.stdin.flush()
            results = [
                _line(p, log, "its result", expired) for p, log in zip(procs, logs, strict=True)
            ]
        finally:
            timer.cancel()
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
    return aggregate(results, s.batch)


def aggregate(results: list[dict[str, Any]], batch: int) -> dict[str, Any]:
    """The row of processes that ran at once: all their samples over the wall time from the
    first one's start to the last one's end (a process that started late or ran slow
    lengthens it: what N runs packed on one GPU give), the peak memory of each."""
    count = len(results)
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    samples = sum(r["samples"] for r in results)
    peaks = [r["peak_mib"] for r in results]
    graphed = all(r["graph"] for r in results)
    each = ", ".join(f"{r['samples'] / (r['end'] - r['start']):,.0f}" for r in results)
    how = "CUDA graph" if graphed else f"eager ({results[0]['reason']})"
    note = (f"{count} processes at once (OMP_NUM_THREADS=1 each), each its own fedskew step "
            f"({how}); samples/s each: {each}")  # fmt: skip
    if peaks[0] is not None:
        note += "; peak MiB each: " + ", ".join(f"{p:,.0f}" for p in peaks)
    return {
        "samples_per_second": round(samples / wall, 1),
        "ms_per_step": round(1000 * wall / (samples // batch), 3),  # per step of any process
        "peak_mib": max(peaks) if peaks[0] is not None else None,
        "peak_mib_each": peaks,
        "processes": count,
        "graph": graphed,
        "note": note,
    }


# ---------------------------------------------------------------------------- MPS


@contextmanager
def mps_daemon(where: Path) -> Iterator[tuple[dict[str, str] | None, str]]:
    """An MPS control daemon with its pipe and log directories under ``where``: yields the
    environment its clients need, or None and why it could not start. Stopped on the way
    out, whatever happened (also on SIGTERM, which ``timeout`` sends)."""
    exe = shutil.which(MPS_CONTROL)
    if exe is None:
        yield None, f"{MPS_CONTROL} not found on PATH"
        return
    pipe, logs = where / "pipe", where / "log"
    pipe.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(logs)}
    try:
        done = subprocess.run([exe, "-d"], env=env, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        yield None, f"{MPS_CONTROL} -d did not start: {exc}"
        return
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()[-1:] or [mps_log(logs)]
        yield None, f"{MPS_CONTROL} -d failed (exit {done.returncode}): {said[0]}"
        return

    def stop_on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop_on_term)
    try:
        yield env, ""
    finally:
        signal.signal(signal.SIGTERM, previous)
        try:
            subprocess.run([exe], input="quit\n", env=env, capture_output=True, text=True,
                           timeout=30)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as exc:
            print(f"concurrent_paths: {MPS_CONTROL} quit failed: {exc}", file=sys.stderr)


def mps_log(logs: Path) -> str:
    """The daemon's last logged line (why a server did not start), or that there is none."""
    lines: list[str] = []
    for name in ("control.log", "server.log"):
        f = logs / name
        if f.is_file():
            lines += f.read_text(errors="replace").strip().splitlines()
    return lines[-1] if lines else "no MPS log"


def processes_under_mps(s: Setting, count: int) -> dict[str, Any]:
    """:func:`run_processes` as clients of a private MPS daemon (CUDA only)."""
    if s.device.type != "cuda":
        return {"samples_per_second": None,
                "note": f"not measured: MPS is CUDA's ({s.device.type} dry run)"}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="fedskew-mps-") as tmp:
        return _under_mps(s, count, Path(tmp))


def _under_mps(s: Setting, count: int, tmp: Path) -> dict[str, Any]:
    with mps_daemon(tmp) as (env, why):
        if env is None:
            return {"samples_per_second": None, "note": f"not measured: {why}"}
        try:
            out = run_processes(s, count, env)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; MPS log: {mps_log(tmp / 'log')}") from None
    out["note"] = "under MPS (private daemon): " + out["note"]
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] != "child":
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    s = Setting.from_json(json.loads(argv[1]))
    child(s, int(argv[2]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
