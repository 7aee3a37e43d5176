"""The wire contract: the only thing engines and algorithms share.

An algorithm's server calls ``channel.exchange({client_id: Message})`` one or more times
per round; its client answers each message (``fedskew.training.interface``). A ``Message``
carries exactly what Flower's records carry (named arrays, named numbers, named short
strings), so every engine can run every algorithm unchanged and count communication from
what was really sent. ``ClientState`` is what a client keeps between messages, held by the
engine (or a Flower node) and never read by the server.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from fedskew.core.errors import FedskewError

SCALAR_BYTES = 8  # a number travels as a 64-bit value in every engine we support


@dataclass(frozen=True)
class ArraySpec:
    """What a client may send under one array name beyond the model's entries and the arrays
    it was sent (``Algorithm.reply_arrays``), so that an engine receiving replies it cannot
    trust (Flower) can refuse a mis-shaped one before the server aggregates it.

    ``shape``: an int is a fixed size; a string names a size that may differ between replies
    but must agree wherever the same string appears within one reply (e.g. ``"n"``, the
    number of classes a client holds). ``classes``: an integer array of distinct class
    indices, each below this number. ``true_count``: a bool array whose number of True
    entries is this named size (a mask over classes, of which another array holds rows).
    ``sample_counts``: an integer array of counts of the client's training samples (per
    class), each at least 0 and together at most the client's size where the server knows
    it, so that a client cannot weigh its anchors as if it held more data than it has."""

    shape: tuple[int | str, ...]
    dtype: torch.dtype = torch.float32
    classes: int | None = None
    true_count: str | None = None
    sample_counts: bool = False


@dataclass(frozen=True)
class ScalarSpec:
    """The range of a number a client sends that the server reads beyond ``num_samples``
    (``Algorithm.reply_scalars``): at least ``low`` (above it when ``low_open``) and at most
    ``high``. Every number must be finite in any case."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False

    def why_not(self, value: float) -> str | None:
        """Why ``value`` is outside this range, or None."""
        below = value <= self.low if self.low_open else value < self.low
        if below or value > self.high:
            left = "(" if self.low_open else "["
            return f"{value!r} is outside {left}{self.low:g}, {self.high:g}]"
        return None


@dataclass
class Message:
    """A flat message: named tensors, named numbers and named short strings."""

    kind: str
    arrays: dict[str, torch.Tensor] = field(default_factory=dict)
    scalars: dict[str, float] = field(default_factory=dict)
    strings: dict[str, str] = field(default_factory=dict)

    def nbytes(self) -> int:
        """Payload bytes: array data, 8 bytes per number, UTF-8 length of strings."""
        array_bytes = sum(t.numel() * t.element_size() for t in self.arrays.values())
        string_bytes = sum(len(s.encode("utf-8")) for s in self.strings.values())
        return array_bytes + SCALAR_BYTES * len(self.scalars) + string_bytes


@dataclass(frozen=True)
class Needs:
    """What a server reads from a reply of one kind: the arrays and numbers it must hold.

    Passed to ``Channel.exchange`` (as ``{reply kind: Needs}``), so that a reply that would
    make the server's aggregation fail (an array or number left out, another kind) is left
    out like a lost one on an engine whose replies cannot be trusted (Flower), and stops the
    run with the client named on the others, where it can only be a fault in the algorithm's
    client. What a reply may hold beyond these is ``Algorithm.reply_arrays``'s business."""

    arrays: frozenset[str] = frozenset()
    scalars: frozenset[str] = frozenset()


def needs(arrays: Iterable[str] = (), scalars: Iterable[str] = ()) -> Needs:
    return Needs(frozenset(arrays), frozenset(scalars))


Expected = Mapping[str, Needs]  # reply kind -> what the server reads from such a reply


def unmet(reply: Message, expected: Expected) -> str | None:
    """Why ``reply`` does not give the server what it reads (``expected``), or None."""
    need = expected.get(reply.kind)
    if need is None:
        kinds = " or ".join(f"'{k}'" for k in sorted(expected))
        return f"is of kind '{reply.kind}', expected {kinds}"
    for name in sorted(need.arrays):
        if name not in reply.arrays:
            return f"lacks the array '{name}'"
    for name in sorted(need.scalars):
        if name not in reply.scalars:
            return f"lacks the number '{name}'"
    return None


class Channel(Protocol):
    """What a server logic sees of the engine: one call per exchange of the round.

    The reply dict may lack clients: on a real deployment a node can die or send a reply
    that fails validation. Servers work with the clients that replied (see ``arrived``).
    ``expect`` says what the server reads from each reply (see ``Needs``); without it a
    reply that lacks something the server reads makes the round raise.

    The run loop's channel also has ``exchange_summed(messages, expect, request)``: the
    summed exchange of secure aggregation and DP, which gives the server only the mean of
    the replies' summands (``SumRequest``, ``Summed``; ``fedskew.training.privacy``).
    """

    def exchange(
        self, messages: Mapping[int, Message], expect: Expected | None = None
    ) -> dict[int, Message]: ...


@dataclass(frozen=True)
class SumRequest:
    """How the replies of a summed exchange are combined (``fedskew.training.privacy``): the
    server gets the weighted mean of the clients' summands, never a summand itself.

    ``shapes``: the summand arrays each reply holds, by name; they are summed in sorted
    name order. ``uniform``: every client weighs 1 (central DP), else its ``num_samples``.
    ``secure``: SecAgg+ (Flower's arithmetic: each value, times the client's weight over
    ``max_weight``, clipped to [-clip_range, clip_range], quantised to ``quantization``
    levels, masked and summed modulo ``modulus``). ``bound``: the L2 norm a summand may
    have (central DP), which the server enforces where it sees the summands. ``seed`` and
    ``round`` address the quantisation's random rounding, so that every engine rounds alike."""

    shapes: Mapping[str, tuple[int, ...]]
    uniform: bool
    secure: bool
    seed: int
    round: int
    clip_range: float = 8.0
    quantization: int = 4194304
    modulus: int = 2**32
    max_weight: float = 1.0
    bound: float | None = None

    def names(self) -> list[str]:
        return sorted(self.shapes)

    def weight(self, reply: Message) -> float:
        """A reply's weight in the mean."""
        return 1.0 if self.uniform else float(reply.scalars["num_samples"])

    def masked_nbytes(self) -> int:
        """Bytes of one client's masked vector: an int64 per value, one more for its weight."""
        return 8 * (1 + sum(math.prod(s) for s in self.shapes.values()))


@dataclass
class Summed:
    """What a summed exchange gives the server: the weighted mean (float64) of the summands
    of the clients in ``replies``, the sum of their weights, and what each of them sent in
    clear (numbers only: the sample count, and what the algorithm reads besides)."""

    mean: dict[str, torch.Tensor]
    weight: float
    replies: dict[int, Message]


class NoReplies(FedskewError):
    """No addressed client replied in an exchange; the engine skips the round."""


def arrived(clients: list[int], replies: Mapping[int, Message]) -> list[int]:
    """The clients (in their sampled order) whose reply arrived; NoReplies when none did."""
    present = [c for c in clients if c in replies]
    if not present:
        raise NoReplies(f"none of {len(clients)} addressed clients replied")
    return present


@dataclass
class ClientState:
    """State a client keeps between rounds (and between exchanges of one round).

    Only tensors and numbers, so that a checkpoint or Flower's ``context.state``
    holds it without pickle. The server never reads it.
    """

    arrays: dict[str, torch.Tensor] = field(default_factory=dict)
    scalars: dict[str, float] = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.arrays.values()) + SCALAR_BYTES * len(
            self.scalars
        )


def largest_state(states: Mapping[int, ClientState]) -> tuple[int, int]:
    """(the largest client's state in bytes, 0 when none; how many clients hold a non-empty
    state). Engines keep an entry for every client they have met, also for methods whose
    clients carry nothing between rounds; those empty entries cost no memory."""
    sizes = [s.nbytes() for s in states.values()]
    return max(sizes, default=0), sum(1 for size in sizes if size > 0)
