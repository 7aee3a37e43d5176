"""Datasets that need no files: scikit-learn's digits (shipped with scikit-learn) and
FedProx's Synthetic(alpha, beta), generated from the seed with one natural partition per
generated client.
"""

from __future__ import annotations

import numpy as np
import torch

from fedskew.core.errors import DataError, UsageError
from fedskew.core.rng import numpy_rng
from fedskew.data.datasets import DATASETS, DIGIT_CLASSES, Dataset, _normalised

SYNTHETIC_FEATURES = 60
SYNTHETIC_CLASSES = 10
# FedProx draws lognormal(4, 2) + 50 samples per device; its heavy tail reaches 10^5 for a
# few clients, which only makes runs slow, so client sizes are capped here.
SYNTHETIC_MAX_SAMPLES = 2000
SYNTHETIC_TEST_FRACTION = 0.2
DIGITS_TEST_FRACTION = 0.2
DIGITS_SPLIT_SEED = 0


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
