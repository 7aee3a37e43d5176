"""What a resume reads back from a run folder, checked before anything uses it.

A run folder is a file like any other: a bad copy, a full disk or an edit can change it.
What a resume continues from (the checkpoint's server and client states, the metrics lines
of the finished rounds) is checked here against what this run writes, so that a folder that
does not fit stops the resume with one line, instead of a crash inside an algorithm or a run
that goes on with other numbers (state silently re-initialised, a summary made of other
lines):

* the server state: exactly ``global_arrays`` and the server's ``checkpoint_fields``, each
  like the freshly built server's value, or as its algorithm declares
  (``Algorithm.checkpoint_specs``);
* the client states: tensors and finite numbers; for an algorithm that declares what its
  clients keep (``Algorithm.client_state``), only those parts, each whole and of its shapes,
  and held by every client that must hold it;
* the metrics lines: the fields the run loop reads back, of their kinds, the clients each
  round samples, and exactly the lines the checkpoint recorded (a digest chained over them).
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fedskew.core.errors import FedskewError
from fedskew.runs.checkpoint import Checkpoint, load_server_state
from fedskew.training.interface import ServerLogic
from fedskew.training.protocol import ClientState
from fedskew.training.state_spec import PerClient, Spec, StatePart, mismatch, spec_of

# Lists of client ids a metrics line may hold.
CLIENT_LISTS = ("missing_replies", "rejected_replies", "diverged_replies", "local_eval_missing")
SCORES = ("accuracy", "loss", "client_dist_accuracy")  # of an evaluated round, or None
FEATURE_SCORES = ("feature_nmi", "feature_silhouette")


@dataclass(frozen=True)
class RecordSpec:
    """What this run's metrics line of each round holds: the fields the run loop reads back
    on resume (its summary, the last evaluation, which clients have trained)."""

    num_clients: int
    num_classes: int
    sampled: Callable[[int], list[int]]  # round (0-based) -> the clients it samples
    evaluated: Callable[[int], bool]
    features_due: Callable[[int], bool]  # feature_nmi and feature_silhouette measured
    local_series: tuple[str, ...] = ()  # client_accuracy, ... on evaluated rounds


@dataclass(frozen=True)
class SavedStateSpec:
    """What a checkpoint of this run must hold. ``server`` is the freshly built server
    logic, whose values give the specs of the fields its algorithm does not declare."""

    algorithm: str
    server: ServerLogic
    fields: Mapping[str, Spec]  # Algorithm.checkpoint_specs
    client_parts: tuple[StatePart, ...] | None  # Algorithm.client_state
    records: RecordSpec
    clients_here: bool  # the engine keeps the clients' states in this process


def check_saved_state(
    ckpt: Checkpoint, path: Path, rows: list[dict[str, Any]], metrics: Path, spec: SavedStateSpec
) -> None:
    """Refuse, in one line, a checkpoint and the metrics lines of its rounds (``rows``: the
    lines of rounds 1..ckpt.round, the last one maybe the checkpoint's own record) that this
    run would not have written."""
    for number, row in enumerate(rows, start=1):
        why = record_problem(row, number - 1, spec.records)
        if why:
            where = (
                f"{path}: its metrics record of round {number}"
                if row is ckpt.record
                else f"{metrics}: line {number}"
            )
            raise FedskewError(f"{where} {why}; this run cannot be resumed from it")
    if ckpt.metrics_digest is not None and ckpt.metrics_digest != metrics_digest(rows):
        raise FedskewError(
            f"{metrics}: the lines of rounds 1..{len(rows)} are not those {path.name} recorded "
            "(edited or damaged); this run cannot be resumed from it"
        )
    why = server_state_problem(ckpt.server, spec)
    if why:
        raise FedskewError(f"{path}: {why}")
    restored = copy.copy(spec.server)  # the saved fields on a copy: the holds rules read them
    load_server_state(restored, ckpt.server)
    trained = trained_clients(rows)
    why = per_client_problem(ckpt.server, spec, restored, trained)
    if not why and spec.clients_here:
        why = client_states_problem(ckpt.clients, spec, restored, trained)
    if why:
        raise FedskewError(f"{path}: {why}")


# ------------------------------------------------------------------------------ server


def server_state_problem(saved: Any, spec: SavedStateSpec) -> str | None:
    """What is wrong with the saved server state, or None."""
    server, algorithm = spec.server, spec.algorithm
    names = ("global_arrays", *server.checkpoint_fields)
    for name in server.checkpoint_fields:
        if _is_method(server, name):  # restoring it would replace the server's code
            return f"{algorithm}'s server declares '{name}' a checkpoint field, but it is a method"
    missing = [n for n in names if n not in saved]
    if missing:
        return f"lacks the server state '{missing[0]}' that {algorithm} saves"
    extra = sorted((str(n) for n in saved if n not in names), key=str)
    if extra:
        what = " (a method of its server)" if _is_method(server, extra[0]) else ""
        return f"holds server state '{extra[0]}'{what}, which {algorithm} does not save"
    for name in names:
        field_spec = spec.fields.get(name) or spec_of(getattr(server, name))
        why = mismatch(saved[name], field_spec, spec.records.num_clients)
        if why:
            return f"server state '{name}' {why}"
    return None


def per_client_problem(
    saved: Mapping[str, Any], spec: SavedStateSpec, server: ServerLogic, trained: Trained
) -> str | None:
    """Which client lacks its entry in a per-client server field (or has one it must not),
    where the algorithm says which clients have one (``PerClient.holds``)."""
    for name, field_spec in spec.fields.items():
        if not isinstance(field_spec, PerClient):
            continue
        for cid in range(spec.records.num_clients):
            must = field_spec.holds(server, cid, trained.get(cid, False))
            if must and cid not in saved[name]:
                return f"server state '{name}' lacks the entry of client {cid}, which has trained"
            if must is False and cid in saved[name]:
                return f"server state '{name}' holds an entry of client {cid}, which has none"
    return None


def _is_method(server: ServerLogic, name: Any) -> bool:
    if not isinstance(name, str):
        return False
    found = inspect.getattr_static(type(server), name, None)
    return callable(found) or isinstance(found, (property, staticmethod, classmethod))


# ----------------------------------------------------------------------------- clients


# Client id -> True: it took part in a round and every reply of it arrived; None: a reply
# of it was lost or dropped; a client that never took part is not listed (False).
Trained = Mapping[int, bool | None]


def trained_clients(rows: Iterable[dict[str, Any]]) -> dict[int, bool | None]:
    """Which clients trained in these rounds (see ``Trained``), from their metrics lines."""
    trained: dict[int, bool | None] = {}
    for row in rows:
        lost = {*row.get("missing_replies", ()), *row.get("diverged_replies", ())}
        for cid in row["clients"]:
            trained[cid] = None if cid in lost or trained.get(cid, True) is None else True
    return trained


def client_states_problem(
    clients: Mapping[Any, Any], spec: SavedStateSpec, server: ServerLogic, trained: Trained
) -> str | None:
    """What is wrong with the saved client states, or None. ``server`` holds the saved
    server state (a part's ``holds`` rule may read it)."""
    n = spec.records.num_clients
    for cid, state in clients.items():
        if type(cid) is not int or not 0 <= cid < n:
            return f"holds the state of client {cid!r}, not a client of this run (0..{n - 1})"
        why = _generic_problem(state)
        if why:
            return f"client {cid}'s state {why}"
    if spec.client_parts is None:
        return None
    for cid in range(n):
        state = clients.get(cid) or ClientState()
        why = _parts_problem(state, spec, server, cid, trained.get(cid, False))
        if why:
            hint = "" if clients else " (the checkpoint holds no client state at all)"
            return f"client {cid}'s state {why}{hint}"
    return None


def _generic_problem(state: Any) -> str | None:
    """A client state must be named tensors and named finite numbers (what an algorithm's
    client reads from ``ctx.state``)."""
    if not isinstance(state, ClientState):
        return "is not a client state"
    for name, value in state.arrays.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            return f"holds {name!r}: {type(value).__name__}, not a tensor"
    for name, value in state.scalars.items():
        if not isinstance(name, str) or not _number(value) or not math.isfinite(value):
            return f"holds the number {name!r} = {value!r}, not a finite number"
    return None


def _parts_problem(
    state: ClientState, spec: SavedStateSpec, server: ServerLogic, cid: int, trained: bool | None
) -> str | None:
    parts = spec.client_parts or ()
    for name in [*state.arrays, *state.scalars]:
        if not any(name in p.arrays or name in p.scalars for p in parts):
            return f"holds '{name}', which {spec.algorithm}'s clients do not keep"
    for part in parts:
        arrays = [a for a in part.arrays if a in state.arrays]
        scalars = [s for s in part.scalars if s in state.scalars]
        held = len(arrays) + len(scalars)
        names = [*part.arrays, *part.scalars]
        if not names:
            continue
        if 0 < held < len(names):
            lacking = next(x for x in names if x not in arrays and x not in scalars)
            return (
                f"holds part of what {spec.algorithm}'s clients keep together: it lacks '{lacking}'"
            )
        for name in part.scalars:
            if name in state.arrays:
                return f"holds '{name}' as an array; {spec.algorithm} keeps it as a number"
        sizes: dict[str, int] = {}
        for name in arrays:
            why = mismatch(state.arrays[name], part.arrays[name], spec.records.num_clients, sizes)
            if why:
                return f"'{name}' {why}"
        must = part.holds(server, cid, trained)
        if must and not held:
            why = "it has trained" if trained else "the server state says it has it"
            return f"lacks '{names[0]}', which {spec.algorithm} keeps for it ({why})"
        if must is False and held:
            return f"holds '{names[0]}', which {spec.algorithm} does not keep for it now"
    return None


# ----------------------------------------------------------------------------- records


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _score(value: Any) -> bool:
    return value is None or _number(value)


def _scores(value: Any, length: int) -> bool:
    return isinstance(value, list) and len(value) == length and all(_score(v) for v in value)


def record_problem(row: Any, rnd: int, spec: RecordSpec) -> str | None:
    """What round ``rnd``'s (0-based) metrics line lacks or holds of the wrong kind for the
    run loop, or None."""
    if not isinstance(row, dict):
        return "is not a JSON object"
    if type(row.get("round")) is not int or row["round"] != rnd + 1:
        return f"is not the record of round {rnd + 1}"
    for key in ("bytes_down", "bytes_up", "seconds"):
        if not _number(row.get(key)):
            return f"lacks the number '{key}'"
    clients = row.get("clients")
    if not isinstance(clients, list) or not all(type(c) is int for c in clients):
        return "lacks the list of its clients"
    if clients != spec.sampled(rnd):
        return "does not name the clients that round samples"
    for key in CLIENT_LISTS:
        ids = row.get(key, [])
        if not isinstance(ids, list) or not all(
            type(c) is int and 0 <= c < spec.num_clients for c in ids
        ):
            return f"holds '{key}' that is not a list of client ids"
    evaluated = spec.evaluated(rnd)
    wanted = [*SCORES, "per_class_accuracy", *spec.local_series]
    for key in wanted:
        if (key in row) != evaluated:
            state = "an evaluated round" if evaluated else "a round without evaluation"
            return f"{'lacks' if evaluated else 'holds'} '{key}' ({state})"
    if evaluated:
        if not all(_score(row[k]) for k in SCORES):
            return "holds an accuracy or loss that is not a number"
        if not _scores(row["per_class_accuracy"], spec.num_classes):
            return f"holds a per_class_accuracy that is not {spec.num_classes} numbers"
        for key in spec.local_series:
            if not _scores(row[key], spec.num_clients):
                return f"holds a {key} that is not {spec.num_clients} numbers"
    if spec.features_due(rnd) and not all(k in row and _score(row[k]) for k in FEATURE_SCORES):
        return "lacks the feature metrics measured after that round"
    listed = {"round", "clients", *CLIENT_LISTS, "per_class_accuracy", *spec.local_series}
    for key, value in row.items():
        if key not in listed and not _score(value):
            return f"holds '{key}' = {value!r:.40}, not a number"
    return None


def metrics_digest(rows: Iterable[dict[str, Any]], digest: str = "") -> str:
    """A digest of metrics lines chained onto ``digest`` (that of the lines before them):
    the checkpoint keeps the digest of the lines up to its round, and a resume compares."""
    for row in rows:
        line = json.dumps(row)  # the line as RunFolder writes it
        digest = hashlib.sha256(f"{digest}\n{line}".encode()).hexdigest()
    return digest
