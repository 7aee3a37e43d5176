"""What saved state may hold: the specs a resumed run checks a checkpoint against.

A checkpoint holds the server logic's ``checkpoint_fields`` and every client's
``ClientState``; a resume reads them back from a file that may have been damaged or edited,
so they are checked before any algorithm code sees them (``fedskew.runs.saved_state``).
Most server fields show what they hold in the freshly built server (SCAFFOLD's ``c``: a dict
of tensors shaped like the model), and :func:`spec_of` reads the spec off that value. A
field whose fresh value does not show it (None before the first anchors, an empty dict that
later holds a value per client) is declared by its algorithm (``Algorithm.checkpoint_specs``),
as is the state its clients keep (``Algorithm.client_state``), with the types here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedskew.training.protocol import ArraySpec

# Whether a client must have something at a checkpoint (a part of its state, an entry of a
# per-client server field): True, False (must not), or None (may or may not), from the
# server logic holding the saved state, the client's id and whether it has trained: True
# when it took part in a finished round and every reply of it arrived, False when it never
# took part, None when a reply of it was lost or dropped (what it holds is then uncertain).
Holds = Callable[[Any, int, bool | None], bool | None]


def after_training(server: Any, client: int, trained: bool | None) -> bool | None:
    """Held by exactly the clients that have trained (SCAFFOLD's c_k, FedDyn's gradient)."""
    return trained


def maybe(server: Any, client: int, trained: bool | None) -> None:
    """Held by some clients at some checkpoints: not required, but whole when held."""
    return None


@dataclass(frozen=True)
class OrNone:
    """None, or a value of ``spec`` (a field that is empty until the first round fills it)."""

    spec: Spec


@dataclass(frozen=True)
class PerClient:
    """A dict from client ids (ints in 0..num_clients-1) to values of ``value``, with an
    entry for the clients ``holds`` says (checked at the top level of a field)."""

    value: Spec
    holds: Holds = maybe


@dataclass(frozen=True)
class Fields:
    """A dict with exactly these keys, each value of its spec."""

    fields: Mapping[Any, Spec]


@dataclass(frozen=True)
class Items:
    """A list (or tuple) with exactly these items."""

    items: tuple[Spec, ...]


@dataclass(frozen=True)
class Number:
    """A number of exactly this type (bool, int or float: a checkpoint keeps the type)."""

    kind: type


@dataclass(frozen=True)
class Kind:
    """Any value of this type (what a fresh empty dict or a string says of later values)."""

    kind: type


@dataclass(frozen=True)
class Anything:
    """A fresh None that its algorithm declares nothing about: unchecked."""


Spec = ArraySpec | OrNone | PerClient | Fields | Items | Number | Kind | Anything


def spec_of(value: Any) -> Spec:
    """The spec a freshly built value stands for: its tensors' shapes and dtypes, its dicts'
    keys, its numbers' types."""
    if isinstance(value, torch.Tensor):
        return ArraySpec(tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        if not value:
            return Kind(dict)
        return Fields({k: spec_of(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return Items(tuple(spec_of(v) for v in value))
    if isinstance(value, (bool, int, float)):
        return Number(type(value))
    if value is None:
        return Anything()
    return Kind(type(value))


def mismatch(
    value: Any, spec: Spec, num_clients: int, sizes: dict[str, int] | None = None
) -> str | None:
    """How ``value`` differs from ``spec`` in words ("is (3,) float64, expected (10,)
    float32"; "lacks 'head.bias'"), or None when it fits. Named sizes of array shapes must
    agree throughout one value (``sizes`` collects them)."""
    sizes = {} if sizes is None else sizes
    if isinstance(spec, Anything):
        return None
    if isinstance(spec, OrNone):
        return None if value is None else mismatch(value, spec.spec, num_clients, sizes)
    if isinstance(spec, ArraySpec):
        return _tensor_mismatch(value, spec, sizes)
    if isinstance(spec, Number):
        if type(value) is not spec.kind:
            return f"is {_kind(value)}, expected {spec.kind.__name__}"
        return None
    if isinstance(spec, Kind):
        if not isinstance(value, spec.kind):
            return f"is {_kind(value)}, expected {spec.kind.__name__}"
        return None
    if isinstance(spec, Items):
        if not isinstance(value, (list, tuple)) or len(value) != len(spec.items):
            return f"is {_kind(value)}, expected a list of {len(spec.items)}"
        for number, (item, item_spec) in enumerate(zip(value, spec.items, strict=True)):
            why = mismatch(item, item_spec, num_clients, sizes)
            if why:
                return f"[{number}] {why}"
        return None
    if not isinstance(value, dict):
        return f"is {_kind(value)}, expected a dict"
    if isinstance(spec, Fields):
        missing = [k for k in spec.fields if k not in value]
        if missing:
            return f"lacks {missing[0]!r}"
        extra = [k for k in value if k not in spec.fields]
        if extra:
            return f"holds {extra[0]!r}, which it does not keep"
        for key, item_spec in spec.fields.items():
            why = mismatch(value[key], item_spec, num_clients, sizes)
            if why:
                return f"{key!r} {why}"
        return None
    for key, item in value.items():  # PerClient
        if type(key) is not int or not 0 <= key < num_clients:
            return f"holds key {key!r}, not a client id of this run (0..{num_clients - 1})"
        why = mismatch(item, spec.value, num_clients, sizes)
        if why:
            return f"{key!r} {why}"
    return None


def _tensor_mismatch(value: Any, spec: ArraySpec, sizes: dict[str, int]) -> str | None:
    want = "(" + ", ".join(str(d) for d in spec.shape) + f") {spec.dtype}"
    if not isinstance(value, torch.Tensor):
        return f"is {_kind(value)}, expected a tensor {want}"
    got = f"{tuple(value.shape)} {value.dtype}"
    if value.dtype != spec.dtype or value.dim() != len(spec.shape):
        return f"is {got}, expected {want}"
    for size, dim in zip(value.shape, spec.shape, strict=True):
        if isinstance(dim, str):
            dim = sizes.setdefault(dim, size)
        if size != dim:
            return f"is {got}, expected {want}"
    return None


def _kind(value: Any) -> str:
    """A value's kind in a message: a tensor's shape and dtype, else its type's name."""
    if isinstance(value, torch.Tensor):
        return f"a tensor {tuple(value.shape)} {value.dtype}"
    if isinstance(value, np.ndarray):
        return f"a NumPy array {value.shape} {value.dtype}"
    return "None" if value is None else f"a {type(value).__name__}"


@dataclass(frozen=True)
class StatePart:
    """Entries of a client's state that are kept together: a client holds all of them or
    none, each array of its spec, each scalar a number; ``holds`` says which clients must."""

    arrays: Mapping[str, ArraySpec] = field(default_factory=dict)
    scalars: tuple[str, ...] = ()
    holds: Holds = maybe


def model_part(prefix: str, model: torch.nn.Module, keys: list[str] | None = None,
               holds: Holds = maybe) -> StatePart:  # fmt: skip
    """A part holding the model's entries (``keys``, default all) under ``prefix``, each of
    its shape and dtype: a kept model, a previous model, a per-entry control variate."""
    state = model.state_dict()
    names = list(state) if keys is None else keys
    return StatePart(
        {prefix + k: ArraySpec(tuple(state[k].shape), state[k].dtype) for k in names}, (), holds
    )
