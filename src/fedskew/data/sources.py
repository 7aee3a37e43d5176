"""Dataset loaders: find a dataset on disk (or download it), read it, normalise it.

Each image dataset is looked for, in this order, in its official on-disk formats:

1. extracted data in the search path: ``data_dir``, ``data_dir/<name>`` (and the
   dataset's other folder names), system locations such as Debian's
   ``/usr/share/datasets``, ``$FEDSKEW_DATA``, the download cache
   ``~/.cache/fedskew/<name>``, and ``shared/data/<name>`` next to or above the current
   directory (where offline copies live); inside each of these also the official
   extracted-folder names (``cifar-10-batches-bin`` ...);
2. official archives lying in the same places, checksum-verified and extracted once;
3. a download from the official URL, md5-verified.

When all of that fails the user gets one DataError line naming where it looked and what
to do, never a traceback.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedskew.data import download as dl
from fedskew.data import formats as fmt
from fedskew.errors import DataError, UsageError
from fedskew.references import entry_points, import_reference, is_reference, load_entry_point
from fedskew.rng import numpy_rng

log = logging.getLogger("fedskew.data")


@dataclass
class Dataset:
    """A loaded dataset, ready for training: tensors normalised, images NCHW."""

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    input_shape: tuple[int, ...]
    class_names: list[str]
    source: str
    natural_partition: list[np.ndarray] | None = None


@dataclass(frozen=True)
class DatasetInfo:
    """What `fedskew list` shows about a dataset, and its normalisation constants."""

    name: str
    description: str
    default_model: str
    mean: tuple[float, ...]
    std: tuple[float, ...]


DATASETS: dict[str, DatasetInfo] = {
    info.name: info
    for info in (
        DatasetInfo(
            "digits",
            "scikit-learn digits: 1,797 8x8 grey images, 10 classes (bundled, no download)",
            "mlp",
            (0.3053,),
            (0.3760,),
        ),
        DatasetInfo(
            "mnist",
            "MNIST handwritten digits: 60,000 + 10,000 28x28 grey images, 10 classes",
            "simple-cnn",
            (0.1307,),
            (0.3081,),
        ),
        DatasetInfo(
            "fmnist",
            "Fashion-MNIST: 60,000 + 10,000 28x28 grey clothing images, 10 classes",
            "simple-cnn",
            (0.2860,),
            (0.3530,),
        ),
        DatasetInfo(
            "cifar10",
            "CIFAR-10: 50,000 + 10,000 32x32 colour images, 10 classes",
            "simple-cnn",
            (0.4914, 0.4822, 0.4465),
            (0.2470, 0.2435, 0.2616),
        ),
        DatasetInfo(
            "cifar100",
            "CIFAR-100: 50,000 + 10,000 32x32 colour images, 100 fine classes",
            "cnn-cifar",
            (0.5071, 0.4865, 0.4409),
            (0.2673, 0.2564, 0.2762),
        ),
        DatasetInfo(
            "tinyimagenet",
            "Tiny ImageNet: 100,000 + 10,000 (val) 64x64 colour images, 200 classes",
            "resnet18",
            (0.4802, 0.4481, 0.3975),
            (0.2770, 0.2691, 0.2821),
        ),
        DatasetInfo(
            "synthetic",
            "FedProx Synthetic(alpha, beta): 60 features, 10 classes, one natural "
            "partition per generated client",
            "mlp",
            (),
            (),
        ),
    )
}

DIGIT_CLASSES = [str(i) for i in range(10)]
FMNIST_CLASSES = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]  # fmt: skip
CIFAR10_CLASSES = [
    "airplane", "automobile", "bird", "cat", "deer",
    "dog", "frog", "horse", "ship", "truck",
]  # fmt: skip
# CIFAR-100 fine labels in label order (the order of fine_label_names in the meta files).
CIFAR100_CLASSES = """
apple aquarium_fish baby bear beaver bed bee beetle bicycle bottle bowl boy bridge bus
butterfly camel can castle caterpillar cattle chair chimpanzee clock cloud cockroach couch
crab crocodile cup dinosaur dolphin elephant flatfish forest fox girl hamster house kangaroo
keyboard lamp lawn_mower leopard lion lizard lobster man maple_tree motorcycle mountain mouse
mushroom oak_tree orange orchid otter palm_tree pear pickup_truck pine_tree plain plate poppy
porcupine possum rabbit raccoon ray road rocket rose sea seal shark shrew skunk skyscraper
snail snake spider squirrel streetcar sunflower sweet_pepper table tank telephone television
tiger tractor train trout tulip turtle wardrobe whale willow_tree wolf woman worm
""".split()

IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".ppm"})

SYNTHETIC_FEATURES = 60
SYNTHETIC_CLASSES = 10
# FedProx draws lognormal(4, 2) + 50 samples per device; its heavy tail reaches 10^5 for a
# few clients, which only makes runs slow, so client sizes are capped here.
SYNTHETIC_MAX_SAMPLES = 2000
SYNTHETIC_TEST_FRACTION = 0.2
DIGITS_TEST_FRACTION = 0.2
DIGITS_SPLIT_SEED = 0


@dataclass
class _Raw:
    """What a format reader found: uint8 NCHW images, int64 labels, where they came from."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    source: str
    class_names: list[str] | None = None  # only when the files name the classes


# --------------------------------------------------------------------------- where to look


@dataclass(frozen=True)
class _Remote:
    filename: str
    url: str
    md5: str
    is_archive: bool


@dataclass(frozen=True)
class _Spec:
    """How to find one on-disk dataset."""

    title: str
    dir_names: tuple[str, ...]  # per-dataset folder names under data_dir, $FEDSKEW_DATA ...
    folders: tuple[str, ...]  # official extracted-folder names, looked for inside every root
    system_dirs: tuple[str, ...]
    archives: tuple[tuple[str, str | None], ...]  # local archive name, md5 (None: MD5SUMS)
    remotes: tuple[_Remote, ...]  # together they make the dataset
    probes: tuple[Callable[[Path], _Raw | None], ...] = field(default=())
    hint: str = ""


def _data_dirs_from_env() -> list[Path]:
    value = os.environ.get("FEDSKEW_DATA", "")
    return [Path(p).expanduser() for p in value.split(os.pathsep) if p]


def _search_roots(name: str, spec: _Spec, data_dir: Path | None) -> list[Path]:
    names = (name, *spec.dir_names)
    roots: list[Path] = []
    if data_dir is not None:
        roots += [data_dir, *(data_dir / n for n in names)]
    roots += [Path(p) for p in spec.system_dirs]
    for env_dir in _data_dirs_from_env():
        roots += [env_dir, *(env_dir / n for n in names)]
    roots.append(dl.cache_root() / name)
    # Offline copies for machines without internet sit in shared/data beside the checkout.
    for base in (Path.cwd(), Path.cwd().parent):
        shared = base / "shared" / "data"
        if shared.is_dir():
            roots += [shared / n for n in names]
    unique: list[Path] = []
    seen: set[str] = set()
    for root in roots:
        key = os.path.abspath(root)
        if key not in seen:
            seen.add(key)
            unique.append(root)
    return unique


def _writable(path: Path) -> bool:
    """Whether ``path`` exists writable, or could be created under a writable ancestor."""
    for p in (path, *path.parents):
        if p.exists():
            return p.is_dir() and os.access(p, os.W_OK | os.X_OK)
    return False


def _target_dir(name: str, data_dir: Path | None) -> Path:
    """Where downloads and extractions go: data_dir/<name>, else the user cache."""
    candidates = [data_dir / name] if data_dir is not None else []
    candidates.append(dl.cache_root() / name)
    for cand in candidates:
        if _writable(cand):
            return cand
    raise DataError(
        f"{name}: no writable folder to store data in ({', '.join(map(str, candidates))})"
    )


def _probe_dirs(root: Path, spec: _Spec) -> list[Path]:
    return [root, *(root / f for f in spec.folders)]


def _probe_all(dirs: list[Path], spec: _Spec, visited: set[str]) -> _Raw | None:
    for d in dirs:
        key = os.path.abspath(d)
        if key in visited or not d.is_dir():
            continue
        visited.add(key)
        for probe in spec.probes:
            raw = probe(d)
            if raw is not None:
                return raw
    return None


def _download_all(name: str, spec: _Spec, target: Path) -> str | None:
    """Download the dataset into ``target``; the failure reason, or None on success."""
    # Folders this call creates are removed again if nothing arrives: a failed download
    # (the normal case offline) must not litter the working directory with empty folders.
    created = [p for p in (target, *target.parents) if not p.exists()]
    try:
        target.mkdir(parents=True, exist_ok=True)
        # Files land in a scratch folder and move into place together, so an interrupted
        # download never leaves an incomplete set that later looks like a damaged dataset.
        scratch = Path(tempfile.mkdtemp(prefix=".fedskew-download-", dir=target))
    except OSError as exc:
        raise DataError(f"{name}: cannot write into {target}: {exc.strerror or exc}") from None
    done = False
    try:
        fetched = []
        for remote in spec.remotes:
            try:
                fetched.append(dl.download(remote.url, scratch / remote.filename, remote.md5))
            except dl.DownloadFailed as exc:
                return exc.reason
        for remote, path in zip(spec.remotes, fetched, strict=True):
            if remote.is_archive:
                dl.extract_archive(path, target)
            else:
                os.replace(path, target / remote.filename)
        done = True
        return None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if not done:
            for folder in created:  # deepest first
                try:
                    folder.rmdir()
                except OSError:
                    break


def _find(name: str, spec: _Spec, data_dir: Path | None, download: bool) -> _Raw:
    roots = _search_roots(name, spec, data_dir)
    visited: set[str] = set()
    for root in roots:
        raw = _probe_all(_probe_dirs(root, spec), spec, visited)
        if raw is not None:
            return raw

    for root in roots:
        for archive_name, md5 in spec.archives:
            archive = root / archive_name
            if not archive.is_file():
                continue
            expected = md5 or dl.md5_from_sums_file(archive)
            if expected:
                dl.verify_md5(archive, expected)
            target = _target_dir(name, data_dir)
            dl.extract_archive(archive, target)
            raw = _probe_all(_probe_dirs(target, spec), spec, set())
            if raw is None:
                raise DataError(
                    f"{name}: extracted {archive} into {target} but found no {spec.title} there"
                )
            return raw

    if download and spec.remotes:
        target = _target_dir(name, data_dir)
        reason = _download_all(name, spec, target)
        if reason is None:
            raw = _probe_all(_probe_dirs(target, spec), spec, set())
            if raw is None:
                raise DataError(f"{name}: downloaded into {target} but found no {spec.title}")
            return raw
        outcome = f"download failed ({reason})"
    else:
        outcome = "download disabled"
    places = ", ".join(str(r) for r in roots)
    raise DataError(f"{name}: no data found in {places} and {outcome}; {spec.hint}")


# --------------------------------------------------------------------------- probes


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


# --------------------------------------------------------------------------- dataset table

_TORONTO = "https://www.cs.toronto.edu/~kriz/"
_MNIST_URL = "https://ossci-datasets.s3.amazonaws.com/mnist/"
_FMNIST_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
_IDX_GZ = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)

_SPECS: dict[str, _Spec] = {
    "mnist": _Spec(
        title="MNIST",
        dir_names=("MNIST",),
        folders=("MNIST/raw", "raw"),
        system_dirs=("/usr/share/datasets/mnist",),
        archives=(),
        remotes=tuple(
            _Remote(f, _MNIST_URL + f, md5, False)
            for f, md5 in zip(
                _IDX_GZ,
                (
                    "f68b3c2dcbeaaa9fbdd348bbdeb94873",
                    "d53e105ee54ea40749a09fcbcd1e9432",
                    "9fb629c4189551a2d022fa330f9573f3",
                    "ec29112dd5afa0611ce80d1b7f02629c",
                ),
                strict=True,
            )
        ),
        probes=(_idx_probe("MNIST"),),
        hint="pass --data-dir with the four MNIST idx files (train-images-idx3-ubyte.gz, ...)",
    ),
    "fmnist": _Spec(
        title="Fashion-MNIST",
        dir_names=("fashion-mnist", "FashionMNIST"),
        folders=("FashionMNIST/raw", "fashion-mnist", "raw"),
        system_dirs=("/usr/share/datasets/fashion-mnist",),
        archives=(),
        remotes=tuple(
            _Remote(f, _FMNIST_URL + f, md5, False)
            for f, md5 in zip(
                _IDX_GZ,
                (
                    "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
                    "25c81989df183df01b3e8a0aad5dffbe",
                    "bef4ecab320f06d8554ea6380940ec79",
                    "bb300cfdad3c16e7a12a480ee83cd310",
                ),
                strict=True,
            )
        ),
        probes=(_idx_probe("Fashion-MNIST"),),
        hint=(
            "pass --data-dir with the four Fashion-MNIST idx files (train-images-idx3-ubyte.gz,"
            " ...) or install Debian's dataset-fashion-mnist"
        ),
    ),
    "cifar10": _Spec(
        title="CIFAR-10",
        dir_names=("cifar10-jpeg", "cifar-10"),
        folders=("cifar-10-batches-bin", "cifar-10-batches-py", "cifar10-jpeg"),
        system_dirs=("/usr/share/datasets/cifar10",),
        archives=(
            ("cifar-10-binary.tar.gz", "c32a1d4ab5d03f1284b67883e8d87530"),
            ("cifar-10-python.tar.gz", "c58f30108f718f92721af3b95e74349a"),
            ("cifar10-jpeg.tar.gz", None),
        ),
        # The binary version needs no unpickling at all, so it is the one downloaded.
        remotes=(
            _Remote(
                "cifar-10-binary.tar.gz",
                _TORONTO + "cifar-10-binary.tar.gz",
                "c32a1d4ab5d03f1284b67883e8d87530",
                True,
            ),
        ),
        probes=(_cifar10_binary, _cifar10_python, _cifar10_folders),
        hint=(
            "pass --data-dir with cifar-10-batches-bin/, cifar-10-batches-py/, "
            "{train,test}/<class>/ image folders or one of their .tar.gz archives"
        ),
    ),
    "cifar100": _Spec(
        title="CIFAR-100",
        dir_names=("cifar-100",),
        folders=("cifar-100-binary", "cifar-100-python"),
        system_dirs=("/usr/share/datasets/cifar100",),
        archives=(
            ("cifar-100-binary.tar.gz", "03b5dce01913d631647c71ecec9e9cb8"),
            ("cifar-100-python.tar.gz", "eb9058c3a382ffc7106e4002c42a8d85"),
        ),
        remotes=(
            _Remote(
                "cifar-100-binary.tar.gz",
                _TORONTO + "cifar-100-binary.tar.gz",
                "03b5dce01913d631647c71ecec9e9cb8",
                True,
            ),
        ),
        probes=(_cifar100_binary, _cifar100_python),
        hint=(
            "pass --data-dir with cifar-100-binary/ or cifar-100-python/ "
            "(or their .tar.gz archives)"
        ),
    ),
    "tinyimagenet": _Spec(
        title="Tiny ImageNet",
        dir_names=("tiny-imagenet",),
        folders=("tiny-imagenet-200",),
        system_dirs=("/usr/share/datasets/tiny-imagenet-200",),
        archives=(("tiny-imagenet-200.zip", "90528d7ca1a48142e341f4ef8d21d0de"),),
        remotes=(
            _Remote(
                "tiny-imagenet-200.zip",
                "http://cs231n.stanford.edu/tiny-imagenet-200.zip",
                "90528d7ca1a48142e341f4ef8d21d0de",
                True,
            ),
        ),
        probes=(_tinyimagenet,),
        hint="pass --data-dir with tiny-imagenet-200/ or tiny-imagenet-200.zip",
    ),
}


# --------------------------------------------------------------------------- assembly


def _normalised(
    x: np.ndarray, scale: float, mean: tuple[float, ...], std: tuple[float, ...]
) -> torch.Tensor:
    """(x / scale - mean) / std per channel, as a fresh contiguous float32 tensor."""
    # np.array copies (the caller's array is never modified) into C order.
    out = torch.from_numpy(np.array(x, dtype=np.float32, order="C"))
    shape = (1, -1) + (1,) * (out.dim() - 2)
    # In place: for Tiny ImageNet the float copy alone is several GB.
    out.div_(scale)
    out.sub_(torch.tensor(mean, dtype=torch.float32).view(shape))
    out.div_(torch.tensor(std, dtype=torch.float32).view(shape))
    return out


def _image_dataset(name: str, raw: _Raw, class_names: list[str]) -> Dataset:
    x_train, y_train, x_test, y_test = raw.x_train, raw.y_train, raw.x_test, raw.y_test
    info = DATASETS[name]
    for split, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
        if x.shape[0] == 0 or x.shape[0] != y.shape[0]:
            raise DataError(f"{name}: {split} set has {x.shape[0]} images and {y.shape[0]} labels")
    return Dataset(
        name=name,
        x_train=_normalised(x_train, 255.0, info.mean, info.std),
        y_train=torch.from_numpy(np.array(y_train, dtype=np.int64)),
        x_test=_normalised(x_test, 255.0, info.mean, info.std),
        y_test=torch.from_numpy(np.array(y_test, dtype=np.int64)),
        num_classes=len(class_names),
        input_shape=tuple(int(s) for s in x_train.shape[1:]),
        class_names=class_names,
        source=raw.source,
    )


def _load_digits() -> Dataset:
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        raise DataError(
            "digits: scikit-learn is not installed (pip install scikit-learn)"
        ) from None
    bunch = load_digits()
    images = bunch.images.reshape(-1, 1, 8, 8)
    labels = bunch.target.astype(np.int64)
    # A fixed split, independent of the experiment seed, so every run tests on the same set.
    train_idx, test_idx = train_test_split(
        np.arange(labels.shape[0]),
        test_size=DIGITS_TEST_FRACTION,
        random_state=DIGITS_SPLIT_SEED,
        stratify=labels,
    )
    train_idx, test_idx = np.sort(train_idx), np.sort(test_idx)
    info = DATASETS["digits"]
    # Pixels are integers 0..16 in load_digits.
    return Dataset(
        name="digits",
        x_train=_normalised(images[train_idx], 16.0, info.mean, info.std),
        y_train=torch.from_numpy(labels[train_idx]),
        x_test=_normalised(images[test_idx], 16.0, info.mean, info.std),
        y_test=torch.from_numpy(labels[test_idx]),
        num_classes=10,
        input_shape=(1, 8, 8),
        class_names=list(DIGIT_CLASSES),
        source="scikit-learn (load_digits)",
    )


def _make_synthetic(num_clients: int, seed: int, alpha: float, beta: float) -> Dataset:
    if num_clients < 1:
        raise UsageError(f"synthetic needs at least 1 client, got {num_clients}")
    if alpha < 0 or beta < 0:
        raise UsageError(f"synthetic alpha and beta must be >= 0, got {alpha} and {beta}")
    rng = numpy_rng(seed, -1, -1, "synthetic")
    sizes = rng.lognormal(4, 2, num_clients).astype(np.int64) + 50
    sizes = np.minimum(sizes, SYNTHETIC_MAX_SAMPLES)
    # As in the FedProx generator, alpha and beta are the standard deviations of the
    # per-client model mean u_k and feature mean B_k.
    u = rng.normal(0.0, alpha, num_clients)
    b_mean = rng.normal(0.0, beta, num_clients)
    feature_sd = np.arange(1, SYNTHETIC_FEATURES + 1, dtype=np.float64) ** -0.6  # sqrt(j^-1.2)

    train_x, train_y, test_x, test_y, partition = [], [], [], [], []
    offset = 0
    for k in range(num_clients):
        w = rng.normal(u[k], 1.0, (SYNTHETIC_CLASSES, SYNTHETIC_FEATURES))
        bias = rng.normal(u[k], 1.0, SYNTHETIC_CLASSES)
        v = rng.normal(b_mean[k], 1.0, SYNTHETIC_FEATURES)
        n = int(sizes[k])
        x = v + rng.standard_normal((n, SYNTHETIC_FEATURES)) * feature_sd
        y = np.argmax(x @ w.T + bias, axis=1).astype(np.int64)
        # Samples are i.i.d. within a client, so the last fifth is as random a test set as any.
        n_test = int(round(n * SYNTHETIC_TEST_FRACTION))
        n_train = n - n_test
        train_x.append(x[:n_train])
        train_y.append(y[:n_train])
        test_x.append(x[n_train:])
        test_y.append(y[n_train:])
        partition.append(np.arange(offset, offset + n_train, dtype=np.int64))
        offset += n_train

    x_train = np.concatenate(train_x)
    x_test = np.concatenate(test_x)
    mean = x_train.mean(axis=0)
    std = x_train.std(axis=0)
    std[std == 0] = 1.0
    return Dataset(
        name="synthetic",
        x_train=torch.from_numpy(((x_train - mean) / std).astype(np.float32)),
        y_train=torch.from_numpy(np.concatenate(train_y)),
        x_test=torch.from_numpy(((x_test - mean) / std).astype(np.float32)),
        y_test=torch.from_numpy(np.concatenate(test_y)),
        num_classes=SYNTHETIC_CLASSES,
        input_shape=(SYNTHETIC_FEATURES,),
        class_names=[str(i) for i in range(SYNTHETIC_CLASSES)],
        source=(
            f"generated (FedProx Synthetic({alpha:g}, {beta:g}), {num_clients} clients, "
            f"seed {seed})"
        ),
        natural_partition=partition,
    )


_REGISTERED_LOADERS: dict[str, Callable[..., Dataset]] = {}


def find_dataset_loader(name: str) -> Callable[..., Dataset]:
    """The loader of a user dataset: a ``module:function`` reference, an installed entry
    point (group ``fedskew.datasets``) or one registered in this process. A loader is called
    with the keyword arguments it accepts among ``data_dir``, ``download``, ``num_clients``
    and ``seed`` and returns a :class:`Dataset` (tensors normalised, images NCHW). It may
    carry a ``default_model`` attribute (the model for ``--model auto``)."""
    loader = _REGISTERED_LOADERS.get(name)
    if loader is None:
        loader = (
            import_reference(name, "dataset")
            if is_reference(name)
            else load_entry_point("dataset", name)
        )
    if loader is None:
        choices = [*DATASETS, *sorted(entry_points("dataset"))]
        raise UsageError(
            f"unknown dataset '{name}'; choose from: {', '.join(choices)}, "
            "or give package.module:loader"
        )
    if not callable(loader):
        raise UsageError(f"dataset '{name}' is {loader!r}, not a loader function")
    return loader


def register_dataset(name: str, loader: Callable[..., Dataset]) -> None:
    """Make a dataset loader known as ``name`` in this process."""
    if not callable(loader):
        raise UsageError(f"dataset '{name}' is {loader!r}, not a loader function")
    _REGISTERED_LOADERS[name] = loader


def default_model_for(name: str, dataset: Dataset | None = None) -> str:
    """The model ``--model auto`` picks: the dataset's own choice, else an MLP for flat
    inputs and the simple CNN for images."""
    if name in DATASETS:
        return DATASETS[name].default_model
    chosen = getattr(find_dataset_loader(name), "default_model", None)
    if isinstance(chosen, str):
        return chosen
    if dataset is not None and len(dataset.input_shape) == 3:
        return "simple-cnn"
    return "mlp"


def load_user_dataset(name: str, loader: Callable[..., Dataset], **offered: Any) -> Dataset:
    """Call a user loader with the arguments it takes; check what it returns."""
    try:
        params = inspect.signature(loader).parameters
    except (TypeError, ValueError):
        params = {}
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in offered.items() if takes_all or k in params}
    try:
        dataset = loader(**kwargs)
    except (UsageError, DataError):
        raise
    except Exception as exc:
        raise DataError(
            f"dataset '{name}': its loader failed: {type(exc).__name__}: {exc}"
        ) from None
    check_dataset(dataset, name)
    return dataset


def check_dataset(dataset: object, name: str) -> None:
    """A user dataset must be a Dataset whose tensors agree with each other."""
    if not isinstance(dataset, Dataset):
        raise DataError(f"dataset '{name}': the loader returned {type(dataset).__name__}, "
                        "not a fedskew.data.sources.Dataset")  # fmt: skip
    problems = []
    for split in ("train", "test"):
        x, y = getattr(dataset, f"x_{split}"), getattr(dataset, f"y_{split}")
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
            problems.append(f"x_{split}/y_{split} are not tensors")
            continue
        if x.shape[0] != y.shape[0] or x.shape[0] == 0:
            problems.append(f"{split}: {x.shape[0]} inputs and {y.shape[0]} labels")
        elif tuple(x.shape[1:]) != tuple(dataset.input_shape):
            problems.append(f"{split} inputs are {tuple(x.shape[1:])}, input_shape says "
                            f"{tuple(dataset.input_shape)}")  # fmt: skip
        elif y.dtype != torch.int64 or int(y.min()) < 0 or int(y.max()) >= dataset.num_classes:
            problems.append(f"{split} labels must be int64 in 0..{dataset.num_classes - 1}")
        elif not x.is_floating_point() or not bool(torch.isfinite(x).all()):
            problems.append(f"{split} inputs must be finite floating-point values")
    if problems:
        raise DataError(f"dataset '{name}': {problems[0]}")


def load_dataset(
    name: str,
    data_dir: str | Path | None = None,
    *,
    download: bool = True,
    num_clients: int = 20,
    seed: int = 0,
    synthetic_alpha: float = 1.0,
    synthetic_beta: float = 1.0,
) -> Dataset:
    """Load dataset ``name``, normalised with its mean/std (see the module docstring).

    ``num_clients``, ``seed`` and ``synthetic_*`` only affect ``synthetic``.
    """
    if name not in DATASETS:
        loader = find_dataset_loader(name)
        return load_user_dataset(
            name, loader, data_dir=data_dir, download=download, num_clients=num_clients, seed=seed
        )
    if name == "digits":
        return _load_digits()
    if name == "synthetic":
        return _make_synthetic(num_clients, seed, synthetic_alpha, synthetic_beta)
    spec = _SPECS[name]
    root = Path(data_dir).expanduser() if data_dir is not None else None
    try:
        raw = _find(name, spec, root, download)
    except DataError as exc:
        message = str(exc)
        if not message.startswith(f"{name}:"):
            message = f"{name}: {message}"
        raise DataError(message) from None
    except OSError as exc:
        # Permission problems and the like while probing folders: still one line.
        where = f"{exc.filename}: " if exc.filename else ""
        raise DataError(f"{name}: {where}{exc.strerror or exc}") from None
    if raw.class_names is not None:
        class_names = raw.class_names
    elif name == "cifar100":
        class_names = list(CIFAR100_CLASSES)
    elif name == "cifar10":
        class_names = list(CIFAR10_CLASSES)
    elif name == "fmnist":
        class_names = list(FMNIST_CLASSES)
    else:
        class_names = list(DIGIT_CLASSES)
    return _image_dataset(name, raw, class_names)
