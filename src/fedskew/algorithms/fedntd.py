"""FedNTD (Lee et al., NeurIPS 2022): not-true distillation from the global model.

Local loss: CE(f, y) + beta * tau^2 * KL(q~_glob || q~_local), where q~ is the softmax at
temperature tau over the not-true classes only (the true class's logit is removed, not
masked to a value), q~_glob comes from a frozen copy of the global model received this
round, and KL is summed over classes and averaged over the batch (``batchmean``, as in the
official code). The global copy runs in eval mode, as MOON's frozen models do (the
official FedNTD code sets no mode on its copy; it matters only for BatchNorm/dropout).

Messages and server are FedAvg's. Defaults: tau = 1, beta = 1; ``server_lr`` is FedAvg's
(1 = plain averaging).
"""

from __future__ import annotations

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
from fedskew.training.interface import Algorithm, ClientContext, ClientLogic, keeps_nothing
from fedskew.training.local import (
    LossOutput,
    PlainTraining,
    frozen_copy,
    run_plain,
    set_arrays,
    trained_reply,
)
from fedskew.training.protocol import Message


@dataclass
class FedNTDParams(FedAvgParams):
    algorithm: ClassVar[str] = "fedntd"
    tau: float = 1.0
    beta: float = 1.0

    def validate(self) -> None:
        super().validate()
        if self.tau <= 0:
            raise UsageError(f"fedntd: tau must be > 0, got {self.tau}")
        if self.beta < 0:
            raise UsageError(f"fedntd: beta must be >= 0, got {self.beta}")


def not_true_logits(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(N, C-1) logits without each row's true class, other classes in their order.

    A gather (column j of a row is class j, or j + 1 from its true class on), not a boolean
    mask, whose size the GPU would have to report to the host at every step."""
    others = torch.arange(logits.shape[1] - 1, device=logits.device)
    columns = others[None, :] + (others[None, :] >= y[:, None]).long()
    return logits.gather(1, columns)


@in_fp32
def not_true_distillation(
    logits: torch.Tensor, global_logits: torch.Tensor, y: torch.Tensor, tau: float
) -> torch.Tensor:
    """tau^2 * KL(q~_glob || q~_local) over the not-true classes, batch mean."""
    log_q = F.log_softmax(not_true_logits(logits, y) / tau, dim=1)
    log_q_glob = F.log_softmax(not_true_logits(global_logits, y) / tau, dim=1)
    # F.kl_div(log_q, log_q_glob, reduction="batchmean", log_target=True) written out as aten
    # computes it (the same values and gradients, bit for bit on the CPU): kl_div has no vmap
    # batching rule, so clients trained together would run it client by client.
    kl = (log_q_glob.exp() * (log_q_glob - log_q)).sum() / log_q.shape[0]
    return tau**2 * kl


class FedNTDClient(ClientLogic):
    def __init__(self, params: FedNTDParams) -> None:
        super().__init__(params)
        self._global: nn.Module | None = None

    def on_train(self, msg: Message, ctx: ClientContext) -> Message:
        return run_plain(self.plain_train(msg, ctx), ctx)

    def plain_train(self, msg: Message, ctx: ClientContext) -> PlainTraining:
        """Load the global model; its weights also go with the training, as the teacher's."""
        set_arrays(ctx.model, msg.arrays)
        if self._global is None:
            self._global = frozen_copy(ctx.model)
        teacher = {k: msg.arrays[k] for k in self._global.state_dict()}
        return PlainTraining(
            lambda result: trained_reply(ctx, result.mean_loss), loss=self.loss, tensors=teacher
        )

    def loss(
        self,
        model: nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        teacher: Mapping[str, torch.Tensor],
    ) -> LossOutput:
        """CE + beta * NTD, the global logits from the frozen copy run with ``teacher``'s
        weights (the architecture alone is this logic's: the weights are the client's)."""
        assert self._global is not None
        features = model.body(x)
        logits = model.head(features)
        with torch.no_grad():
            global_logits = functional_call(self._global, dict(teacher), (x,))
        ntd = not_true_distillation(logits, global_logits, y, self.params.tau)
        return LossOutput(F.cross_entropy(logits, y) + self.params.beta * ntd, features, logits)


class FedNTD(Algorithm):
    name = "fedntd"
    description = (
        "FedNTD: CE + not-true distillation (KL on non-target classes) from the global model"
    )
    Params = FedNTDParams
    Server = FedAvgServer
    Client = FedNTDClient
    client_state = classmethod(keeps_nothing)
    privacy = AVERAGED_UPDATES  # its server is FedAvg's
