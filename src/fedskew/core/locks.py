"""Advisory file locks that say who holds them ("pid N on HOST"), for work that two processes
must not do at once (train one run folder, start one planned run of a grid). The OS drops a
lock with its process, so a crash or a kill never leaves one behind. POSIX ``flock``; where
there is none (Windows) or the file system refuses it, nothing is locked."""

from __future__ import annotations

import os
import socket
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: two processes on one folder go unnoticed
    fcntl = None  # type: ignore[assignment]


class Busy(Exception):
    def __init__(self, holder: str) -> None:
        super().__init__(holder)
        self.holder = holder


def lock(path: Path) -> int | None:
    """Lock ``path`` (created if missing) for this process and write who holds it; returns
    the descriptor to pass to :func:`unlock`, or None where locks are not available.
    Raises :class:`Busy` when a live process holds it, OSError when it cannot be opened."""
    if fcntl is None:
        return None
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise Busy(holder) from None
    except OSError:  # a file system without flock: go on unguarded, as before locks
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
    return fd


def unlock(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)


def holder(path: Path) -> str | None:
    """Who holds the lock on ``path``, or None when no live process does."""
    if fcntl is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder(fd)
    except OSError:
        return None
    finally:
        os.close(fd)  # also drops the shared lock taken just to look
    return None


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    return text or "pid unknown"
