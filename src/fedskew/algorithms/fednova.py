"""FedNova (Wang et al., NeurIPS 2020): normalised averaging of local updates.

Client ``i`` runs ``tau_i`` local steps from the global model ``w`` and sends its normalised
update ``d_i = (w - y_i) / a_i``, where ``a_i`` is the sum of the coefficients with which the
local optimiser applied its gradients. With SGD momentum ``rho`` (the momentum buffer starts at
zero every round, as ``train_client`` builds a fresh optimiser)::

    a_i = 1/(1 - rho) * [tau_i - rho (1 - rho^tau_i) / (1 - rho)]    (plain SGD: a_i = tau_i)

The server moves ``w <- w - tau_eff * sum_i p_i d_i`` with ``tau_eff = sum_i p_i a_i`` and
``p_i = n_i / n`` over the sampled clients (those whose reply arrived). Clients that run more
steps (more data, or more epochs) thus no longer pull the average towards their own optimum:
each contributes its per-step direction, and the global step size is the weighted mean number
of steps.

Weight decay is treated as part of the local objective's gradient: it changes the gradient the
optimiser sees, not how many times (with which coefficients) gradients are applied, so ``a_i``
does not depend on it. This matches the paper, whose normaliser depends only on the optimiser's
step rule.

Buffers that no gradient moves (BatchNorm running statistics) are not updates of the
optimiser: clients send them as they are and the server averages them with the weights ``p_i``.

FedNova has no hyper-parameter of its own: ``tau_i`` and ``rho`` come from the local
training settings (``--local-epochs``, ``--batch-size``, ``--momentum``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fedskew.training.aggregation import weighted_average
from fedskew.training.interface import (
    Algorithm,
    ClientContext,
    ClientLogic,
    ServerLogic,
    keeps_nothing,
)
from fedskew.training.local import (
    get_arrays,
    set_arrays,
    train_client,
    trained_needs,
    trained_reply,
)
from fedskew.training.protocol import Channel, Message, ScalarSpec, arrived

# BatchNorm keeps these as buffers; the forward pass moves them, not the optimiser.
_RUNNING_STATS = ("running_mean", "running_var", "num_batches_tracked")


def is_trained(name: str, tensor: torch.Tensor) -> bool:
    """Whether a state-dict entry is moved by the optimiser (a trainable variable).

    The server only has the state dict, not the model, so it tells variables from buffers
    by this rule; clients apply the same rule so that both sides agree on the keys.
    SCAFFOLD and FedDyn share it.
    """
    return tensor.is_floating_point() and not name.endswith(_RUNNING_STATS)


def trained_keys(arrays: Mapping[str, torch.Tensor]) -> list[str]:
    return [k for k, v in arrays.items() if is_trained(k, v)]


def momentum_normaliser(tau: int, rho: float) -> float:
    """FedNova's ``a``: the sum of the coefficients of ``tau`` momentum-SGD steps.

    Step ``t`` (1-based) moves the weights by ``lr * sum_{j<t} rho^j g_{t-j}``, so gradient
    ``g_s`` enters the total displacement with ``1 + rho + ... + rho^(tau - s)``; summed over
    ``s`` that is the closed form below. With ``rho = 0`` it is ``tau``.
    """
    if tau <= 0:
        return 0.0
    if rho == 0.0:
        return float(tau)
    return (tau - rho * (1.0 - rho**tau) / (1.0 - rho)) / (1.0 - rho)


@dataclass
class FedNovaParams:
    def validate(self) -> None:
        pass


class FedNovaServer(ServerLogic):
    def round(self, rnd: int, clients: list[int], channel: Channel) -> dict[str, float]:
        replies = channel.exchange(
            {c: Message("train", arrays=self.global_arrays) for c in clients},
            trained_needs(self.global_arrays, "num_samples", "a"),
        )
        clients = arrived(clients, replies)
        sizes = [replies[c].scalars["num_samples"] for c in clients]
        total = sum(sizes)
        p = [n / total for n in sizes]
        a = [replies[c].scalars["a"] for c in clients]
        tau_eff = sum(pi * ai for pi, ai in zip(p, a, strict=True))
        keys = trained_keys(self.global_arrays)
        direction = weighted_average([{k: replies[c].arrays[k] for k in keys} for c in clients], p)
        new = weighted_average(
            [{k: v for k, v in replies[c].arrays.items() if k not in direction} for c in clients],
            p,
        )
        for k in keys:
            old = self.global_arrays[k]
            new[k] = (old.double() - tau_eff * direction[k].double()).to(old.dtype)
        self.global_arrays = new
        return {
            "train_loss": self.mean_train_loss(replies, clients),
            "tau_eff": tau_eff,
        }


class FedNovaClient(ClientLogic):
    def on_train(self, msg: Message, ctx: ClientContext) -> Message:
        set_arrays(ctx.model, msg.arrays)
        result = train_client(ctx)
        a = momentum_normaliser(result.steps, ctx.train.momentum)
        local = get_arrays(ctx.model)
        arrays = {
            k: ((msg.arrays[k] - v) / a if a > 0 else torch.zeros_like(v))
            if is_trained(k, v)
            else v
            for k, v in local.items()
        }
        return trained_reply(ctx, result.mean_loss, arrays, {"a": a})


class FedNova(Algorithm):
    name = "fednova"
    description = "FedNova: updates normalised by each client's (momentum-corrected) step count"
    Params = FedNovaParams
    Server = FedNovaServer
    Client = FedNovaClient
    client_state = classmethod(keeps_nothing)
    replies_carry_local_models = False  # they carry (w - y) / a, not the local model y

    @classmethod
    def reply_scalars(cls, params: Any) -> dict[str, ScalarSpec]:
        # 0 only for a client that took no step; the server cannot bound it from above
        # without the client's step count (SECURITY.md).
        return {"a": ScalarSpec(low=0.0)}
