"""The one door through which reports read run folders: regular files inside the folder the
report was asked for, and nothing else.

A report is a file people share, made from folders people share: a run folder may hold a
symbolic link to a file elsewhere on the machine (``summary.json -> ~/.ssh/id_rsa``, a
t-SNE picture linked to a private image) or a FIFO where a file belongs. A path whose
target (links followed) lies outside the folder is not read, nor one that is not a regular
file; a file is opened without blocking and checked on the open descriptor, so that a FIFO
cannot hang the report between the check and the read. A file that is read but is not what
it should be (not UTF-8, not JSON) is :class:`Damaged`: one line naming it, which the caller
turns into "run left out" rather than a stopped report.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from fedskew.core.errors import FedskewError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class Damaged(FedskewError):
    """A file of a run folder that cannot be read as what it should be (one line)."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).splitlines()
    return text[0] if text and text[0] else type(exc).__name__


class FolderFiles:
    """Reads files inside ``root`` only: regular files whose real path lies within it."""

    def __init__(self, root: Path) -> None:
        self.given = Path(root)
        self.root = self.given.resolve()

    def name(self, path: Path) -> str:
        """``path`` as the report names it: relative to the folder given, where it can be."""
        try:
            return Path(path).relative_to(self.given).as_posix()
        except ValueError:
            return str(path)

    def outside(self, path: Path) -> bool:
        """Whether ``path``, links followed, lies outside the folder (a link loop too)."""
        try:
            real = Path(path).resolve()
        except (OSError, RuntimeError, ValueError):  # ValueError: a NUL in the name
            return True
        return not real.is_relative_to(self.root)

    def exists(self, path: Path) -> bool:
        """Whether anything is at ``path`` (a link counts, wherever it points)."""
        return os.path.lexists(path)

    def read_bytes(self, path: Path, what: str) -> bytes:
        where = self.name(path)
        if self.outside(path):
            raise Damaged(f"{what} {where} leads outside {self.given}; not read")
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            raise Damaged(f"cannot read {what} {where}: {exc.strerror or exc}") from None
        with open(fd, "rb") as fh:  # closes fd
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                raise Damaged(f"{what} {where} is not a regular file; not read")
            try:
                return fh.read()
            except OSError as exc:
                raise Damaged(f"cannot read {what} {where}: {exc.strerror or exc}") from None

    def check(self, path: Path, what: str) -> None:
        """Raise :class:`Damaged` unless ``path`` may be read (for files read elsewhere by
        name, such as partition.npz and checkpoint.npz)."""
        where = self.name(path)
        if self.outside(path):
            raise Damaged(f"{what} {where} leads outside {self.given}; not read")
        try:
            mode = os.stat(path).st_mode
        except OSError as exc:
            raise Damaged(f"cannot read {what} {where}: {exc.strerror or exc}") from None
        if not stat.S_ISREG(mode):
            raise Damaged(f"{what} {where} is not a regular file; not read")

    def json(self, path: Path, what: str) -> Any:
        """The JSON value of the file."""
        data = self.read_bytes(path, what)
        try:
            return json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            # ValueError: bad JSON, or an integer of more digits than Python converts.
            raise Damaged(f"{what} {self.name(path)} is not JSON ({_first_line(exc)})") from None

    def json_lines(self, path: Path, what: str) -> list[Any]:
        """The values of a JSON-lines file. A last line that does not parse is a line cut
        by a kill mid-write (or being written now) and is dropped; one with lines after it
        is damage."""
        lines = self.read_bytes(path, what).split(b"\n")
        rows = []
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line.decode("utf-8")))
            except (UnicodeDecodeError, ValueError, RecursionError) as exc:
                if any(rest.strip() for rest in lines[number:]):
                    raise Damaged(
                        f"{what} {self.name(path)}: line {number} is not JSON ({_first_line(exc)})"
                    ) from None
                break
        return rows

    def picture(self, path: Path) -> bytes:
        """A PNG picture's bytes."""
        data = self.read_bytes(path, "picture")
        if not data.startswith(PNG_SIGNATURE):
            raise Damaged(f"picture {self.name(path)} is not a PNG file; not embedded")
        return data
