"""Each client's local-majority, local-minority and absent classes, and the global model's
accuracy on each group, checked against numbers worked out by hand on tiny examples."""

from __future__ import annotations

import numpy as np
import pytest

from fedskew.metrics.local_split import client_groups, group_accuracy

# 3 clients x 4 classes of training samples:
# client 0 holds 3 classes, 12 samples, mean 4: classes 0 (6) and 3 (4) majority, 1 (2)
#   minority, 2 absent;
# client 1 holds all 4 equally: all majority, none minority, none absent;
# client 2 holds 2 classes, 10 samples, mean 5: class 2 (9) majority, 3 (1) minority,
#   0 and 1 absent.
COUNTS = np.array([[6, 2, 0, 4], [5, 5, 5, 5], [0, 0, 9, 1]])


def test_groups_by_hand():
    assert client_groups(COUNTS).tolist() == [[0, 1, 2, 0], [0, 0, 0, 0], [2, 2, 0, 1]]
    # At exactly the mean a class is majority; one sample under it, minority.
    assert client_groups(np.array([[3, 3, 2, 0]])).tolist() == [[0, 0, 1, 2]]  # mean 8/3


def test_group_accuracy_by_hand():
    tests = [10, 20, 30, 40]
    acc = [0.5, 0.25, 1.0, 0.75]
    got = group_accuracy(COUNTS, acc, tests)
    # Majority: client 0 on classes 0, 3: (10 * .5 + 40 * .75) / 50 = .7; client 1 on all:
    # (5 + 5 + 30 + 30) / 100 = .7; client 2 on class 2: 1.0. Mean .8 over 3 clients.
    assert got["majority"].accuracy == pytest.approx(0.8)
    assert got["majority"].clients == 3
    assert got["majority"].classes == pytest.approx(7 / 3)
    # Minority: client 0 on class 1 (.25), client 2 on class 3 (.75); client 1 has none.
    assert got["minority"].accuracy == pytest.approx(0.5)
    assert got["minority"].clients == 2
    assert got["minority"].classes == pytest.approx(2 / 3)
    # Absent: client 0 on class 2 (1.0), client 2 on classes 0, 1: (5 + 5) / 30.
    assert got["absent"].accuracy == pytest.approx((1.0 + 1 / 3) / 2)
    assert got["absent"].clients == 2
    assert got["absent"].classes == pytest.approx(1.0)


def test_classes_without_test_samples_or_accuracy_drop_out():
    # Class 1 has no test samples, class 3 no accuracy (as a metrics line writes None).
    got = group_accuracy(COUNTS, [0.5, 0.25, 1.0, None], [10, 0, 30, 40])
    # Majority: client 0 on class 0 only (.5); client 1 on 0 and 2: (5 + 30) / 40;
    # client 2 on class 2 (1.0).
    assert got["majority"].accuracy == pytest.approx((0.5 + 0.875 + 1.0) / 3)
    # Minority: client 0's class 1 has no test sample, client 2's class 3 no accuracy.
    assert got["minority"].accuracy is None
    assert got["minority"].clients == 0
    # Absent: client 0 on class 2 (1.0), client 2 on class 0 only (.5).
    assert got["absent"].accuracy == pytest.approx(0.75)
    assert got["absent"].clients == 2
