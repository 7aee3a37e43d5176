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

Secure aggregation: the server needs ``sum_i p_i d_i`` (and the buffers' weighted mean),
a sample-weighted mean, and ``tau_eff``, from each client's ``a_i`` in clear (a function of
its size, the epochs and the batch size, all of which the server knows). So each client
sums its ``d_i`` (its buffers' change for the buffers) and sends ``a_i`` beside. Differential
privacy is refused: the mean is weighted by sample counts and scaled by the step counts,
which DP-FedAvg's noise calibration (equal weights, one clip norm) does not cover.
"""

from __future__ import annotations

import math
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
    ServerSetup,
    keeps_nothing,
)
from fedskew.training.local import (
    PlainTraining,
    TrainResult,
    get_arrays,
    run_plain,
    set_arrays,
    trained_needs,
    trained_reply,
)
from fedskew.training.privacy import PrivateAggregation, moved
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
    def __init__(self, params: FedNovaParams, setup: ServerSetup) -> None:
        super().__init__(params, setup)
        self.private = PrivateAggregation.install(self)  # None without secure aggregation

    def round(self, rnd: int, clients: list[int], channel: Channel) -> dict[str, float]:
        if self.private is not None:
            return self.secure_round(rnd, clients, channel)
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

    def typical_a(self) -> float:
        """a of a client of mean size: d_i is summed times it, so that it is about as large
        as a model update and SecAgg+'s quantisation (steps of 2R/Q) keeps its precision.
        Known to both sides: the message says it."""
        sizes = self.setup.client_sizes
        mean = sum(sizes) / max(1, len(sizes))
        train = self.setup.train
        steps = train.epochs * max(1, math.ceil(mean / train.batch_size))
        return max(1.0, momentum_normaliser(steps, train.momentum))

    def secure_round(self, rnd: int, clients: list[int], channel: Channel) -> dict[str, float]:
        """The round over a secure sum: sum_i p_i d_i and the buffers' mean change come
        summed; each a_i in clear."""
        assert self.private is not None
        msg = Message("train", arrays=self.global_arrays)
        summed = self.private.exchange(
            channel, rnd, clients, msg, self.privacy_state, ("a",), scale=self.typical_a()
        )
        sizes = {c: r.scalars["num_samples"] for c, r in summed.replies.items()}
        total = sum(sizes.values())
        tau_eff = sum(n / total * summed.replies[c].scalars["a"] for c, n in sizes.items())
        update, metrics = self.private.finish(rnd, summed, self.privacy_state)
        trained = set(trained_keys(self.global_arrays))
        # w <- w - tau_eff * sum_i p_i d_i; a buffer <- its weighted mean (old + mean change)
        self.global_arrays = moved(
            self.global_arrays,
            {k: -tau_eff * v if k in trained else v for k, v in update.items()},
        )
        return {**metrics, "tau_eff": tau_eff}


class FedNovaClient(ClientLogic):
    def on_train(self, msg: Message, ctx: ClientContext) -> Message:
        return run_plain(self.plain_train(msg, ctx), ctx)

    def plain_train(self, msg: Message, ctx: ClientContext) -> PlainTraining:
        """Load the global model; after plain local training, reply with the normalised
        update d_i and a_i."""
        set_arrays(ctx.model, msg.arrays)

        def finish(result: TrainResult) -> Message:
            a = momentum_normaliser(result.steps, ctx.train.momentum)
            local = get_arrays(ctx.model)
            arrays = {
                k: ((msg.arrays[k] - v) / a if a > 0 else torch.zeros_like(v))
                if is_trained(k, v)
                else v
                for k, v in local.items()
            }
            return trained_reply(ctx, result.mean_loss, arrays, {"a": a})

        return PlainTraining(finish)

    def summand(self, sent: Message, reply: Message) -> Message:
        """d_i for the trained entries (already an update), the change of the buffers; a_i
        beside the sample count."""
        arrays = {
            k: v if is_trained(k, v) else v - sent.arrays[k]
            for k, v in reply.arrays.items()
            if v.is_floating_point()
        }
        scalars = {"num_samples": reply.scalars["num_samples"], "a": reply.scalars["a"]}
        return Message(reply.kind, arrays=arrays, scalars=scalars)


class FedNova(Algorithm):
    name = "fednova"
    description = "FedNova: updates normalised by each client's (momentum-corrected) step count"
    Params = FedNovaParams
    Server = FedNovaServer
    Client = FedNovaClient
    client_state = classmethod(keeps_nothing)
    replies_carry_local_models = False  # they carry (w - y) / a, not the local model y
    privacy = {
        "secure_aggregation": None,
        "dp": "weighs the clients' updates by sample counts and scales their mean by the step "
        "counts (tau_eff), which DP-FedAvg's noise calibration does not cover",
    }

    @classmethod
    def reply_scalars(cls, params: Any) -> dict[str, ScalarSpec]:
        # 0 only for a client that took no step; the server cannot bound it from above
        # without the client's step count (SECURITY.md).
        return {"a": ScalarSpec(low=0.0)}
