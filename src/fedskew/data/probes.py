"""Probes for the official on-disk dataset formats: IDX (MNIST, Fashion-MNIST), CIFAR
binary and python batches, ``<split>/<class>/<image>`` folders and Tiny ImageNet.

A probe takes one folder and returns what it found there as uint8 NCHW images and int64
labels (``_Raw``), None when the folder does not hold its format, and a one-line
DataError when it holds an incomplete or broken copy. Image folders are decoded once and
the decoded arrays cached as ``.npz`` next to the folder (or in the user cache).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedskew.core.errors import DataError
from fedskew.data import download as dl
from fedskew.data import formats as fmt
from fedskew.data.datasets import CIFAR10_CLASSES

log = logging.getLogger("fedskew.data")

IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".ppm"})


@dataclass
class _Raw:
    """What a format reader found: uint8 NCHW images, int64 labels, where they came from."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    source: str
    class_names: list[str] | None = None  # only when the files name the classes


def _idx_probe(title: str) -> Callable[[Path], _Raw | None]:
    bases = (
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    )

    def probe(d: Path) -> _Raw | None:
        found: dict[str, Path] = {}
        for base in bases:
            for cand in (d / f"{base}.gz", d / base):
                if cand.is_file():
                    found[base] = cand
                    break
        if not found:
            return None
        missing = [f"{b}.gz" for b in bases if b not in found]
        if missing:
            raise DataError(f"incomplete {title} idx files in {d}: missing {', '.join(missing)}")
        arrays = []
        for split in ("train", "t10k"):
            img_path = found[f"{split}-images-idx3-ubyte"]
            lbl_path = found[f"{split}-labels-idx1-ubyte"]
            images = fmt.read_idx(img_path, fmt.IDX_IMAGES_MAGIC)
            labels = fmt.read_idx(lbl_path, fmt.IDX_LABELS_MAGIC).astype(np.int64)
            if images.shape[1:] != (28, 28):
                raise DataError(f"{img_path}: images are {images.shape[1:]}, expected 28x28")
            if images.shape[0] != labels.shape[0]:
                raise DataError(
                    f"{lbl_path}: {labels.shape[0]} labels for {images.shape[0]} images"
                )
            fmt.check_labels(labels, 10, lbl_path)
            arrays += [images.reshape(-1, 1, 28, 28), labels]
        return _Raw(*arrays, source=f"{title} idx files in {d}")

    return probe


def _require_all(d: Path, names: list[str], title: str) -> list[Path] | None:
    """The files ``names`` in ``d``; None if none exist, DataError if only some do."""
    paths = [d / n for n in names]
    present = [p.is_file() for p in paths]
    if not any(present):
        return None
    if not all(present):
        missing = ", ".join(p.name for p, ok in zip(paths, present, strict=True) if not ok)
        raise DataError(f"incomplete {title} in {d}: missing {missing}")
    return paths


def _concat(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def _cifar10_binary(d: Path) -> _Raw | None:
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    paths = _require_all(d, names, "CIFAR-10 binary batches")
    if paths is None:
        return None
    parts = [fmt.read_cifar_binary(p, 1, 0, 10) for p in paths]
    x_train, y_train = _concat(parts[:5])
    x_test, y_test = parts[5]
    return _Raw(x_train, y_train, x_test, y_test, f"CIFAR-10 binary batches in {d}")


def _cifar10_python(d: Path) -> _Raw | None:
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    paths = _require_all(d, names, "CIFAR-10 python batches")
    if paths is None:
        return None
    parts = [fmt.read_cifar_python(p, "labels", 10) for p in paths]
    x_train, y_train = _concat(parts[:5])
    x_test, y_test = parts[5]
    return _Raw(x_train, y_train, x_test, y_test, f"CIFAR-10 python batches in {d}")


def _cifar100_binary(d: Path) -> _Raw | None:
    paths = _require_all(d, ["train.bin", "test.bin"], "CIFAR-100 binary files")
    if paths is None:
        return None
    # Records are <coarse label><fine label><3072 pixels>; fedskew uses the fine labels.
    x_train, y_train = fmt.read_cifar_binary(paths[0], 2, 1, 100)
    x_test, y_test = fmt.read_cifar_binary(paths[1], 2, 1, 100)
    return _Raw(x_train, y_train, x_test, y_test, f"CIFAR-100 binary files in {d}")


def _cifar100_python(d: Path) -> _Raw | None:
    paths = _require_all(d, ["train", "test"], "CIFAR-100 python files")
    if paths is None:
        return None
    x_train, y_train = fmt.read_cifar_python(paths[0], "fine_labels", 100)
    x_test, y_test = fmt.read_cifar_python(paths[1], "fine_labels", 100)
    return _Raw(x_train, y_train, x_test, y_test, f"CIFAR-100 python files in {d}")


def _image_files(folder: Path) -> list[str]:
    # Plain strings, not Path objects: building 100,000 Paths costs about a second on
    # every load, even when the decoded images come from the cache.
    try:
        entries = list(os.scandir(folder))
    except OSError as exc:
        raise DataError(f"cannot list {folder}: {exc.strerror or exc}") from None
    names = sorted(
        e.name
        for e in entries
        if not e.name.startswith(".") and os.path.splitext(e.name)[1].lower() in IMAGE_SUFFIXES
    )
    prefix = os.path.join(folder, "")
    return [prefix + n for n in names]


def _subfolders(folder: Path) -> set[str]:
    try:
        return {e.name for e in os.scandir(folder) if e.is_dir() and not e.name.startswith(".")}
    except OSError as exc:
        raise DataError(f"cannot list {folder}: {exc.strerror or exc}") from None


def _fingerprint(root: Path, files: list[str], labels: np.ndarray) -> str:
    # Names and labels identify the decoded content well enough: the folders are datasets
    # that are extracted once, not edited in place.
    skip = len(os.path.join(root, ""))
    lines = [
        f"{path[skip:]}\t{label}\n" for path, label in zip(files, labels.tolist(), strict=True)
    ]
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def _cache_candidates(d: Path, name: str) -> list[Path]:
    # Next to the image folder when that is writable; else in the user cache, keyed by the
    # folder's absolute path so that two folders never share a cache file.
    key = hashlib.sha256(os.path.abspath(d).encode()).hexdigest()[:12]
    return [
        d.parent / f"{d.name}.fedskew.npz",
        dl.cache_root() / name / f"{d.name}-{key}.fedskew.npz",
    ]


def _decoded(
    d: Path,
    name: str,
    train: tuple[list[str], np.ndarray],
    test: tuple[list[str], np.ndarray],
    size: tuple[int, int],
) -> _Raw:
    """Decode the train and test images, or load them from the .npz cache."""
    fingerprint = _fingerprint(d, train[0] + test[0], np.concatenate([train[1], test[1]]))
    candidates = _cache_candidates(d, name)
    for cache in candidates:
        arrays = fmt.load_npz_cache(cache, fingerprint)
        if arrays is not None and set(arrays) == {"x_train", "y_train", "x_test", "y_test"}:
            return _Raw(**arrays, source=str(d))
    total = len(train[0]) + len(test[0])
    log.info("decoding %d images in %s (cached after the first load)", total, d)
    arrays = {
        "x_train": fmt.decode_images(train[0], size),
        "y_train": train[1],
        "x_test": fmt.decode_images(test[0], size),
        "y_test": test[1],
    }
    written = next((c for c in candidates if fmt.save_npz_cache(c, arrays, fingerprint)), None)
    if written is None:
        log.warning("could not cache decoded %s images; the next load decodes them again", name)
    return _Raw(**arrays, source=str(d))


def _class_folder_split(split_dir: Path, classes: list[str]) -> tuple[list[str], np.ndarray]:
    present = _subfolders(split_dir)
    unexpected = sorted(present - set(classes))
    if unexpected:
        raise DataError(f"{split_dir}: unexpected class folder(s) {', '.join(unexpected)}")
    missing = [c for c in classes if c not in present]
    if missing:
        raise DataError(f"{split_dir}: missing class folder(s) {', '.join(missing)}")
    files: list[str] = []
    counts = []
    for cls in classes:
        found = _image_files(split_dir / cls)
        files += found
        counts.append(len(found))
    if not files:
        raise DataError(f"{split_dir}: no image files in the class folders")
    return files, np.repeat(np.arange(len(classes), dtype=np.int64), counts)


def _cifar10_folders(d: Path) -> _Raw | None:
    train_dir, test_dir = d / "train", d / "test"
    if not (train_dir.is_dir() and test_dir.is_dir()):
        return None
    if not (_subfolders(train_dir) & set(CIFAR10_CLASSES)):
        return None
    # Labels follow CIFAR-10's label order, not the alphabetical order of the folders.
    train = _class_folder_split(train_dir, CIFAR10_CLASSES)
    test = _class_folder_split(test_dir, CIFAR10_CLASSES)
    raw = _decoded(d, "cifar10", train, test, (32, 32))
    # JPEG is lossy: results on such a copy must not be reported as plain CIFAR-10.
    jpeg = any(p.lower().endswith((".jpg", ".jpeg")) for p in train[0] + test[0])
    raw.source = f"CIFAR-10 ({'JPEG copy' if jpeg else 'image folders'}) at {d}"
    return raw


def _read_lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}") from None


def _tinyimagenet_classes(d: Path) -> list[str] | None:
    wnids_path = d / "wnids.txt"
    if not (wnids_path.is_file() and (d / "train").is_dir()):
        return None
    wnids = [line.strip() for line in _read_lines(wnids_path) if line.strip()]
    if not wnids or len(set(wnids)) != len(wnids):
        raise DataError(f"{wnids_path}: empty or has duplicate class ids")
    return wnids


def _tinyimagenet(d: Path) -> _Raw | None:
    wnids = _tinyimagenet_classes(d)
    if wnids is None:
        return None
    train_files: list[str] = []
    counts = []
    for wnid in wnids:
        class_dir = d / "train" / wnid / "images"
        if not class_dir.is_dir():
            raise DataError(f"{d}: missing folder train/{wnid}/images for a class in wnids.txt")
        found = _image_files(class_dir)
        train_files += found
        counts.append(len(found))
    train = (train_files, np.repeat(np.arange(len(wnids), dtype=np.int64), counts))

    annotations = d / "val" / "val_annotations.txt"
    if not annotations.is_file():
        raise DataError(f"{d}: missing val/val_annotations.txt (the test labels)")
    index = {wnid: i for i, wnid in enumerate(wnids)}
    test_files: list[str] = []
    test_labels: list[int] = []
    for lineno, line in enumerate(_read_lines(annotations), start=1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) < 2 or fields[1] not in index:
            raise DataError(f"{annotations}:{lineno}: expected '<file>\\t<wnid from wnids.txt>'")
        test_files.append(os.path.join(d, "val", "images", fields[0]))
        test_labels.append(index[fields[1]])
    if not train_files or not test_files:
        raise DataError(f"{d}: no training images or no validation images")
    test = (test_files, np.asarray(test_labels, dtype=np.int64))
    raw = _decoded(d, "tinyimagenet", train, test, (64, 64))
    raw.source = f"Tiny ImageNet at {d}"
    raw.class_names = _tinyimagenet_names(d, wnids)
    return raw


def _tinyimagenet_names(d: Path, wnids: list[str]) -> list[str]:
    words = d / "words.txt"
    if not words.is_file():
        return list(wnids)
    names: dict[str, str] = {}
    for line in _read_lines(words):
        wnid, _, text = line.partition("\t")
        if text:
            names[wnid.strip()] = text.split(",")[0].strip()
    return [names.get(w, w) for w in wnids]
