"""The message protocol: the only thing engines and algorithms share.

An algorithm is a server logic that calls ``channel.exchange({client_id: Message})``
one or more times per round, and a client logic whose handlers are keyed by message
kind. A ``Message`` carries exactly what Flower's records carry (named arrays, named
numbers, named short strings), so every engine can run every algorithm unchanged and
count communication from what was really sent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch

from fedskew.errors import FedskewError, UsageError
from fedskew.rng import torch_rng

SCALAR_BYTES = 8  # a number travels as a 64-bit value in every engine we support


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


class Channel(Protocol):
    """What a server logic sees of the engine: one call per exchange of the round.

    The reply dict may lack clients: on a real deployment a node can die or send a reply
    that fails validation. Servers work with the clients that replied (see ``arrived``).
    """

    def exchange(self, messages: Mapping[int, Message]) -> dict[int, Message]: ...


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


@dataclass
class ClientData:
    """One client's training data: indices into tensors held once for all clients."""

    x: torch.Tensor  # all training inputs, already normalised
    y: torch.Tensor  # all training labels (int64)
    indices: torch.Tensor  # this client's rows (int64)
    num_classes: int

    def __post_init__(self) -> None:
        self._labels: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.indices.numel())

    @property
    def labels(self) -> torch.Tensor:
        if self._labels is None:
            self._labels = self.y.index_select(0, self.indices)
        return self._labels

    def class_counts(self) -> torch.Tensor:
        return torch.bincount(self.labels, minlength=self.num_classes)

    def batch(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and labels of the given positions (0..len-1) of this client's data."""
        idx = self.indices.index_select(0, rows)
        # Advanced indexing keeps the inputs' memory format (channels_last); index_select
        # would silently return the default layout.
        return self.x[idx], self.y.index_select(0, idx)


@dataclass
class LocalTrainConfig:
    """The local optimisation settings every algorithm shares."""

    epochs: int = 2
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 1e-5
    augment: bool = False
    grad_clip: float = 0.0  # max gradient norm per step; 0: no clipping
    precision: str = "fp32"  # forward passes in fp32 or under bf16 autocast (fedskew.precision)


@dataclass
class ClientContext:
    """Everything a client handler may use for one message."""

    client_id: int
    round: int
    seed: int
    data: ClientData
    model: torch.nn.Module  # one scratch model per engine worker: load weights before use
    state: ClientState
    train: LocalTrainConfig
    # Loss terms (features, logits, y) -> scalar that plug-ins add to the algorithm's loss.
    loss_terms: list[Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = field(
        default_factory=list
    )
    # The uniform test set, for methods that report personalised accuracy on the client.
    test_x: torch.Tensor | None = None
    test_y: torch.Tensor | None = None

    def rng(self, purpose: str) -> torch.Generator:
        """The generator addressed by (seed, round, this client, purpose)."""
        return torch_rng(self.seed, self.round, self.client_id, purpose)


class ClientLogic:
    """Client side of an algorithm: methods ``on_<kind>(msg, ctx) -> Message``."""

    def __init__(self, params: Any) -> None:
        self.params = params

    def handle(self, msg: Message, ctx: ClientContext) -> Message:
        handler: Callable[[Message, ClientContext], Message] | None = getattr(
            self, f"on_{msg.kind}", None
        )
        if handler is None:
            raise UsageError(f"{type(self).__name__} has no handler for message kind '{msg.kind}'")
        return handler(msg, ctx)


@dataclass
class ServerSetup:
    """What a server logic is given at the start of a run."""

    initial_arrays: dict[str, torch.Tensor]  # the initial global model's state dict
    num_clients: int
    num_classes: int
    client_sizes: list[int]  # training samples per client (FedAvg weights need them up front)
    seed: int
    train: LocalTrainConfig
    rounds: int = 1
    eval_every: int = 1

    def is_eval_round(self, rnd: int) -> bool:
        """Whether the experiment evaluates after round ``rnd`` (0-based)."""
        return (rnd + 1) % self.eval_every == 0 or rnd + 1 == self.rounds


class ServerLogic:
    """Server side of an algorithm. Keeps the global model as named tensors."""

    def __init__(self, params: Any, setup: ServerSetup) -> None:
        self.params = params
        self.setup = setup
        self.global_arrays: dict[str, torch.Tensor] = {
            k: v.detach().clone() for k, v in setup.initial_arrays.items()
        }

    def round(self, rnd: int, clients: list[int], channel: Channel) -> dict[str, float]:
        """Run one round with the given clients; return metrics to log."""
        raise NotImplementedError

    def eval_arrays(self) -> dict[str, torch.Tensor]:
        """The model the evaluation should score (the global model unless overridden)."""
        return self.global_arrays


class Algorithm:
    """An algorithm: hyper-parameters, a server logic and a client logic."""

    name: ClassVar[str]
    description: ClassVar[str]
    Params: ClassVar[type]
    Server: ClassVar[type[ServerLogic]]
    Client: ClassVar[type[ClientLogic]]

    @classmethod
    def adapt_model(cls, params: Any, model: torch.nn.Module) -> torch.nn.Module:
        """Change the architecture where the method needs it (MOON's projection head,
        FedNH's prototype classifier). Called on every model the engine builds, before
        the initial weights are taken, so server and clients share one architecture."""
        return model

    @classmethod
    def make_params(cls, values: Mapping[str, object]) -> Any:
        """Build the Params dataclass from user values, coercing strings and naming mistakes."""
        fields = {f.name: f for f in dataclasses.fields(cls.Params)}
        kwargs: dict[str, object] = {}
        for key, raw in values.items():
            name = key.replace("-", "_")
            if name not in fields:
                valid = ", ".join(fields) or "none"
                raise UsageError(
                    f"algorithm '{cls.name}' has no parameter '{key}' (valid: {valid})"
                )
            kwargs[name] = coerce(raw, fields[name], cls.name)
        params = cls.Params(**kwargs)
        check = getattr(params, "validate", None)
        if check is not None:
            check()
        return params


def coerce(raw: object, f: dataclasses.Field, owner: str) -> object:
    """Convert a CLI/config value to the type of a dataclass field."""
    default = f.default if f.default is not dataclasses.MISSING else None
    kind = type(default) if default is not None else str
    if isinstance(raw, kind) and not (kind is int and isinstance(raw, bool)):
        return raw
    text = str(raw).strip()
    try:
        if kind is bool:
            if text.lower() in {"1", "true", "yes", "on"}:
                return True
            if text.lower() in {"0", "false", "no", "off"}:
                return False
            raise ValueError(text)
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
    except ValueError:
        raise UsageError(
            f"{owner}: parameter '{f.name}' expects {kind.__name__}, got '{text}'"
        ) from None
    return text
