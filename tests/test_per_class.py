"""Per-class and per-client statistics, checked against numbers computed here by other
means (by hand or with NumPy): the clients' spread, the per-class summary of a run's metrics
lines, and the ranking of minority and majority classes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedskew.metrics.client_spread import client_spread
from fedskew.metrics.per_class import per_class_summary
from fedskew.report.per_class import BY_CLIENTS, BY_SAMPLES, ClassCounts, class_ranking


def test_client_spread_by_hand():
    # 5 clients with values (one None): n = 4, ceil(0.4) = 1 client in each tail.
    got = client_spread([0.5, None, 1.0, 0.25, 0.75])
    assert got["mean"] == pytest.approx(0.625)
    # Population variance: ((-.125)^2 + .375^2 + (-.375)^2 + .125^2) / 4 = 0.078125
    assert got["std"] == pytest.approx(math.sqrt(0.078125))
    assert got["worst10"] == pytest.approx(0.25)
    assert got["gap"] == pytest.approx(0.75)


def test_client_spread_against_numpy():
    rng = np.random.default_rng(7)
    values = rng.uniform(0, 1, 23)
    listed: list[float | None] = [float(v) for v in values]
    listed[3] = listed[11] = None  # not evaluated
    kept = np.array([v for v in listed if v is not None])  # 21 clients: tails of 3
    ordered = np.sort(kept)
    got = client_spread(listed)
    assert got["mean"] == pytest.approx(kept.mean())
    assert got["std"] == pytest.approx(kept.std(ddof=0))
    assert got["worst10"] == pytest.approx(ordered[:3].mean())
    assert got["gap"] == pytest.approx(ordered[-3:].mean() - ordered[:3].mean())
    assert client_spread([None, None]) == {}
    assert client_spread([0.4]) == pytest.approx({"mean": 0.4, "std": 0.0, "worst10": 0.4,
                                                  "gap": 0.0})  # fmt: skip


def test_per_class_summary_of_metrics_lines():
    rows = [{"round": r} for r in range(1, 14)]  # 13 rounds, 12 evaluated (not round 5)
    rng = np.random.default_rng(1)
    table = rng.uniform(0, 1, (13, 3)).round(4)
    for i, row in enumerate(rows):
        if i != 4:
            row["per_class_accuracy"] = [float(table[i, 0]), None, float(table[i, 2])]
    got = per_class_summary(rows)
    assert got["per_class_last_k"] == 10
    assert got["final_per_class_accuracy"] == [table[12, 0], None, table[12, 2]]
    last10 = table[[i for i in range(13) if i != 4][-10:]]  # evaluated rounds 4, 6..13
    assert got["last_k_per_class_accuracy"][0] == pytest.approx(last10[:, 0].mean(), abs=1e-6)
    assert got["last_k_per_class_accuracy"][1] is None
    assert got["last_k_per_class_accuracy"][2] == pytest.approx(last10[:, 2].mean(), abs=1e-6)
    few = per_class_summary(rows[:3])
    assert few["per_class_last_k"] == 3
    assert few["last_k_per_class_accuracy"][0] == pytest.approx(table[:3, 0].mean(), abs=1e-6)
    assert per_class_summary([{"round": 1}]) == {}


def test_ranking_by_samples_when_class_totals_differ():
    # Class 2 holds a quarter of class 0's samples: ranked by samples, ties by clients.
    counts = ClassCounts(samples=[400, 100, 100, 300, 400], clients=[5, 9, 2, 5, 3], where="x")
    ranking = class_ranking(counts)
    assert ranking.rule == BY_SAMPLES
    assert ranking.minority == [2, 1]  # fewest samples; 2 has fewer clients than 1
    assert ranking.majority == [4, 0]  # most common last: 0 has more clients; 3 in neither
    assert class_ranking(ClassCounts([0, 5, 5, 5], [0, 1, 1, 1], "x")).rule == BY_SAMPLES


def test_ranking_by_clients_when_class_totals_are_alike():
    # Totals within 10 %: a balanced dataset dealt out whole; clients decide.
    counts = ClassCounts(samples=[100, 104, 98, 101], clients=[3, 1, 4, 1], where="x")
    ranking = class_ranking(counts)
    assert ranking.rule == BY_CLIENTS
    assert ranking.minority == [3, 1]  # one client each; rarest first: 101 samples < 104
    assert ranking.majority == [0, 2]
    flat = class_ranking(ClassCounts(samples=[100, 101], clients=[4, 4], where="x"))
    assert isinstance(flat, str) and "balanced" in flat
