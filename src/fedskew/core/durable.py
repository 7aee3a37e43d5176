"""Writing files that a resume depends on, so that a crash or a power cut leaves either the
old file or the new one, never a torn one: temp file, fsync, rename, fsync of the folder."""

from __future__ import annotations

import itertools
import json
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from fedskew.core.errors import FedskewError

# Two processes may write the same file at once (two `fedskew compare` on one grid both write
# compare.json and the tables): each write gets its own temp name, so neither can rename or
# delete the other's half-written file. Readers of a folder ignore and clean `*.tmp`.
_TEMP_SERIAL = itertools.count()


_TEMP = re.compile(r"\.(\d+)-\d+\.tmp$")


def temp_name(path: Path) -> Path:
    return path.with_name(f"{path.name}.{os.getpid()}-{next(_TEMP_SERIAL)}.tmp")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    if os.name != "posix":  # os.kill(pid, 0) would end the process on Windows
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def remove_stale_temps(folder: Path) -> None:
    """Delete the temp files that killed writers left in ``folder``; a live writer's stays."""
    for tmp in Path(folder).glob("*.tmp"):
        match = _TEMP.search(tmp.name)
        if match is None or not _alive(int(match.group(1))):
            tmp.unlink(missing_ok=True)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (a no-op where folders cannot be
    opened, as on Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def replace_durably(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write ``path`` through ``write(fh)`` into a temp file beside it, then put it in place."""
    path = Path(path)
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_bytes_durably(path: Path, data: bytes) -> None:
    replace_durably(path, lambda fh: fh.write(data))


def append_line_durably(path: Path, line: str) -> None:
    """Append one line (a newline is added) and fsync; a kill mid-write leaves at most a
    last line without its newline, which readers drop."""
    path = Path(path)
    new = not path.exists()
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    if new:
        fsync_dir(path.parent)


def refuse_non_regular(path: Path, what: str) -> None:
    """A one-line FedskewError when ``path`` exists but is not a regular file (after links):
    reading a FIFO placed where a checkpoint, partition or metrics file belongs would block
    for ever, a device would never end. A missing file is the caller's to report."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise FedskewError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        raise FedskewError(f"{what} {path} is not a regular file; refusing to read it")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file up to the first line that does not parse (one cut by a
    kill mid-write, or being written now); none if the file does not exist."""
    if not path.exists():
        return []
    refuse_non_regular(path, "metrics file")
    rows = []
    for line in path.read_bytes().split(b"\n"):
        try:
            rows.append(json.loads(line.decode("utf-8")))
        except (UnicodeDecodeError, json.JSONDecodeError):
            break
    return rows
