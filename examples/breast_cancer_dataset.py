"""A dataset from outside fedskew: scikit-learn's breast cancer data (bundled with
scikit-learn, no download): 569 samples, 30 features, 2 classes.

A dataset loader returns a ``fedskew.data.sources.Dataset`` with normalised tensors; it may
take any of ``data_dir``, ``download``, ``num_clients`` and ``seed`` as keyword arguments
and may name the model that ``--model auto`` should use.

    cd examples
    fedskew run -d breast_cancer_dataset:load -n 5 --clients-per-round 3 -r 10

or from Python: ``fedskew.run({"num_clients": 5}, dataset=load)``.
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_breast_cancer

from fedskew.data.sources import Dataset


def load(seed: int = 0) -> Dataset:
    """A fixed 80/20 split (the split's own seed, so every experiment seed sees the same
    test set), features standardised with the training split's statistics."""
    data = load_breast_cancer()
    x = data.data.astype(np.float32)
    y = data.target.astype(np.int64)
    order = np.random.default_rng(12345).permutation(len(y))
    cut = int(0.8 * len(y))
    train, test = order[:cut], order[cut:]
    mean, std = x[train].mean(axis=0), x[train].std(axis=0) + 1e-8
    x = (x - mean) / std
    return Dataset(
        name="breast-cancer",
        x_train=torch.from_numpy(x[train]),
        y_train=torch.from_numpy(y[train]),
        x_test=torch.from_numpy(x[test]),
        y_test=torch.from_numpy(y[test]),
        num_classes=2,
        input_shape=(x.shape[1],),
        class_names=list(data.target_names),
        source="scikit-learn load_breast_cancer (Wisconsin diagnostic, bundled)",
    )


load.default_model = "mlp"  # type: ignore[attr-defined]


if __name__ == "__main__":
    import fedskew

    result = fedskew.run(
        {"num_clients": 5, "clients_per_round": 3, "rounds": 5, "quiet": True,
         "partition": "dirichlet", "partition_params": {"beta": 1.0}},
        dataset=load,
    )  # fmt: skip
    print(f"breast cancer: final accuracy {result.summary['final_accuracy']:.4f}")
