"""Downloading, checksum verification and archive extraction for the dataset loaders.

Everything here either completes or leaves nothing behind: downloads stream into a
``.part`` file that is renamed only after its md5 matched, and archives are extracted
into a scratch folder that is renamed into place only once extraction succeeded. A
second process loading the same dataset at the same time therefore never sees a half
file, and an interrupted run does not poison the next one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import shutil
import socket
import tarfile
import tempfile
import urllib.error
import urllib.request
import zipfile
import zlib
from pathlib import Path

from fedskew.core.errors import DataError

log = logging.getLogger("fedskew.data")

CONNECT_TIMEOUT_S = 10.0
_CHUNK = 1 << 20


class DownloadFailed(Exception):
    """The network did not deliver a file; the caller falls back or reports ``reason``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def create_unique(folder: Path, prefix: str, suffix: str = ".part") -> tuple[int, Path]:
    """Create a new empty file in ``folder``; its descriptor (opened for writing) and path.

    Unlike tempfile.mkstemp, whose files are private (0600), the file gets the permissions
    the umask allows, since it becomes a dataset or cache file that others may share.
    """
    folder.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    for _ in range(100):
        path = folder / f"{prefix}.{secrets.token_hex(6)}{suffix}"
        try:
            return os.open(path, flags, 0o666), path
        except FileExistsError:
            continue
    raise FileExistsError(f"cannot create a unique file in {folder}")


def cache_root() -> Path:
    """Where fedskew keeps downloads and decoded caches when no data folder is given."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(base) / "fedskew"


def md5_file(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def verify_md5(path: Path, expected: str) -> None:
    """Raise a one-line DataError when ``path`` does not have the published md5."""
    try:
        actual = md5_file(path)
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}") from None
    if actual != expected.lower():
        raise DataError(
            f"checksum mismatch for {path}: md5 {actual}, expected {expected} "
            "(corrupt or incomplete file; delete it and retry)"
        )


def md5_from_sums_file(path: Path) -> str | None:
    """The md5 listed for ``path`` in an ``MD5SUMS`` file next to it, if there is one."""
    sums = path.parent / "MD5SUMS"
    try:
        lines = sums.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        # md5sum writes "<hex>  <name>" or "<hex> *<name>" in binary mode.
        if len(parts) == 2 and parts[1].lstrip("*") == path.name:
            return parts[0]
    return None


def _network_reason(exc: BaseException) -> str:
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    if isinstance(reason, socket.gaierror):
        return "no network"
    if isinstance(reason, TimeoutError):
        return "timed out"
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code} {exc.reason}"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror.lower()
    return str(reason) or type(reason).__name__


def download(url: str, dest: Path, md5: str) -> Path:
    """Fetch ``url`` to ``dest`` and check its md5.

    Raises DownloadFailed when the network does not cooperate (the caller turns that into
    its own one-line message listing every place it looked), DataError on a checksum
    mismatch or when ``dest`` cannot be written.
    """
    try:
        fd, tmp = create_unique(dest.parent, dest.name)
    except OSError as exc:
        raise DataError(f"cannot write into {dest.parent}: {exc.strerror or exc}") from None
    log.info("downloading %s", url)
    try:
        digest = hashlib.md5(usedforsecurity=False)
        with os.fdopen(fd, "wb") as out:
            try:
                with urllib.request.urlopen(url, timeout=CONNECT_TIMEOUT_S) as resp:
                    while chunk := resp.read(_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
            except (urllib.error.URLError, OSError, ValueError) as exc:
                # OSError covers socket errors raised mid-stream; a write error on our side
                # is also an OSError but is reported the same way, with its strerror.
                raise DownloadFailed(_network_reason(exc)) from None
        if digest.hexdigest() != md5.lower():
            raise DataError(
                f"checksum mismatch for {url}: md5 {digest.hexdigest()}, expected {md5}"
            )
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def _extract_into(archive: Path, scratch: Path) -> None:
    name = archive.name.lower()
    if name.endswith(".zip"):
        with zipfile.ZipFile(archive) as zf:
            bad = zf.testzip()
            if bad is not None:
                raise zipfile.BadZipFile(f"bad CRC for member {bad}")
            # ZipFile.extractall drops absolute paths and ".." components itself.
            zf.extractall(scratch)
    else:
        with tarfile.open(archive) as tf:
            # The "data" filter refuses absolute paths, links out of the tree and device
            # files, so a hostile archive cannot write outside the scratch folder.
            tf.extractall(scratch, filter="data")


def extract_archive(archive: Path, target_dir: Path) -> list[Path]:
    """Extract a .tar.gz/.tgz/.tar/.zip archive into ``target_dir``.

    Returns the top-level entries now present in ``target_dir`` that came from the
    archive. An entry that already exists there is kept (another process won the race or
    an earlier run already extracted it) and the fresh copy is discarded.
    """
    try:
        target_dir.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=".fedskew-extract-", dir=target_dir))
    except OSError as exc:
        raise DataError(f"cannot write into {target_dir}: {exc.strerror or exc}") from None
    log.info("extracting %s into %s", archive, target_dir)
    try:
        try:
            _extract_into(archive, scratch)
        except (tarfile.TarError, zipfile.BadZipFile, EOFError, zlib.error) as exc:
            raise DataError(f"corrupt archive {archive}: {exc}") from None
        except OSError as exc:
            raise DataError(f"cannot extract {archive}: {exc.strerror or exc}") from None
        placed = []
        for entry in sorted(scratch.iterdir()):
            final = target_dir / entry.name
            if not final.exists():
                os.replace(entry, final)
            placed.append(final)
        return placed
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
