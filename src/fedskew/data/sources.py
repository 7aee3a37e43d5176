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

The parts live in their own modules: the ``Dataset`` type and the table of built-in
datasets in ``fedskew.data.datasets``, the search and download in ``fedskew.data.locate``,
the format readers in ``fedskew.data.probes``, ``digits`` and ``synthetic`` in
``fedskew.data.bundled`` and user datasets in ``fedskew.data.user_datasets``. This module
keeps ``load_dataset`` and re-exports the names other code imports from it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fedskew.core.errors import DataError
from fedskew.data.bundled import (
    DIGITS_SPLIT_SEED,
    DIGITS_TEST_FRACTION,
    SYNTHETIC_CLASSES,
    SYNTHETIC_FEATURES,
    SYNTHETIC_MAX_SAMPLES,
    SYNTHETIC_TEST_FRACTION,
    _load_digits,
    _make_synthetic,
)
from fedskew.data.datasets import (
    CIFAR10_CLASSES,
    CIFAR100_CLASSES,
    DATASETS,
    DIGIT_CLASSES,
    FMNIST_CLASSES,
    Dataset,
    DatasetInfo,
    _normalised,
)

# _SPECS is the very dict _find reads, so tests that patch sources._SPECS patch the search.
from fedskew.data.locate import _SPECS, _find
from fedskew.data.probes import IMAGE_SUFFIXES, _Raw
from fedskew.data.user_datasets import (
    check_dataset,
    default_model_for,
    find_dataset_loader,
    load_user_dataset,
    register_dataset,
)

__all__ = [
    "CIFAR10_CLASSES",
    "CIFAR100_CLASSES",
    "DATASETS",
    "DIGITS_SPLIT_SEED",
    "DIGITS_TEST_FRACTION",
    "DIGIT_CLASSES",
    "FMNIST_CLASSES",
    "IMAGE_SUFFIXES",
    "SYNTHETIC_CLASSES",
    "SYNTHETIC_FEATURES",
    "SYNTHETIC_MAX_SAMPLES",
    "SYNTHETIC_TEST_FRACTION",
    "Dataset",
    "DatasetInfo",
    "check_dataset",
    "default_model_for",
    "find_dataset_loader",
    "load_dataset",
    "load_user_dataset",
    "register_dataset",
]


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
