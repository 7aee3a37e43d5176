"""The Ray cluster that compare or tune starts on this machine (no ``--ray-address``) dies
with them, however they end. ``ray.shutdown`` stops it on a normal end, a Ctrl-C or a
SIGTERM; but a compare killed outright (SIGKILL, the OOM killer) left Ray's dashboard and
runtime-env agents running for ever, and they ignore SIGTERM. So a small watcher process,
in a session of its own, holds a pipe from compare and the list of the cluster's processes
(compare's descendants once the cluster is up, each with its start time, so that a reused
pid is left alone); when the pipe ends, by compare closing it after ``ray.shutdown`` or by
compare's death, it kills whichever of them still live."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# Runs in the watcher: lines of JSON [[pid, start time], ...] until end of input; then
# SIGKILL to each listed process still alive with its start time.
WATCHER = """
import json, os, signal, sys
listed = {}
for line in sys.stdin:
    listed.update({int(p): t for p, t in json.loads(line)})
def started(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except OSError:
        return None
for pid, t in listed.items():
    if started(pid) == t:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
"""


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, start time) of a process, from /proc; None where it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[19]


def descendants(root: int) -> list[tuple[int, str]]:
    """Every live descendant of ``root`` as (pid, start time)."""
    children: dict[int, list[int]] = {}
    started: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None:
                children.setdefault(stat[0], []).append(int(entry.name))
                started[int(entry.name)] = stat[1]
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid in started:
            found.append((pid, started[pid]))
            todo.extend(children.get(pid, []))
    return found


class Reaper:
    """The watcher of a Ray cluster this process started (Linux; elsewhere it does
    nothing)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None
        if not sys.platform.startswith("linux"):
            return
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WATCHER],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,  # a Ctrl-C to compare's process group passes it by
        )

    def note(self) -> None:
        """List this process's descendants now (the cluster's processes) to the watcher."""
        if self.proc is None or self.proc.stdin is None:
            return
        # Only what started after the watcher, that is with the cluster: a caller's other
        # children (main() called from a program of its own) are none of its business.
        watcher = _stat(self.proc.pid)
        if watcher is None:
            return
        mine = [(pid, t) for pid, t in descendants(os.getpid())
                if pid != self.proc.pid and int(t) >= int(watcher[1])]  # fmt: skip
        try:
            self.proc.stdin.write(json.dumps(mine) + "\n")
            self.proc.stdin.flush()
        except OSError:  # the watcher is gone: nothing more to do for it
            pass

    def close(self) -> None:
        """After ray.shutdown: the watcher kills what is left and ends."""
        if self.proc is None:
            return
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            pass
