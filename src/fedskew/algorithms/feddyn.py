"""FedDyn (Acar et al., ICLR 2021): dynamic regularisation of the local objectives.

Client ``k`` keeps ``g_k``, its last ``grad L_k(theta_k)`` (zeros before it first trains), in
its state. From the server model ``theta`` it minimises::

    L_k(theta') - <g_k, theta'> + alpha/2 ||theta' - theta||^2

reaching ``theta_k``, then sets ``g_k <- g_k - alpha (theta_k - theta)`` (the first-order
optimality condition of that objective) and replies ``theta_k``. The server keeps ``h``
(zeros at first) and, with ``m`` the total number of clients and ``P`` the sampled ones::

    h     <- h - alpha/m * sum_{k in P} (theta_k - theta)
    theta <- mean_{k in P} theta_k - h / alpha

The new ``theta`` is both what clients receive next and what is evaluated, as in the paper's
algorithm. The mean is unweighted (``1/|P|``), as the paper writes. When some replies do not
arrive, ``P`` is the set of clients that replied (both sums and the mean are over it, ``m``
stays the total number of clients), as the formulas read for that smaller sample.

Weight decay and momentum come from the local training settings. The state update is the
optimality condition of the local objective, so it does not depend on the optimiser; with
weight decay the objective the optimiser sees also holds ``wd/2 ||theta'||^2``, whose gradient
the update then attributes to ``g_k`` (the paper's own code trains with weight decay too).
``g_k`` and ``h`` cover trainable variables only; buffers (BatchNorm statistics) are averaged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fedskew.algorithms.fednova import trained_keys
from fedskew.core.errors import UsageError
from fedskew.core.precision import in_fp32
from fedskew.training.aggregation import weighted_average
from fedskew.training.interface import (
    Algorithm,
    ClientContext,
    ClientLogic,
    ServerLogic,
    ServerSetup,
)
from fedskew.training.local import (
    LossOutput,
    PlainTraining,
    TrainResult,
    get_arrays,
    run_plain,
    set_arrays,
    trained_needs,
)
from fedskew.training.parameter_terms import flat, inner
from fedskew.training.protocol import Channel, Message, arrived
from fedskew.training.state_spec import StatePart, after_training, model_part

STATE_PREFIX = "feddyn.grad/"  # the client's g_k in its state


@dataclass
class FedDynParams:
    alpha: float = 0.01

    def validate(self) -> None:
        if self.alpha <= 0:
            raise UsageError(f"feddyn: alpha must be > 0, got {self.alpha}")


def dynamic_loss(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    variables: Sequence[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor]],
    alpha: float,
) -> LossOutput:
    """Cross-entropy minus ``<g_k, theta'>`` plus ``alpha/2 ||theta' - theta||^2``, with
    ``variables`` the triples (parameter theta', its g_k, its server value theta)."""
    features = model.body(x)
    logits = model.head(features)
    loss = F.cross_entropy(logits, y)
    if variables:
        linear, quad = dynamic_terms(variables)
        loss = loss - linear + 0.5 * alpha * quad
    return LossOutput(loss, features, logits)


@in_fp32
def dynamic_terms(
    variables: Sequence[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``<g_k, theta'>`` and ``||theta' - theta||^2`` over the (theta', g_k, theta) triples."""
    # all tensors at once (a few operators, not a few per tensor): runs every local step
    # (the weights concatenated once for both terms: squared_distance would concatenate again)
    params, grads, servers = (list(column) for column in zip(*variables, strict=True))
    w = flat(params)
    d = w - flat(servers)
    return inner(w, flat(grads)), inner(d, d)


class FedDynServer(ServerLogic):
    checkpoint_fields = ("h",)  # server state a resumed run must find

    def __init__(self, params: FedDynParams, setup: ServerSetup) -> None:
        super().__init__(params, setup)
        self.h = {
            k: torch.zeros_like(self.global_arrays[k]) for k in trained_keys(self.global_arrays)
        }

    def round(self, rnd: int, clients: list[int], channel: Channel) -> dict[str, float]:
        replies = channel.exchange(
            {c: Message("train", arrays=self.global_arrays) for c in clients},
            trained_needs(self.global_arrays),
        )
        clients = arrived(clients, replies)  # P is the set that replied, m stays all clients
        models = [replies[c].arrays for c in clients]
        mean = weighted_average(models, [1.0] * len(clients))
        alpha, m = self.params.alpha, self.setup.num_clients
        for k, h in self.h.items():
            drift = torch.stack([s[k] for s in models]).sum(0) - len(models) * self.global_arrays[k]
            self.h[k] = h - (alpha / m) * drift
            mean[k] = mean[k] - self.h[k] / alpha
        self.global_arrays = mean
        return {"train_loss": self.mean_train_loss(replies, clients)}


GRAD, SERVER = "grad/", "server/"  # PlainTraining.tensors: g_k and theta per parameter


class FedDynClient(ClientLogic):
    def on_train(self, msg: Message, ctx: ClientContext) -> Message:
        return run_plain(self.plain_train(msg, ctx), ctx)

    def plain_train(self, msg: Message, ctx: ClientContext) -> PlainTraining:
        """Load the server model; train with ``g_k`` (from the client's state) and ``theta``
        as the loss's tensors; then update ``g_k`` and reply ``theta_k``."""
        set_arrays(ctx.model, msg.arrays)
        params = dict(ctx.model.named_parameters())
        keys = [k for k in trained_keys(msg.arrays) if k in params]
        grads = {
            k: ctx.state.arrays.get(STATE_PREFIX + k, torch.zeros_like(msg.arrays[k])) for k in keys
        }
        tensors = {
            **{GRAD + k: grads[k] for k in keys},
            **{SERVER + k: msg.arrays[k] for k in keys},
        }

        def finish(result: TrainResult) -> Message:
            theta_k = get_arrays(ctx.model)
            alpha = self.params.alpha
            for k in keys:
                ctx.state.arrays[STATE_PREFIX + k] = grads[k] - alpha * (theta_k[k] - msg.arrays[k])
            return Message("trained", arrays=theta_k, scalars={"loss": result.mean_loss})

        return PlainTraining(finish, loss=self.loss, tensors=tensors)

    def loss(
        self,
        model: torch.nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        tensors: Mapping[str, torch.Tensor],
    ) -> LossOutput:
        params = dict(model.named_parameters())
        keys = [name[len(GRAD) :] for name in tensors if name.startswith(GRAD)]
        variables = [(params[k], tensors[GRAD + k], tensors[SERVER + k]) for k in keys]
        return dynamic_loss(model, x, y, variables, self.params.alpha)


class FedDyn(Algorithm):
    name = "feddyn"
    description = "FedDyn: dynamic regularisation (linear + proximal terms, server correction h)"
    Params = FedDynParams
    Server = FedDynServer
    Client = FedDynClient
    privacy = {
        "secure_aggregation": "is not wired for it yet (its correction h needs only the sum "
        "of the models, which the algebra allows)",
        "dp": "is not wired for it (its correction h accumulates the clients' updates across "
        "rounds)",
    }

    @classmethod
    def client_state(
        cls, params: FedDynParams, model: torch.nn.Module, num_classes: int
    ) -> tuple[StatePart, ...]:
        """g_k of every trained parameter: every client that has trained holds it."""
        parameters = dict(model.named_parameters())
        keys = [k for k in trained_keys(model.state_dict()) if k in parameters]
        return (model_part(STATE_PREFIX, model, keys, holds=after_training),)
