"""Partition schemes that should treat the classes alike do (a within-draw permutation test
over 30 seeds, data.exchangeability); the schemes kept from before (dirichlet-niidbench,
shards-fedavg) draw exactly what dirichlet and shards drew; no scheme hands out an empty
client."""

from __future__ import annotations

import numpy as np
import pytest

from fedskew.core.errors import UsageError
from fedskew.data.exchangeability import class_index_pvalues, trend
from fedskew.data.partition import (
    class_holders,
    largest_share,
    make_partition,
    partition_digest,
    partition_stats,
)

SEEDS = range(30)
PERMUTATIONS = 999
# Four p-values per setting (two statistics, two patterns); an exchangeable scheme falls at
# or below this in at most 4 x 0.2 % of settings, and the minimum p-value is 0.1 %.
ALPHA = 0.002


def balanced(num_classes: int, per_class: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(num_classes), per_class))


# CIFAR-10's shape at a fifth of its size (10 classes, equal sizes, as the test needs): the
# cap's effect depends on the ratio of samples to clients, not on the number of samples.
LABELS = balanced(10, 1000)


def per_class(scheme: str, num_clients: int, params: dict) -> dict[str, np.ndarray]:
    """(seeds, classes) arrays of the clients holding >= 1 % of each class and of the largest
    holder's share, over SEEDS."""
    holders, largest = [], []
    for seed in SEEDS:
        parts = make_partition(LABELS, num_clients, scheme, seed, **params)
        counts = partition_stats(parts, LABELS, 10)
        holders.append(class_holders(counts))
        largest.append(largest_share(counts))
    return {"holders": np.array(holders), "largest": np.array(largest)}


def pvalues(scheme: str, num_clients: int, params: dict) -> dict[str, float]:
    return {
        f"{stat} {pattern}": p
        for stat, values in per_class(scheme, num_clients, params).items()
        for pattern, p in class_index_pvalues(values, PERMUTATIONS).items()
    }


EXCHANGEABLE = [
    ("dirichlet", 10, {"beta": 0.5}),  # FedFM's NIID-1
    ("dirichlet", 10, {"beta": 0.1}),
    ("dirichlet", 100, {"beta": 0.5, "min_size": 5}),
    ("dirichlet", 100, {"beta": 0.1, "min_size": 5}),  # the min_size repair at work
    ("shards", 7, {}),  # 14 shards: boundaries inside classes
    ("shards", 30, {}),
    ("classes", 7, {"classes_per_client": 3}),
    ("classes", 4, {"classes_per_client": 3}),  # 12 slots: two classes held twice
    ("quantity", 10, {"beta": 0.5}),
    ("iid", 7, {}),
]


@pytest.mark.parametrize(("scheme", "num_clients", "params"), EXCHANGEABLE)
def test_scheme_does_not_tie_the_classes_to_their_index(scheme, num_clients, params):
    found = pvalues(scheme, num_clients, params)
    assert min(found.values()) > ALPHA, found


@pytest.mark.parametrize(
    ("scheme", "num_clients", "params"),
    [
        ("dirichlet-niidbench", 10, {"beta": 0.5}),
        ("dirichlet-niidbench", 100, {"beta": 0.1, "min_size": 5}),
        ("shards-fedavg", 7, {}),
    ],
)
def test_the_test_finds_the_index_order_of_the_kept_schemes(scheme, num_clients, params):
    """The same test on the schemes that visit or sort the classes in index order (what
    dirichlet and shards were): it finds them, so its passes above mean something."""
    found = pvalues(scheme, num_clients, params)
    assert min(found.values()) <= ALPHA, found


def test_niidbench_loop_splits_the_last_classes_among_fewer_clients():
    """The issue's numbers, on the kept loop: with 10 clients and beta 0.5 class 9 has
    about 3 holders fewer than class 0, and the largest holder's share grows with the
    index; the default has no such trend."""
    old = per_class("dirichlet-niidbench", 10, {"beta": 0.5})
    new = per_class("dirichlet", 10, {"beta": 0.5})
    assert old["holders"][:, 0].mean() - old["holders"][:, 9].mean() > 2
    assert trend(old["holders"]) < -0.2 and trend(old["largest"]) > 0.01
    assert abs(trend(new["holders"])) < 0.1 and abs(trend(new["largest"])) < 0.01


def test_permutation_test_edge_cases():
    assert class_index_pvalues(np.ones((5, 4))) == {"slope": 1.0, "spread": 1.0}
    with pytest.raises(ValueError):
        class_index_pvalues(np.ones(4))
    with pytest.raises(ValueError):
        class_index_pvalues(np.array([[1.0, np.nan]]))
    # A perfect trend in every draw: no permutation of 10 classes matches it often.
    ramp = np.tile(np.arange(10.0), (30, 1))
    assert class_index_pvalues(ramp, 999)["slope"] == pytest.approx(0.001)


def test_holders_and_largest_share():
    counts = np.array([[100, 0, 0], [1, 0, 5], [899, 0, 5]])
    assert class_holders(counts).tolist() == [2, 0, 2]  # 1 of 1000 is below 1 %
    largest = largest_share(counts)
    assert largest[0] == pytest.approx(0.899) and np.isnan(largest[1]) and largest[2] == 0.5


# --------------------------------------------------------------- the kept schemes' draws

# Digests of partitions that dirichlet and shards made before partition_version 2 (computed
# with fedskew at commit 03cddfc): dirichlet-niidbench and shards-fedavg must draw exactly
# these, so that every run folder made with the old names rebuilds its partition.
SIZES = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]


def _mnist_like() -> np.ndarray:
    return np.random.default_rng(1).permutation(np.repeat(np.arange(10), SIZES))


KEPT_DRAWS = [
    ("dirichlet-niidbench", "cifar", 10, 0, {"beta": 0.5}, "12d316108965613b"),
    ("dirichlet-niidbench", "cifar", 10, 1, {"beta": 0.5}, "2bb17447f0718116"),
    ("dirichlet-niidbench", "cifar", 20, 2, {"beta": 0.1}, "5cbf1b4ccb1ecff4"),
    ("dirichlet-niidbench", "mnist", 100, 0, {"beta": 0.05, "min_size": 10}, "04f32fcc0f3198da"),
    ("dirichlet-niidbench", "mnist", 1000, 0, {"beta": 0.01, "min_size": 10}, "98ee8478afaf3314"),
    ("dirichlet-niidbench", "small", 10, 3, {"beta": 0.1, "min_size": 0}, "322208e97e3ff5e1"),
    ("shards-fedavg", "cifar", 7, 0, {}, "41675743fdf0899f"),
    ("shards-fedavg", "mnist", 100, 1, {}, "6725034629e4b150"),
    ("shards-fedavg", "small", 10, 3, {"shards_per_client": 3}, "f88cce01a2b04c53"),
]


@pytest.mark.parametrize(("scheme", "labels", "clients", "seed", "params", "digest"), KEPT_DRAWS)
def test_kept_schemes_draw_what_the_old_names_drew(scheme, labels, clients, seed, params, digest):
    made = {"cifar": lambda: balanced(10, 5000), "mnist": _mnist_like,
            "small": lambda: balanced(10, 200)}[labels]()  # fmt: skip
    assert partition_digest(make_partition(made, clients, scheme, seed, **params)) == digest


def test_new_schemes_draw_from_streams_of_their_own():
    labels = balanced(10, 200)
    for new, kept, params in (
        ("dirichlet", "dirichlet-niidbench", {"beta": 0.5}),
        ("shards", "shards-fedavg", {}),
    ):
        a = make_partition(labels, 10, new, 0, **params)
        b = make_partition(labels, 10, kept, 0, **params)
        assert partition_digest(a) != partition_digest(b)


# ------------------------------------------------------------------------- empty clients

EMPTY = [
    ("dirichlet", balanced(10, 200), 100, {"beta": 0.01, "min_size": 0}, None, "min_size >= 1"),
    ("dirichlet-niidbench", balanced(10, 200), 100, {"beta": 0.01, "min_size": 0}, None,
     "min_size >= 1"),
    ("quantity", balanced(10, 200), 100, {"beta": 0.01, "min_size": 0}, None, "min_size >= 1"),
    # Class 3 has no samples: the clients dealt only class 3 would get none.
    ("classes", np.repeat([0, 1, 2, 4], 50), 8, {"classes_per_client": 1}, 5,
     "class\\(es\\) 3 have no samples"),
    ("missing", np.repeat([0, 1], 50), 4, {"missing_classes": 3}, 4, "without samples"),
]  # fmt: skip


@pytest.mark.parametrize(("scheme", "labels", "clients", "params", "classes", "match"), EMPTY)
def test_no_scheme_hands_out_an_empty_client(scheme, labels, clients, params, classes, match):
    with pytest.raises(UsageError, match=match) as caught:
        make_partition(labels, clients, scheme, 0, num_classes=classes, **params)
    text = str(caught.value)
    assert "\n" not in text and f"partition '{scheme}' leaves" in text


# ------------------------------------------------------- the committed measurement


@pytest.fixture(scope="module")
def bench(benchmark_script):  # type: ignore[no-untyped-def]
    return benchmark_script("partition_exchangeability.py")


def test_committed_results_and_docs_are_the_scripts_output(bench):
    """results/partition_exchangeability.md and docs/partitions.md's measured block are
    what the script writes from the committed .json (nothing typed in), and the .json holds
    50 seeds of both schemes in the four settings the issue names."""
    import json

    data = json.loads(bench.RESULTS.read_text(encoding="utf-8"))
    assert bench.RESULTS.with_suffix(".md").read_text(encoding="utf-8") == bench.markdown(data)
    assert bench.doc_block(data) in bench.DOC.read_text(encoding="utf-8")
    assert data["seeds"] == "0..49" and data["machine"]["cores"] >= 1
    assert [(s["beta"], s["clients"]) for s in data["settings"]] == bench.SETTINGS
    for s in data["settings"]:
        assert [r["scheme"] for r in s["rows"]] == [*bench.SCHEMES, bench.NO_CAP]


def test_the_script_measures_what_it_reports(bench, monkeypatch):
    """A small run (4 seeds, one setting): holders and shares per class, p-values, balance."""
    monkeypatch.setattr(bench, "SETTINGS", [(0.5, 10)])
    data = bench.run(seeds=4, permutations=19)
    rows = {r["scheme"]: r for r in data["settings"][0]["rows"]}
    assert set(rows) == {"dirichlet", "dirichlet-niidbench", bench.NO_CAP}
    for row in rows.values():
        assert len(row["holders"]) == 10 and all(1 <= h <= 10 for h in row["holders"])
        assert all(0 < x <= 1 for x in row["largest"]) and row["size_cv"] > 0
        assert all(0.05 <= p <= 1 for p in row["p"].values())  # >= 1 / (19 + 1)
    assert len(rows["dirichlet"]["holders_by_position"]) == 10
    assert bench.conclusions(data)[-1].startswith("In every setting")
