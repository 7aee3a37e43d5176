"""FedDecorr (Shi et al., ICLR 2023): decorrelate the batch's features against
dimensional collapse.

Local loss: CE + beta * L_dec on the body features z (N x d) of each batch, with the
normalisation of the official code:

    z^ = (z - mean_n z) / sqrt(var_n z + 1e-8)     per dimension, var unbiased (N - 1)
    L_dec = (1 / N) * mean_{i != j} ((z^T z^)_ij)^2

i.e. L_dec = N * mean_{i != j} K_ij^2 with K = z^T z^ / N. The paper writes
(1 / d^2) * ||K||_F^2; the official code drops the diagonal (constant up to the variance
estimator) and has the factor N, and its beta values (0.01 to 0.1) go with this form.
A batch of one sample contributes 0.

Messages and server are FedAvg's. Default beta = 0.1; ``server_lr`` is FedAvg's
(1 = plain averaging).
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
from fedskew.core.precision import in_fp32
from fedskew.training.interface import Algorithm, ClientContext, ClientLogic, keeps_nothing
from fedskew.training.local import (
    LossOutput,
    PlainTraining,
    run_plain,
    set_arrays,
    trained_reply,
)
from fedskew.training.protocol import Message

EPS = 1e-8


@dataclass
class FedDecorrParams(FedAvgParams):
    algorithm: ClassVar[str] = "feddecorr"
    beta: float = 0.1

    def validate(self) -> None:
        super().validate()
        if self.beta < 0:
            raise UsageError(f"feddecorr: beta must be >= 0, got {self.beta}")


@in_fp32
def decorrelation_loss(z: torch.Tensor) -> torch.Tensor:
    """(1/N) * mean of the squared off-diagonal entries of z^T z^ (z^ standardised)."""
    n, d = z.shape
    if n < 2 or d < 2:
        return z.sum() * 0.0  # keeps the graph, so backward works on any batch
    centred = z - z.mean(dim=0, keepdim=True)
    standard = centred / torch.sqrt(centred.var(dim=0, keepdim=True) + EPS)
    gram = standard.T @ standard
    # The diagonal multiplied away, not masked out: a boolean mask's size is read back to
    # the host at every step on a GPU. (Subtracting the diagonal's squares instead would
    # cancel: they dominate the sum when the features are nearly decorrelated. The order of the
    # sum differs from the masked mean's: 8e-8 relative, tests/test_host_syncs.py.)
    off_diagonal = 1.0 - torch.eye(d, dtype=gram.dtype, device=gram.device)
    return (gram * off_diagonal).pow(2).sum() / (d * (d - 1)) / n


class FedDecorrClient(ClientLogic):
    def on_train(self, msg: Message, ctx: ClientContext) -> Message:
        return run_plain(self.plain_train(msg, ctx), ctx)

    def plain_train(self, msg: Message, ctx: ClientContext) -> PlainTraining:
        """Load the global model; nothing of the client's goes with its training."""
        set_arrays(ctx.model, msg.arrays)
        return PlainTraining(lambda result: trained_reply(ctx, result.mean_loss), loss=self.loss)

    def loss(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, t: Mapping[str, torch.Tensor]
    ) -> LossOutput:
        features = model.body(x)
        logits = model.head(features)
        loss = F.cross_entropy(logits, y) + self.params.beta * decorrelation_loss(features)
        return LossOutput(loss, features, logits)


class FedDecorr(Algorithm):
    name = "feddecorr"
    description = "FedDecorr: CE + beta * squared off-diagonal correlations of batch features"
    Params = FedDecorrParams
    Server = FedAvgServer
    Client = FedDecorrClient
    client_state = classmethod(keeps_nothing)
    privacy = AVERAGED_UPDATES  # its server is FedAvg's
