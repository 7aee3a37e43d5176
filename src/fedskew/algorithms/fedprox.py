"""FedProx (Li et al., MLSys 2020): FedAvg with a proximal term in the local objective.

Each client minimises ``L_k(w) + mu/2 ||w - w_t||^2`` from the global model ``w_t``; the term
pulls local models back towards ``w_t`` and so limits client drift under skew. ``mu`` is the
paper's name (grid {0.001, 0.01, 0.1, 1}); 0.01 is the usual default in label-skew
comparisons. The term covers the trainable parameters, not buffers (BatchNorm statistics).

The server is FedAvg's (sample-weighted averaging; ``server_lr`` 1.0 is plain FedProx).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from fedskew.algorithms.fedavg import AVERAGED_UPDATES, FedAvgParams, FedAvgServer
from fedskew.core.errors import UsageError
from fedskew.training.interface import Algorithm, ClientContext, ClientLogic, keeps_nothing
from fedskew.training.local import (
    LossOutput,
    PlainTraining,
    run_plain,
    set_arrays,
    trained_reply,
)
from fedskew.training.parameter_terms import squared_distance
from fedskew.training.protocol import Message


@dataclass
class FedProxParams(FedAvgParams):
    algorithm: ClassVar[str] = "fedprox"
    mu: float = 0.01

    def validate(self) -> None:
        super().validate()
        if self.mu < 0:
            raise UsageError(f"fedprox: mu must be >= 0, got {self.mu}")


def proximal_loss(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    anchor: Sequence[torch.Tensor],
    mu: float,
) -> LossOutput:
    """Cross-entropy plus ``mu/2 ||w - anchor||^2`` over ``model.parameters()`` (in order)."""
    features = model.body(x)
    logits = model.head(features)
    loss = F.cross_entropy(logits, y)
    if mu:
        # all tensors at once (a few operators, not a few per tensor): runs every local step
        loss = loss + 0.5 * mu * squared_distance(list(model.parameters()), anchor)
    return LossOutput(loss, features, logits)


class FedProxClient(ClientLogic):
    def on_train(self, msg: Message, ctx: ClientContext) -> Message:
        return run_plain(self.plain_train(msg, ctx), ctx)

    def plain_train(self, msg: Message, ctx: ClientContext) -> PlainTraining:
        """Load the global model, which is also the anchor of the proximal term."""
        set_arrays(ctx.model, msg.arrays)
        anchor = {k: p.detach().clone() for k, p in ctx.model.named_parameters()}
        return PlainTraining(
            lambda result: trained_reply(ctx, result.mean_loss), loss=self.loss, tensors=anchor
        )

    def loss(
        self,
        model: torch.nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        anchor: Mapping[str, torch.Tensor],
    ) -> LossOutput:
        return proximal_loss(model, x, y, list(anchor.values()), self.params.mu)


class FedProx(Algorithm):
    name = "fedprox"
    description = "FedProx: FedAvg with a proximal term mu/2 ||w - w_global||^2 in local training"
    Params = FedProxParams
    Server = FedAvgServer
    Client = FedProxClient
    client_state = classmethod(keeps_nothing)
    privacy = AVERAGED_UPDATES  # its server is FedAvg's
