"""MOON, FedRS, FedLC, FedNTD and FedDecorr: each loss against an independent formula,
MOON's architecture and per-client state, and each method end to end through the CLI
(FedAvg's communication)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from fedskew.algorithms import fedavg, feddecorr, fedlc, fedntd, fedrs, get_algorithm, moon
from fedskew.apps.cli import main
from fedskew.core.errors import UsageError
from fedskew.data.federated import ClientData, FederatedData
from fedskew.engines.inprocess import InProcessEngine
from fedskew.models import build_model
from fedskew.models.base import BodyHeadModel
from fedskew.training.interface import ClientContext, LocalTrainConfig
from fedskew.training.local import TrainResult, get_arrays
from fedskew.training.protocol import ClientState, Message

# --- helpers ------------------------------------------------------------------------------


def linear_model(weight: list[list[float]], bias: list[float]) -> BodyHeadModel:
    """Identity body + linear head with the given weights: logits = W x + b, by hand."""
    w = torch.tensor(weight)
    head = nn.Linear(w.shape[1], w.shape[0])
    with torch.no_grad():
        head.weight.copy_(w)
        head.bias.copy_(torch.tensor(bias))
    return BodyHeadModel(nn.Identity(), head, w.shape[1])


def context(model: nn.Module, x: torch.Tensor, y: torch.Tensor, num_classes: int, **kw):
    data = ClientData(x, y, torch.arange(len(y)), num_classes)
    train = LocalTrainConfig(epochs=1, batch_size=len(y))
    return ClientContext(
        client_id=kw.get("client_id", 0),
        round=kw.get("round", 0),
        seed=0,
        data=data,
        model=model,
        state=kw.get("state", ClientState()),
        train=train,
    )


def captured_loss_fn(monkeypatch, module, client, msg: Message, ctx: ClientContext):
    """The loss_fn the client trains with: its ``plain_train`` split's, tensors bound (what
    ``run_plain`` gives ``train_client``), or else, with training replaced by a spy, the one
    its handler passes to ``train_client``."""
    split = getattr(client, "plain_train", None)
    if split is not None:
        return split(msg, ctx).loss_fn()
    seen = {}

    def spy(ctx_, *, loss_fn, **_):
        seen["loss_fn"] = loss_fn
        return TrainResult(steps=0, samples=0, mean_loss=0.0)

    monkeypatch.setattr(module, "train_client", spy)
    client.handle(msg, ctx)
    return seen["loss_fn"]


def ce(logits: list[float], y: int) -> float:
    return -logits[y] + math.log(sum(math.exp(v) for v in logits))


def rows(t: torch.Tensor) -> list[list[float]]:
    return t.tolist()


X = torch.tensor([[1.0, -2.0], [0.5, 1.5], [-1.0, 0.0]])
Y = torch.tensor([0, 2, 2])
W = [[0.5, -1.0], [1.0, 0.25], [-0.5, 2.0], [0.2, 0.3]]
B = [0.1, -0.2, 0.3, 0.0]


def hand_logits(x: torch.Tensor, weight=W, bias=B) -> list[list[float]]:
    return [
        [
            sum(wi * xi for wi, xi in zip(w_row, x_row, strict=True)) + b
            for w_row, b in zip(weight, bias, strict=True)
        ]
        for x_row in x.tolist()
    ]


# --- MOON ---------------------------------------------------------------------------------


def test_moon_contrastive_loss_on_given_vectors():
    z = torch.tensor([[1.0, 0.0], [3.0, 4.0]])
    z_glob = torch.tensor([[1.0, 1.0], [3.0, 4.0]])
    z_prev = torch.tensor([[0.0, 1.0], [-4.0, 3.0]])
    tau = 0.5
    # Row 1: cos(z, glob) = 1/sqrt(2), cos(z, prev) = 0. Row 2: cos = 1 and 0.
    expected = [
        -math.log(math.exp(2**-0.5 / tau) / (math.exp(2**-0.5 / tau) + math.exp(0.0))),
        -math.log(math.exp(1 / tau) / (math.exp(1 / tau) + 1.0)),
    ]
    got = moon.model_contrastive_loss(z, z_glob, z_prev, tau)
    assert float(got) == pytest.approx(sum(expected) / 2, rel=1e-6)


def test_moon_without_previous_model_is_log2_with_zero_gradient():
    z = torch.tensor([[1.0, 2.0, -1.0], [0.3, 0.1, 0.2]], requires_grad=True)
    z_glob = torch.tensor([[0.5, -1.0, 2.0], [1.0, 1.0, 1.0]])
    loss = moon.model_contrastive_loss(z, z_glob, z_glob, 0.5)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(math.log(2))
    assert z.grad.abs().max() < 1e-7  # the two cosines' gradients cancel (up to rounding)


def test_moon_first_participation_adds_mu_log2_and_no_gradient(monkeypatch):
    params = moon.Moon.make_params({"out_dim": 3, "mu": 2.0})
    model = moon.Moon.adapt_model(params, linear_model(W, B))
    ctx = context(model, X, Y, 4)  # empty state: this client never trained
    msg = Message("train", arrays=get_arrays(model))
    loss_fn = captured_loss_fn(monkeypatch, moon, moon.MoonClient(params), msg, ctx)
    out = loss_fn(model, X, Y)
    logits = model(X).detach().tolist()
    plain = np.mean([ce(row, int(t)) for row, t in zip(logits, Y, strict=True)])
    assert float(out.loss.detach()) == pytest.approx(plain + 2.0 * math.log(2), rel=1e-6)
    out.loss.backward()
    moon_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(X), Y).backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(moon_grads, model.parameters(), strict=True))


def test_moon_adapts_the_head_into_projection_then_classifier():
    params = moon.Moon.make_params({"out_dim": 16})
    plain = build_model("mlp", (1, 8, 8), 10, hidden=12)
    body_keys = [k for k in plain.state_dict() if k.startswith("body.")]
    model = moon.Moon.adapt_model(params, plain)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes == {
        **{k: shapes[k] for k in body_keys},
        "head.projection.fc1.weight": (12, 12),
        "head.projection.fc1.bias": (12,),
        "head.projection.fc2.weight": (16, 12),
        "head.projection.fc2.bias": (16,),
        "head.classifier.weight": (10, 16),
        "head.classifier.bias": (10,),
    }
    x = torch.randn(5, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    feats = model.body(x)
    assert feats.shape == (5, 12)
    h = torch.relu(feats @ model.head.projection.fc1.weight.T + model.head.projection.fc1.bias)
    z = h @ model.head.projection.fc2.weight.T + model.head.projection.fc2.bias
    logits = z @ model.head.classifier.weight.T + model.head.classifier.bias
    assert torch.allclose(model(x), logits, atol=1e-6)
    no_bias = moon.Moon.adapt_model(params, build_model("cnn-cifar", (3, 16, 16), 10))
    assert no_bias.head.classifier.bias is None


def test_moon_loss_uses_global_as_positive_and_state_as_negative(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    params = moon.Moon.make_params({"out_dim": 3, "mu": 2.0, "tau": 0.7})

    def make() -> nn.Module:
        model = moon.Moon.adapt_model(params, linear_model(W, B))
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        return model

    local, glob, prev = make(), make(), make()
    client = moon.MoonClient(params)
    state = ClientState(arrays={moon.PREV + k: v for k, v in prev.state_dict().items()})
    scratch = make()
    ctx = context(scratch, X, Y, 4, state=state)
    loss_fn = captured_loss_fn(
        monkeypatch, moon, client, Message("train", arrays=get_arrays(glob)), ctx
    )
    out = loss_fn(local, X, Y)

    def project(m: nn.Module) -> np.ndarray:
        return m.head.projection(X).detach().numpy().astype(np.float64)

    z, zg, zp = project(local), project(glob), project(prev)
    cos = lambda a, b: (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)  # noqa: E731
    pos, neg = cos(z, zg) / 0.7, cos(z, zp) / 0.7
    l_con = np.mean(-pos + np.log(np.exp(pos) + np.exp(neg)))
    logits = local(X).detach().tolist()
    expected = np.mean([ce(row, int(t)) for row, t in zip(logits, Y, strict=True)]) + 2.0 * l_con
    assert float(out.loss.detach()) == pytest.approx(expected, rel=1e-5)
    assert torch.equal(out.features, X)  # body output (identity body here)
    assert torch.allclose(out.logits, local(X))


def test_moon_with_mu_zero_trains_exactly_like_fedavg():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(40, 1, 8, 8, generator=gen)
    y = torch.randint(0, 10, (40,), generator=gen)
    params = moon.Moon.make_params({"mu": 0.0})
    model = moon.Moon.adapt_model(params, build_model("mlp", (1, 8, 8), 10, hidden=16))
    start = get_arrays(model)
    msg = Message("train", arrays=start)
    a = moon.MoonClient(params).handle(msg, context(model, x, y, 10)).arrays
    b = fedavg.FedAvgClient(fedavg.FedAvgParams()).handle(msg, context(model, x, y, 10)).arrays
    assert not torch.equal(a["head.classifier.weight"], start["head.classifier.weight"])
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_moon_client_sampled_again_finds_its_previous_model():
    seen: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    negatives: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    class Spy(moon.MoonClient):
        def plain_train(self, msg, ctx):
            seen[(ctx.round, ctx.client_id)] = {k: v.clone() for k, v in ctx.state.arrays.items()}
            plan = super().plain_train(msg, ctx)
            negatives[(ctx.round, ctx.client_id)] = {
                k[len(moon.PREV_T) :]: v for k, v in plan.tensors.items() if k.startswith("prev/")
            }
            return plan

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(60, 1, 8, 8, generator=gen)
    y = torch.randint(0, 10, (60,), generator=gen)
    parts = [np.arange(0, 20), np.arange(20, 40), np.arange(40, 60)]
    params = moon.Moon.make_params({})
    model = moon.Moon.adapt_model(params, build_model("mlp", (1, 8, 8), 10, hidden=16))
    logic = Spy(params)
    train = LocalTrainConfig(epochs=1, batch_size=8)
    engine = InProcessEngine(logic, FederatedData(x, y, parts, 10), model, train, seed=0)
    global0 = get_arrays(model)
    engine.begin_round(0)
    up0 = engine.exchange({0: Message("train", arrays=global0)})[0].arrays
    engine.exchange({1: Message("train", arrays=global0)})  # reuses the scratch model
    engine.begin_round(1)
    global1 = {k: v + 0.01 for k, v in global0.items()}
    up1 = engine.exchange({0: Message("train", arrays=global1)})[0].arrays

    assert seen[(0, 0)] == {}  # first participation: nothing kept yet
    kept = seen[(1, 0)]
    assert set(kept) == {moon.PREV + k for k in up0}
    assert all(torch.equal(kept[moon.PREV + k], v) for k, v in up0.items())
    # ... it was the negative model of that training, and is now replaced by the new upload.
    assert negatives[(0, 0)] == {}
    assert all(torch.equal(negatives[(1, 0)][k], v) for k, v in up0.items())
    state = engine.client_states[0].arrays
    assert all(torch.equal(state[moon.PREV + k], v) for k, v in up1.items())


# --- FedRS --------------------------------------------------------------------------------


def test_fedrs_scales_only_absent_classes(monkeypatch):
    counts_y = torch.tensor([0, 2, 2])  # classes 0 and 2 present, 1 and 3 absent
    params = fedrs.FedRS.make_params({"alpha": 0.5})
    factors = fedrs.restriction_factors(torch.bincount(counts_y, minlength=4), 0.5)
    assert factors.tolist() == [1.0, 0.5, 1.0, 0.5]
    model = linear_model(W, B)
    ctx = context(model, X, counts_y, 4)
    msg = Message("train", arrays=get_arrays(model))
    loss_fn = captured_loss_fn(monkeypatch, fedrs, fedrs.FedRSClient(params), msg, ctx)
    out = loss_fn(model, X, counts_y)
    restricted = [
        [v * (0.5 if c in (1, 3) else 1.0) for c, v in enumerate(row)] for row in hand_logits(X)
    ]
    expected = np.mean([ce(r, int(t)) for r, t in zip(restricted, counts_y, strict=True)])
    assert float(out.loss.detach()) == pytest.approx(expected, rel=1e-6)
    # Returned logits are the plain head output (what plug-ins and evaluation see).
    assert np.allclose(rows(out.logits), hand_logits(X), atol=1e-6)


def test_fedrs_alpha_one_is_plain_cross_entropy(monkeypatch):
    model = linear_model(W, B)
    ctx = context(model, X, Y, 4)
    msg = Message("train", arrays=get_arrays(model))
    params = fedrs.FedRS.make_params({"alpha": "1"})
    loss_fn = captured_loss_fn(monkeypatch, fedrs, fedrs.FedRSClient(params), msg, ctx)
    expected = np.mean([ce(r, int(t)) for r, t in zip(hand_logits(X), Y, strict=True)])
    assert float(loss_fn(model, X, Y).loss.detach()) == pytest.approx(expected, rel=1e-6)


# --- FedLC --------------------------------------------------------------------------------


def test_fedlc_calibration_values_for_given_counts():
    counts = torch.tensor([16, 1, 0, 81])
    margins = fedlc.calibration_margins(counts, tau=1.0)
    # 16^(-1/4) = 1/2, 1^(-1/4) = 1, 81^(-1/4) = 1/3; the missing class counts as 1e-8: 100.
    assert margins.tolist() == pytest.approx([0.5, 1.0, 100.0, 1 / 3], rel=1e-6)
    assert fedlc.calibration_margins(counts, tau=0.5).tolist() == pytest.approx(
        [0.25, 0.5, 50.0, 1 / 6], rel=1e-6
    )


def test_fedlc_loss_is_cross_entropy_on_calibrated_logits(monkeypatch):
    y = torch.tensor([0, 0, 3])  # local counts: 2, 0, 0, 1
    model = linear_model(W, B)
    ctx = context(model, X, y, 4)
    params = fedlc.FedLC.make_params({"tau": 0.5})
    msg = Message("train", arrays=get_arrays(model))
    loss_fn = captured_loss_fn(monkeypatch, fedlc, fedlc.FedLCClient(params), msg, ctx)
    margin = [0.5 * 2**-0.25, 0.5 * 100.0, 0.5 * 100.0, 0.5 * 1.0]
    calibrated = [[v - m for v, m in zip(row, margin, strict=True)] for row in hand_logits(X)]
    expected = np.mean([ce(r, int(t)) for r, t in zip(calibrated, y, strict=True)])
    out = loss_fn(model, X, y)
    assert float(out.loss.detach()) == pytest.approx(expected, rel=1e-6)
    assert np.allclose(rows(out.logits), hand_logits(X), atol=1e-6)


# --- FedNTD -------------------------------------------------------------------------------


def test_fedntd_not_true_softmax_and_kl_by_hand():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    global_logits = torch.tensor([[5.0, 2.0, 1.0]])
    y = torch.tensor([0])
    assert fedntd.not_true_logits(logits, y).tolist() == [[1.0, 2.0]]
    assert fedntd.not_true_logits(torch.tensor([[0.0, 1.0, 2.0]]), torch.tensor([1])).tolist() == [
        [0.0, 2.0]
    ]
    # Not-true softmaxes: local (s(-1), s(1)), global (s(1), s(-1)) with s the sigmoid; each
    # log ratio is +-1, so KL = s(1) - s(-1) = tanh(1/2).
    kl = fedntd.not_true_distillation(logits, global_logits, y, tau=1.0)
    assert float(kl) == pytest.approx(math.tanh(0.5), rel=1e-6)
    # The true class's logit plays no part.
    moved = fedntd.not_true_distillation(torch.tensor([[9.0, 1.0, 2.0]]), global_logits, y, 1.0)
    assert float(moved) == pytest.approx(math.tanh(0.5), rel=1e-6)
    # tau = 2 halves the logits: log ratios +-1/2, KL = tanh(1/4) / 2, times tau^2 = 4.
    kl2 = fedntd.not_true_distillation(logits, global_logits, y, tau=2.0)
    assert float(kl2) == pytest.approx(4 * math.tanh(0.25) / 2, rel=1e-6)


def test_fedntd_loss_distils_the_global_model_received(monkeypatch):
    params = fedntd.FedNTD.make_params({"tau": 2.0, "beta": 0.5})
    glob_w = [[0.1, 0.2], [-0.3, 0.4], [0.5, -0.6], [0.7, 0.8]]
    glob_b = [0.0, 0.1, -0.1, 0.2]
    glob = linear_model(glob_w, glob_b)
    local = linear_model(W, B)
    ctx = context(linear_model(W, B), X, Y, 4)
    msg = Message("train", arrays=get_arrays(glob))
    loss_fn = captured_loss_fn(monkeypatch, fedntd, fedntd.FedNTDClient(params), msg, ctx)
    out = loss_fn(local, X, Y)
    tau = 2.0
    total = 0.0
    for fl, fg, t in zip(hand_logits(X), hand_logits(X, glob_w, glob_b), Y.tolist(), strict=True):
        others = [c for c in range(4) if c != t]
        zl = sum(math.exp(fl[c] / tau) for c in others)
        zg = sum(math.exp(fg[c] / tau) for c in others)
        kl = sum(
            math.exp(fg[c] / tau)
            / zg
            * math.log((math.exp(fg[c] / tau) / zg) / (math.exp(fl[c] / tau) / zl))
            for c in others
        )
        total += ce(fl, t) + 0.5 * tau**2 * kl
    assert float(out.loss.detach()) == pytest.approx(total / 3, rel=1e-5)
    # Distilling the model from itself leaves plain cross-entropy.
    same = loss_fn(glob, X, Y).loss
    plain = np.mean(
        [ce(r, t) for r, t in zip(hand_logits(X, glob_w, glob_b), Y.tolist(), strict=True)]
    )
    assert float(same.detach()) == pytest.approx(plain, rel=1e-6)


# --- FedDecorr ----------------------------------------------------------------------------


def test_feddecorr_loss_on_given_features():
    # Two samples: every standardised column is +-1/sqrt(2), so each off-diagonal entry of
    # z^T z is +-1 and the loss is 1 / N = 1/2 (up to the 1e-8 in the variance).
    two = torch.tensor([[1.0, 5.0, -2.0], [3.0, 4.0, 7.0]])
    assert float(feddecorr.decorrelation_loss(two)) == pytest.approx(0.5, rel=1e-6)
    z = np.array([[1.0, 2.0, 0.5], [0.0, 1.0, -1.0], [2.0, -1.0, 0.0], [1.5, 0.5, 2.0]])
    n, d = z.shape
    zs = (z - z.mean(0)) / np.sqrt(z.var(0, ddof=1) + 1e-8)
    k = zs.T @ zs / n
    expected = n * (np.sum(k**2) - np.sum(np.diag(k) ** 2)) / (d * (d - 1))
    got = feddecorr.decorrelation_loss(torch.tensor(z, dtype=torch.float32))
    assert float(got) == pytest.approx(expected, rel=1e-5)
    # The standardisation makes the loss blind to per-dimension scale and shift.
    scaled = torch.tensor(z * [3.0, 0.1, 7.0] + [1.0, -4.0, 0.0], dtype=torch.float32)
    assert float(feddecorr.decorrelation_loss(scaled)) == pytest.approx(expected, rel=1e-4)


def test_feddecorr_zero_for_decorrelated_features():
    hadamard = np.array([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]], float)
    z = hadamard[:, 1:] * [2.0, 0.5, 3.0] + [1.0, 2.0, -1.0]  # orthogonal, zero-mean columns
    assert float(feddecorr.decorrelation_loss(torch.tensor(z))) == pytest.approx(0.0, abs=1e-12)
    assert float(feddecorr.decorrelation_loss(torch.ones(1, 3))) == 0.0


def test_feddecorr_loss_adds_beta_times_decorrelation_of_body_features(monkeypatch):
    model = linear_model(W, B)
    ctx = context(model, X, Y, 4)
    params = feddecorr.FedDecorr.make_params({"beta": 0.3})
    msg = Message("train", arrays=get_arrays(model))
    loss_fn = captured_loss_fn(monkeypatch, feddecorr, feddecorr.FedDecorrClient(params), msg, ctx)
    z = X.numpy().astype(np.float64)  # identity body: features are the inputs
    zs = (z - z.mean(0)) / np.sqrt(z.var(0, ddof=1) + 1e-8)
    off = (zs.T @ zs)[0, 1]
    expected = np.mean([ce(r, int(t)) for r, t in zip(hand_logits(X), Y, strict=True)])
    assert float(loss_fn(model, X, Y).loss.detach()) == pytest.approx(
        expected + 0.3 * off**2 / 3, rel=1e-5
    )


# --- parameters ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, defaults",
    [
        ("moon", {"mu": 5.0, "tau": 0.5, "out_dim": 256}),
        ("fedrs", {"alpha": 0.5}),
        ("fedlc", {"tau": 1.0}),
        ("fedntd", {"tau": 1.0, "beta": 1.0}),
        ("feddecorr", {"beta": 0.1}),
    ],
)
def test_defaults_and_bad_values(name, defaults):
    params = vars(get_algorithm(name).make_params({}))
    assert params == {"server_lr": 1.0, **defaults}
    key = next(iter(defaults))
    with pytest.raises(UsageError, match=f"{name}: {key}"):
        get_algorithm(name).make_params({key: -1})


@pytest.mark.parametrize(
    "name", ["fedavg", "fedprox", "moon", "fedrs", "fedlc", "fedntd", "feddecorr"]
)
def test_server_lr_is_checked_once_and_the_error_names_the_algorithm(name):
    with pytest.raises(UsageError, match=f"^{name}: server_lr must be > 0, got 0.0$"):
        get_algorithm(name).make_params({"server_lr": "0"})


# --- end to end ---------------------------------------------------------------------------

FAST = ["--rounds", "3", "--local-epochs", "1", "-q"]
CLIENTS_PER_ROUND = 8  # the default: 40 % of 20 clients
MLP = [(64, 200), (200, 200)]  # digits' default model: 8x8 inputs, hidden 200, 10 classes


def linear_numel(layers: list[tuple[int, int]]) -> int:
    return sum(i * o + o for i, o in layers)


def read_metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def fedavg_rows(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("fedavg")
    assert main(["run", "-a", "fedavg", *FAST, "-o", str(out), "--name", "r"]) == 0
    return read_metrics(out / "r")


@pytest.mark.parametrize(
    "name, head",
    [
        ("moon", [(200, 200), (200, 256), (256, 10)]),  # projection head, then classifier
        ("fedrs", [(200, 10)]),
        ("fedlc", [(200, 10)]),
        ("fedntd", [(200, 10)]),
        ("feddecorr", [(200, 10)]),
    ],
)
def test_runs_end_to_end_with_fedavgs_bytes(tmp_path, fedavg_rows, name, head):
    assert main(["run", "-a", name, *FAST, "-o", str(tmp_path), "--name", "r"]) == 0
    got = read_metrics(tmp_path / "r")
    assert [r["round"] for r in got] == [1, 2, 3]
    model_bytes = 4 * linear_numel(MLP + head)
    for r in got:
        assert math.isfinite(r["accuracy"]) and 0 <= r["accuracy"] <= 1
        assert r["exchanges"] == 1
        assert r["bytes_down"] == CLIENTS_PER_ROUND * model_bytes
        assert r["bytes_up"] == CLIENTS_PER_ROUND * (model_bytes + 2 * 8)  # samples, loss
    if name != "moon":
        assert [r["bytes_up"] for r in got] == [r["bytes_up"] for r in fedavg_rows]


@pytest.mark.parametrize(
    "module, algorithm, client",
    [
        (moon, moon.Moon, moon.MoonClient),
        (fedrs, fedrs.FedRS, fedrs.FedRSClient),
        (fedlc, fedlc.FedLC, fedlc.FedLCClient),
        (fedntd, fedntd.FedNTD, fedntd.FedNTDClient),
        (feddecorr, feddecorr.FedDecorr, feddecorr.FedDecorrClient),
    ],
)
def test_loss_returns_body_features_and_head_logits(monkeypatch, module, algorithm, client):
    # What FedFM's plug-in terms receive: the body's output and the head's output on it.
    params = algorithm.make_params({})
    gen = torch.Generator().manual_seed(4)
    model = algorithm.adapt_model(params, build_model("mlp", (1, 8, 8), 10, hidden=8))
    x = torch.randn(6, 1, 8, 8, generator=gen)
    y = torch.tensor([0, 1, 2, 3, 3, 1])
    ctx = context(model, x, y, 10)
    loss_fn = captured_loss_fn(
        monkeypatch, module, client(params), Message("train", arrays=get_arrays(model)), ctx
    )
    out = loss_fn(model, x, y)
    assert torch.allclose(out.features, model.body(x))
    assert torch.allclose(out.logits, model.head(model.body(x)))
    assert out.loss.requires_grad and out.loss.dim() == 0


def test_moon_composes_with_feature_matching(tmp_path, fedavg_rows):
    args = ["run", "-a", "moon", "--feature-matching", "-p", "start_round=0", *FAST]
    assert main([*args, "-o", str(tmp_path), "--name", "r"]) == 0
    got = read_metrics(tmp_path / "r")
    assert [r["round"] for r in got] == [r["round"] for r in fedavg_rows]
    assert all(math.isfinite(r["accuracy"]) for r in got)
