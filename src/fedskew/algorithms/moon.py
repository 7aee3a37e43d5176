"""MOON (Li, He & Song, CVPR 2021): model-contrastive local training.

The model gets a projection head between the body and the classifier: the head is
``projection`` (Linear d->d, ReLU, Linear d->``out_dim``) followed by ``classifier``
(Linear ``out_dim``->C), so ``model.body(x)`` stays the feature extractor,
``z = model.head.projection(features)`` is MOON's representation and the logits are
``model.head.classifier(z)``. Server and messages are FedAvg's (the whole model, which is
bigger by the projection head).

Local loss: CE(logits, y) + ``mu`` * l_con with

    l_con = -log( e^{cos(z, z_glob)/tau} / (e^{cos(z, z_glob)/tau} + e^{cos(z, z_prev)/tau}) )

averaged over the batch, where z_glob comes from the global model received this round and
z_prev from the model this client uploaded the last time it trained (kept in
``ctx.state``; the official code keeps one previous model, ``model_buffer_size`` = 1).
Both are frozen copies in eval mode, as in the official code.

First participation: no previous model exists. The official code then has an empty model
pool in its first round, so the contrastive term is zero with no gradient; FL-bench uses
the global model as the previous one. We do the latter: z_prev = z_glob, which makes
l_con exactly log 2 with zero gradient, so training equals the official first round
(the logged loss includes the constant mu * log 2; the frozen passes are skipped then).

Defaults: tau = 0.5, mu = 5 (the paper's value for CIFAR-10; use mu = 1 for CIFAR-100 and
Tiny-ImageNet), out_dim = 256. ``server_lr`` is FedAvg's (1 = plain averaging).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from fedskew.algorithms.fedavg import AVERAGED_UPDATES, FedAvgParams, FedAvgServer
from fedskew.core.errors import UsageError
from fedskew.core.precision import in_fp32
from fedskew.training.interface import (
    Algorithm,
    ClientContext,
    ClientLogic,
    InactiveMechanism,
    RunShape,
    starts_too_late,
)
from fedskew.training.local import (
    LossOutput,
    PlainTraining,
    TrainResult,
    frozen_copy,
    get_arrays,
    run_plain,
    set_arrays,
    trained_reply,
)
from fedskew.training.protocol import Message
from fedskew.training.state_spec import StatePart, after_training, model_part

PREV = "moon.prev."  # client-state prefix of the previous local model
LOG2 = math.log(2.0)


@dataclass
class MoonParams(FedAvgParams):
    algorithm: ClassVar[str] = "moon"
    mu: float = 5.0
    tau: float = 0.5
    out_dim: int = 256

    def validate(self) -> None:
        super().validate()
        if self.mu < 0:
            raise UsageError(f"moon: mu must be >= 0, got {self.mu}")
        if self.tau <= 0:
            raise UsageError(f"moon: tau must be > 0, got {self.tau}")
        if self.out_dim < 1:
            raise UsageError(f"moon: out_dim must be >= 1, got {self.out_dim}")


@in_fp32
def model_contrastive_loss(
    z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, tau: float
) -> torch.Tensor:
    """Batch mean of MOON's l_con: a two-way softmax with the global z as the positive."""
    pos = F.cosine_similarity(z, z_glob, dim=-1)
    neg = F.cosine_similarity(z, z_prev, dim=-1)
    logits = torch.stack([pos, neg], dim=1) / tau
    return F.cross_entropy(logits, torch.zeros(len(z), dtype=torch.long, device=z.device))


def projection_head(feature_dim: int, out_dim: int, num_classes: int, bias: bool) -> nn.Module:
    projection = nn.Sequential(
        OrderedDict(
            fc1=nn.Linear(feature_dim, feature_dim),
            relu=nn.ReLU(),
            fc2=nn.Linear(feature_dim, out_dim),
        )
    )
    classifier = nn.Linear(out_dim, num_classes, bias=bias)
    return nn.Sequential(OrderedDict(projection=projection, classifier=classifier))


GLOBAL_T, PREV_T = "global/", "prev/"  # PlainTraining.tensors: the frozen models' weights


class _Representation(nn.Module):
    """A frozen model's MOON representation, ``head.projection(body(x))``, as a forward
    that ``functional_call`` can run with any client's weights."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = frozen_copy(model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.head.projection(self.model.body(x))


class MoonClient(ClientLogic):
    def __init__(self, params: MoonParams) -> None:
        super().__init__(params)
        self._frozen: _Representation | None = None

    def on_train(self, msg: Message, ctx: ClientContext) -> Message:
        return run_plain(self.plain_train(msg, ctx), ctx)

    def plain_train(self, msg: Message, ctx: ClientContext) -> PlainTraining:
        """Load the global model; the global and previous models' weights go with the
        training as the frozen models' (none for the previous one at first participation);
        then keep the trained model as the next previous one."""
        set_arrays(ctx.model, msg.arrays)
        if self._frozen is None:
            self._frozen = _Representation(ctx.model)
        names = list(ctx.model.state_dict())
        frozen = {GLOBAL_T + k: msg.arrays[k] for k in names}
        if any(k.startswith(PREV) for k in ctx.state.arrays):
            frozen.update({PREV_T + k: ctx.state.arrays[PREV + k] for k in names})

        def finish(result: TrainResult) -> Message:
            arrays = get_arrays(ctx.model)
            for k, v in arrays.items():
                ctx.state.arrays[PREV + k] = v.clone()
            return trained_reply(ctx, result.mean_loss, arrays)

        return PlainTraining(finish, loss=self.loss, tensors=frozen)

    def loss(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, frozen: Mapping[str, torch.Tensor]
    ) -> LossOutput:
        """CE + mu * l_con, z_glob and z_prev from the frozen representation run with the
        weights in ``frozen``."""
        features = model.body(x)
        z = model.head.projection(features)
        logits = model.head.classifier(z)
        mu = self.params.mu
        glob = {"model." + k[len(GLOBAL_T) :]: v for k, v in frozen.items() if k[:7] == GLOBAL_T}
        prev = {"model." + k[len(PREV_T) :]: v for k, v in frozen.items() if k[:5] == PREV_T}
        if not prev:
            # z_prev = z_glob: l_con is log 2 whatever z is, so skip both frozen passes.
            return LossOutput(F.cross_entropy(logits, y) + mu * LOG2, features, logits)
        assert self._frozen is not None
        with torch.no_grad():
            z_glob = functional_call(self._frozen, glob, (x,))
            z_prev = functional_call(self._frozen, prev, (x,))
        tau = self.params.tau
        loss = F.cross_entropy(logits, y) + mu * model_contrastive_loss(z, z_glob, z_prev, tau)
        return LossOutput(loss, features, logits)


class Moon(Algorithm):
    name = "moon"
    description = (
        "MOON: projection head + model-contrastive loss (global z positive, previous z negative)"
    )
    Params = MoonParams
    Server = FedAvgServer
    Client = MoonClient
    privacy = AVERAGED_UPDATES  # its server is FedAvg's

    @classmethod
    def adapt_model(cls, params: MoonParams, model: nn.Module) -> nn.Module:
        old = model.head
        if not isinstance(old, nn.Linear):
            raise UsageError("moon: the model's head must be a linear classifier")
        # Keep the architecture's bias choice (cnn-cifar's classifier has none).
        model.head = projection_head(
            model.feature_dim, params.out_dim, old.out_features, old.bias is not None
        )
        return model

    @classmethod
    def client_state(
        cls, params: MoonParams, model: nn.Module, num_classes: int
    ) -> tuple[StatePart, ...]:
        """The previous local model: every client that has trained holds it."""
        return (model_part(PREV, model, holds=after_training),)

    @classmethod
    def inactive_mechanisms(cls, params: MoonParams, shape: RunShape) -> list[InactiveMechanism]:
        """The contrastive term in a one-round run: a client's first round has no previous
        model, and the term then has no gradient (see the module docstring)."""
        if params.mu == 0:
            return []
        return starts_too_late(
            "model-contrastive term", 1, shape, {"mu": params.mu},
            "a client's first round has no previous model, so the term has no gradient",
        )  # fmt: skip
