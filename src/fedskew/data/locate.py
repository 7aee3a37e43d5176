"""Finding an on-disk dataset: the search roots, official archives and downloads.

``_find`` looks for a dataset in the order the ``fedskew.data.sources`` docstring gives:
extracted data in the search roots (``_search_roots``), then official archives lying there
(checksum-verified and extracted once), then a download from the official URL
(md5-verified). ``_SPECS`` says, per image dataset, its folder names, archives, official
URLs with their md5 checksums and the probes (``fedskew.data.probes``) that read it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fedskew.core.errors import DataError
from fedskew.data import download as dl
from fedskew.data.probes import (
    _cifar10_binary,
    _cifar10_folders,
    _cifar10_python,
    _cifar100_binary,
    _cifar100_python,
    _idx_probe,
    _Raw,
    _tinyimagenet,
)

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
