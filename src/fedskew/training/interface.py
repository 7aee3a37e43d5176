"""The algorithm interface: what an algorithm file implements and what its code is given.

An algorithm is hyper-parameters (a dataclass with the paper's names and defaults), a
server logic that plays a round over a ``Channel`` (``fedskew.training.protocol``), and a client
logic whose handlers ``on_<kind>`` answer messages. The engines call ``ClientLogic.handle``
and ``ServerLogic.round``; nothing else of an algorithm is visible to them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from fedskew.config import params_from_values
from fedskew.core.errors import UsageError
from fedskew.core.rng import torch_rng
from fedskew.data.federated import ClientData
from fedskew.training.protocol import ArraySpec, Channel, ClientState, Message, ScalarSpec
from fedskew.training.state_spec import Spec, StatePart

if TYPE_CHECKING:
    from fedskew.training.privacy import Privacy


def check_one_of(owner: str, name: str, value: object, choices: tuple[str, ...]) -> None:
    """A string hyper-parameter must be one of ``choices`` (one-line UsageError otherwise)."""
    if value not in choices:
        raise UsageError(f"{owner}: {name} must be one of {', '.join(choices)}, got '{value}'")


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
    precision: str = (
        "fp32"  # forward passes in fp32 or under bf16 autocast (fedskew.core.precision)
    )
    # The local step replayed as a CUDA graph: "auto"/"on" where the device is CUDA and the
    # step graph-safe, "off" never (fedskew.training.graph_step).
    cuda_graphs: str = "auto"


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

    def summand(self, sent: Message, reply: Message) -> Message:
        """What this client puts into a summed exchange (secure aggregation, DP:
        ``fedskew.training.privacy``), from the message ``sent`` and the reply its handler
        made: the arrays to sum and the numbers the server may see in clear. By default its
        update, the reply's array minus the one sent, for every floating-point array sent
        (the trained model's change), and its sample count. A method whose reply holds
        something else under the model's names (FedNova's normalised update) overrides it."""
        arrays = {
            k: reply.arrays[k] - v
            for k, v in sent.arrays.items()
            if v.is_floating_point() and k in reply.arrays
        }
        return Message(
            reply.kind, arrays=arrays, scalars={"num_samples": reply.scalars["num_samples"]}
        )

    def personal_model(self, ctx: ClientContext) -> torch.nn.Module | None:
        """The model this client would predict with, for a method that keeps a personal part
        on the client (``ctx.model`` holds the global model's weights already), or None: no
        personal part (the default), or none yet for this client. Local evaluation
        (``--local-test-fraction``) reports its accuracy as the personalised accuracy. It
        must not change ``ctx.state``."""
        return None


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
    privacy: Privacy | None = None  # secure aggregation and DP, where the run asks for them

    def is_eval_round(self, rnd: int) -> bool:
        """Whether the experiment evaluates after round ``rnd`` (0-based)."""
        return (rnd + 1) % self.eval_every == 0 or rnd + 1 == self.rounds


class ServerLogic:
    """Server side of an algorithm. Keeps the global model as named tensors."""

    # The attributes besides ``global_arrays`` that a resumed run needs (SCAFFOLD's c,
    # FedFM's anchors, ...): the checkpoint saves and restores exactly these, and a resume
    # checks each against the fresh server's value or ``Algorithm.checkpoint_specs``.
    checkpoint_fields: ClassVar[tuple[str, ...]] = ()

    def __init__(self, params: Any, setup: ServerSetup) -> None:
        self.params = params
        self.setup = setup
        self.global_arrays: dict[str, torch.Tensor] = {
            k: v.detach().clone() for k, v in setup.initial_arrays.items()
        }

    def round(self, rnd: int, clients: list[int], channel: Channel) -> dict[str, float]:
        """Run one round with the given clients; return metrics to log."""
        raise NotImplementedError

    def takes_device_replies(self) -> bool:
        """Whether this round's replies may keep their arrays on the device the clients
        trained on (the in-process engine on a GPU) instead of coming to host memory: then
        ``round`` must compute with them where they are and put what it keeps (the global
        model, its own state) where that lives. Off unless a server says it can (FedAvg's):
        10 replies of an 11 M-parameter model are 450 MB each way across PCIe per round."""
        return False

    @staticmethod
    def mean_train_loss(replies: Mapping[int, Message], clients: list[int]) -> float:
        """The ``train_loss`` metric: the mean of the replies' ``loss`` over ``clients``."""
        return sum(replies[c].scalars["loss"] for c in clients) / len(clients)

    def eval_arrays(self) -> dict[str, torch.Tensor]:
        """The model the evaluation should score (the global model unless overridden)."""
        return self.global_arrays


@dataclass(frozen=True)
class RunShape:
    """What decides whether a mechanism gets to act within a run: its length and shape."""

    rounds: int
    local_epochs: int
    clients_per_round: int


@dataclass(frozen=True)
class InactiveMechanism:
    """A mechanism of a method that never acts within a run, so that the run trains as a
    plainer method does (FedFM launched after the last round is FedAvg). A run records
    these (config.json, ``resolved.inactive_mechanisms``) and the reports mark its rows."""

    mechanism: str  # what never acts, e.g. "feature matching"
    options: dict[str, Any]  # the values that keep it off, e.g. {"start_round": 20, "rounds": 6}
    reason: str  # why, in a few words: "it starts in round 21"

    def record(self) -> dict[str, Any]:
        return {"mechanism": self.mechanism, "options": dict(self.options), "reason": self.reason}

    def line(self) -> str:
        values = ", ".join(f"{k}={v}" for k, v in self.options.items())
        return f"{self.mechanism} never acts in this run ({values}): {self.reason}"


def starts_too_late(
    mechanism: str, first_round: int, shape: RunShape, options: Mapping[str, Any], consequence: str
) -> list[InactiveMechanism]:
    """The mechanism, when the first round it acts in (0-based) is past the run's last."""
    if first_round < shape.rounds:
        return []
    return [
        InactiveMechanism(
            mechanism,
            {**options, "rounds": shape.rounds},
            f"it first acts in round {first_round + 1}, the run has {shape.rounds}; " + consequence,
        )
    ]


class Algorithm:
    """An algorithm: hyper-parameters, a server logic and a client logic."""

    name: ClassVar[str]
    description: ClassVar[str]
    Params: ClassVar[type]
    Server: ClassVar[type[ServerLogic]]
    Client: ClassVar[type[ClientLogic]]
    # Whether a reply holding an array for every entry of the model's state is the client's
    # trained model (what the run loop's local-model metrics score). False where replies
    # carry arrays named like the model's that are something else (FedNova's normalised
    # updates).
    replies_carry_local_models: ClassVar[bool] = True
    # Which privacy mechanisms (fedskew.training.privacy) the method's server supports: None
    # where it does, else why not, in a few words after the method's name ("reads each
    # client's anchors"). A server supports them when all it needs of the clients' models is
    # their (weighted) mean, and implements the summed exchange (FedAvg's server).
    privacy: ClassVar[dict[str, str | None]] = {
        "secure_aggregation": "reads each client's reply, not only the sum of their updates",
        "dp": "reads each client's reply, not only the mean of their updates",
    }

    @classmethod
    def adapt_model(cls, params: Any, model: torch.nn.Module) -> torch.nn.Module:
        """Change the architecture where the method needs it (MOON's projection head,
        FedNH's prototype classifier). Called on every model the engine builds, before
        the initial weights are taken, so server and clients share one architecture."""
        return model

    @classmethod
    def reply_arrays(
        cls, params: Any, model: torch.nn.Module, num_classes: int
    ) -> Mapping[str, ArraySpec] | None:
        """The arrays a client adds to its replies beyond the model's entries and the arrays
        it was sent (e.g. FedFM's local anchors), by name; also one sent back under a
        received array's name with another shape (FedProto's prototypes). An engine whose
        replies cannot be trusted (Flower) rejects a reply holding any other array or one
        that does not fit its spec, so an algorithm whose clients add arrays must declare
        them here; ``None`` leaves such arrays unchecked."""
        return {}

    @classmethod
    def reply_scalars(cls, params: Any) -> Mapping[str, ScalarSpec]:
        """The range of each number the server reads from replies beyond ``num_samples``
        (which is checked against the client's size), by name: FedNova's step count must be
        above 0, FedACD's divergence at least 0. An engine whose replies cannot be trusted
        (Flower) rejects a reply with a number outside its range like a lost one."""
        return {}

    @classmethod
    def checkpoint_specs(
        cls, params: Any, model: torch.nn.Module, num_classes: int
    ) -> Mapping[str, Spec]:
        """What the server's ``checkpoint_fields`` hold after some rounds, by name, for the
        fields whose value in a freshly built server does not show it: None before the first
        anchors (``OrNone``), an empty dict that fills with a value per client
        (``PerClient``). A resume checks every other field against the fresh server's value
        (``fedskew.training.state_spec.spec_of``)."""
        return {}

    @classmethod
    def client_state(
        cls, params: Any, model: torch.nn.Module, num_classes: int
    ) -> tuple[StatePart, ...] | None:
        """The parts of the state (``ctx.state``) a client may hold at the end of a round,
        with which clients must hold each; a resume refuses a checkpoint whose client
        states hold anything else, a part in pieces or of another shape, or lack a part a
        client must hold. ``()``: the clients keep nothing. ``None`` (the default, for
        algorithms that say nothing): only checked to be tensors and finite numbers."""
        return None

    @classmethod
    def inactive_mechanisms(cls, params: Any, shape: RunShape) -> list[InactiveMechanism]:
        """The method's mechanisms that the options and the run's shape keep from ever acting
        (a launch round after the last round, a period longer than the run, an exchange
        that needs two clients with one per round). An option set to its documented off
        value (a weight of 0) is the user's stated choice and is not listed. The run warns
        of each at its start and records them; the reports mark the runs' rows."""
        return []

    @classmethod
    def make_params(cls, values: Mapping[str, object]) -> Any:
        """Build the Params dataclass from user values, coercing strings and naming mistakes."""
        return params_from_values(cls.Params, values, f"algorithm '{cls.name}'", cls.name)


def keeps_nothing(
    cls: type[Algorithm], params: Any, model: torch.nn.Module, num_classes: int
) -> tuple[StatePart, ...]:
    """``Algorithm.client_state`` of a method whose clients keep nothing between messages:
    ``client_state = classmethod(keeps_nothing)``."""
    return ()
