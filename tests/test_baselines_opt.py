"""FedProx, SCAFFOLD, FedDyn and FedNova: each one's mechanism pinned by hand, then end to end.

Expected values are computed here from the papers' formulas (a hand-written SGD loop, closed
forms, explicit sums), never by calling the implementation a second time.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedskew.algorithms.feddyn import FedDyn, dynamic_loss
from fedskew.algorithms.fednova import FedNova, momentum_normaliser
from fedskew.algorithms.fedprox import FedProx, proximal_loss
from fedskew.algorithms.scaffold import Scaffold
from fedskew.apps.cli import main
from fedskew.core.errors import UsageError
from fedskew.data.federated import ClientData, FederatedData
from fedskew.engines.inprocess import InProcessEngine
from fedskew.models import build_model
from fedskew.models.base import BodyHeadModel
from fedskew.training.interface import ClientContext, LocalTrainConfig, ServerSetup
from fedskew.training.protocol import SCALAR_BYTES, ClientState, Message

# --- helpers ----------------------------------------------------------------------------------

D, C = 3, 2  # input features, classes of the tiny linear model


def tiny_model(seed: int = 0) -> BodyHeadModel:
    gen = torch.Generator().manual_seed(seed)
    model = BodyHeadModel(torch.nn.Identity(), torch.nn.Linear(D, C), feature_dim=D)
    with torch.no_grad():
        model.head.weight.copy_(torch.randn(C, D, generator=gen))
        model.head.bias.copy_(torch.randn(C, generator=gen))
    return model


def tiny_data(n: int = 6, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=gen)
    y = torch.tensor([0, 1] * (n // 2))
    return x, y


def ce_grad(w: torch.Tensor, b: torch.Tensor, x: torch.Tensor, y: torch.Tensor):
    """Gradient of the mean cross-entropy of logits x w^T + b, on fresh leaves."""
    w = w.detach().clone().requires_grad_(True)
    b = b.detach().clone().requires_grad_(True)
    F.cross_entropy(x @ w.T + b, y).backward()
    return w.grad, b.grad


def context(model, x, y, *, epochs, momentum=0.0, lr=0.1, state=None, cid=0) -> ClientContext:
    """A client holding all of (x, y) and training full-batch, so that batch order is moot."""
    return ClientContext(
        client_id=cid,
        round=0,
        seed=0,
        data=ClientData(x, y, torch.arange(len(y)), num_classes=C),
        model=model,
        state=state if state is not None else ClientState(),
        train=LocalTrainConfig(
            epochs=epochs, batch_size=len(y), lr=lr, momentum=momentum, weight_decay=0.0
        ),
    )


class FixedReplies:
    """A channel that records what the server sends and answers with prepared replies."""

    def __init__(self, replies: dict[int, Message]) -> None:
        self.replies = replies
        self.sent: list[dict[int, Message]] = []

    def exchange(self, messages, expect=None):
        self.sent.append(dict(messages))
        return {c: self.replies[c] for c in messages}


class Recording:
    """Wraps a real engine and keeps every message and reply."""

    def __init__(self, engine: InProcessEngine) -> None:
        self.engine = engine
        self.log: list[tuple[dict[int, Message], dict[int, Message]]] = []

    def exchange(self, messages, expect=None):
        replies = self.engine.exchange(messages, expect)
        self.log.append((dict(messages), replies))
        return replies


def setup_for(arrays: dict[str, torch.Tensor], num_clients: int, sizes=None) -> ServerSetup:
    return ServerSetup(
        arrays,
        num_clients=num_clients,
        num_classes=C,
        client_sizes=sizes or [10] * num_clients,
        seed=0,
        train=LocalTrainConfig(),
    )


def small_federation(num_clients: int = 4, per_client: int = 8):
    gen = torch.Generator().manual_seed(3)
    n = num_clients * per_client
    x = torch.randn(n, D, generator=gen)
    y = (x[:, 0] > 0).long()
    parts = [np.arange(k * per_client, (k + 1) * per_client) for k in range(num_clients)]
    return FederatedData(x, y, parts, C)


# --- FedProx --------------------------------------------------------------------------------


def test_fedprox_gradient_is_ce_gradient_plus_mu_times_distance():
    model = tiny_model()
    x, y = tiny_data()
    anchor = [p.detach() + 0.3 * torch.ones_like(p) for p in model.parameters()]
    mu = 0.7
    out = proximal_loss(model, x, y, anchor, mu)
    out.loss.backward()
    gw, gb = ce_grad(model.head.weight, model.head.bias, x, y)
    w, b = model.head.weight.detach(), model.head.bias.detach()
    assert torch.allclose(model.head.weight.grad, gw + mu * (w - anchor[0]), atol=1e-6)
    assert torch.allclose(model.head.bias.grad, gb + mu * (b - anchor[1]), atol=1e-6)
    # the plug-in contract: features and logits of the same forward pass
    assert out.features.shape == (6, D) and out.logits.shape == (6, C)
    # value: CE + mu/2 * ||w - anchor||^2, with ||.||^2 = 0.09 per coordinate
    ce = F.cross_entropy(x @ w.T + b, y)
    assert out.loss.item() == pytest.approx(ce.item() + mu / 2 * 0.09 * (C * D + C), rel=1e-6)


def test_fedprox_client_trains_with_the_proximal_term():
    model = tiny_model()
    x, y = tiny_data()
    w0, b0 = model.head.weight.detach().clone(), model.head.bias.detach().clone()
    msg = Message("train", arrays={k: v.clone() for k, v in model.state_dict().items()})
    lr, mu = 0.5, 2.0
    client = FedProx.Client(FedProx.make_params({"mu": mu}))
    reply = client.handle(msg, context(model, x, y, epochs=3, lr=lr))
    # three plain full-batch SGD steps on CE + mu/2 ||w - w0||^2, by hand
    w, b = w0.clone(), b0.clone()
    for _ in range(3):
        gw, gb = ce_grad(w, b, x, y)
        w, b = w - lr * (gw + mu * (w - w0)), b - lr * (gb + mu * (b - b0))
    assert torch.allclose(reply.arrays["head.weight"], w, atol=1e-5)
    assert torch.allclose(reply.arrays["head.bias"], b, atol=1e-5)
    assert reply.scalars["num_samples"] == 6.0


# --- SCAFFOLD --------------------------------------------------------------------------------


def test_scaffold_client_control_variate_by_hand():
    model = tiny_model()
    x, y = tiny_data()
    w0, b0 = model.head.weight.detach().clone(), model.head.bias.detach().clone()
    c = {"head.weight": torch.full((C, D), 0.2), "head.bias": torch.tensor([0.1, -0.3])}
    ck = {"head.weight": torch.full((C, D), -0.1), "head.bias": torch.tensor([0.05, 0.0])}
    state = ClientState(arrays={f"scaffold.c_k/{k}": v.clone() for k, v in ck.items()})
    msg = Message(
        "train",
        arrays={"head.weight": w0, "head.bias": b0, **{f"c/{k}": v for k, v in c.items()}},
    )
    K, lr = 4, 0.3
    reply = Scaffold.Client(Scaffold.make_params({})).handle(
        msg, context(model, x, y, epochs=K, lr=lr, state=state)
    )
    # K corrected plain-SGD steps, keeping the CE gradients seen on the way
    w, b = w0.clone(), b0.clone()
    seen_w, seen_b = [], []
    for _ in range(K):
        gw, gb = ce_grad(w, b, x, y)
        seen_w.append(gw)
        seen_b.append(gb)
        w = w - lr * (gw - ck["head.weight"] + c["head.weight"])
        b = b - lr * (gb - ck["head.bias"] + c["head.bias"])
    assert torch.allclose(reply.arrays["head.weight"], w, atol=1e-5)
    assert torch.allclose(reply.arrays["head.bias"], b, atol=1e-5)
    # option II: c_k+ = c_k - c + (w_t - y_k) / (K lr) ...
    new_w = ck["head.weight"] - c["head.weight"] + (w0 - w) / (K * lr)
    new_b = ck["head.bias"] - c["head.bias"] + (b0 - b) / (K * lr)
    # ... which for plain SGD is the mean gradient along the local trajectory
    assert torch.allclose(new_w, torch.stack(seen_w).mean(0), atol=1e-5)
    assert torch.allclose(new_b, torch.stack(seen_b).mean(0), atol=1e-5)
    assert torch.allclose(reply.arrays["dc/head.weight"], new_w - ck["head.weight"], atol=1e-5)
    assert torch.allclose(reply.arrays["dc/head.bias"], new_b - ck["head.bias"], atol=1e-5)
    assert torch.allclose(state.arrays["scaffold.c_k/head.weight"], new_w, atol=1e-5)
    assert torch.allclose(state.arrays["scaffold.c_k/head.bias"], new_b, atol=1e-5)
    assert set(reply.arrays) == {"head.weight", "head.bias", "dc/head.weight", "dc/head.bias"}


@pytest.mark.parametrize("normaliser", ["momentum", "steps"])
def test_scaffold_normaliser_with_momentum(normaliser):
    model = tiny_model()
    x, y = tiny_data()
    w0, b0 = model.head.weight.detach().clone(), model.head.bias.detach().clone()
    msg = Message(
        "train",
        arrays={
            "head.weight": w0,
            "head.bias": b0,
            "c/head.weight": torch.zeros(C, D),
            "c/head.bias": torch.zeros(C),
        },
    )
    K, lr, rho = 3, 0.2, 0.5
    state = ClientState()
    params = Scaffold.make_params({"normaliser": normaliser})
    reply = Scaffold.Client(params).handle(
        msg, context(model, x, y, epochs=K, lr=lr, momentum=rho, state=state)
    )
    y_w = reply.arrays["head.weight"]
    # step s's gradient moves the weights K - s + 1 times, by rho^0, rho^1, ...: 1 + 1.5 + 1.75
    a = sum(sum(rho**j for j in range(t)) for t in range(1, K + 1))
    assert a == pytest.approx(4.25)
    divisor = a if normaliser == "momentum" else K
    expected = (w0 - y_w) / (divisor * lr)
    assert torch.allclose(state.arrays["scaffold.c_k/head.weight"], expected, atol=1e-5)
    assert torch.allclose(reply.arrays["dc/head.weight"], expected, atol=1e-5)


def test_scaffold_server_update_by_hand():
    init = {"w": torch.tensor([1.0, 2.0])}
    setup = setup_for(init, num_clients=4)
    server = Scaffold.Server(Scaffold.make_params({"global_lr": 0.5}), setup)
    replies = {
        0: Message(
            "trained",
            arrays={"w": torch.tensor([3.0, 2.0]), "dc/w": torch.tensor([0.4, 0.0])},
            scalars={"loss": 1.0},
        ),
        2: Message(
            "trained",
            arrays={"w": torch.tensor([1.0, 0.0]), "dc/w": torch.tensor([0.0, -0.8])},
            scalars={"loss": 3.0},
        ),
    }
    channel = FixedReplies(replies)
    metrics = server.round(0, [0, 2], channel)
    sent = channel.sent[0][0]
    assert set(sent.arrays) == {"w", "c/w"} and torch.equal(sent.arrays["c/w"], torch.zeros(2))
    # w + 0.5 * mean([2, 0], [0, -2]) = [1, 2] + 0.5 * [1, -1]
    assert torch.allclose(server.global_arrays["w"], torch.tensor([1.5, 1.5]))
    # c + (1/N) * sum(dc) with N = 4 clients in all, not the 2 sampled
    assert torch.allclose(server.c["w"], torch.tensor([0.1, -0.2]))
    assert metrics["train_loss"] == 2.0
    server.round(1, [0, 2], channel)
    assert torch.allclose(channel.sent[1][2].arrays["c/w"], torch.tensor([0.1, -0.2]))
    assert torch.allclose(server.c["w"], torch.tensor([0.2, -0.4]))


def test_scaffold_client_state_persists_between_visits():
    fed = small_federation()
    model = tiny_model()
    train = LocalTrainConfig(epochs=1, batch_size=4, lr=0.1, momentum=0.0, weight_decay=0.0)
    engine = InProcessEngine(Scaffold.Client(Scaffold.make_params({})), fed, model, train, seed=0)
    server = Scaffold.Server(Scaffold.make_params({}), setup_for(model.state_dict(), 4))
    channel = Recording(engine)
    key = "scaffold.c_k/head.weight"

    engine.begin_round(0)
    server.round(0, [0, 1], channel)
    assert set(engine.client_states) == {0, 1}
    snap = {c: engine.client_states[c].arrays[key].clone() for c in (0, 1)}
    assert all(snap[c].abs().sum() > 0 for c in snap)

    engine.begin_round(1)
    server.round(1, [1, 2], channel)
    sent, replies = channel.log[-1]
    assert torch.equal(engine.client_states[0].arrays[key], snap[0])  # not sampled: untouched
    assert 3 not in engine.client_states or not engine.client_states[3].arrays
    # client 1 found its c_k and built on it: c_k+ = c_k - c + (w - y) / (K lr), K = 2 batches
    msg = sent[1]
    expected = (
        snap[1]
        - msg.arrays["c/head.weight"]
        + (msg.arrays["head.weight"] - replies[1].arrays["head.weight"]) / (2 * 0.1)
    )
    assert torch.allclose(engine.client_states[1].arrays[key], expected, atol=1e-5)
    assert torch.allclose(replies[1].arrays["dc/head.weight"], expected - snap[1], atol=1e-5)
    assert not torch.allclose(engine.client_states[1].arrays[key], snap[1])


# --- FedDyn ----------------------------------------------------------------------------------


def test_feddyn_loss_gradient():
    model = tiny_model()
    x, y = tiny_data()
    params = [model.head.weight, model.head.bias]
    grads = [torch.full((C, D), 0.3), torch.tensor([-0.2, 0.4])]
    server = [p.detach() - 0.5 for p in params]
    alpha = 0.1
    out = dynamic_loss(model, x, y, list(zip(params, grads, server, strict=True)), alpha)
    out.loss.backward()
    gw, gb = ce_grad(*[p.detach() for p in params], x, y)
    # grad = CE grad - g_k + alpha (theta - theta_server), and theta - theta_server = 0.5
    assert torch.allclose(model.head.weight.grad, gw - grads[0] + alpha * 0.5, atol=1e-6)
    assert torch.allclose(model.head.bias.grad, gb - grads[1] + alpha * 0.5, atol=1e-6)
    assert out.features is not None and out.logits.shape == (6, C)


def test_feddyn_client_trains_and_updates_its_gradient_state():
    model = tiny_model()
    x, y = tiny_data()
    w0, b0 = model.head.weight.detach().clone(), model.head.bias.detach().clone()
    g = {"head.weight": torch.full((C, D), 0.25), "head.bias": torch.tensor([0.5, -0.5])}
    state = ClientState(arrays={f"feddyn.grad/{k}": v.clone() for k, v in g.items()})
    msg = Message("train", arrays={"head.weight": w0.clone(), "head.bias": b0.clone()})
    lr, alpha = 0.4, 0.5
    reply = FedDyn.Client(FedDyn.make_params({"alpha": alpha})).handle(
        msg, context(model, x, y, epochs=3, lr=lr, state=state)
    )
    w, b = w0.clone(), b0.clone()
    for _ in range(3):
        gw, gb = ce_grad(w, b, x, y)
        w = w - lr * (gw - g["head.weight"] + alpha * (w - w0))
        b = b - lr * (gb - g["head.bias"] + alpha * (b - b0))
    assert torch.allclose(reply.arrays["head.weight"], w, atol=1e-5)
    assert torch.allclose(reply.arrays["head.bias"], b, atol=1e-5)
    # g_k <- g_k - alpha (theta_k - theta)
    assert torch.allclose(
        state.arrays["feddyn.grad/head.weight"], g["head.weight"] - alpha * (w - w0), atol=1e-5
    )
    assert torch.allclose(
        state.arrays["feddyn.grad/head.bias"], g["head.bias"] - alpha * (b - b0), atol=1e-5
    )
    assert set(reply.arrays) == {"head.weight", "head.bias"}


def test_feddyn_server_update_by_hand():
    setup = setup_for({"w": torch.tensor([1.0, 0.0])}, num_clients=4)
    alpha = 0.5
    server = FedDyn.Server(FedDyn.make_params({"alpha": alpha}), setup)
    channel = FixedReplies(
        {
            0: Message("trained", arrays={"w": torch.tensor([3.0, 0.0])}, scalars={"loss": 0.0}),
            1: Message("trained", arrays={"w": torch.tensor([1.0, 2.0])}, scalars={"loss": 0.0}),
        }
    )
    server.round(0, [0, 1], channel)
    # h = 0 - (0.5 / 4) * ([2, 0] + [0, 2]) = [-0.25, -0.25]
    assert torch.allclose(server.h["w"], torch.tensor([-0.25, -0.25]))
    # theta = mean([3, 0], [1, 2]) - h / 0.5 = [2, 1] + [0.5, 0.5]
    assert torch.allclose(server.global_arrays["w"], torch.tensor([2.5, 1.5]))
    server.round(1, [0, 1], channel)
    assert torch.allclose(channel.sent[1][0].arrays["w"], torch.tensor([2.5, 1.5]))
    # h = [-0.25, -0.25] - 0.125 * ([0.5, -1.5] + [-1.5, 0.5]) = [-0.125, -0.125]
    assert torch.allclose(server.h["w"], torch.tensor([-0.125, -0.125]))
    # theta = mean([3, 0], [1, 2]) - h / 0.5 = [2, 1] + [0.25, 0.25]
    assert torch.allclose(server.global_arrays["w"], torch.tensor([2.25, 1.25]))


def test_feddyn_client_state_persists_between_visits():
    fed = small_federation()
    model = tiny_model()
    train = LocalTrainConfig(epochs=1, batch_size=4, lr=0.1, momentum=0.9, weight_decay=0.0)
    params = FedDyn.make_params({"alpha": 0.1})
    engine = InProcessEngine(FedDyn.Client(params), fed, model, train, seed=0)
    server = FedDyn.Server(params, setup_for(model.state_dict(), 4))
    channel = Recording(engine)
    key = "feddyn.grad/head.weight"

    engine.begin_round(0)
    server.round(0, [0, 3], channel)
    snap = {c: engine.client_states[c].arrays[key].clone() for c in (0, 3)}
    engine.begin_round(1)
    server.round(1, [2, 3], channel)
    sent, replies = channel.log[-1]
    assert torch.equal(engine.client_states[0].arrays[key], snap[0])
    assert 1 not in engine.client_states or not engine.client_states[1].arrays
    theta, theta3 = sent[3].arrays["head.weight"], replies[3].arrays["head.weight"]
    expected = snap[3] - 0.1 * (theta3 - theta)
    assert torch.allclose(engine.client_states[3].arrays[key], expected, atol=1e-6)
    # client 2's first visit starts from zeros
    theta2 = replies[2].arrays["head.weight"]
    assert torch.allclose(engine.client_states[2].arrays[key], -0.1 * (theta2 - theta), atol=1e-6)


# --- FedNova ---------------------------------------------------------------------------------


@pytest.mark.parametrize("tau, rho", [(1, 0.9), (5, 0.0), (7, 0.5), (40, 0.9), (3, 0.99)])
def test_fednova_normaliser_closed_form_is_sum_of_momentum_coefficients(tau, rho):
    closed = 1 / (1 - rho) * (tau - rho * (1 - rho**tau) / (1 - rho))
    # gradient of step s enters every later step t >= s with rho^(t - s)
    coefficients = sum(rho ** (t - s) for s in range(1, tau + 1) for t in range(s, tau + 1))
    assert momentum_normaliser(tau, rho) == pytest.approx(closed, rel=1e-12)
    assert momentum_normaliser(tau, rho) == pytest.approx(coefficients, rel=1e-9)


@pytest.mark.parametrize("tau, rho", [(6, 0.9), (10, 0.5)])
def test_fednova_normaliser_matches_momentum_sgd_steps(tau, rho):
    lr = 0.01
    # a quadratic without curvature: the gradient is constant, so w0 - w_tau = lr * a * g
    g = torch.tensor([1.0, -2.0, 0.5])
    w = torch.zeros(3, requires_grad=True)
    opt = torch.optim.SGD([w], lr=lr, momentum=rho)
    for _ in range(tau):
        opt.zero_grad()
        (g * w).sum().backward()
        opt.step()
    measured = (-w.detach() / (lr * g)).mean().item()
    assert measured == pytest.approx(momentum_normaliser(tau, rho), rel=1e-5)

    # a curved quadratic 0.5 w^T A w: the displacement is lr * sum_s coef_s g_s with the
    # gradients g_s actually seen, and the coefficients sum to a
    A = torch.diag(torch.tensor([1.0, 3.0, 10.0]))
    w0 = torch.tensor([1.0, 1.0, 1.0])
    w = w0.clone().requires_grad_(True)
    opt = torch.optim.SGD([w], lr=lr, momentum=rho)
    grads = []
    for _ in range(tau):
        opt.zero_grad()
        (0.5 * w @ A @ w).backward()
        grads.append(w.grad.clone())
        opt.step()
    coef = [sum(rho**j for j in range(tau - s + 1)) for s in range(1, tau + 1)]
    predicted = lr * sum(cs * gs for cs, gs in zip(coef, grads, strict=True))
    assert torch.allclose(w0 - w.detach(), predicted, atol=1e-6)
    assert sum(coef) == pytest.approx(momentum_normaliser(tau, rho), rel=1e-9)


def test_fednova_client_sends_normalised_update():
    model = tiny_model()
    x, y = tiny_data(n=10)
    msg = Message("train", arrays={k: v.clone() for k, v in model.state_dict().items()})
    rho, epochs = 0.9, 2
    ctx = context(model, x, y, epochs=epochs, momentum=rho, lr=0.1)
    ctx.train.batch_size = 4  # batches of 4, 4 and 2 samples: 3 steps per epoch
    reply = FedNova.Client(FedNova.make_params({})).handle(msg, ctx)
    tau = epochs * 3
    a = sum(rho ** (t - s) for s in range(1, tau + 1) for t in range(s, tau + 1))
    assert reply.scalars["a"] == pytest.approx(a)
    assert reply.scalars["num_samples"] == 10.0
    y_w = model.head.weight.detach()  # the scratch model holds y_i after training
    expected = (msg.arrays["head.weight"] - y_w) / a
    assert torch.allclose(reply.arrays["head.weight"], expected, atol=1e-6)


def test_fednova_server_aggregation_by_hand():
    setup = setup_for({"w": torch.tensor([1.0, 1.0])}, num_clients=3)
    server = FedNova.Server(FedNova.make_params({}), setup)
    replies = {
        0: Message(
            "trained",
            arrays={"w": torch.tensor([0.2, 0.0])},
            scalars={"num_samples": 10.0, "a": 2.0, "loss": 1.0},
        ),
        2: Message(
            "trained",
            arrays={"w": torch.tensor([0.0, 0.4])},
            scalars={"num_samples": 30.0, "a": 6.0, "loss": 1.0},
        ),
    }
    metrics = server.round(0, [0, 2], FixedReplies(replies))
    # p = (1/4, 3/4); tau_eff = 0.5 + 4.5 = 5; sum p d = [0.05, 0.3]; w - 5 * that
    assert metrics["tau_eff"] == pytest.approx(5.0)
    assert torch.allclose(server.global_arrays["w"], torch.tensor([0.75, -0.5]))


def test_fednova_averages_buffers_and_moves_parameters():
    setup = setup_for(
        {"w": torch.tensor([1.0]), "bn.running_mean": torch.tensor([0.0])}, num_clients=2
    )
    server = FedNova.Server(FedNova.make_params({}), setup)
    replies = {
        c: Message(
            "trained",
            arrays={"w": torch.tensor([0.1 * (c + 1)]), "bn.running_mean": torch.tensor([4.0 * c])},
            scalars={"num_samples": 10.0, "a": 1.0, "loss": 0.0},
        )
        for c in (0, 1)
    }
    server.round(0, [0, 1], FixedReplies(replies))
    assert server.global_arrays["w"].item() == pytest.approx(1.0 - 0.15)
    assert server.global_arrays["bn.running_mean"].item() == pytest.approx(2.0)


# --- parameters ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "algorithm, values, match",
    [
        (FedProx, {"mu": -1}, "mu"),
        (Scaffold, {"global_lr": 0}, "global_lr"),
        (Scaffold, {"normaliser": "bogus"}, "normaliser"),
        (FedDyn, {"alpha": 0}, "alpha"),
        (FedNova, {"mu": 0.1}, "no parameter"),
    ],
)
def test_bad_parameters_are_refused(algorithm, values, match):
    with pytest.raises(UsageError, match=match):
        algorithm.make_params(values)


def test_paper_defaults():
    assert FedProx.make_params({}).mu == 0.01
    assert Scaffold.make_params({}).global_lr == 1.0
    assert FedDyn.make_params({}).alpha == 0.01


# --- end to end through the CLI ------------------------------------------------------------

FAST = ["--rounds", "3", "--local-epochs", "1", "-q"]
PER_ROUND = 8  # 40 % of the 20 default clients


def run_cli(tmp: Path, name: str, *args: str) -> list[dict]:
    assert main(["run", *args, "-o", str(tmp), "--name", name, *FAST]) == 0
    lines = (tmp / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def fedavg_records(tmp_path_factory):
    return run_cli(tmp_path_factory.mktemp("fedavg"), "fedavg", "-a", "fedavg")


def digits_sizes() -> tuple[int, int]:
    """Bytes of the default digits model's state dict and of its trainable parameters."""
    model = build_model("mlp", (1, 8, 8), 10)
    state = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return state, params


def expected_bytes(algorithm: str) -> tuple[int, int]:
    """(down, up) per round: what each method must send, from the model's size."""
    model, params = digits_sizes()
    s = SCALAR_BYTES
    per_client = {
        "fedavg": (model, model + 2 * s),  # num_samples, loss
        "fedprox": (model, model + 2 * s),
        "scaffold": (model + params, model + params + s),  # w and c; y_k, delta c_k and loss
        "feddyn": (model, model + s),  # unweighted mean: loss only
        "fednova": (model, model + 3 * s),  # num_samples, loss, a
    }[algorithm]
    return PER_ROUND * per_client[0], PER_ROUND * per_client[1]


@pytest.mark.parametrize(
    "algorithm, extra",
    [
        ("fedprox", []),
        ("scaffold", []),
        ("scaffold", ["-p", "normaliser=steps", "-p", "global_lr=0.5"]),
        ("feddyn", []),
        ("fednova", []),
    ],
)
def test_runs_end_to_end_with_exact_traffic(tmp_path, algorithm, extra):
    records = run_cli(tmp_path, algorithm, "-a", algorithm, *extra)
    assert [r["round"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["accuracy"]) and 0 <= r["accuracy"] <= 1 for r in records)
    assert all(math.isfinite(r["train_loss"]) for r in records)
    down, up = expected_bytes(algorithm)
    assert all(r["bytes_down"] == down and r["bytes_up"] == up for r in records), records[0]
    assert all(r["exchanges"] == 1 for r in records)


def test_fedavg_traffic_reference_and_scaffold_doubles_it(fedavg_records):
    down, up = expected_bytes("fedavg")
    assert all(r["bytes_down"] == down and r["bytes_up"] == up for r in fedavg_records)
    s_down, s_up = expected_bytes("scaffold")
    assert 1.99 < s_down / down <= 2.0 and 1.99 < s_up / up <= 2.0
