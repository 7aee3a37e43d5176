"""Does a partition scheme treat the classes alike? A within-draw permutation test.

A scheme is exchangeable in the classes when relabelling the classes only relabels the
columns of its (clients, classes) count matrix, in distribution. Then, for equal class sizes,
any per-class statistic of a draw (how many clients hold the class, the largest holder's
share) has the same distribution under every permutation of the classes within that draw.
The test permutes the classes of each draw independently and asks how often the permuted
draws show as strong a pattern over the class index as the real ones: an exact test of
exchangeability that needs no model of the scheme.

Two patterns are measured: ``slope``, the mean over draws of the least-squares slope of the
statistic on the class index (a trend such as NIID-Bench's loop gives: the classes visited
last are split among fewer clients), and ``spread``, the variance across classes of the
statistic's mean over draws (any fixed pattern, e.g. classes always cut by the same shard
boundaries).
"""

from __future__ import annotations

import numpy as np

PATTERNS = ("slope", "spread")


def _patterns(values: np.ndarray) -> dict[str, np.ndarray]:
    """The patterns of ``values`` (..., draws, classes) over the class index: one number per
    leading index."""
    num_classes = values.shape[-1]
    x = np.arange(num_classes) - (num_classes - 1) / 2
    slope = (values @ x).mean(axis=-1) / float(x @ x)
    spread = values.mean(axis=-2).var(axis=-1)
    return {"slope": slope, "spread": spread}


def class_index_pvalues(
    per_draw: np.ndarray, permutations: int = 999, seed: int = 0
) -> dict[str, float]:
    """p-values of the permutation test for each pattern (PATTERNS), from a (draws, classes)
    array of a per-class statistic; small values say the scheme ties the statistic to the
    class index. A p-value is at least 1 / (permutations + 1). Classes without a value in a
    draw (NaN) make the test meaningless: give equal class sizes."""
    values = np.asarray(per_draw, dtype=np.float64)
    if values.ndim != 2 or values.shape[1] < 2 or values.shape[0] < 1:
        raise ValueError(f"expected a (draws, classes >= 2) array, got shape {values.shape}")
    if not np.all(np.isfinite(values)):
        raise ValueError("the statistic is not finite for every draw and class")
    rng = np.random.default_rng(seed)
    # Each draw's classes in an independent random order, for every permutation.
    order = np.argsort(rng.random((permutations, *values.shape)), axis=-1)
    permuted = np.take_along_axis(np.broadcast_to(values, order.shape), order, axis=-1)
    observed, null = _patterns(values), _patterns(permuted)
    out = {}
    for name in PATTERNS:
        # A tolerance so that floating-point noise in equal patterns counts as equal.
        extreme = np.abs(null[name]) >= np.abs(observed[name]) * (1 - 1e-9) - 1e-12
        out[name] = float((1 + extreme.sum()) / (permutations + 1))
    return out


def trend(per_draw: np.ndarray) -> float:
    """The mean over draws of the least-squares slope on the class index (per class)."""
    return float(_patterns(np.asarray(per_draw, dtype=np.float64))["slope"])
