"""Running `fedskew run` as a child process for benchmarks: thread count, peak memory, metrics."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def command_text(argv: list[str], threads: int | None = None) -> str:
    """The command as a user would paste it from the repository root (``python`` shown for
    this interpreter)."""
    shown = ["python" if a == sys.executable else a for a in argv]
    prefix = f"OMP_NUM_THREADS={threads} " if threads else ""
    return prefix + " ".join(shlex.quote(a) for a in shown)


def child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    src = str(REPO / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _descendants(root: int) -> list[int]:
    """``root`` and every live process below it, from /proc (no psutil needed)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", encoding="ascii", errors="replace") as fh:
                stat = fh.read()
        except OSError:
            continue
        # The command name may hold spaces or parentheses: the fields start after the last ')'.
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def _pss(pid: int) -> int:
    """Proportional set size: shared pages (libraries, copy-on-write) split between the
    processes that share them, so that a sum over processes counts them once."""
    for path, field in ((f"/proc/{pid}/smaps_rollup", "Pss:"), (f"/proc/{pid}/status", "VmRSS:")):
        try:
            with open(path, encoding="ascii", errors="replace") as fh:
                for line in fh:
                    if line.startswith(field):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError):
            continue
    return 0


def run_child(
    argv: list[str], threads: int, log: Path, poll_s: float = 0.1
) -> tuple[int, float, int, int]:
    """Run one child process in REPO: (exit code, wall seconds, peak RSS of the child in bytes,
    peak summed PSS of the child and its descendants in bytes).

    The first peak is exact (the kernel's high-water mark, from ``os.wait4``; with worker
    processes it is the largest single process). The second is sampled every ``poll_s``
    seconds from /proc, so it can miss a peak shorter than that; it is the one that counts
    worker processes, each shared page once. ``poll_s=0`` does not sample (0 is returned; no
    /proc scans to perturb a timing).
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    tree_peak = 0
    with open(log, "w", encoding="utf-8") as fh:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            argv, stdout=fh, stderr=subprocess.STDOUT, env=child_env(threads), cwd=REPO
        )
        while True:
            # wait4 gives this child's own rusage; RUSAGE_CHILDREN would mix earlier ones in.
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG if poll_s > 0 else 0)
            if pid:
                break
            tree_peak = max(tree_peak, sum(_pss(p) for p in _descendants(proc.pid)))
            time.sleep(poll_s)
        wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    peak = usage.ru_maxrss * 1024  # Linux reports KiB
    return proc.returncode, wall, peak, tree_peak


def read_metrics(out_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl of the (single) run folder under ``out_dir``, finished or not."""
    found = sorted(Path(REPO, out_dir).glob("*/metrics.jsonl"))
    if not found:
        return []
    with open(found[0], encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
