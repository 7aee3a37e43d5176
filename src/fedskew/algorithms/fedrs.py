"""FedRS (Li & Zhan, KDD 2021): restricted softmax for label-skewed clients.

During local training the logit of every class the client has no sample of is multiplied
by ``alpha`` before the softmax cross-entropy, p_c ∝ exp(alpha_c * f_c) with alpha_c = 1
for local classes and ``alpha`` otherwise. The whole logit is scaled, bias included, as in
the Flower baseline (the paper's classifier has no bias). Evaluation uses the plain logits.

The local classes come from the client's own data: nothing extra is sent, so messages and
server are FedAvg's. Defaults: alpha = 0.5 (the paper's other setting is 0.9);
``server_lr`` is FedAvg's (1 = plain averaging).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

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
from fedskew.training.protocol import Message


@dataclass
class FedRSParams(FedAvgParams):
    algorithm: ClassVar[str] = "fedrs"
    alpha: float = 0.5

    def validate(self) -> None:
        super().validate()
        if not 0 <= self.alpha <= 1:
            raise UsageError(f"fedrs: alpha must be in [0, 1], got {self.alpha}")


def restriction_factors(class_counts: torch.Tensor, alpha: float) -> torch.Tensor:
    """(C,) factors: 1 for classes with local samples, alpha for absent ones."""
    return torch.where(class_counts > 0, 1.0, alpha)


class FedRSClient(ClientLogic):
    def on_train(self, msg: Message, ctx: ClientContext) -> Message:
        return run_plain(self.plain_train(msg, ctx), ctx)

    def plain_train(self, msg: Message, ctx: ClientContext) -> PlainTraining:
        """Load the global model; the client's restriction factors go with its training."""
        set_arrays(ctx.model, msg.arrays)
        factors = restriction_factors(ctx.data.class_counts(), self.params.alpha)
        return PlainTraining(
            lambda result: trained_reply(ctx, result.mean_loss),
            loss=self.loss,
            tensors={"factors": factors},
        )

    def loss(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, t: Mapping[str, torch.Tensor]
    ) -> LossOutput:
        features = model.body(x)
        logits = model.head(features)
        return LossOutput(F.cross_entropy(logits * t["factors"], y), features, logits)


class FedRS(Algorithm):
    name = "fedrs"
    description = "FedRS: restricted softmax, logits of locally absent classes scaled by alpha"
    Params = FedRSParams
    Server = FedAvgServer
    Client = FedRSClient
    client_state = classmethod(keeps_nothing)
    privacy = AVERAGED_UPDATES  # its server is FedAvg's
