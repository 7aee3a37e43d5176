"""FedROD (Chen & Chao, ICLR 2022): a shared body with a generic and a personal head.

The shared model (body + generic head g) is trained with the balanced-softmax loss
CE(g(h) + gamma * log n_c, y), n_c being the client's class counts: the shift undoes the
client's label prior, so g learns the class-balanced classifier. A class the client lacks
has log 0 = -inf and drops out of the softmax (exactly, not via a tiny count).

A personal linear head p lives ONLY on the client (``ctx.state``): it is trained with
CE(g(h).detach() + p(h.detach()), y), so it learns the client's correction of the generic
logits and sends no gradient into the shared part. It never appears in a message. The
server averages body and generic head as FedAvg does; the engine's evaluation of that model
is the generic accuracy.

Personalised accuracy is measured where p lives: on evaluation rounds the server sets
``evaluate`` in the training message; each client, after training, scores body + g + p on
the uniform test set, weights the per-class accuracies by its own label proportions (a test
set shaped like its data) and returns that one number with its update (8 bytes). The round
metric ``personal_accuracy`` is their plain mean over the round's clients whose reply arrived
(like the average, which leaves out missing replies).

Choices the paper leaves open: p starts at zero, so the personalised logits start equal to
the generic ones (``phead_init=generic`` starts p as a copy of the generic head the client
first receives, as FedNH's code base does); p shares the client's optimiser settings (lr,
momentum, weight decay); the hypernetwork variant of p is not implemented.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from fedskew.core.errors import UsageError
from fedskew.metrics.evaluation import client_distribution_accuracy, evaluate
from fedskew.training.aggregation import weighted_average
from fedskew.training.interface import (
    Algorithm,
    ClientContext,
    ClientLogic,
    ServerLogic,
    check_one_of,
)
from fedskew.training.local import (
    LossOutput,
    PlainTraining,
    TrainResult,
    run_plain,
    set_arrays,
    trained_needs,
    trained_reply,
)
from fedskew.training.protocol import ArraySpec, Channel, Message, ScalarSpec, arrived
from fedskew.training.state_spec import StatePart, after_training

PHEAD_INITS = ("zeros", "generic")
PHEAD_WEIGHT = "personal_head.weight"
PHEAD_BIAS = "personal_head.bias"


@dataclass
class FedRODParams:
    gamma: float = 1.0  # balanced-softmax exponent on the class counts; 0 gives plain CE
    phead_init: str = "zeros"

    def validate(self) -> None:
        if self.gamma < 0:
            raise UsageError(f"fedrod: gamma must be >= 0, got {self.gamma}")
        check_one_of("fedrod", "phead_init", self.phead_init, PHEAD_INITS)


def balanced_shift(counts: torch.Tensor, gamma: float) -> torch.Tensor:
    """gamma * log n_c, with -inf for absent classes (they leave the softmax).

    With gamma = 0 nothing is shifted and nothing removed: 0 * log 0 would be nan.
    """
    counts = counts.to(torch.float32)
    if gamma == 0:
        return torch.zeros_like(counts)
    return torch.where(counts > 0, gamma * counts.clamp(min=1).log(), float("-inf"))


def balanced_softmax_loss(
    logits: torch.Tensor, y: torch.Tensor, shift: torch.Tensor
) -> torch.Tensor:
    # Labels come from the client's own data, so the target logit is never -inf and both
    # the loss and its gradient stay finite (the -inf entries get softmax weight 0).
    return F.cross_entropy(logits + shift, y)


class _Personalised(torch.nn.Module):
    """body + generic head + personal head, for scoring on the client only."""

    def __init__(self, model: torch.nn.Module, weight: torch.Tensor, bias: torch.Tensor) -> None:
        super().__init__()
        self.model = model
        self.weight = weight
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.model.body(x)
        return self.model.head(h) + F.linear(h, self.weight, self.bias)


def personal_accuracy(
    model: torch.nn.Module,
    weight: torch.Tensor,
    bias: torch.Tensor,
    test_x: torch.Tensor,
    test_y: torch.Tensor,
    counts: torch.Tensor,
) -> float:
    """Accuracy of body + g + p on a test set shaped like the client's labels."""
    result = evaluate(_Personalised(model, weight, bias), test_x, test_y, len(counts))
    return client_distribution_accuracy(result.per_class_accuracy, counts.cpu().numpy()[None, :])


class FedRODServer(ServerLogic):
    def round(self, rnd: int, clients: list[int], channel: Channel) -> dict[str, float]:
        scalars = {"evaluate": 1.0} if self.setup.is_eval_round(rnd) else {}
        msg = Message("train", arrays=self.global_arrays, scalars=scalars)
        replies = channel.exchange(
            {c: msg for c in clients}, trained_needs(self.global_arrays, "num_samples")
        )
        clients = arrived(clients, replies)
        self.global_arrays = weighted_average(
            [replies[c].arrays for c in clients],
            [replies[c].scalars["num_samples"] for c in clients],
        )
        metrics = {"train_loss": self.mean_train_loss(replies, clients)}
        scores = [
            replies[c].scalars["personal_accuracy"]
            for c in clients
            if "personal_accuracy" in replies[c].scalars
        ]
        if scores:
            metrics["personal_accuracy"] = sum(scores) / len(scores)
        return metrics


class FedRODClient(ClientLogic):
    params: FedRODParams

    def _personal_head(self, ctx: ClientContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The client's personal head from its state (made on first participation),
        as fresh leaf tensors: the state keeps clones, never the tensors being trained."""
        state = ctx.state.arrays
        if PHEAD_WEIGHT not in state:
            num_classes, dim = ctx.data.num_classes, ctx.model.feature_dim
            dev = ctx.data.device
            weight = torch.zeros(num_classes, dim, device=dev)
            bias = torch.zeros(num_classes, device=dev)
            if self.params.phead_init == "generic":
                head = dict(ctx.model.head.state_dict())
                weight = head["weight"].detach().clone()
                if "bias" in head:
                    bias = head["bias"].detach().clone()
            state[PHEAD_WEIGHT], state[PHEAD_BIAS] = weight, bias
        weight = state[PHEAD_WEIGHT].clone().requires_grad_(True)
        bias = state[PHEAD_BIAS].clone().requires_grad_(True)
        return weight, bias

    def personal_model(self, ctx: ClientContext) -> torch.nn.Module | None:
        """body + generic head + this client's personal head (None before its first round)."""
        state = ctx.state.arrays
        if PHEAD_WEIGHT not in state:
            return None
        return _Personalised(ctx.model, state[PHEAD_WEIGHT], state[PHEAD_BIAS])

    def on_train(self, msg: Message, ctx: ClientContext) -> Message:
        return run_plain(self.plain_train(msg, ctx), ctx)

    def plain_train(self, msg: Message, ctx: ClientContext) -> PlainTraining:
        """Load the global model; the balanced-softmax shift goes with the training and the
        personal head is trained beside the model; then keep the head in the state."""
        set_arrays(ctx.model, msg.arrays)
        counts = ctx.data.class_counts()
        shift = balanced_shift(counts, self.params.gamma)
        p_weight, p_bias = self._personal_head(ctx)

        def finish(result: TrainResult) -> Message:
            ctx.state.arrays[PHEAD_WEIGHT] = p_weight.detach().clone()
            ctx.state.arrays[PHEAD_BIAS] = p_bias.detach().clone()
            scalars: dict[str, float] = {}
            if msg.scalars.get("evaluate") and ctx.test_x is not None and ctx.test_y is not None:
                scalars["personal_accuracy"] = personal_accuracy(
                    ctx.model, p_weight.detach(), p_bias.detach(), ctx.test_x, ctx.test_y, counts
                )
            return trained_reply(ctx, result.mean_loss, scalars=scalars)

        return PlainTraining(
            finish,
            loss=self.loss,
            tensors={"shift": shift},
            trained={"p_weight": p_weight, "p_bias": p_bias},
        )

    def loss(
        self,
        model: torch.nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        tensors: Mapping[str, torch.Tensor],
    ) -> LossOutput:
        features = model.body(x)
        logits = model.head(features)
        generic = balanced_softmax_loss(logits, y, tensors["shift"])
        personal_logits = logits.detach() + F.linear(
            features.detach(), tensors["p_weight"], tensors["p_bias"]
        )
        personal = F.cross_entropy(personal_logits, y)
        # The two terms touch disjoint parameters, so one backward of their sum trains
        # the shared model on BSM alone and p on the personal CE alone.
        return LossOutput(generic + personal, features, logits)


class FedROD(Algorithm):
    name = "fedrod"
    description = (
        "FedROD: balanced-softmax generic head (shared) + personal head kept on the client; "
        "reports personal_accuracy"
    )
    Params = FedRODParams
    Server = FedRODServer
    Client = FedRODClient

    @classmethod
    def reply_scalars(cls, params: Any) -> dict[str, ScalarSpec]:
        return {"personal_accuracy": ScalarSpec(low=0.0, high=1.0)}

    @classmethod
    def client_state(
        cls, params: FedRODParams, model: torch.nn.Module, num_classes: int
    ) -> tuple[StatePart, ...]:
        """The personal head: every client that has trained holds it."""
        head = {
            PHEAD_WEIGHT: ArraySpec((num_classes, model.feature_dim)),
            PHEAD_BIAS: ArraySpec((num_classes,)),
        }
        return (StatePart(head, holds=after_training),)
