"""SCAFFOLD (Karimireddy et al., ICML 2020), option II control variates.

The server keeps a control variate ``c`` and each client ``k`` its own ``c_k`` (zeros at
first, kept in the client's state). A round:

* the server sends the global model ``w`` and ``c``;
* the client trains from ``w`` with corrected gradients ``g - c_k + c`` (applied to the
  gradients after backward, before the optimiser step), reaching ``y_k`` after ``K`` steps;
* it sets ``c_k+ = c_k - c + (w - y_k) / (K_eff lr)`` and replies ``y_k`` and
  ``delta c_k = c_k+ - c_k``;
* the server moves ``w <- w + global_lr * mean_k (y_k - w)`` and
  ``c <- c + (1/N) sum_k delta c_k`` with ``N`` the number of clients.

Both directions carry a model and a control variate: about twice FedAvg's traffic.

``K_eff`` [PROPOSAL: the paper assumes plain SGD]: the option-II formula divides the
displacement by ``K lr``, which is the mean corrected gradient only for plain SGD. With SGD
momentum ``rho`` (the project's default is 0.9) a gradient applied at step ``s`` moves the
weights by ``lr (1 + rho + ... + rho^(K-s))``, so ``w - y_k`` is about ``a / K`` times larger
(up to ``1/(1-rho)``, ten-fold at 0.9) and ``c_k`` would overshoot the client's gradient by
that factor. ``normaliser="momentum"`` (default) divides by ``a lr`` with ``a`` FedNova's sum of
momentum coefficients, so ``c_k+`` is the coefficient-weighted mean of the local gradients;
``a = K`` when momentum is 0, where this is exactly the paper's formula.
``normaliser="steps"`` divides by ``K lr`` as written in the paper, whatever the momentum
(at momentum 0 both are the same; at 0.9 ``c_k`` overshoots as above). It is there to
reproduce implementations that keep the plain formula.
Weight decay is part of the gradient the optimiser sees (the correction is added before the
step, the decay inside it), so the control variates estimate the gradient of the weight-decayed
local objective; every client applies the same decay, so its share in ``c`` and ``c_k`` is
alike and mostly cancels in the correction ``c - c_k``.

The server averages ``y_k`` without sample weights (``1/|S|``), as the paper writes
(``weighting="uniform"``, default). ``weighting="samples"`` weights ``y_k`` by ``n_k`` as FedAvg
does (what many public implementations do under quantity skew; the client then also sends
``num_samples``); ``c`` keeps the paper's ``1/N`` update either way. It does not cure the
instability below (on digits it made it worse: it weights the clients that drift furthest most).
When some replies do not arrive, ``S`` is the set of clients that replied: ``y_k`` is averaged
over it and ``c`` moves by ``(1/N) sum_{k in S} delta c_k``, the paper's update for that smaller
sample (a lost ``delta c_k`` is not added later, so ``c`` no longer equals the mean of the
clients' ``c_k`` exactly).
Control variates cover the trainable variables only; buffers (BatchNorm statistics) are
averaged like the other entries of ``y_k`` but carry no control variate.

Stability: ``c - c_k`` is a fixed, first-order stand-in for the other clients' losses, valid
near ``w`` only, and unlike the client's own gradient it does not fade once the client has fitted
its data; so the client keeps moving along it, about ``K lr / (1 - rho) |c - c_k|`` in all (the
paper's analysis likewise needs ``K lr`` small). When this local step budget is large (thousands
of samples per client, several epochs, momentum 0.9 multiplying every step tenfold) the clients
leave that region, the next control variates are estimated far from the optimum, and accuracy
can swing or diverge where FedAvg does not (benchmarks/results/baselines_findings.md,
reproduction/NOTES.md). The budget is the cause, not staleness or momentum as such; cut it:
fewer local epochs, ``--momentum 0`` (the paper's plain SGD) at the same ``--lr``, or a
smaller ``--lr``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedskew.algorithms.fednova import momentum_normaliser, trained_keys
from fedskew.core.errors import UsageError
from fedskew.training.aggregation import apply_server_lr, weighted_average
from fedskew.training.interface import (
    Algorithm,
    ClientContext,
    ClientLogic,
    InactiveMechanism,
    RunShape,
    ServerLogic,
    ServerSetup,
    check_one_of,
    starts_too_late,
)
from fedskew.training.local import (
    PlainTraining,
    TrainResult,
    get_arrays,
    run_plain,
    set_arrays,
    trained_needs,
)
from fedskew.training.protocol import ArraySpec, Channel, Message, arrived
from fedskew.training.state_spec import StatePart, after_training, model_part

C_PREFIX = "c/"  # the server's control variate in the "train" message
DC_PREFIX = "dc/"  # the client's delta c_k in its reply
STATE_PREFIX = "scaffold.c_k/"  # the client's own control variate in its state
NORMALISERS = ("momentum", "steps")
WEIGHTINGS = ("uniform", "samples")


@dataclass
class ScaffoldParams:
    global_lr: float = 1.0  # the paper's eta_g
    normaliser: str = "momentum"  # K_eff in c_k+: momentum-corrected steps, or the raw K
    weighting: str = "uniform"  # mean of y_k: 1/|S| (paper) or n_k / n (FedAvg's)

    def validate(self) -> None:
        if self.global_lr <= 0:
            raise UsageError(f"scaffold: global_lr must be > 0, got {self.global_lr}")
        check_one_of("scaffold", "normaliser", self.normaliser, NORMALISERS)
        check_one_of("scaffold", "weighting", self.weighting, WEIGHTINGS)


class ScaffoldServer(ServerLogic):
    checkpoint_fields = ("c",)  # server state a resumed run must find

    def __init__(self, params: ScaffoldParams, setup: ServerSetup) -> None:
        super().__init__(params, setup)
        self.c = {
            k: torch.zeros_like(self.global_arrays[k]) for k in trained_keys(self.global_arrays)
        }

    def round(self, rnd: int, clients: list[int], channel: Channel) -> dict[str, float]:
        msg = Message(
            "train",
            arrays={**self.global_arrays, **{C_PREFIX + k: v for k, v in self.c.items()}},
        )
        counts = ("num_samples",) if self.params.weighting == "samples" else ()
        deltas = [DC_PREFIX + k for k in self.c]
        expect = trained_needs((*self.global_arrays, *deltas), *counts)
        replies = channel.exchange({c: msg for c in clients}, expect)
        clients = arrived(clients, replies)  # S is the set that replied, N stays all clients
        models = [{k: replies[c].arrays[k] for k in self.global_arrays} for c in clients]
        # mean of y_k, then w + eta_g (mean - w) = w + eta_g * mean(y_k - w)
        if self.params.weighting == "samples":
            weights = [replies[c].scalars["num_samples"] for c in clients]
        else:
            weights = [1.0] * len(clients)
        averaged = weighted_average(models, weights)
        self.global_arrays = apply_server_lr(self.global_arrays, averaged, self.params.global_lr)
        n = self.setup.num_clients
        for k, ck in self.c.items():
            total = torch.stack([replies[c].arrays[DC_PREFIX + k] for c in clients]).sum(0)
            self.c[k] = ck + total / n
        return {"train_loss": self.mean_train_loss(replies, clients)}


class ScaffoldClient(ClientLogic):
    def on_train(self, msg: Message, ctx: ClientContext) -> Message:
        return run_plain(self.plain_train(msg, ctx), ctx)

    def plain_train(self, msg: Message, ctx: ClientContext) -> PlainTraining:
        """Load the global model; train with the gradient correction ``c - c_k``; then
        update ``c_k`` in the client's state and reply ``y_k`` and ``delta c_k``."""
        model_arrays = {k: v for k, v in msg.arrays.items() if not k.startswith(C_PREFIX)}
        c = {k[len(C_PREFIX) :]: v for k, v in msg.arrays.items() if k.startswith(C_PREFIX)}
        c_k = {k: ctx.state.arrays.get(STATE_PREFIX + k, torch.zeros_like(v)) for k, v in c.items()}
        set_arrays(ctx.model, model_arrays)
        params = dict(ctx.model.named_parameters())
        # Fixed for the whole round: g - c_k + c is g plus this.
        correction = {k: c[k] - c_k[k] for k in c if k in params}

        def finish(result: TrainResult) -> Message:
            y = get_arrays(ctx.model)
            if self.params.normaliser == "momentum":
                k_eff = momentum_normaliser(result.steps, ctx.train.momentum)
            else:
                k_eff = float(result.steps)
            delta_c: dict[str, torch.Tensor] = {}
            for k in c:
                if k_eff > 0:
                    c_new = c_k[k] - c[k] + (model_arrays[k] - y[k]) / (k_eff * ctx.train.lr)
                else:
                    c_new = c_k[k]
                delta_c[DC_PREFIX + k] = c_new - c_k[k]
                ctx.state.arrays[STATE_PREFIX + k] = c_new.detach().clone()
            scalars = {"loss": result.mean_loss}
            if self.params.weighting == "samples":  # only sent when the server needs it
                scalars["num_samples"] = float(len(ctx.data))
            return Message("trained", arrays={**y, **delta_c}, scalars=scalars)

        return PlainTraining(finish, grad_shift=correction)


class Scaffold(Algorithm):
    name = "scaffold"
    description = "SCAFFOLD: control variates correct client drift (option II, ~2x traffic)"
    Params = ScaffoldParams
    Server = ScaffoldServer
    Client = ScaffoldClient
    privacy = {
        "secure_aggregation": "is not wired for it yet (its server needs the sums of the "
        "model updates and of the control-variate updates, which the algebra allows)",
        "dp": "sends control-variate updates, outside the clip norm",
    }

    @classmethod
    def reply_arrays(
        cls, params: ScaffoldParams, model: torch.nn.Module, num_classes: int
    ) -> dict[str, ArraySpec]:
        """Delta c_k: one array per trained entry of the model, of its shape."""
        state = model.state_dict()
        return {
            DC_PREFIX + k: ArraySpec(tuple(state[k].shape), state[k].dtype)
            for k in trained_keys(state)
        }

    @classmethod
    def client_state(
        cls, params: ScaffoldParams, model: torch.nn.Module, num_classes: int
    ) -> tuple[StatePart, ...]:
        """c_k, an array per trained entry: every client that has trained holds it (a
        client without it would restart from zeros and the run would differ)."""
        keys = trained_keys(model.state_dict())
        return (model_part(STATE_PREFIX, model, keys, holds=after_training),)

    @classmethod
    def inactive_mechanisms(
        cls, params: ScaffoldParams, shape: RunShape
    ) -> list[InactiveMechanism]:
        """The correction in a one-round run: c and every c_k start at zero."""
        return starts_too_late(
            "control-variate correction", 1, shape, {},
            "c and c_k are zero in the first round, so its gradients are uncorrected",
        )  # fmt: skip
