"""Properties of the partition schemes, their file format and their plot."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedskew.core.errors import FedskewError, UsageError
from fedskew.data.partition import (
    PARTITIONS,
    load_partition,
    make_partition,
    niid2_dominant,
    partition_stats,
    save_partition,
)
from fedskew.report.partition_plot import plot_partition

SCHEMES = [
    "iid", "dirichlet", "dirichlet-niidbench", "shards", "shards-fedavg", "classes", "niid2",
    "missing", "quantity",
]  # fmt: skip
FULL_COVER = {"iid", "dirichlet", "dirichlet-niidbench", "shards", "shards-fedavg", "quantity"}
# niid2 defaults need 2,300 samples per class for 10 clients; keep the generic tests small.
SMALL_PARAMS: dict[str, dict[str, object]] = {
    "niid2": {"dominant_shards": 4, "tail_shards": 1, "shard_size": 10},
    "dirichlet": {"min_size": 5},
    "dirichlet-niidbench": {"min_size": 5},
    "quantity": {"min_size": 5},
}


def balanced_labels(num_classes: int, per_class: int, seed: int = 0) -> np.ndarray:
    labels = np.repeat(np.arange(num_classes), per_class)
    return np.random.default_rng(seed).permutation(labels)


def cifar_labels() -> np.ndarray:
    return balanced_labels(10, 5_000)


def mnist_like_labels() -> np.ndarray:
    # Uneven class sizes, like MNIST, so nothing relies on balance by accident.
    sizes = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    labels = np.repeat(np.arange(10), sizes)
    return np.random.default_rng(1).permutation(labels)


@pytest.fixture(scope="module")
def labels() -> np.ndarray:
    return balanced_labels(10, 200)


@pytest.mark.parametrize("seed", [0, 1, 7])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_disjoint_sorted_in_range(labels: np.ndarray, scheme: str, seed: int) -> None:
    parts = make_partition(labels, 10, scheme, seed, **SMALL_PARAMS.get(scheme, {}))
    assert len(parts) == 10
    for idx in parts:
        assert idx.dtype == np.int64
        assert idx.ndim == 1
        assert np.all(np.diff(idx) > 0)  # sorted and no duplicates within a client
        if idx.size:
            assert idx.min() >= 0 and idx.max() < labels.size
    flat = np.concatenate(parts)
    assert np.unique(flat).size == flat.size  # disjoint across clients
    if scheme in FULL_COVER:
        assert flat.size == labels.size


@pytest.mark.parametrize("scheme", SCHEMES)
def test_determinism(labels: np.ndarray, scheme: str) -> None:
    params = SMALL_PARAMS.get(scheme, {})
    a = make_partition(labels, 10, scheme, 3, **params)
    b = make_partition(labels, 10, scheme, 3, **params)
    c = make_partition(labels, 10, scheme, 4, **params)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_iid_equal_sizes(labels: np.ndarray) -> None:
    parts = make_partition(labels[:1003], 10, "iid", 0)
    sizes = sorted(len(p) for p in parts)
    assert sizes[0] == 100 and sizes[-1] == 101 and sum(sizes) == 1003


DIRICHLETS = ["dirichlet", "dirichlet-niidbench"]


@pytest.mark.parametrize("scheme", DIRICHLETS)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("beta", [0.01, 0.1, 0.5, 5.0])
def test_dirichlet_min_size(beta: float, seed: int, scheme: str) -> None:
    labels = mnist_like_labels()[:6000]
    parts = make_partition(labels, 100, scheme, seed, beta=beta, min_size=20)
    assert min(len(p) for p in parts) >= 20
    assert sum(len(p) for p in parts) == labels.size


@pytest.mark.parametrize("scheme", DIRICHLETS)
def test_dirichlet_extreme_terminates(scheme: str) -> None:
    labels = mnist_like_labels()
    parts = make_partition(labels, 1000, scheme, 0, beta=0.01, min_size=10)
    assert len(parts) == 1000
    assert min(len(p) for p in parts) >= 10
    flat = np.concatenate(parts)
    assert flat.size == labels.size and np.unique(flat).size == labels.size


@pytest.mark.parametrize("scheme", DIRICHLETS)
def test_dirichlet_min_size_exactly_feasible(scheme: str) -> None:
    labels = balanced_labels(10, 100)
    parts = make_partition(labels, 100, scheme, 0, beta=0.05, min_size=10)
    assert all(len(p) == 10 for p in parts)


@pytest.mark.parametrize("scheme", DIRICHLETS)
def test_dirichlet_smaller_beta_more_skew(scheme: str) -> None:
    labels = mnist_like_labels()

    def mean_classes(beta: float) -> float:
        parts = make_partition(labels, 100, scheme, 0, beta=beta, min_size=10)
        return float((partition_stats(parts, labels, 10) > 0).sum(axis=1).mean())

    skewed, flat = mean_classes(0.01), mean_classes(10.0)
    assert skewed < flat
    assert skewed < 3 and flat > 9


def test_shards_at_most_k_labels() -> None:
    labels = balanced_labels(10, 100)  # 20 shards of 50: never straddle a class boundary
    parts = make_partition(labels, 10, "shards", 0, shards_per_client=2)
    stats = partition_stats(parts, labels, 10)
    assert np.all((stats > 0).sum(axis=1) <= 2)
    assert np.all(stats.sum(axis=1) == 100)


@pytest.mark.parametrize("k", [1, 2, 3, 10])
@pytest.mark.parametrize("num_clients", [3, 10, 25])
def test_classes_exactly_k(num_clients: int, k: int) -> None:
    labels = balanced_labels(10, 300)
    parts = make_partition(labels, num_clients, "classes", 0, classes_per_client=k)
    stats = partition_stats(parts, labels, 10)
    assert np.all((stats > 0).sum(axis=1) == k)
    held = stats > 0
    if num_clients * k >= 10:
        assert np.all(held.any(axis=0))  # every class has a holder
    # All samples of each held class are handed out, evenly (within one) among holders.
    for c in np.flatnonzero(held.any(axis=0)):
        col = stats[held[:, c], c]
        assert col.sum() == 300
        assert col.max() - col.min() <= 1


@pytest.mark.parametrize("x", [0, 1, 3, 9])
@pytest.mark.parametrize("num_clients", [10, 4, 23])
def test_missing_fedfm_classes(num_clients: int, x: int) -> None:
    num_classes = 10
    labels = balanced_labels(num_classes, 230)
    parts = make_partition(labels, num_clients, "missing", 0, missing_classes=x)
    stats = partition_stats(parts, labels, num_classes)
    for i in range(num_clients):
        expected = {(i + j) % num_classes for j in range(num_classes - x)}
        assert set(np.flatnonzero(stats[i]).tolist()) == expected
        assert num_classes - len(expected) == x
    held = stats > 0
    for c in np.flatnonzero(held.any(axis=0)):
        col = stats[held[:, c], c]
        assert col.sum() == 230
        assert col.max() - col.min() <= 1


def test_missing_cifar_fedfm_sizes() -> None:
    labels = cifar_labels()
    parts = make_partition(labels, 10, "missing", 0, missing_classes=1)
    stats = partition_stats(parts, labels, 10)
    # 9 holders per class: 5000 / 9 = 555 rem 5.
    assert set(np.unique(stats[stats > 0]).tolist()) <= {555, 556}
    assert stats.sum() == 50_000


def test_niid2_cifar() -> None:
    labels = cifar_labels()
    parts = make_partition(labels, 10, "niid2", 0)
    stats = partition_stats(parts, labels, 10)
    expected = np.full((10, 10), 300)
    np.fill_diagonal(expected, 2300)
    assert np.array_equal(stats, expected)
    assert all(len(p) == 5000 for p in parts)
    flat = np.concatenate(parts)
    assert np.unique(flat).size == flat.size == 50_000


def test_niid2_dominant_layouts() -> None:
    # CIFAR-100 with 10 clients: contiguous blocks of 10 classes.
    dom = niid2_dominant(10, 100)
    for i in range(10):
        assert np.flatnonzero(dom[i]).tolist() == list(range(10 * i, 10 * i + 10))
    # Not a multiple: round-robin.
    dom = niid2_dominant(3, 10)
    assert np.flatnonzero(dom[0]).tolist() == [0, 3, 6, 9]
    # More clients than classes: class i mod C.
    dom = niid2_dominant(25, 10)
    assert np.all(dom.sum(axis=1) == 1)
    assert np.flatnonzero(dom[17]).tolist() == [7]


def test_niid2_infeasible_message() -> None:
    labels = balanced_labels(100, 500)  # CIFAR-100 sized classes
    with pytest.raises(UsageError, match="needs .* only 500 available.*shard_size"):
        make_partition(labels, 10, "niid2", 0)


def test_quantity_sizes_vary_labels_iid() -> None:
    labels = mnist_like_labels()
    parts = make_partition(labels, 20, "quantity", 0, beta=0.5, min_size=50)
    sizes = np.array([len(p) for p in parts])
    assert sizes.min() >= 50
    assert sizes.sum() == labels.size
    assert sizes.max() > 3 * sizes.min()
    stats = partition_stats(parts, labels, 10)
    global_dist = np.bincount(labels, minlength=10) / labels.size
    for i in np.flatnonzero(sizes >= 2000):
        assert np.abs(stats[i] / sizes[i] - global_dist).max() < 0.03


@pytest.mark.parametrize(
    ("scheme", "params", "match"),
    [
        ("dirichlet", {"beta": 0}, "beta"),
        ("dirichlet", {"beta": -1.0}, "beta"),
        ("quantity", {"beta": float("nan")}, "beta"),
        ("nope", {}, "choices: iid, dirichlet"),
        ("dirichlet", {"alpha": 0.5}, "valid: beta, min_size"),
        ("iid", {"beta": 0.5}, "valid: none"),
        ("classes", {"classes_per_client": 11}, "classes_per_client 11 > number of classes 10"),
        ("missing", {"missing_classes": 10}, "missing_classes"),
        ("shards", {"shards_per_client": 0}, "shards_per_client"),
        ("dirichlet", {"min_size": 2.5}, "integer"),
        ("natural", {}, "own clients"),
    ],
)
def test_usage_errors(labels: np.ndarray, scheme: str, params: dict, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        make_partition(labels, 10, scheme, 0, **params)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_more_clients_than_samples(scheme: str) -> None:
    with pytest.raises(UsageError, match="more clients"):
        make_partition(balanced_labels(2, 5), 11, scheme, 0)


def test_min_size_infeasible() -> None:
    labels = balanced_labels(10, 10)
    with pytest.raises(UsageError, match="min_size"):
        make_partition(labels, 20, "dirichlet", 0, min_size=6)
    with pytest.raises(UsageError, match="min_size"):
        make_partition(labels, 20, "quantity", 0, min_size=6)


def test_none_params_mean_default(labels: np.ndarray) -> None:
    a = make_partition(labels, 10, "dirichlet", 0, beta=None, shard_size=None)
    b = make_partition(labels, 10, "dirichlet", 0)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_registry() -> None:
    assert set(SCHEMES) | {"natural"} == set(PARTITIONS)
    for name, info in PARTITIONS.items():
        assert info.name == name and info.description and "\n" not in info.description
    assert PARTITIONS["dirichlet"].params == {"beta": 0.5, "min_size": 10}
    assert PARTITIONS["dirichlet-niidbench"].params == PARTITIONS["dirichlet"].params
    assert PARTITIONS["shards-fedavg"].params == PARTITIONS["shards"].params


def test_partition_stats() -> None:
    labels = np.array([0, 1, 1, 2, 2, 2])
    stats = partition_stats([np.array([0, 3]), np.array([1, 2, 4, 5])], labels, 3)
    assert stats.tolist() == [[1, 0, 1], [0, 2, 2]]


def test_save_load_round_trip(tmp_path: Path, labels: np.ndarray) -> None:
    parts = make_partition(labels, 10, "dirichlet", 0, beta=0.1, min_size=0)
    parts.append(np.empty(0, dtype=np.int64))  # empty clients must survive
    meta = {"scheme": "dirichlet", "seed": 0, "params": {"beta": 0.1}, "n": np.int64(2000)}
    path = tmp_path / "part.npz"
    save_partition(path, parts, meta)
    loaded, loaded_meta = load_partition(path)
    assert len(loaded) == len(parts)
    assert all(
        np.array_equal(x, y) and y.dtype == np.int64 for x, y in zip(parts, loaded, strict=True)
    )
    assert loaded_meta == {"scheme": "dirichlet", "seed": 0, "params": {"beta": 0.1}, "n": 2000}


def test_save_keeps_exact_name(tmp_path: Path) -> None:
    path = tmp_path / "part.bin"
    save_partition(path, [np.array([0, 1])], {})
    assert path.exists()
    assert load_partition(path)[0][0].tolist() == [0, 1]


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(FedskewError):
        load_partition(tmp_path / "missing.npz")
    bad = tmp_path / "bad.npz"
    np.savez(bad, something=np.arange(3))
    with pytest.raises(FedskewError, match="not a fedskew partition"):
        load_partition(bad)


@pytest.mark.parametrize(
    ("indices", "offsets", "what"),
    [
        (np.arange(4), np.array([0.0, 2.5, 4.0]), "offsets are float64"),
        (np.array([0.0, 1.0, 2.7, 3.0]), np.array([0, 2, 4]), "indices are float64"),
        (np.arange(4), np.array([0, 2, 2**64 - 1], dtype=np.uint64), "offsets are uint64"),
    ],
)
def test_partition_files_with_fractional_or_wrapping_numbers_are_refused(
    tmp_path: Path, indices: np.ndarray, offsets: np.ndarray, what: str
) -> None:
    # A cast to int64 read 2.5 as 2 and client sizes shifted without a word.
    path = tmp_path / "p.npz"
    np.savez(path, indices=indices, offsets=offsets, meta=np.array("{}"))
    with pytest.raises(FedskewError, match=f"its {what}, not integers"):
        load_partition(path)


@pytest.mark.parametrize("num_clients", [10, 1000])
def test_plot_partition_png(tmp_path: Path, num_clients: int) -> None:
    labels = mnist_like_labels()[:20_000]
    parts = make_partition(labels, num_clients, "dirichlet", 0, beta=0.3, min_size=5)
    stats = partition_stats(parts, labels, 10)
    path = tmp_path / "part.png"
    plot_partition(stats, path, title="dirichlet 0.3", class_names=[str(c) for c in range(10)])
    data = path.read_bytes()
    assert len(data) > 0 and data[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_unwritable(tmp_path: Path) -> None:
    with pytest.raises(FedskewError, match="not writable"):
        plot_partition(np.ones((3, 3)), tmp_path / "no_such_dir" / "p.png")
