"""The split of classes that FedRS and FedNTD argue with: per client, from its own training
class counts, the classes it holds many of, the classes it holds few of, and the classes it
does not hold; and the global model's test accuracy on each group.

For client k with training counts n_kc (its data after a local test split, if any),
N_k = sum_c n_kc and m_k = the number of classes with n_kc > 0:

* local-majority: n_kc > 0 and n_kc * m_k >= N_k (at least the client's mean count over
  the classes it holds);
* local-minority: n_kc > 0 and n_kc * m_k < N_k (held, below that mean);
* absent: n_kc = 0.

A client holding its classes equally has no local-minority class; one holding every class
has no absent class. The comparison is on integers, so no rounding decides a class.

The accuracy of client k on group G is the global model's accuracy on the global test set
restricted to G's classes: sum over c in G of t_c a_c, divided by sum over c in G of t_c,
with t_c the test samples of class c and a_c the model's accuracy on class c. A class
without test samples or without an accuracy drops out; a group left with no test sample has
no accuracy for that client. A run's value of a group is the unweighted mean over the
clients where the group has an accuracy (every client weighs the same, as in the client
spread), with the number of those clients beside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

GROUPS = ("majority", "minority", "absent")


def client_groups(counts: np.ndarray) -> np.ndarray:
    """(clients, classes) group index per class: 0 local-majority, 1 local-minority, 2
    absent, from (clients, classes) training counts."""
    counts = np.asarray(counts, dtype=np.int64)
    held = counts > 0
    per_client = held.sum(axis=1, keepdims=True)
    total = counts.sum(axis=1, keepdims=True)
    majority = held & (counts * per_client >= total)
    return np.where(majority, 0, np.where(held, 1, 2))


@dataclass(frozen=True)
class GroupAccuracy:
    """A run's accuracy (fraction) on one group, averaged over ``clients`` clients; None
    when no client has the group with test samples. ``classes``: the group's mean size per
    client, over all clients."""

    accuracy: float | None
    clients: int
    classes: float


def group_accuracy(
    counts: np.ndarray,
    per_class: Sequence[float | None],
    test_counts: Sequence[int],
) -> dict[str, GroupAccuracy]:
    """Each group's accuracy over the clients, from the clients' training counts, the
    global model's per-class accuracy (fractions, None where not scored) and the test
    set's class counts."""
    counts = np.asarray(counts, dtype=np.int64)
    classes = counts.shape[1]
    acc = np.array(
        [np.nan if c >= len(per_class) or per_class[c] is None else float(per_class[c])
         for c in range(classes)]
    )  # fmt: skip
    tests = np.zeros(classes, dtype=float)
    given = np.asarray(test_counts, dtype=float)[:classes]
    tests[: given.size] = given
    usable = (tests > 0) & np.isfinite(acc)
    weight = np.where(usable, tests, 0.0)
    hits = np.where(usable, tests * np.nan_to_num(acc), 0.0)
    groups = client_groups(counts)
    out: dict[str, GroupAccuracy] = {}
    for g, name in enumerate(GROUPS):
        member = groups == g
        samples = member @ weight
        correct = member @ hits
        has = samples > 0
        values = correct[has] / samples[has]
        out[name] = GroupAccuracy(
            accuracy=float(values.mean()) if values.size else None,
            clients=int(has.sum()),
            classes=float(member.sum(axis=1).mean()) if len(counts) else 0.0,
        )
    return out
