"""Each client's local test split: a stratified part of its data held out from training.

PFLlib and the FedFM authors' code report every client's accuracy on data of its own that
it never trains on; ``--local-test-fraction F`` gives fedskew the same. The split is a pure
function of the partition, the labels, F and the experiment seed (an addressed generator per
client), so the run's process, its worker processes and every Flower node compute the same
split without sending it, and a resumed run has it again.

Stratified per client: the client holds out ``round(F * n)`` of its ``n`` samples (never all
of them: at least one stays for training), shared among its classes in proportion to their
counts (largest remainders get the leftover samples, ties broken at random), so the split's
label distribution is the client's own as nearly as whole samples allow. Within a class the
held-out samples are drawn at random. Both parts keep the partition's order of indices.
"""

from __future__ import annotations

import numpy as np

from fedskew.core.rng import numpy_rng

PURPOSE = "local-test-split"
VALIDATION = "validation-split"


def held_out_per_class(counts: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """How many samples of each class (``counts``) a client holds out for ``fraction``."""
    n = int(counts.sum())
    target = min(int(np.floor(fraction * n + 0.5)), max(n - 1, 0))
    exact = fraction * counts.astype(np.float64)
    # The floors add up to at most floor(F * n) <= target, as F < 1.
    base = np.floor(exact).astype(np.int64)
    left = target - int(base.sum())
    if left > 0:
        room = counts - base
        remainder = np.where(room > 0, exact - np.floor(exact), -1.0)
        # Largest remainders first; a random key breaks ties between equal remainders.
        order = np.lexsort((rng.random(len(counts)), -remainder))
        for c in order:
            if left == 0:
                break
            if room[c] > 0:
                base[c] += 1
                left -= 1
    return base


def split_local_test(
    partition: list[np.ndarray],
    labels: np.ndarray,
    num_classes: int,
    fraction: float,
    seed: int,
    purpose: str = PURPOSE,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(training part, local test part) of every client's indices; ``fraction`` 0 holds out
    nothing. ``purpose`` addresses the generator: the validation split (``VALIDATION``) is
    drawn apart from the local test split."""
    train: list[np.ndarray] = []
    test: list[np.ndarray] = []
    for cid, idx in enumerate(partition):
        idx = np.asarray(idx, dtype=np.int64)
        if fraction <= 0 or len(idx) == 0:
            train.append(idx)
            test.append(idx[:0])
            continue
        rng = numpy_rng(seed, -1, cid, purpose)
        y = labels[idx]
        counts = np.bincount(y, minlength=num_classes)
        take = held_out_per_class(counts, fraction, rng)
        held = np.zeros(len(idx), dtype=bool)
        for c in np.flatnonzero(take):
            where = np.flatnonzero(y == c)
            held[rng.choice(where, int(take[c]), replace=False)] = True
        train.append(idx[~held])
        test.append(idx[held])
    return train, test
