"""FedROD, FedNH, CReFF and generalised FedProto: each distinctive mechanism against values
computed here by hand, per-client state, and each method end to end through the CLI (exact
traffic per round)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedskew.algorithms import creff, fednh, fedproto, fedrod, get_algorithm
from fedskew.apps.cli import main
from fedskew.assembly.prepare import prepare
from fedskew.config import ExperimentConfig
from fedskew.core.errors import UsageError
from fedskew.data.federated import FederatedData
from fedskew.engines.inprocess import InProcessEngine
from fedskew.models import build_model
from fedskew.runs.loop import run
from fedskew.training import local
from fedskew.training.interface import LocalTrainConfig, ServerSetup
from fedskew.training.local import TrainResult, set_arrays
from fedskew.training.protocol import Message

C, IN, HID = 4, 6, 8  # classes, input size, feature size of the small test model


# --- helpers ------------------------------------------------------------------------------


def toy_data(seed: int = 0, per_client: tuple[dict[int, int], ...] = ()) -> FederatedData:
    """Gaussian blobs, one per class; ``per_client`` gives each client's class counts."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(C, IN, generator=gen) * 3
    xs, ys, parts, start = [], [], [], 0
    for counts in per_client:
        labels = torch.tensor([c for c, n in counts.items() for _ in range(n)], dtype=torch.int64)
        xs.append(centres[labels] + torch.randn(len(labels), IN, generator=gen))
        ys.append(labels)
        parts.append(np.arange(start, start + len(labels)))
        start += len(labels)
    return FederatedData(torch.cat(xs), torch.cat(ys), parts, C)


def toy_test_set(seed: int = 1, n: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    centres = torch.randn(C, IN, generator=gen) * 3  # the same blobs as toy_data
    gen = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % C
    return centres[y] + torch.randn(n, IN, generator=gen), y


CLIENTS = ({0: 9, 1: 5}, {1: 3, 2: 8, 3: 4}, {0: 2, 3: 10})


class Recorder(InProcessEngine):
    """The in-process engine, keeping every message that crossed the channel."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[tuple[int, Message, Message]] = []

    def exchange(self, messages, expect=None):
        replies = super().exchange(messages, expect)
        self.log.extend((c, messages[c], replies[c]) for c in messages)
        return replies


def setup_run(alg, params, train=None, rounds=3, eval_every=1, seed=0, data=None, bias=True):
    """(server, engine, model) for ``alg`` on the toy data with a small MLP."""
    data = data or toy_data(per_client=CLIENTS)
    torch.manual_seed(seed)
    model = build_model("mlp", (IN,), C, hidden=HID)
    if not bias:
        model.head = torch.nn.Linear(HID, C, bias=False)
    model = alg.adapt_model(params, model)
    train = train or LocalTrainConfig(epochs=1, batch_size=8, lr=0.1, momentum=0.0)
    setup = ServerSetup(
        initial_arrays=model.state_dict(),
        num_clients=data.num_clients,
        num_classes=C,
        client_sizes=data.sizes(),
        seed=seed,
        train=train,
        rounds=rounds,
        eval_every=eval_every,
    )
    server = alg.Server(params, setup)
    engine = Recorder(alg.Client(params), data, model, train, seed, test=toy_test_set())
    return server, engine, model


def one_step_config(lr: float = 0.5) -> LocalTrainConfig:
    """One full-batch plain SGD step: the update is -lr times the mean gradient."""
    return LocalTrainConfig(epochs=1, batch_size=1000, lr=lr, momentum=0.0, weight_decay=0.0)


def fresh_model(alg, params, arrays):
    model = alg.adapt_model(params, build_model("mlp", (IN,), C, hidden=HID))
    set_arrays(model, arrays)
    return model


def client_xy(data: FederatedData, cid: int) -> tuple[torch.Tensor, torch.Tensor]:
    d = data.client(cid)
    return d.batch(torch.arange(len(d)))


class FixedChannel:
    """Answers every exchange with prepared replies."""

    def __init__(self, replies: dict[int, Message]) -> None:
        self.replies = replies
        self.sent: dict[int, Message] = {}

    def exchange(self, messages, expect=None):
        self.sent.update(messages)
        return {c: self.replies[c] for c in messages}


# --- FedROD -------------------------------------------------------------------------------


def test_fedrod_balanced_softmax_is_ce_on_count_shifted_logits_by_hand():
    logits = torch.tensor([[0.3, -1.2, 2.0, 0.1], [1.5, 0.2, -0.4, 0.0], [-0.7, 0.9, 0.5, 1.1]])
    y = torch.tensor([0, 2, 3])
    counts = torch.tensor([3, 0, 1, 6])  # class 1 missing: it must leave the softmax
    expected = []
    for row, t in zip(logits.tolist(), y.tolist(), strict=True):
        # -log(n_y e^f_y / sum_{c: n_c > 0} n_c e^f_c)
        den = sum(n * math.exp(f) for f, n in zip(row, counts.tolist(), strict=True) if n > 0)
        expected.append(-math.log(counts[t].item() * math.exp(row[t]) / den))
    logits.requires_grad_(True)
    loss = fedrod.balanced_softmax_loss(logits, y, fedrod.balanced_shift(counts, 1.0))
    assert loss.item() == pytest.approx(sum(expected) / 3, rel=1e-6)
    loss.backward()
    assert torch.isfinite(logits.grad).all()
    assert torch.equal(logits.grad[:, 1], torch.zeros(3))  # the missing class gets no push
    # gamma = 0 is plain CE over all classes (0 * log 0 must not become nan)
    plain = fedrod.balanced_softmax_loss(logits, y, fedrod.balanced_shift(counts, 0.0))
    by_hand = sum(
        -row[t] + math.log(sum(math.exp(f) for f in row))
        for row, t in zip(logits.tolist(), y.tolist(), strict=True)
    )
    assert plain.item() == pytest.approx(by_hand / 3, rel=1e-6)


def test_fedrod_one_step_trains_shared_part_on_bsm_and_personal_head_on_detached_sum():
    params = fedrod.FedROD.make_params({})
    server, engine, _ = setup_run(fedrod.FedROD, params, train=one_step_config(lr=0.5))
    start = {k: v.clone() for k, v in server.global_arrays.items()}
    server.round(0, [1], engine)
    _, _, reply = engine.log[0]
    x, y = client_xy(engine.data, 1)
    counts = torch.bincount(y, minlength=C).float()  # [0, 3, 8, 4]

    # Shared part: one SGD step on the balanced softmax, written out here.
    model = fresh_model(fedrod.FedROD, params, start)
    logits = model(x)
    present = counts > 0
    scores = logits[:, present] + counts[present].log()
    target = logits.gather(1, y[:, None])[:, 0] + counts[y].log()
    bsm = (torch.logsumexp(scores, dim=1) - target).mean()
    grads = torch.autograd.grad(bsm, list(model.parameters()))
    for (name, p), g in zip(model.named_parameters(), grads, strict=True):
        assert torch.allclose(reply.arrays[name], p.detach() - 0.5 * g, atol=1e-6), name

    # Personal head: from zero, one step on CE(g(h) + p(h)) with g and h held fixed.
    with torch.no_grad():
        h = model.body(x)
        residual = (logits.detach().softmax(dim=1) - F.one_hot(y, C)) / len(y)
    state = engine.client_states[1].arrays
    assert torch.allclose(state[fedrod.PHEAD_WEIGHT], -0.5 * residual.t() @ h, atol=1e-6)
    assert torch.allclose(state[fedrod.PHEAD_BIAS], -0.5 * residual.sum(dim=0), atol=1e-6)


def test_fedrod_personal_head_never_leaves_the_client_and_survives_other_clients():
    params = fedrod.FedROD.make_params({})
    server, engine, model = setup_run(fedrod.FedROD, params, rounds=3, eval_every=3)
    keys = set(model.state_dict())
    m0 = server.round(0, [0, 1], engine)
    assert "personal_accuracy" not in m0  # not an evaluation round
    snapshot = {k: v.clone() for k, v in engine.client_states[0].arrays.items()}
    assert set(snapshot) == {fedrod.PHEAD_WEIGHT, fedrod.PHEAD_BIAS}
    assert snapshot[fedrod.PHEAD_WEIGHT].abs().sum() > 0  # it trained
    server.round(1, [1, 2], engine)  # others train on the shared scratch model meanwhile
    for k, v in snapshot.items():
        assert torch.equal(engine.client_states[0].arrays[k], v)

    # Round 2 (an evaluation round): client 0 again, with a zero learning rate, so that
    # what it reports must come from exactly the head it kept.
    engine.train = LocalTrainConfig(epochs=1, batch_size=8, lr=0.0, momentum=0.0)
    sent = {k: v.clone() for k, v in server.global_arrays.items()}
    m2 = server.round(2, [0], engine)
    trained = fresh_model(fedrod.FedROD, params, sent)
    x_test, y_test = toy_test_set()
    with torch.no_grad():
        h = trained.body(x_test)
        pred = (trained.head(h) + h @ snapshot[fedrod.PHEAD_WEIGHT].t()).add(
            snapshot[fedrod.PHEAD_BIAS]
        )
    hit = (pred.argmax(dim=1) == y_test).float()
    per_class = [hit[y_test == c].mean().item() for c in range(C)]
    props = [9 / 14, 5 / 14, 0.0, 0.0]  # client 0 holds 9 of class 0 and 5 of class 1
    by_hand = sum(p * a for p, a in zip(props, per_class, strict=True))
    assert m2["personal_accuracy"] == pytest.approx(by_hand, abs=1e-9)
    for k, v in snapshot.items():
        assert torch.equal(engine.client_states[0].arrays[k], v)

    # No message in any direction carried the personal head, nor anything but the model.
    for _, down, up in engine.log:
        assert set(down.arrays) == keys and set(up.arrays) == keys
        for t in [*down.arrays.values(), *up.arrays.values()]:
            for p in snapshot.values():
                assert not (t.shape == p.shape and torch.allclose(t, p))
    evaluate_flags = [down.scalars.get("evaluate") for _, down, _ in engine.log]
    assert evaluate_flags == [None, None, None, None, 1.0]


def test_fedrod_generic_head_init_copies_the_received_head():
    params = fedrod.FedROD.make_params({"phead_init": "generic"})
    server, engine, _ = setup_run(fedrod.FedROD, params, train=one_step_config(lr=1e-12))
    head = server.global_arrays["head.weight"].clone()
    server.round(0, [0], engine)
    assert torch.allclose(engine.client_states[0].arrays[fedrod.PHEAD_WEIGHT], head, atol=1e-9)


# --- FedNH --------------------------------------------------------------------------------


def test_fednh_head_is_scaled_cosine_to_spread_unit_prototypes():
    params = fednh.FedNH.make_params({})
    model = fednh.FedNH.adapt_model(params, build_model("mlp", (IN,), C, hidden=HID))
    protos = model.head.prototypes
    assert "head.prototypes" in model.state_dict() and "head.scale" in model.state_dict()
    assert all(n != "head.prototypes" for n, _ in model.named_parameters())  # frozen
    assert torch.allclose(protos @ protos.t(), torch.eye(C), atol=1e-5)  # d >= C: orthonormal
    assert model.head.scale.item() == 1.0
    x = torch.randn(5, IN)
    h = model.body(x)
    cos = torch.tensor(
        [[float(hi @ p / (hi.norm() * p.norm())) for p in protos] for hi in h.detach()]
    )
    assert torch.allclose(model(x).detach(), cos, atol=1e-5)
    # d < C: unit rows on the sphere; a ResNet starts with scale 20; a number overrides
    wide = fednh.init_prototypes(10, 3, torch.Generator().manual_seed(0))
    assert torch.allclose(wide.norm(dim=1), torch.ones(10), atol=1e-6)
    resnet = build_model("resnet18", (3, 16, 16), 10)
    assert fednh.resolve_scale(params, resnet) == 20.0
    assert fednh.resolve_scale(fednh.FedNH.make_params({"scale_init": "5"}), resnet) == 5.0


def test_fednh_local_steps_leave_prototypes_and_move_scale_and_upload_scaled_means():
    params = fednh.FedNH.make_params({})
    server, engine, model = setup_run(fednh.FedNH, params, train=one_step_config(lr=0.5))
    sent = {k: v.clone() for k, v in server.global_arrays.items()}
    server.round(0, [1], engine)
    _, down, up = engine.log[0]
    assert torch.equal(model.head.prototypes, sent["head.prototypes"])  # after local steps
    assert "head.prototypes" not in up.arrays
    assert up.arrays["head.scale"].item() != sent["head.scale"].item()
    # upload: for each class held, n_c * normalize(mean_i normalize(h_i)), trained body
    trained = fresh_model(
        fednh.FedNH, params, {**sent, **{k: up.arrays[k] for k in sent if k in up.arrays}}
    )
    x, y = client_xy(engine.data, 1)
    with torch.no_grad():
        h = trained.body(x)
    assert up.arrays["proto_classes"].tolist() == [1, 2, 3]
    for row, c in zip(up.arrays["proto_sums"], [1, 2, 3], strict=True):
        units = [v / v.norm() for v in h[y == c]]
        mean = sum(units) / len(units)
        assert torch.allclose(row, len(units) * mean / mean.norm(), atol=1e-5)


def test_fednh_server_prototype_update_by_formula():
    params = fednh.FedNH.make_params({"rho": 0.9})
    server, _, _ = setup_run(fednh.FedNH, params)
    mu = server.global_arrays["head.prototypes"].clone()
    body = {k: v for k, v in server.global_arrays.items() if k.startswith("body.")}
    nu = F.normalize(torch.randn(3, HID), dim=1)  # client class means (unit)
    replies = {
        0: Message(
            "trained",
            arrays={
                **{k: v + 1 for k, v in body.items()},
                "head.scale": torch.tensor([2.0]),
                "proto_classes": torch.tensor([0, 2]),
                "proto_sums": torch.stack([4 * nu[0], 1 * nu[1]]),
            },
            scalars={"num_samples": 5.0, "loss": 1.0},
        ),
        1: Message(
            "trained",
            arrays={
                **{k: v - 1 for k, v in body.items()},
                "head.scale": torch.tensor([4.0]),
                "proto_classes": torch.tensor([2]),
                "proto_sums": torch.stack([3 * nu[2]]),
            },
            scalars={"num_samples": 15.0, "loss": 3.0},
        ),
    }
    metrics = server.round(0, [0, 1], FixedChannel(replies))

    def unit(v):
        return v / v.norm()

    new = server.global_arrays["head.prototypes"]
    mean0 = unit((4 * nu[0]) / 4)
    mean2 = unit((1 * nu[1] + 3 * nu[2]) / (1 + 3))
    assert torch.allclose(new[0], unit(0.9 * mu[0] + 0.1 * mean0), atol=1e-6)
    assert torch.allclose(new[2], unit(0.9 * mu[2] + 0.1 * mean2), atol=1e-6)
    assert torch.equal(new[1], mu[1]) and torch.equal(new[3], mu[3])  # nobody held 1 or 3
    # body and scale: FedAvg, weighted 5 : 15
    assert server.global_arrays["head.scale"].item() == pytest.approx(0.25 * 2 + 0.75 * 4)
    assert metrics["scale"] == pytest.approx(3.5)
    for k, v in body.items():
        assert torch.allclose(server.global_arrays[k], v + 0.25 - 0.75, atol=1e-6)


# --- CReFF --------------------------------------------------------------------------------


def small_creff(**kw):
    values = {"num_features": 6, "match_epochs": 20, "crt_epochs": 30, **kw}
    return creff.CReFF.make_params(values)


def test_creff_client_uploads_per_class_head_gradients_of_the_received_model():
    params = small_creff()
    server, engine, _ = setup_run(creff.CReFF, params)
    server.classifier = {
        creff.CLF_WEIGHT: torch.randn(C, HID),
        creff.CLF_BIAS: torch.randn(C),
    }
    sent = {k: v.clone() for k, v in server.global_arrays.items()}
    server.round(0, [1], engine)
    _, down, up = engine.log[0]
    server_weight = down.arrays[creff.CLF_WEIGHT]
    received = fresh_model(creff.CReFF, params, sent).eval()  # the body BEFORE local training
    x, y = client_xy(engine.data, 1)
    assert up.arrays[creff.GRAD_CLASSES].tolist() == [1, 2, 3]
    for k, c in enumerate([1, 2, 3]):
        w = server_weight.clone().requires_grad_(True)
        b = down.arrays[creff.CLF_BIAS].clone().requires_grad_(True)
        with torch.no_grad():
            h = received.body(x[y == c])
        loss = F.cross_entropy(h @ w.t() + b, torch.full((len(h),), c))
        gw, gb = torch.autograd.grad(loss, [w, b])
        assert torch.allclose(up.arrays[creff.GRAD_WEIGHT][k], gw, atol=1e-6)
        assert torch.allclose(up.arrays[creff.GRAD_BIAS][k], gb, atol=1e-6)


def syn_distance(features, classes, w, b, real) -> float:
    """The default matching distance, from autograd gradients and cosines written here."""
    total = 0.0
    for k, c in enumerate(classes):
        wv, bv = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
        loss = F.cross_entropy(features[k] @ wv.t() + bv, torch.full((len(features[k]),), c))
        gw, gb = torch.autograd.grad(loss, [wv, bv])
        for row_s, row_r in zip(gw, real[0][k], strict=True):  # one row per class of W
            total += 1 - float(row_s @ row_r) / (float(row_s.norm() * row_r.norm()) + 1e-6)
        total += 1 - float(gb @ real[1][k]) / (float(gb.norm() * real[1][k].norm()) + 1e-6)
    return total


def test_creff_gradient_matching_reduces_the_matching_distance():
    params = small_creff(match_epochs=50, lr_feature=0.1)
    server, _, _ = setup_run(creff.CReFF, params)
    w, b = torch.randn(C, HID), torch.randn(C)
    server.classifier = {creff.CLF_WEIGHT: w, creff.CLF_BIAS: b}
    classes = [0, 2, 3]
    # "real" gradients: those of some real features of each class
    real_feats = torch.randn(len(classes), 20, HID) + 2
    real_w, real_b = [], []
    for k, c in enumerate(classes):
        wv, bv = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
        loss = F.cross_entropy(real_feats[k] @ wv.t() + bv, torch.full((20,), c))
        gw, gb = torch.autograd.grad(loss, [wv, bv])
        real_w.append(gw)
        real_b.append(gb)
    real = [torch.stack(real_w), torch.stack(real_b)]
    before_all = server.features.clone()
    before = syn_distance(before_all[classes], classes, w, b, real)
    reported = server.match(torch.tensor(classes), real)
    after = syn_distance(server.features[classes], classes, w, b, real)
    assert after < 0.5 * before
    assert reported == pytest.approx(after, rel=1e-4)
    assert torch.equal(server.features[1], before_all[1])  # no client held class 1


def test_creff_gradient_aggregation_is_a_plain_mean_over_holders():
    server, _, _ = setup_run(creff.CReFF, small_creff())
    g = torch.randn(3, C, HID)
    gb = torch.randn(3, C)
    replies = [
        Message(
            "t",
            arrays={
                creff.GRAD_CLASSES: torch.tensor([0, 2]),
                creff.GRAD_WEIGHT: g[:2],
                creff.GRAD_BIAS: gb[:2],
            },
        ),  # fmt: skip
        Message(
            "t",
            arrays={
                creff.GRAD_CLASSES: torch.tensor([2]),
                creff.GRAD_WEIGHT: g[2:],
                creff.GRAD_BIAS: gb[2:],
            },
        ),  # fmt: skip
    ]
    classes, real = server.aggregate_gradients(replies)
    assert classes.tolist() == [0, 2]
    assert torch.allclose(real[0][0], g[0]) and torch.allclose(real[0][1], (g[1] + g[2]) / 2)
    assert torch.allclose(real[1][1], (gb[1] + gb[2]) / 2)


def test_creff_evaluates_the_retrained_classifier_on_the_fedavg_body():
    # No matching steps, and federated features we choose: well apart per class, so a
    # classifier re-trained on them must separate them, while FedAvg's head knows nothing
    # of them.
    params = small_creff(match_epochs=0, crt_epochs=100, lr_net=0.5)
    server, engine, _ = setup_run(creff.CReFF, params)
    gen = torch.Generator().manual_seed(3)
    centres = torch.eye(C, HID) * 6
    server.features = centres[:, None, :] + torch.randn(C, params.num_features, HID, generator=gen)
    server.round(0, [0, 1, 2], engine)
    ups = [up for _, _, up in engine.log]
    sizes = [14.0, 15.0, 12.0]
    ev = server.eval_arrays()
    for k, v in server.global_arrays.items():
        avg = sum(s * up.arrays[k] for s, up in zip(sizes, ups, strict=True)) / sum(sizes)
        assert torch.allclose(v, avg, atol=1e-6), k  # FedAvg goes on with the whole model
        if k.startswith("body."):
            assert torch.equal(ev[k], v)
    assert torch.equal(ev["head.weight"], server.classifier[creff.CLF_WEIGHT])
    assert torch.equal(ev["head.bias"], server.classifier[creff.CLF_BIAS])
    assert not torch.allclose(ev["head.weight"], server.global_arrays["head.weight"])
    feats = server.features.reshape(-1, HID)
    labels = torch.arange(C).repeat_interleave(params.num_features)
    pred = (feats @ ev["head.weight"].t() + ev["head.bias"]).argmax(dim=1)
    assert torch.equal(pred, labels)
    # and it is the classifier the next round's clients compute their gradients with
    server.round(1, [0], engine)
    _, down, _ = engine.log[-1]
    assert torch.equal(down.arrays[creff.CLF_WEIGHT], ev["head.weight"])


def test_creff_with_a_bias_free_head():
    server, engine, model = setup_run(creff.CReFF, small_creff(), bias=False)
    server.round(0, [0, 1], engine)
    assert all(creff.GRAD_BIAS not in up.arrays for _, _, up in engine.log)
    assert set(server.eval_arrays()) == set(model.state_dict())
    assert math.isfinite(server.round(1, [2], engine)["match_distance"])


# --- FedProto -----------------------------------------------------------------------------


def test_fedproto_regulariser_by_hand():
    h = torch.tensor([[1.0, 2.0], [0.0, -1.0], [3.0, 1.0]])
    y = torch.tensor([0, 1, 2])
    protos = torch.tensor([[0.5, 1.0], [9.0, 9.0], [1.0, 1.0]])
    known = torch.tensor([True, False, True])  # class 1 has no prototype: adds nothing
    sq = [(1 - 0.5) ** 2 + (2 - 1) ** 2, 0.0, (3 - 1) ** 2 + (1 - 1) ** 2]
    mse = fedproto.prototype_regulariser(h, y, protos, known, "mse")
    assert mse.item() == pytest.approx(sum(sq) / (3 * 2))
    per_sample = fedproto.prototype_regulariser(h, y, protos, known, "sq")
    assert per_sample.item() == pytest.approx(sum(sq) / 3)


def test_fedproto_client_step_uses_received_prototypes_and_uploads_class_means():
    params = fedproto.FedProto.make_params({"ld": 2.0})
    server, engine, _ = setup_run(fedproto.FedProto, params, train=one_step_config(lr=0.3))
    protos = torch.randn(C, HID)
    server.prototypes, server.known = protos.clone(), torch.tensor([False, True, True, False])
    sent = {k: v.clone() for k, v in server.global_arrays.items()}
    server.round(0, [1], engine)
    _, down, up = engine.log[0]
    assert down.arrays[fedproto.PROTO_CLASSES].tolist() == [1, 2]
    assert torch.equal(down.arrays[fedproto.PROTOS], protos[[1, 2]])
    x, y = client_xy(engine.data, 1)  # classes 1, 2, 3; class 3 has no prototype
    model = fresh_model(fedproto.FedProto, params, sent)
    h = model.body(x)
    reg = sum(((h[i] - protos[c]) ** 2).sum() for i, c in enumerate(y.tolist()) if c in (1, 2))
    loss = F.cross_entropy(model.head(h), y) + 2.0 * reg / (len(y) * HID)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    for (name, p), g in zip(model.named_parameters(), grads, strict=True):
        assert torch.allclose(up.arrays[name], p.detach() - 0.3 * g, atol=1e-6), name
    trained = fresh_model(fedproto.FedProto, params, {k: up.arrays[k] for k in sent})
    with torch.no_grad():
        h = trained.body(x)
    assert up.arrays[fedproto.PROTO_CLASSES].tolist() == [1, 2, 3]
    assert up.arrays[fedproto.PROTO_COUNTS].tolist() == [3, 8, 4]
    for row, c in zip(up.arrays[fedproto.PROTOS], [1, 2, 3], strict=True):
        assert torch.allclose(row, h[y == c].mean(dim=0), atol=1e-6)


def proto_reply(classes, means, counts, body, n):
    return Message(
        "trained",
        arrays={
            **body,
            fedproto.PROTOS: torch.tensor(means),
            fedproto.PROTO_CLASSES: torch.tensor(classes),
            fedproto.PROTO_COUNTS: torch.tensor(counts),
        },
        scalars={"num_samples": n, "loss": 0.0},
    )


@pytest.mark.parametrize("keep_stale", [True, False])
def test_fedproto_server_aggregates_prototypes_by_counts(keep_stale):
    params = fedproto.FedProto.make_params({"keep_stale": keep_stale})
    server, _, _ = setup_run(fedproto.FedProto, params)
    body = dict(server.global_arrays)
    d = [0.0] * (HID - 2)
    r0 = {
        0: proto_reply([0, 1], [[1.0, 2.0, *d], [0.0, 4.0, *d]], [3, 1], body, 4.0),
        1: proto_reply([1, 3], [[2.0, 0.0, *d], [5.0, 5.0, *d]], [3, 2], body, 5.0),
    }
    server.round(0, [0, 1], FixedChannel(r0))
    assert server.known.tolist() == [True, True, False, True]
    p = server.prototypes
    assert p[0, :2].tolist() == pytest.approx([1.0, 2.0])
    # class 1: (1 * [0, 4] + 3 * [2, 0]) / 4
    assert p[1, :2].tolist() == pytest.approx([1.5, 1.0])
    assert p[3, :2].tolist() == pytest.approx([5.0, 5.0])
    # round 1: only class 1 is held; the others keep their prototype or are forgotten
    r1 = {2: proto_reply([1], [[8.0, 8.0, *d]], [2], body, 2.0)}
    channel = FixedChannel(r1)
    server.round(1, [2], channel)
    sent = channel.sent[2].arrays
    assert sent[fedproto.PROTO_CLASSES].tolist() == [0, 1, 3]  # what round 0 produced
    assert server.prototypes[1, :2].tolist() == pytest.approx([8.0, 8.0])
    if keep_stale:
        assert server.known.tolist() == [True, True, False, True]
        assert server.prototypes[3, :2].tolist() == pytest.approx([5.0, 5.0])
    else:
        assert server.known.tolist() == [False, True, False, False]


# --- parameters ---------------------------------------------------------------------------


def test_paper_defaults():
    assert vars(fedrod.FedROD.make_params({})) == {"gamma": 1.0, "phead_init": "zeros"}
    assert vars(fednh.FedNH.make_params({})) == {"rho": 0.9, "scale_init": "auto"}
    assert vars(creff.CReFF.make_params({})) == {
        "num_features": 100,
        "match_epochs": 100,
        "crt_epochs": 300,
        "lr_feature": 0.1,
        "lr_net": 0.01,
        "dis_metric": "ours",
    }
    assert vars(fedproto.FedProto.make_params({})) == {
        "ld": 1.0,
        "distance": "mse",
        "keep_stale": True,
    }


@pytest.mark.parametrize(
    "name, values, needle",
    [
        ("fedrod", {"gamma": "-1"}, "gamma"),
        ("fedrod", {"phead_init": "random"}, "phead_init"),
        ("fednh", {"rho": "1.5"}, "rho"),
        ("fednh", {"scale_init": "big"}, "scale_init"),
        ("fednh", {"scale_init": "0"}, "scale_init"),
        ("creff", {"num_features": "0"}, "num_features"),
        ("creff", {"lr_net": "0"}, "lr_net"),
        ("creff", {"dis_metric": "l1"}, "dis_metric"),
        ("fedproto", {"ld": "-1"}, "ld"),
        ("fedproto", {"distance": "l1"}, "distance"),
    ],
)
def test_bad_values_are_refused_with_one_line(name, values, needle):
    with pytest.raises(UsageError, match=needle):
        get_algorithm(name).make_params(values)


# --- end to end through the CLI -----------------------------------------------------------

FAST = ["--rounds", "3", "--local-epochs", "1", "-q"]
SMALL_CREFF = ["-p", "num_features=10", "-p", "match_epochs=5", "-p", "crt_epochs=5"]
DEFAULTS = {
    "fedrod": [],
    "fednh": [],
    "creff": SMALL_CREFF,
    "fedproto": [],
}


def read_rows(folder: Path) -> list[dict]:
    return [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]


def cli_run(tmp: Path, name: str, *args: str) -> list[dict]:
    assert main(["run", "-o", str(tmp), "--name", name, *FAST, *args]) == 0
    rows = read_rows(tmp / name)
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["accuracy"]) and 0 <= r["accuracy"] <= 1 for r in rows)
    return rows


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    tmp = tmp_path_factory.mktemp("head")
    out = {"fedavg": cli_run(tmp, "fedavg")}
    for name, args in DEFAULTS.items():
        out[name] = cli_run(tmp, name, "-a", name, *args)
    return out


@pytest.fixture(scope="module")
def digits():
    """Facts of the default digits run: model sizes and each client's classes."""
    prep = prepare(ExperimentConfig(rounds=3, local_epochs=1, quiet=True))
    model = build_model("mlp", (1, 8, 8), 10)
    body = sum(p.numel() for n, p in model.state_dict().items() if n.startswith("body."))
    total = sum(p.numel() for p in model.state_dict().values())
    held = [int((row > 0).sum()) for row in prep.fed.class_counts()]
    classes = [set(np.nonzero(row)[0].tolist()) for row in prep.fed.class_counts()]
    return {"P": total, "body": body, "d": 200, "C": 10, "held": held, "classes": classes}


def test_fedavg_reference_traffic(runs, digits):
    for r in runs["fedavg"]:
        assert r["bytes_down"] == 8 * 4 * digits["P"]
        assert r["bytes_up"] == 8 * (4 * digits["P"] + 16)


def test_fedrod_traffic_and_personal_accuracy(runs, digits):
    # the model both ways; down the evaluate flag (every round evaluates here), up the
    # sample count, the loss and the personalised accuracy
    for r in runs["fedrod"]:
        assert r["bytes_down"] == 8 * (4 * digits["P"] + 8)
        assert r["bytes_up"] == 8 * (4 * digits["P"] + 24)
        assert 0 <= r["personal_accuracy"] <= 1


def test_fednh_traffic(runs, digits):
    d, c = digits["d"], digits["C"]
    for r in runs["fednh"]:
        # down: body, scale, prototypes; up: body, scale, held classes' sums and indices
        assert r["bytes_down"] == 8 * 4 * (digits["body"] + 1 + c * d)
        up = sum(4 * (digits["body"] + 1) + digits["held"][k] * (4 * d + 8) + 16
                 for k in r["clients"])  # fmt: skip
        assert r["bytes_up"] == up


def test_creff_traffic(runs, digits):
    d, c = digits["d"], digits["C"]
    head = c * d + c  # the classifier the gradients are taken for (weight and bias)
    for r in runs["creff"]:
        assert r["bytes_down"] == 8 * 4 * (digits["P"] + head)
        up = sum(4 * digits["P"] + digits["held"][k] * (4 * head + 8) + 16 for k in r["clients"])
        assert r["bytes_up"] == up
        assert math.isfinite(r["match_distance"])


def test_fedproto_traffic(runs, digits):
    d = digits["d"]
    known: set[int] = set()
    for r in runs["fedproto"]:
        # down: the model and the prototypes of every class seen so far (with indices)
        assert r["bytes_down"] == 8 * (4 * digits["P"] + len(known) * (4 * d + 8))
        up = sum(4 * digits["P"] + digits["held"][k] * (4 * d + 8 + 8) + 16 for k in r["clients"])
        assert r["bytes_up"] == up
        for k in r["clients"]:
            known |= digits["classes"][k]


@pytest.mark.parametrize(
    "name, args",
    [
        ("fedrod", ["-p", "gamma=0"]),
        ("fedrod", ["-p", "phead_init=generic"]),
        ("fednh", ["-p", "scale_init=20", "-p", "rho=0.5"]),
        ("creff", [*SMALL_CREFF, "-p", "dis_metric=mse"]),
        ("creff", [*SMALL_CREFF, "-p", "dis_metric=cos"]),
        ("fedproto", ["-p", "distance=sq", "-p", "keep_stale=false"]),
    ],
)
def test_switches_run_end_to_end(tmp_path, runs, name, args):
    rows = cli_run(tmp_path, "r", "-a", name, *args)
    assert [r["round"] for r in rows] == [r["round"] for r in runs["fedavg"]]
    assert all(math.isfinite(r["accuracy"]) and math.isfinite(r["train_loss"]) for r in rows)


@pytest.mark.parametrize("name", list(DEFAULTS))
def test_composes_with_feature_matching(tmp_path, name):
    rows = cli_run(
        tmp_path, "r", "-a", name, "--feature-matching", "-p", "start_round=0", *DEFAULTS[name]
    )
    assert all(r["fm_active"] == 1.0 for r in rows)


@pytest.mark.parametrize("name", list(DEFAULTS))
def test_resumed_run_equals_uninterrupted(tmp_path, name):
    """Server state (CReFF's features and classifier, FedProto's prototypes) and client
    state (FedROD's personal heads) survive a checkpoint."""
    params = {"num_features": 10, "match_epochs": 5, "crt_epochs": 5} if name == "creff" else {}
    common = dict(algorithm=name, params=params, rounds=4, local_epochs=1, quiet=True, seed=2)
    keys = ("clients", "accuracy", "loss", "bytes_down", "bytes_up", "personal_accuracy")

    def rows(folder: Path) -> list[dict]:
        return [{k: r.get(k) for k in keys} for r in read_rows(folder)]

    full, _ = run(ExperimentConfig(out_dir=str(tmp_path / "a"), name="r", **common))

    def stop_after_two(record):
        if record["round"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(ExperimentConfig(out_dir=str(tmp_path / "b"), name="r", **common), stop_after_two)
    assert main(["run", "--resume", str(tmp_path / "b" / "r.incomplete"), "-q"]) == 0
    assert rows(tmp_path / "b" / "r") == rows(full)


def test_loss_functions_return_body_features_and_head_logits(monkeypatch):
    """Each client's loss hands the plug-ins body(x) and head(body(x))."""
    seen = {}
    # Both train through run_plain, which calls fedskew.training.local's train_client.
    for alg, params in [(fedrod.FedROD, {}), (fedproto.FedProto, {})]:

        def spy(ctx, *, loss_fn, **_):
            x, y = ctx.data.batch(torch.arange(len(ctx.data)))
            out = loss_fn(ctx.model, x, y)
            seen["ok"] = torch.allclose(out.features, ctx.model.body(x)) and torch.allclose(
                out.logits, ctx.model.head(ctx.model.body(x))
            )
            return TrainResult(0, 0, 0.0)

        monkeypatch.setattr(local, "train_client", spy)
        server, engine, _ = setup_run(alg, alg.make_params(params))
        server.round(0, [0], engine)
        assert seen.pop("ok"), alg.name
    # FedNH and CReFF train with the shared CE loss, which returns LossOutput(features, logits)
