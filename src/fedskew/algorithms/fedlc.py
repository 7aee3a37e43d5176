"""FedLC (Zhang et al., ICML 2022): federated learning with logit calibration.

Local training shifts every logit by a class-count margin before the softmax
cross-entropy: f~_c = f_c - tau * n_c^(-1/4), with n_c the client's count of class c, so
rare local classes get a larger margin. Evaluation uses the plain logits.

Denominator: the paper writes the loss as -log(e^{f~_y} / sum_{c != y} e^{f~_c}), the true
class left out of the denominator. That loss is unbounded below (raising f~_y alone drives
it to -infinity), and FL-bench reports that it collapsed in training; we follow FL-bench
and keep y in the denominator, i.e. the loss is plain cross-entropy on the calibrated
logits.

Missing classes: n_c = 0 is clamped to ``MISSING_COUNT`` (1e-8, as in FL-bench), a margin
of tau * 100, so those logits are suppressed and hardly pushed down by local training.

The counts never leave the client: messages and server are FedAvg's. Default tau = 1.0
(FL-bench); ``server_lr`` is FedAvg's (1 = plain averaging).
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

MISSING_COUNT = 1e-8


@dataclass
class FedLCParams(FedAvgParams):
    algorithm: ClassVar[str] = "fedlc"
    tau: float = 1.0

    def validate(self) -> None:
        super().validate()
        if self.tau < 0:
            raise UsageError(f"fedlc: tau must be >= 0, got {self.tau}")


def calibration_margins(class_counts: torch.Tensor, tau: float) -> torch.Tensor:
    """(C,) margins tau * n_c^(-1/4), absent classes counted as MISSING_COUNT."""
    counts = class_counts.to(torch.float64).clamp(min=MISSING_COUNT)
    return (tau * counts.pow(-0.25)).to(torch.get_default_dtype())


class FedLCClient(ClientLogic):
    def on_train(self, msg: Message, ctx: ClientContext) -> Message:
        return run_plain(self.plain_train(msg, ctx), ctx)

    def plain_train(self, msg: Message, ctx: ClientContext) -> PlainTraining:
        """Load the global model; the client's margins go with its training."""
        set_arrays(ctx.model, msg.arrays)
        margins = calibration_margins(ctx.data.class_counts(), self.params.tau)
        return PlainTraining(
            lambda result: trained_reply(ctx, result.mean_loss),
            loss=self.loss,
            tensors={"margins": margins},
        )

    def loss(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, t: Mapping[str, torch.Tensor]
    ) -> LossOutput:
        features = model.body(x)
        logits = model.head(features)
        return LossOutput(F.cross_entropy(logits - t["margins"], y), features, logits)


class FedLC(Algorithm):
    name = "fedlc"
    description = "FedLC: logit calibration, CE on f_c - tau * n_c^(-1/4) with local counts n_c"
    Params = FedLCParams
    Server = FedAvgServer
    Client = FedLCClient
    client_state = classmethod(keeps_nothing)
    privacy = AVERAGED_UPDATES  # its server is FedAvg's
