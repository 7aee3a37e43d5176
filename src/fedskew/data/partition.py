"""Non-IID partition schemes: how a labelled dataset is dealt out to federated clients.

Every scheme is a pure function of (labels, num_clients, scheme, params, seed): all randomness
comes from ``numpy_rng(seed, -1, -1, "partition:<scheme>")``, so a partition can be rebuilt
anywhere from its recipe, and saving it (``save_partition``) is a convenience, not a necessity.

The schemes work on per-class count matrices and per-class pools of shuffled indices, never on
individual samples in Python, so that 10,000 clients and 60,000 labels take well under a second.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedskew.core.durable import refuse_non_regular, replace_durably
from fedskew.core.errors import DataError, FedskewError, UsageError
from fedskew.core.rng import numpy_rng
from fedskew.core.structured_text import parse_structured_text, read_text_file


@dataclass(frozen=True)
class PartitionInfo:
    """A partition scheme as listed by ``fedskew list``."""

    name: str
    description: str  # one line
    params: dict[str, object]  # parameter name -> default; names double as CLI options


PARTITIONS: dict[str, PartitionInfo] = {
    info.name: info
    for info in (
        PartitionInfo("iid", "random equal split", {}),
        PartitionInfo(
            "dirichlet",
            "label skew: per class, client proportions ~ Dir(beta), classes visited in a "
            "random order, full clients (N/K) closed; every client >= min_size",
            {"beta": 0.5, "min_size": 10},
        ),
        PartitionInfo(
            "dirichlet-niidbench",
            "NIID-Bench's noniid-labeldir: dirichlet with classes visited in index order (the "
            "last classes go to fewer clients); what dirichlet was before partition_version 2",
            {"beta": 0.5, "min_size": 10},
        ),
        PartitionInfo(
            "shards",
            "pathological label skew (FedAvg): label-sorted shards dealt out at random, the "
            "classes sorted in a random order",
            {"shards_per_client": 2},
        ),
        PartitionInfo(
            "shards-fedavg",
            "shards with the classes sorted in index order, as FedAvg's code (a class at a "
            "fixed position is always cut by the same shard boundaries); shards before "
            "partition_version 2",
            {"shards_per_client": 2},
        ),
        PartitionInfo(
            "classes",
            "each client holds exactly classes_per_client classes, split evenly among holders",
            {"classes_per_client": 2},
        ),
        PartitionInfo(
            "niid2",
            "FedFM NIID-2: dominant shards of the client's own class(es) plus a uniform tail",
            {"dominant_shards": 20, "tail_shards": 3, "shard_size": 100},
        ),
        PartitionInfo(
            "missing",
            "FedFM NIID-3: client i lacks missing_classes classes, holds (i+j) mod C",
            {"missing_classes": 1},
        ),
        PartitionInfo(
            "quantity",
            "quantity skew with IID labels: client sizes ~ Dir(beta), each >= min_size",
            {"beta": 0.5, "min_size": 10},
        ),
        PartitionInfo(
            "natural",
            "the dataset's own clients (synthetic dataset only)",
            {},
        ),
    )
}

# What the scheme names mean changes with the partition version (a config key, so that a run
# folder says which it ran with). Version 1 placed the classes in index order: dirichlet
# visited them in that order (NIID-Bench's loop: the classes visited last are split among
# fewer, larger clients), shards sorted the labels in it (a class at a fixed position is
# always cut by the same shard boundaries). Version 2 gives those schemes a fresh random class
# order per draw, and keeps version 1's under the names of where they come from.
PARTITION_VERSION = 2
# {today's name: its name in version 1}, for the version-1 schemes whose name now means
# another scheme.
VERSION_1_NAMES = {"dirichlet-niidbench": "dirichlet", "shards-fedavg": "shards"}


def current_scheme(name: str, version: int) -> str:
    """Today's name of the scheme that ``name`` meant in partition version ``version``."""
    if version == 1:
        return {old: new for new, old in VERSION_1_NAMES.items()}.get(name, name)
    return name


def stable_name(scheme: str) -> str:
    """The name under which a scheme draws its randomness and enters a configuration's hash:
    a version-1 scheme under its version-1 name (so it draws what it drew, and the run
    folders made with it keep their hash), a name reused since with its version."""
    if scheme in VERSION_1_NAMES:
        return VERSION_1_NAMES[scheme]
    if scheme in VERSION_1_NAMES.values():
        return f"{scheme}@{PARTITION_VERSION}"
    return scheme


# Resampling only helps when the draw is nearly feasible; at extreme skew (1,000 clients,
# beta 0.01) no number of tries succeeds, which is why NIID-Bench-style loops never end.
# A few tries keep the common case identical in spirit, and the repair handles the rest.
_DIRICHLET_TRIES = 10


# --------------------------------------------------------------------------- validation


def _as_int(scheme: str, name: str, value: object, minimum: int) -> int:
    # bool is an int subclass but "shards_per_client=True" is surely a mistake.
    if isinstance(value, bool):
        raise UsageError(f"partition '{scheme}': {name} must be an integer, got {value!r}")
    if isinstance(value, int | np.integer):
        out = int(value)
    elif isinstance(value, float | np.floating) and float(value).is_integer():
        out = int(value)
    else:
        raise UsageError(f"partition '{scheme}': {name} must be an integer, got {value!r}")
    if out < minimum:
        raise UsageError(f"partition '{scheme}': {name} must be >= {minimum}, got {out}")
    return out


def _as_beta(scheme: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise UsageError(f"partition '{scheme}': beta must be a number, got {value!r}")
    beta = float(value)
    if not math.isfinite(beta) or beta <= 0:
        raise UsageError(f"partition '{scheme}': beta must be a finite number > 0, got {value!r}")
    return beta


def resolve_partition_params(scheme: str, params: dict[str, object]) -> dict[str, object]:
    info = PARTITIONS[scheme]
    # None means "not given": a CLI can then pass every option it knows without knowing which
    # scheme uses which.
    given = {k: v for k, v in params.items() if v is not None}
    unknown = sorted(set(given) - set(info.params))
    if unknown:
        valid = ", ".join(info.params) if info.params else "none"
        raise UsageError(
            f"unknown parameter {unknown[0]!r} for partition '{scheme}' (valid: {valid})"
        )
    return {**info.params, **given}


def _check_labels(labels: np.ndarray, num_classes: int | None) -> tuple[np.ndarray, int]:
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise DataError(f"labels must be a 1-D array, got shape {labels.shape}")
    if labels.size == 0:
        raise DataError("cannot partition an empty dataset (no labels)")
    if labels.dtype.kind not in "iu":
        raise DataError(f"labels must be integers, got dtype {labels.dtype}")
    labels = labels.astype(np.int64, copy=False)
    lo, hi = int(labels.min()), int(labels.max())
    if lo < 0:
        raise DataError(f"labels must be >= 0, found {lo}")
    if num_classes is None:
        num_classes = hi + 1
    else:
        if isinstance(num_classes, bool) or not isinstance(num_classes, int | np.integer):
            raise UsageError(f"num_classes must be an integer, got {num_classes!r}")
        num_classes = int(num_classes)
        if hi >= num_classes:
            raise UsageError(f"label {hi} found but num_classes is {num_classes}")
    return labels, num_classes


# --------------------------------------------------------------------------- helpers


def _group(indices: np.ndarray, owners: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """Per-client sorted int64 index arrays from parallel (index, owner) arrays."""
    order = np.lexsort((indices, owners))
    flat = np.ascontiguousarray(indices[order], dtype=np.int64)
    sizes = np.bincount(owners, minlength=num_clients)
    return np.split(flat, np.cumsum(sizes)[:-1])


def _class_pools(
    labels: np.ndarray, num_classes: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Each class's indices in a random order (one permutation, one stable sort)."""
    perm = rng.permutation(labels.size)
    order = perm[np.argsort(labels[perm], kind="stable")]
    sizes = np.bincount(labels, minlength=num_classes)
    return np.split(order, np.cumsum(sizes)[:-1])


def _even_sizes(n: int, parts: int) -> np.ndarray:
    # np.array_split's sizes: the first n % parts parts get one extra.
    sizes = np.full(parts, n // parts, dtype=np.int64)
    sizes[: n % parts] += 1
    return sizes


def _deal_counts(pools: list[np.ndarray], counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Hand out counts[i, c] samples of class c to client i from the shuffled class pools."""
    num_clients = counts.shape[0]
    idx_parts, own_parts = [], []
    for c, pool in enumerate(pools):
        col = counts[:, c]
        total = int(col.sum())
        if total == 0:
            continue
        idx_parts.append(pool[:total])
        own_parts.append(np.repeat(np.arange(num_clients), col))
    if not idx_parts:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    return np.concatenate(idx_parts), np.concatenate(own_parts)


def _split_among_holders(
    pools: list[np.ndarray], held: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """counts[i, c]: each class's samples split evenly over the clients holding it."""
    counts = np.zeros(held.shape, dtype=np.int64)
    for c, pool in enumerate(pools):
        holders = np.flatnonzero(held[:, c])
        if holders.size == 0:
            continue
        # Shuffled so the one-extra remainder does not always favour low client ids.
        counts[rng.permutation(holders), c] = _even_sizes(pool.size, holders.size)
    return counts


def _dirichlet(rng: np.random.Generator, beta: float, size: int) -> np.ndarray:
    p = rng.dirichlet(np.full(size, beta))
    # Tiny beta can underflow every component in some numpy versions; fall back to uniform
    # rather than propagate NaN into integer counts.
    if not np.all(np.isfinite(p)) or p.sum() <= 0:
        p = np.full(size, 1.0 / size)
    return p


# --------------------------------------------------------------------------- schemes


def _iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    perm = rng.permutation(labels.size)
    owners = np.repeat(np.arange(num_clients), _even_sizes(labels.size, num_clients))
    return _group(perm, owners, num_clients)


def _dirichlet_counts(
    class_sizes: np.ndarray,
    num_clients: int,
    beta: float,
    rng: np.random.Generator,
    order: np.ndarray | None = None,
) -> np.ndarray:
    """One capped Dirichlet draw as a (clients, classes) count matrix, visiting the classes
    in ``order`` (None: 0..C-1, NIID-Bench's loop).

    The cap closes clients that hold N/K samples to the classes visited after that, so a
    class visited late is split among fewer, larger clients than one visited early: with the
    classes in index order that ties the skew to the class index, with a fresh random order
    per draw it falls on each class alike (docs/partitions.md has the numbers)."""
    n = int(class_sizes.sum())
    counts = np.zeros((num_clients, class_sizes.size), dtype=np.int64)
    totals = np.zeros(num_clients, dtype=np.int64)
    cap = n / num_clients
    visits = range(class_sizes.size) if order is None else order.tolist()
    for c in visits:
        n_c = int(class_sizes[c])
        p = _dirichlet(rng, beta, num_clients)
        if n_c == 0:
            continue  # drawn anyway so later classes do not depend on empty ones
        # Balancing trick: full clients take no more classes. Some client is always open,
        # because the samples assigned so far are fewer than n.
        open_ = totals < cap
        p = np.where(open_, p, 0.0)
        s = p.sum()
        if not s > 0:
            p, s = open_.astype(np.float64), float(open_.sum())
        bounds = np.floor(np.cumsum(p) * (n_c / s)).astype(np.int64)
        np.clip(bounds, 0, n_c, out=bounds)
        bounds[-1] = n_c
        col = np.diff(bounds, prepend=0)
        counts[:, c] = col
        totals += col
    return counts


def _repair_min_size(counts: np.ndarray, min_size: int) -> None:
    """Top up clients below min_size, in place, from the currently largest clients.

    Each move takes the donor's most abundant class, so a topped-up client usually ends up
    with a single class and the label skew the user asked for stays sharp. Feasibility
    (clients * min_size <= N) guarantees a donor with surplus exists while anyone is short.
    """
    totals = counts.sum(axis=1)
    needy = np.flatnonzero(totals < min_size)
    if needy.size == 0:
        return
    heap = [(-int(t), int(i)) for i, t in enumerate(totals) if t > min_size]
    heapq.heapify(heap)
    for r in needy.tolist():
        need = min_size - int(totals[r])
        while need > 0:
            neg_total, d = heapq.heappop(heap)
            c = int(np.argmax(counts[d]))
            take = min(need, -neg_total - min_size, int(counts[d, c]))
            counts[d, c] -= take
            counts[r, c] += take
            totals[d] -= take
            totals[r] += take
            need -= take
            if totals[d] > min_size:
                heapq.heappush(heap, (-int(totals[d]), d))


def _dirichlet_scheme(
    labels: np.ndarray,
    num_clients: int,
    num_classes: int,
    rng: np.random.Generator,
    p: dict,
    scheme: str,
) -> list[np.ndarray]:
    """``dirichlet`` (a fresh random class order per draw) and ``dirichlet-niidbench``
    (classes in index order; it must keep drawing exactly what it always drew, so that run
    folders made with it rebuild their partition: no extra draws from ``rng`` on its path)."""
    beta = _as_beta(scheme, p["beta"])
    min_size = _as_int(scheme, "min_size", p["min_size"], 0)
    n = labels.size
    if num_clients * min_size > n:
        raise UsageError(
            f"partition '{scheme}': {num_clients} clients x min_size {min_size} needs "
            f"{num_clients * min_size} samples, only {n} available (lower min_size)"
        )
    shuffled = scheme == "dirichlet"
    class_sizes = np.bincount(labels, minlength=num_classes)
    best, best_order, best_deficit = None, None, None
    for _ in range(_DIRICHLET_TRIES):
        order = rng.permutation(num_classes) if shuffled else np.arange(num_classes)
        counts = _dirichlet_counts(class_sizes, num_clients, beta, rng, order)
        deficit = int(np.maximum(min_size - counts.sum(axis=1), 0).sum())
        if best_deficit is None or deficit < best_deficit:
            best, best_order, best_deficit = counts, order, deficit
        if deficit == 0:
            break
    assert best is not None and best_order is not None
    # The repair breaks ties between classes by position: it works on the columns in the
    # draw's visiting order, so that no class index is favoured there either.
    visited = best[:, best_order]
    _repair_min_size(visited, min_size)
    best[:, best_order] = visited
    pools = _class_pools(labels, num_classes, rng)
    return _group(*_deal_counts(pools, best), num_clients)


def _shards_scheme(
    labels: np.ndarray,
    num_clients: int,
    num_classes: int,
    rng: np.random.Generator,
    p: dict,
    scheme: str,
) -> list[np.ndarray]:
    """``shards`` (the classes sorted in a fresh random order per draw) and ``shards-fedavg``
    (in index order; it draws exactly what it always drew)."""
    per_client = _as_int(scheme, "shards_per_client", p["shards_per_client"], 1)
    n = labels.size
    num_shards = num_clients * per_client
    if num_shards > n:
        raise UsageError(
            f"partition '{scheme}': {num_clients} clients x {per_client} shards = {num_shards} "
            f"shards, more than the {n} samples"
        )
    # Where the shard boundaries cut depends on each class's position in the sorted labels
    # (unless every class is a whole number of shards): a random position per draw, so that
    # which classes are cut is not tied to their index.
    rank = rng.permutation(num_classes) if scheme == "shards" else np.arange(num_classes)
    # A random permutation before the stable sort gives a random order within each label.
    perm = rng.permutation(n)
    order = perm[np.argsort(rank[labels[perm]], kind="stable")]
    shard_of_position = np.repeat(np.arange(num_shards), _even_sizes(n, num_shards))
    owner_of_shard = np.empty(num_shards, dtype=np.int64)
    owner_of_shard[rng.permutation(num_shards)] = np.arange(num_shards) // per_client
    return _group(order, owner_of_shard[shard_of_position], num_clients)


def _classes_scheme(
    labels: np.ndarray, num_clients: int, num_classes: int, rng: np.random.Generator, p: dict
) -> list[np.ndarray]:
    k = _as_int("classes", "classes_per_client", p["classes_per_client"], 1)
    if k > num_classes:
        raise UsageError(
            f"partition 'classes': classes_per_client {k} > number of classes {num_classes}"
        )
    # Consecutive slots (i*k + j) mod C over a shuffled class order: k distinct classes per
    # client, and every class used once num_clients * k >= C.
    class_order = rng.permutation(num_classes)
    slots = (np.arange(num_clients)[:, None] * k + np.arange(k)[None, :]) % num_classes
    held = np.zeros((num_clients, num_classes), dtype=bool)
    held[np.arange(num_clients)[:, None], class_order[slots]] = True
    pools = _class_pools(labels, num_classes, rng)
    counts = _split_among_holders(pools, held, rng)
    return _group(*_deal_counts(pools, counts), num_clients)


def _missing_scheme(
    labels: np.ndarray, num_clients: int, num_classes: int, rng: np.random.Generator, p: dict
) -> list[np.ndarray]:
    x = _as_int("missing", "missing_classes", p["missing_classes"], 0)
    if x >= num_classes:
        raise UsageError(
            f"partition 'missing': missing_classes must be < number of classes "
            f"({num_classes}), got {x}"
        )
    cols = (np.arange(num_clients)[:, None] + np.arange(num_classes - x)[None, :]) % num_classes
    held = np.zeros((num_clients, num_classes), dtype=bool)
    held[np.arange(num_clients)[:, None], cols] = True
    pools = _class_pools(labels, num_classes, rng)
    counts = _split_among_holders(pools, held, rng)
    return _group(*_deal_counts(pools, counts), num_clients)


def niid2_dominant(num_clients: int, num_classes: int) -> np.ndarray:
    """(clients, classes) bool matrix: which classes each client is dominant in under niid2.

    - more clients than classes: client i is dominant in class i mod C;
    - C a multiple of the number of clients: contiguous blocks, client i dominant in
      classes i*C/K .. (i+1)*C/K - 1 (FedFM's CIFAR-100 layout, and class i when K = C);
    - otherwise round-robin: client i dominant in {c : c mod K == i}.
    """
    dom = np.zeros((num_clients, num_classes), dtype=bool)
    clients = np.arange(num_clients)
    classes = np.arange(num_classes)
    if num_clients > num_classes:
        dom[clients, clients % num_classes] = True
    elif num_classes % num_clients == 0:
        dom[classes // (num_classes // num_clients), classes] = True
    else:
        dom[classes % num_clients, classes] = True
    return dom


def _niid2_scheme(
    labels: np.ndarray, num_clients: int, num_classes: int, rng: np.random.Generator, p: dict
) -> list[np.ndarray]:
    dominant = _as_int("niid2", "dominant_shards", p["dominant_shards"], 0)
    tail = _as_int("niid2", "tail_shards", p["tail_shards"], 0)
    shard_size = _as_int("niid2", "shard_size", p["shard_size"], 1)
    if dominant == 0 and tail == 0:
        raise UsageError("partition 'niid2': dominant_shards and tail_shards are both 0")
    dom = niid2_dominant(num_clients, num_classes)
    counts = (tail + dominant * dom.astype(np.int64)) * shard_size
    needed = counts.sum(axis=0)
    available = np.bincount(labels, minlength=num_classes)
    short = np.flatnonzero(needed > available)
    if short.size:
        c = int(short[0])
        raise UsageError(
            f"partition 'niid2': class {c} needs {int(needed[c])} samples "
            f"({int(needed[c]) // shard_size} shards of {shard_size}), only "
            f"{int(available[c])} available (use a smaller shard_size or fewer shards)"
        )
    # Taking a prefix of a shuffled pool is the same as drawing shards without replacement.
    pools = _class_pools(labels, num_classes, rng)
    return _group(*_deal_counts(pools, counts), num_clients)


def _quantity_scheme(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, p: dict
) -> list[np.ndarray]:
    beta = _as_beta("quantity", p["beta"])
    min_size = _as_int("quantity", "min_size", p["min_size"], 0)
    n = labels.size
    if num_clients * min_size > n:
        raise UsageError(
            f"partition 'quantity': {num_clients} clients x min_size {min_size} needs "
            f"{num_clients * min_size} samples, only {n} available (lower min_size)"
        )
    rest = n - num_clients * min_size
    share = _dirichlet(rng, beta, num_clients) * rest
    sizes = np.floor(share).astype(np.int64)
    # Largest remainders get the leftover samples: sizes sum to n exactly, deterministically.
    leftover = rest - int(sizes.sum())
    if leftover > 0:
        sizes[np.argsort(-(share - sizes), kind="stable")[:leftover]] += 1
    sizes += min_size
    perm = rng.permutation(n)
    return _group(perm, np.repeat(np.arange(num_clients), sizes), num_clients)


# --------------------------------------------------------------------------- public API


def make_partition(
    labels: np.ndarray,
    num_clients: int,
    scheme: str,
    seed: int,
    num_classes: int | None = None,
    **params: object,
) -> list[np.ndarray]:
    """Split sample indices over clients; one sorted int64 index array per client.

    A pure function of its arguments. Parameters not given (or given as None) take the
    scheme's defaults from ``PARTITIONS``. Raises UsageError with one line for an unknown
    scheme or parameter, or an invalid or infeasible value.
    """
    if scheme not in PARTITIONS:
        raise UsageError(f"unknown partition {scheme!r} (choices: {', '.join(PARTITIONS)})")
    p = resolve_partition_params(scheme, params)
    if scheme == "natural":
        raise UsageError("partition 'natural' needs a dataset with its own clients (synthetic)")
    labels, num_classes = _check_labels(labels, num_classes)
    num_clients = _as_int(scheme, "num_clients", num_clients, 1)
    if num_clients > labels.size:
        raise UsageError(
            f"partition '{scheme}': more clients ({num_clients}) than samples ({labels.size})"
        )
    rng = numpy_rng(seed, -1, -1, f"partition:{stable_name(scheme)}")
    partition = _draw(labels, num_clients, num_classes, scheme, rng, p)
    _refuse_empty_clients(partition, labels, num_classes, scheme, p)
    return partition


def _draw(
    labels: np.ndarray,
    num_clients: int,
    num_classes: int,
    scheme: str,
    rng: np.random.Generator,
    p: dict,
) -> list[np.ndarray]:
    if scheme == "iid":
        return _iid(labels, num_clients, rng)
    if scheme in ("dirichlet", "dirichlet-niidbench"):
        return _dirichlet_scheme(labels, num_clients, num_classes, rng, p, scheme)
    if scheme in ("shards", "shards-fedavg"):
        return _shards_scheme(labels, num_clients, num_classes, rng, p, scheme)
    if scheme == "classes":
        return _classes_scheme(labels, num_clients, num_classes, rng, p)
    if scheme == "missing":
        return _missing_scheme(labels, num_clients, num_classes, rng, p)
    if scheme == "niid2":
        return _niid2_scheme(labels, num_clients, num_classes, rng, p)
    if scheme == "quantity":
        return _quantity_scheme(labels, num_clients, rng, p)
    raise AssertionError(f"partition {scheme!r} is listed but not implemented")


def _refuse_empty_clients(
    partition: list[np.ndarray], labels: np.ndarray, num_classes: int, scheme: str, p: dict
) -> None:
    """A client without samples cannot train (and divides by zero in weighted averages): no
    scheme hands one out, whatever its parameters allowed."""
    empty = [k for k, idx in enumerate(partition) if idx.size == 0]
    if not empty:
        return
    absent = np.flatnonzero(np.bincount(labels, minlength=num_classes) == 0)
    if scheme in ("dirichlet", "dirichlet-niidbench", "quantity"):
        hint = f"min_size {p['min_size']} allows it; use min_size >= 1"
    elif absent.size:
        hint = (
            f"class(es) {', '.join(map(str, absent[:5].tolist()))} have no samples; give "
            "num_classes as the labels hold them, fewer clients or another partition"
        )
    else:
        hint = "use fewer clients or another partition"
    raise UsageError(
        f"partition '{scheme}' leaves {len(empty)} of {len(partition)} client(s) without "
        f"samples (first: client {empty[0]}): {hint}"
    )


def partition_stats(
    partition: list[np.ndarray], labels: np.ndarray, num_classes: int
) -> np.ndarray:
    """(clients, classes) int64 matrix of sample counts."""
    labels = np.asarray(labels)
    num_clients = len(partition)
    if num_clients == 0:
        return np.zeros((0, num_classes), dtype=np.int64)
    sizes = np.array([len(idx) for idx in partition], dtype=np.int64)
    flat = np.concatenate([np.asarray(idx, dtype=np.int64) for idx in partition])
    client_labels = labels[flat].astype(np.int64)
    if client_labels.size and (client_labels.min() < 0 or client_labels.max() >= num_classes):
        raise UsageError(f"labels outside 0..{num_classes - 1} in partition")
    owners = np.repeat(np.arange(num_clients), sizes)
    flat_counts = np.bincount(
        owners * num_classes + client_labels, minlength=num_clients * num_classes
    )
    return flat_counts.reshape(num_clients, num_classes)


# A client "holds" a class when it has at least this share of the class's samples: a few
# strays left by rounding or the min_size repair are not a holding.
HOLDER_SHARE = 0.01
# A JSON list of every index of a million-sample dataset is about 8 MiB.
MAX_PARTITION_JSON_BYTES = 256 * 2**20


def class_holders(counts: np.ndarray, min_share: float = HOLDER_SHARE) -> np.ndarray:
    """Per class, the clients holding at least ``min_share`` of its samples (0 for a class
    without samples), from a (clients, classes) count matrix."""
    counts = np.asarray(counts)
    totals = counts.sum(axis=0)
    held = counts >= min_share * totals[None, :]
    return np.where(totals > 0, (held & (counts > 0)).sum(axis=0), 0)


def largest_share(counts: np.ndarray) -> np.ndarray:
    """Per class, the largest client's share of its samples (NaN for a class without any)."""
    counts = np.asarray(counts, dtype=np.float64)
    totals = counts.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(totals > 0, counts.max(axis=0, initial=0) / totals, np.nan)


def _json_default(obj: object) -> object:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def flat_partition(partition: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(indices, offsets): every client's sample indices in one int64 array, and where each
    client's slice starts (with the total at the end), as partition files store them."""
    sizes = np.array([len(idx) for idx in partition], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    indices = (
        np.concatenate([np.asarray(idx, dtype=np.int64) for idx in partition])
        if partition
        else np.empty(0, dtype=np.int64)
    )
    return indices, offsets


def partition_digest(partition: list[np.ndarray]) -> str:
    """A short hash of which samples each client holds (order included), so that runs can
    be checked to have had the same clients without their partition files."""
    indices, offsets = flat_partition(partition)
    h = hashlib.sha256()
    for key, arr in (("indices", indices), ("offsets", offsets)):
        h.update(key.encode())
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()[:16]


def save_partition(path: Path, partition: list[np.ndarray], meta: dict) -> None:
    """Write a partition and its metadata to an .npz file (no pickled objects)."""
    path = Path(path)
    try:
        meta_json = json.dumps(meta, sort_keys=True, default=_json_default)
    except (TypeError, ValueError) as exc:
        raise FedskewError(f"partition metadata is not JSON serialisable: {exc}") from exc
    indices, offsets = flat_partition(partition)
    try:
        # Written beside and renamed into place: a resume reads this file. (An open file
        # also keeps the exact name: np.savez would append ".npz" to a bare path.)
        meta_array = np.array(meta_json)
        replace_durably(
            path, lambda fh: np.savez(fh, indices=indices, offsets=offsets, meta=meta_array)
        )
    except OSError as exc:
        raise FedskewError(f"cannot write partition file {path}: {exc.strerror or exc}") from exc


def load_partition(path: Path) -> tuple[list[np.ndarray], dict]:
    """Read a file written by ``save_partition``."""
    path = Path(path)
    refuse_non_regular(path, "partition file")
    try:
        with np.load(path, allow_pickle=False) as data:
            indices, offsets = data["indices"], data["offsets"]
            meta = json.loads(str(data["meta"]))
    except FileNotFoundError:
        raise FedskewError(f"cannot read partition file {path}: no such file") from None
    except Exception as exc:  # a torn or foreign file fails in zipfile, zlib or NumPy
        raise FedskewError(
            f"{path} is not a fedskew partition file, or it is damaged ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else 'no detail'})"
        ) from None
    for key, arr in (("indices", indices), ("offsets", offsets)):
        # A cast would truncate 2.5 to 2 (or wrap a huge unsigned value) without a word.
        if arr.dtype.kind not in "iu" or (
            arr.dtype.kind == "u" and arr.size and arr.max() >= 2**63
        ):
            raise FedskewError(
                f"{path} is not a fedskew partition file: its {key} are {arr.dtype}, not integers"
            )
    indices = indices.astype(np.int64, copy=False)
    offsets = offsets.astype(np.int64, copy=False)
    if (
        offsets.ndim != 1
        or offsets.size == 0
        or offsets[0] != 0
        or offsets[-1] != indices.size
        or np.any(np.diff(offsets) < 0)
    ):
        raise FedskewError(f"{path} is not a fedskew partition file: bad offsets")
    return np.split(indices, offsets[1:-1]), meta


def read_partition_file(path: str | Path) -> list[np.ndarray]:
    """A partition made by another tool: a fedskew ``.npz`` (as runs save it) or a ``.json``
    list with one list of training-sample indices per client (or an object mapping client
    ids 0..K-1 to such lists). Only the file's shape is checked here; see
    :func:`check_partition` for the checks against a dataset."""
    p = Path(path)
    if p.suffix.lower() == ".npz":
        return load_partition(p)[0]
    if p.suffix.lower() != ".json":
        raise UsageError(f"partition file must end in .npz or .json: {p}")
    refuse_non_regular(p, "partition file")
    text = read_text_file(p, "partition file", MAX_PARTITION_JSON_BYTES)
    raw = parse_structured_text(text, ".json", f"partition file {p}")
    if isinstance(raw, dict):
        # isdecimal, not isdigit: "²" is a digit that int() refuses.
        keys = sorted(raw, key=lambda k: int(k) if str(k).isdecimal() else -1)
        if [str(k) for k in keys] != [str(i) for i in range(len(raw))]:
            raise UsageError(f"{p}: client ids must be 0..{len(raw) - 1}")
        raw = [raw[k] for k in keys]
    if not isinstance(raw, list) or not all(isinstance(c, list) for c in raw):
        raise UsageError(f"{p}: expected a list of index lists, one per client")
    clients = []
    for k, indices in enumerate(raw):
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in indices):
            raise UsageError(f"{p}: client {k} has an index that is not an integer")
        if any(not -(2**63) <= i < 2**63 for i in indices):  # numpy would overflow
            raise UsageError(f"{p}: client {k} has an index outside the training set")
        clients.append(np.asarray(indices, dtype=np.int64))
    return clients


def check_partition(
    partition: list[np.ndarray], num_samples: int, where: str, allow_overlap: bool = False
) -> None:
    """Indices in range, no client empty, no index twice in a client, and (unless allowed)
    no sample held by two clients."""
    if not partition:
        raise UsageError(f"{where}: no clients")
    seen = np.zeros(num_samples, dtype=np.int64)
    for k, idx in enumerate(partition):
        if idx.size == 0:
            raise UsageError(f"{where}: client {k} has no samples")
        if idx.min() < 0 or idx.max() >= num_samples:
            raise UsageError(
                f"{where}: client {k} has indices outside 0..{num_samples - 1} "
                "(the training set's size)"
            )
        if np.unique(idx).size != idx.size:
            raise UsageError(f"{where}: client {k} lists a sample twice")
        seen[idx] += 1
    shared = int((seen > 1).sum())
    if shared and not allow_overlap:
        raise UsageError(
            f"{where}: {shared} samples are held by more than one client "
            "(allow with partition_overlap / --partition-overlap)"
        )
