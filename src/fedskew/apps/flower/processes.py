"""Finding and ending the processes a run started, by a tag in their environment."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def _start_time(pid: int) -> int | None:
    """A process's start time (clock ticks since boot), None when it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def tagged_processes(variable: str, tag: str) -> list[tuple[int, int]]:
    """(pid, start time) of the live processes, other than this one, whose environment holds
    ``variable=tag``: those a run started, and what they started. Only this user's processes
    can be read; none where there is no /proc."""
    marker = f"{variable}={tag}".encode()
    found: list[tuple[int, int]] = []
    proc = Path("/proc")
    if not proc.is_dir():
        return found
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if marker in environ.split(b"\0"):
            started = _start_time(int(entry.name))
            if started is not None:
                found.append((int(entry.name), started))
    return found


def end_processes(processes: list[tuple[int, int]], grace: float = 5.0) -> list[int]:
    """SIGTERM each (pid, start time) still running, SIGKILL after ``grace`` seconds what is
    left; a pid whose start time changed belongs to another process and is left alone.
    Returns the pids signalled."""

    def same(pid: int, started: int) -> bool:
        return _start_time(pid) == started

    signalled: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid, started in processes:
            if same(pid, started):
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    continue
                if pid not in signalled:
                    signalled.append(pid)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(same(p, s) for p, s in processes):
            time.sleep(0.1)
        if not any(same(p, s) for p, s in processes):
            break
    return signalled
