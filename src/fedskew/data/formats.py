"""Readers for the official on-disk dataset formats.

Every reader returns images as contiguous ``uint8`` arrays in NCHW order and labels as
``int64``; normalisation happens once, later, in ``sources``. Any file that does not
match its format is reported as a one-line DataError naming the file, never as a numpy
or pickle traceback.
"""

from __future__ import annotations

import gzip
import importlib
import logging
import os
import pickle
import zipfile
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from fedskew.core.errors import DataError
from fedskew.data.download import create_unique

log = logging.getLogger("fedskew.data")

IDX_LABELS_MAGIC = 2049  # 0x00000801: unsigned bytes, 1 dimension
IDX_IMAGES_MAGIC = 2051  # 0x00000803: unsigned bytes, 3 dimensions

CIFAR_PIXELS = 3 * 32 * 32

# Bumped whenever the layout of the decoded-image caches changes, so stale caches are rebuilt.
CACHE_VERSION = 1


def _oserror_text(exc: OSError) -> str:
    return exc.strerror or str(exc)


def read_file_bytes(path: Path) -> bytes:
    """The content of ``path``, transparently gunzipped when its name ends in ``.gz``."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as fh:
                return fh.read()
        return path.read_bytes()
    except gzip.BadGzipFile:
        raise DataError(f"{path}: not a valid gzip file") from None
    except (EOFError, zlib.error) as exc:
        raise DataError(f"{path}: corrupt or truncated gzip data ({exc})") from None
    except OSError as exc:
        raise DataError(f"cannot read {path}: {_oserror_text(exc)}") from None


# --------------------------------------------------------------------------- idx (MNIST family)


def parse_idx(buf: bytes, path: Path, expected_magic: int) -> np.ndarray:
    """Decode an idx file held in ``buf`` (header: magic, then one big-endian u32 per dim)."""
    kind = "labels" if expected_magic == IDX_LABELS_MAGIC else "images"
    if len(buf) < 4:
        raise DataError(f"{path}: truncated idx file ({len(buf)} bytes)")
    magic = int.from_bytes(buf[:4], "big")
    if magic != expected_magic:
        raise DataError(
            f"{path}: bad magic number {magic} (expected {expected_magic} for idx {kind})"
        )
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    if len(buf) < header:
        raise DataError(f"{path}: truncated idx header")
    dims = tuple(int(d) for d in np.frombuffer(buf, dtype=">u4", count=ndim, offset=4))
    expected = int(np.prod(dims, dtype=np.int64))
    have = len(buf) - header
    if have < expected:
        raise DataError(f"{path}: truncated ({have} of {expected} data bytes for shape {dims})")
    if have > expected:
        raise DataError(f"{path}: wrong size ({have - expected} bytes beyond shape {dims})")
    return np.frombuffer(buf, dtype=np.uint8, count=expected, offset=header).reshape(dims)


def read_idx(path: Path, expected_magic: int) -> np.ndarray:
    return parse_idx(read_file_bytes(path), path, expected_magic)


# --------------------------------------------------------------------------- CIFAR binary


def read_cifar_binary(
    path: Path, label_bytes: int, label_index: int, num_classes: int
) -> tuple[np.ndarray, np.ndarray]:
    """Read a CIFAR binary batch: fixed-size records of label byte(s) then 3072 CHW pixels.

    CIFAR-10 records carry one label byte; CIFAR-100 records carry the coarse then the
    fine label, and ``label_index`` picks which one to keep.
    """
    buf = read_file_bytes(path)
    record = label_bytes + CIFAR_PIXELS
    if len(buf) == 0 or len(buf) % record:
        raise DataError(
            f"{path}: wrong size {len(buf)} bytes, not a whole number of {record}-byte records"
        )
    rows = np.frombuffer(buf, dtype=np.uint8).reshape(-1, record)
    labels = rows[:, label_index].astype(np.int64)
    check_labels(labels, num_classes, path)
    images = np.ascontiguousarray(rows[:, label_bytes:]).reshape(-1, 3, 32, 32)
    return images, labels


def check_labels(labels: np.ndarray, num_classes: int, path: Path) -> None:
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise DataError(f"{path}: label {int(labels.max())} out of range for {num_classes} classes")


# --------------------------------------------------------------------------- CIFAR python


def _resolve(*candidates: tuple[str, str]) -> Any:
    # numpy 2 moved numpy.core to numpy._core; old pickles still name numpy.core. Prefer
    # the new name, which numpy 1.26 also provides, to avoid the deprecation shim.
    for module, name in candidates:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    raise ImportError(f"none of {candidates} is importable")


_RECONSTRUCT = (
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "_reconstruct"),
)
_FROMBUFFER = (("numpy._core.numeric", "_frombuffer"), ("numpy.core.numeric", "_frombuffer"))
_ALLOWED_GLOBALS: dict[tuple[str, str], Callable[[], Any]] = {
    ("numpy.core.multiarray", "_reconstruct"): lambda: _resolve(*_RECONSTRUCT),
    ("numpy._core.multiarray", "_reconstruct"): lambda: _resolve(*_RECONSTRUCT),
    # Pickle protocol 5 (Python's default from 3.14) rebuilds arrays with _frombuffer.
    ("numpy.core.numeric", "_frombuffer"): lambda: _resolve(*_FROMBUFFER),
    ("numpy._core.numeric", "_frombuffer"): lambda: _resolve(*_FROMBUFFER),
    ("numpy", "ndarray"): lambda: np.ndarray,
    ("numpy", "dtype"): lambda: np.dtype,
}


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that can rebuild plain numpy arrays and builtin containers, nothing else.

    The official CIFAR "python version" is a set of pickles, and unpickling may call any
    importable function named in the file. fedskew accepts no arbitrary pickle: a file
    downloaded or copied from elsewhere must not be able to run code, so every global a
    pickle asks for is refused unless numpy needs it to rebuild an array.
    """

    def find_class(self, module: str, name: str) -> Any:
        factory = _ALLOWED_GLOBALS.get((module, name))
        if factory is None:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")
        return factory()

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not allowed")


def load_restricted_pickle(path: Path) -> Any:
    """Unpickle ``path`` with :class:`RestrictedUnpickler` (Python-2 pickles: bytes keys)."""
    try:
        with open(path, "rb") as fh:
            return RestrictedUnpickler(fh, encoding="bytes").load()
    except pickle.UnpicklingError as exc:
        raise DataError(f"{path}: refused or corrupt pickle ({exc})") from None
    except OSError as exc:
        raise DataError(f"cannot read {path}: {_oserror_text(exc)}") from None
    except (EOFError, ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise DataError(f"{path}: corrupt pickle ({type(exc).__name__}: {exc})") from None


def _entry(batch: dict, key: str) -> Any:
    # Official batches were written by Python 2 and load with bytes keys; accept str keys
    # too, for batches re-pickled from Python 3.
    if key.encode() in batch:
        return batch[key.encode()]
    return batch.get(key)


def read_cifar_python(
    path: Path, label_key: str, num_classes: int
) -> tuple[np.ndarray, np.ndarray]:
    """Read one pickled CIFAR batch: ``data`` (N, 3072) uint8 in CHW order plus a label list."""
    batch = load_restricted_pickle(path)
    if not isinstance(batch, dict):
        raise DataError(f"{path}: not a CIFAR batch (a {type(batch).__name__}, not a dict)")
    data = _entry(batch, "data")
    raw_labels = _entry(batch, label_key)
    if not isinstance(data, np.ndarray) or raw_labels is None:
        raise DataError(f"{path}: not a CIFAR batch (no 'data' array or no '{label_key}')")
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != CIFAR_PIXELS:
        raise DataError(
            f"{path}: 'data' has shape {data.shape} and dtype {data.dtype}, "
            f"expected (N, {CIFAR_PIXELS}) uint8"
        )
    try:
        labels = np.asarray(raw_labels, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError):
        raise DataError(f"{path}: '{label_key}' is not a list of integers") from None
    if labels.shape[0] != data.shape[0]:
        raise DataError(f"{path}: {data.shape[0]} images but {labels.shape[0]} labels")
    check_labels(labels, num_classes, path)
    return np.ascontiguousarray(data).reshape(-1, 3, 32, 32), labels


# --------------------------------------------------------------------------- image files


def _decode_chunk(
    files: Sequence[str | Path], out: np.ndarray, start: int, size: tuple[int, int]
) -> None:
    # Imported here: only the image-folder datasets need Pillow.
    from PIL import Image, UnidentifiedImageError

    width, height = size
    for offset, path in enumerate(files):
        try:
            with Image.open(path) as img:
                if img.size != (width, height):
                    raise DataError(
                        f"{path}: image is {img.size[0]}x{img.size[1]}, expected {width}x{height}"
                    )
                # Grey (and palette/CMYK) images become 3 identical/converted channels.
                out[start + offset] = np.asarray(img.convert("RGB"), dtype=np.uint8)
        except DataError:
            raise
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
            raise DataError(f"{path}: cannot decode image ({exc})") from None


def decode_images(files: Sequence[str | Path], size: tuple[int, int]) -> np.ndarray:
    """Decode RGB image files of one fixed ``(width, height)`` into an NCHW uint8 array.

    Decoding is the only per-sample Python in the loaders; Pillow releases the GIL while
    decompressing, so a few threads share the work. Callers cache the result.
    """
    width, height = size
    nhwc = np.empty((len(files), height, width, 3), dtype=np.uint8)
    workers = max(1, min(8, os.cpu_count() or 1))
    chunk = max(1, -(-len(files) // (workers * 8)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [
            pool.submit(_decode_chunk, files[i : i + chunk], nhwc, i, size)
            for i in range(0, len(files), chunk)
        ]
        try:
            for future in futures:
                future.result()
        except BaseException:
            # Stop decoding the rest once one file is known bad.
            for future in futures:
                future.cancel()
            raise
    return np.ascontiguousarray(nhwc.transpose(0, 3, 1, 2))


# --------------------------------------------------------------------------- decoded caches


def load_npz_cache(path: Path, fingerprint: str) -> dict[str, np.ndarray] | None:
    """The arrays cached at ``path`` if the cache exists, is readable and is current."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as npz:
            stored = str(npz["fingerprint"][()]) if "fingerprint" in npz.files else ""
            if stored != f"v{CACHE_VERSION}:{fingerprint}":
                return None
            return {key: npz[key] for key in npz.files if key != "fingerprint"}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        # A broken cache is ours to rebuild, not the user's problem.
        log.warning("ignoring unreadable cache %s (%s)", path, exc)
        return None


def save_npz_cache(path: Path, arrays: dict[str, np.ndarray], fingerprint: str) -> bool:
    """Write ``arrays`` atomically to ``path``; False (and no file) when that is impossible."""
    try:
        fd, tmp = create_unique(path.parent, path.name)
    except OSError:
        return False
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, fingerprint=np.array(f"v{CACHE_VERSION}:{fingerprint}"), **arrays)
        os.replace(tmp, path)
        return True
    except OSError as exc:
        log.warning("cannot write cache %s (%s)", path, exc)
        return False
    finally:
        tmp.unlink(missing_ok=True)
