"""FedCME: matching, classifier exchange, memory of global features, alignment loss,
evaluation vectors, cold start, and the CLI with exact communication per round."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch import nn

from fedskew.algorithms import get_algorithm
from fedskew.algorithms.fedcme import (
    EVAL_VECTOR,
    HALF,
    FedCMEClient,
    FedCMEParams,
    FedCMEServer,
    aggregate_features,
    alignment_loss,
    eval_subset,
    evaluation_vector,
    fedcme_loss,
    match_many_to_one,
    match_one_to_one,
)
from fedskew.apps.cli import main
from fedskew.assembly.prepare import new_model, prepare
from fedskew.config import ExperimentConfig
from fedskew.core.errors import UsageError
from fedskew.core.rng import torch_rng
from fedskew.data.federated import FederatedData
from fedskew.engines.inprocess import InProcessEngine
from fedskew.models import build_model
from fedskew.models.base import BodyHeadModel
from fedskew.runs.loop import run
from fedskew.training import local
from fedskew.training.interface import ClientContext, LocalTrainConfig, ServerSetup
from fedskew.training.local import get_arrays
from fedskew.training.protocol import ClientState, Message

# --- helpers ----------------------------------------------------------------------------------


class Recorder(InProcessEngine):
    """The in-process engine, keeping every exchange's messages and replies."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[tuple[dict[int, Message], dict[int, Message]]] = []

    def exchange(self, messages, expect=None):
        replies = super().exchange(messages, expect)
        self.log.append((dict(messages), replies))
        return replies


def make_fed(
    classes_per_client: list[list[int]], per_class: int = 12, dim: int = 6
) -> FederatedData:
    """Gaussian blobs, one per class, and each client holding the listed classes."""
    num_classes = 1 + max(c for cs in classes_per_client for c in cs)
    gen = torch.Generator().manual_seed(0)
    centres = 3 * torch.randn(num_classes, dim, generator=gen)
    xs, ys, partition, start = [], [], [], 0
    for classes in classes_per_client:
        rows = []
        for c in classes:
            xs.append(centres[c] + torch.randn(per_class, dim, generator=gen))
            ys.append(torch.full((per_class,), c, dtype=torch.int64))
            rows.extend(range(start, start + per_class))
            start += per_class
        partition.append(np.array(rows, dtype=np.int64))
    return FederatedData(torch.cat(xs), torch.cat(ys), partition, num_classes)


def small_mlp(fed: FederatedData) -> BodyHeadModel:
    torch.manual_seed(1)
    return build_model("mlp", (fed.x.shape[1],), fed.num_classes, hidden=8)


def make_run(params: FedCMEParams, fed: FederatedData, model: nn.Module, epochs: int = 2):
    train = LocalTrainConfig(epochs=epochs, batch_size=8, lr=0.1, momentum=0.9, weight_decay=0.0)
    setup = ServerSetup(
        initial_arrays=model.state_dict(),
        num_clients=fed.num_clients,
        num_classes=fed.num_classes,
        client_sizes=fed.sizes(),
        seed=0,
        train=train,
    )
    server = FedCMEServer(params, setup)
    engine = Recorder(FedCMEClient(params), fed, model, train, seed=0)
    return server, engine


def identity_model() -> BodyHeadModel:
    """3 inputs, 3 classes, prediction = argmax of the input: predictions set by hand."""
    head = nn.Linear(3, 3)
    with torch.no_grad():
        head.weight.copy_(torch.eye(3))
        head.bias.zero_()
    return BodyHeadModel(nn.Flatten(), head, 3)


# Client 0: class 0 four times (3 predicted right), class 1 twice (0 right), no class 2.
HAND_X = torch.tensor(
    [[1.0, 0, 0], [1, 0, 0], [1, 0, 0], [0, 1, 0], [1, 0, 0], [0, 0, 1]], dtype=torch.float32
)
HAND_Y = torch.tensor([0, 0, 0, 0, 1, 1])
HAND_VECTOR = [0.75, 0.0, 0.0]


# --- parameters -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values",
    [
        {"mu": "-0.1"},
        {"exchange": "tail"},
        {"matching": "two-to-one"},
        {"cold_start": "zero"},
        {"feature_weights": "classes"},
        {"eval_fraction": "0"},
        {"eval_fraction": "1.5"},
    ],
)
def test_bad_parameters_are_one_line_usage_errors(values):
    with pytest.raises(UsageError) as err:
        get_algorithm("fedcme").make_params(values)
    assert "\n" not in str(err.value)


def test_defaults_are_the_papers_and_the_proposals():
    p = get_algorithm("fedcme").make_params({})
    assert (p.mu, p.exchange, p.matching, p.cold_start, p.feature_weights, p.eval_fraction) == (
        0.01,
        "head",
        "one-to-one",
        "evaluate",
        "samples",
        0.2,
    )


# --- matching on given vectors ----------------------------------------------------------------

# Four clients, worked by hand. mean g = (0.4, 0.45, 0.3), |g| = 0.6727.
# cos(v, g): v0 0.665, v1 0.731, v2 0.581, v3 0.991  ->  ascending order 2, 0, 1, 3.
# Pairwise cos: (0,1) 0.220, (0,2) 0.024, (0,3) 0.736, (1,2) 0.216, (1,3) 0.736, (2,3) 0.470.
FOUR = torch.tensor([[0.9, 0.1, 0.0], [0.1, 0.9, 0.0], [0.0, 0.2, 0.9], [0.6, 0.6, 0.3]])


def test_one_to_one_pairs_the_least_typical_client_with_its_least_similar():
    # 2 first: least similar to it is 0 (0.024) -> (2, 0); then 1 and 3 remain -> (1, 3).
    # (Pairing by sorted position, first with last, would give (2, 3) and (0, 1) instead.)
    ids = [10, 11, 12, 13]
    assert match_one_to_one(ids, FOUR) == {12: 10, 10: 12, 11: 13, 13: 11}


def test_one_to_one_with_an_odd_count_and_a_zero_vector():
    # Five clients. mean g = (0.3, 0.2, 0.26), |g| = 0.4445.
    # cos(v, g): v0 0.675, v1 0.450, v2 0.987, v3 (zero) 0, v4 0.585 -> order 3, 1, 4, 0, 2.
    # 3 first: its cosines are all 0 (zero vector), the first of equals is 1 -> (3, 1).
    # 4 next: cos(4, 0) = 0, cos(4, 2) = 0.577 -> (4, 0). 2 is left over: no partner.
    vectors = torch.tensor(
        [[1.0, 0.0, 0.0], [0.0, 0.5, 0.0], [0.5, 0.5, 0.5], [0.0, 0.0, 0.0], [0.0, 0.0, 0.8]]
    )
    pairs = match_one_to_one([0, 1, 2, 3, 4], vectors)
    assert pairs == {3: 1, 1: 3, 4: 0, 0: 4}
    assert 2 not in pairs


def test_many_to_one_gives_each_client_the_head_of_its_least_similar_client():
    # 0: min(0.220, 0.024, 0.736) -> 2; 1: min(0.220, 0.216, 0.736) -> 2; 2: min(0.024, ...) -> 0;
    # 3: min(0.736, 0.736, 0.470) -> 2. Clients 1 and 3 are nobody's donor.
    assert match_many_to_one([0, 1, 2, 3], FOUR) == {0: 2, 1: 2, 2: 0, 3: 2}


def partners(message_log_entry) -> dict[int, int]:
    messages, _ = message_log_entry
    return {c: int(m.scalars["partner"]) for c, m in messages.items()}


def test_server_matches_on_stored_vectors_and_relays_the_partners_heads():
    fed = make_fed([[0], [1], [2], [0, 1]])
    server, engine = make_run(FedCMEParams(), fed, small_mlp(fed))
    server.vectors = {c: FOUR[c] for c in range(4)}
    engine.begin_round(0)
    metrics = server.round(0, [0, 1, 2, 3], engine)
    assert [next(iter(m.values())).kind for m, _ in engine.log] == ["train_first", "train_rest"]
    assert partners(engine.log[0]) == {0: 2, 2: 0, 1: 3, 3: 1}
    (_, half_replies), (rest_msgs, _) = engine.log
    head_keys = sorted(k for k in server.global_arrays if k.startswith("head."))
    for c, partner in {0: 2, 2: 0, 1: 3, 3: 1}.items():
        assert half_replies[c].kind == "half"
        assert sorted(half_replies[c].arrays) == head_keys  # only the head goes up
        assert sorted(rest_msgs[c].arrays) == head_keys  # and only the partner's head comes down
        for k in head_keys:
            assert torch.equal(rest_msgs[c].arrays[k], half_replies[partner].arrays[k])
    assert metrics["exchanged"] == 4 and metrics["cold_starts"] == 0
    # The final evaluation vectors replace the stored ones.
    assert all(not torch.equal(server.vectors[c], FOUR[c]) for c in range(4))


def test_the_odd_client_out_trains_plain_in_one_exchange():
    # mean (0.5, 0.5, 0): cos 0.707, 0.707, 1 -> order 0, 1, 2; cos(0, 1) = 0 -> (0, 1); 2 alone.
    fed = make_fed([[0], [1], [0, 1]])
    server, engine = make_run(FedCMEParams(), fed, small_mlp(fed))
    vectors = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.5, 0.5, 0.0]])
    server.vectors = {c: vectors[c] for c in range(3)}
    engine.begin_round(0)
    server.round(0, [0, 1, 2], engine)
    assert partners(engine.log[0]) == {0: 1, 1: 0, 2: -1}
    assert engine.log[0][1][2].kind == "trained"  # the full upload, after all E epochs
    assert sorted(engine.log[1][0]) == [0, 1]  # the relay exchange does not reach it


def test_many_to_one_server_asks_only_donors_to_upload():
    fed = make_fed([[0], [1], [2], [0, 1]])
    server, engine = make_run(FedCMEParams(matching="many-to-one"), fed, small_mlp(fed))
    server.vectors = {c: FOUR[c] for c in range(4)}
    engine.begin_round(0)
    metrics = server.round(0, [0, 1, 2, 3], engine)
    (first, half_replies), (rest, _) = engine.log
    assert partners(engine.log[0]) == {0: 2, 1: 2, 2: 0, 3: 2}
    assert {c: m.scalars["share"] for c, m in first.items()} == {0: 1, 1: 0, 2: 1, 3: 0}
    assert half_replies[1].arrays == {} and half_replies[3].arrays == {}
    for c, donor in {0: 2, 1: 2, 2: 0, 3: 2}.items():
        assert torch.equal(rest[c].arrays["head.weight"], half_replies[donor].arrays["head.weight"])
    assert (metrics["exchanged"], metrics["donors"]) == (4, 2)


def test_random_matching_is_seeded_and_needs_no_vectors():
    fed = make_fed([[0], [1], [2], [0, 1], [1, 2]])
    params = FedCMEParams(matching="random")
    first, _ = make_run(params, fed, small_mlp(fed))
    second, _ = make_run(params, fed, small_mlp(fed))
    clients = [0, 1, 2, 3, 4]
    pairs = first.match(3, clients)
    assert pairs == second.match(3, clients)  # the server's addressed rng, not a global one
    assert len(pairs) == 4 and all(pairs[pairs[c]] == c for c in pairs)
    assert any(first.match(r, clients) != pairs for r in range(4, 12))  # redrawn each round


def test_cold_start_random_pairs_new_clients_at_random_and_joins_the_odd_ones():
    fed = make_fed([[0], [1], [0, 1], [2], [2], [1]])
    server, engine = make_run(FedCMEParams(cold_start="random"), fed, small_mlp(fed))
    vectors = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.5, 0.5, 0.0]])
    server.vectors = {c: vectors[c] for c in range(3)}  # matched as above: (0, 1), 2 alone
    pairs = server.match(0, [0, 1, 2, 3, 4, 5])
    assert pairs[0] == 1 and pairs[1] == 0
    assert pairs[2] in (3, 4, 5)  # the odd seen client takes the odd new client
    assert all(pairs[pairs[c]] == c for c in pairs) and len(pairs) == 6
    engine.begin_round(0)
    server.round(0, [0, 1, 2, 3, 4, 5], engine)
    assert engine.log[0][0][0].kind == "train_first"  # no evaluate exchange


# --- classifier exchange ------------------------------------------------------------------------


@pytest.mark.parametrize("exchange, prefix", [("head", "head."), ("body", "body."), ("model", "")])
def test_exchange_crosses_the_part_and_keeps_the_rest(monkeypatch, exchange, prefix):
    """Direct handler calls: after floor(E/2) epochs each client continues with its own
    half-trained model except for the exchanged part, which is the partner's."""
    fed = make_fed([[0, 1], [2]])
    model = small_mlp(fed)
    params = FedCMEParams(exchange=exchange)
    train = LocalTrainConfig(epochs=3, batch_size=8, lr=0.1, momentum=0.9, weight_decay=0.0)
    starts: list[tuple[int, str, int, dict[str, torch.Tensor]]] = []
    real = local.train_client  # what run_plain calls

    def spy(ctx, **kw):
        starts.append((ctx.client_id, kw["purpose"], kw["epochs"], get_arrays(ctx.model)))
        return real(ctx, **kw)

    monkeypatch.setattr(local, "train_client", spy)
    client = FedCMEClient(params)
    ctxs = {c: ClientContext(c, 0, 0, fed.client(c), model, ClientState(), train) for c in (0, 1)}
    initial = get_arrays(model)
    halves, parts = {}, {}
    for c, partner in ((0, 1), (1, 0)):
        msg = Message("train_first", arrays=dict(initial), scalars={"partner": float(partner)})
        reply = client.handle(msg, ctxs[c])
        state = ctxs[c].state.arrays
        halves[c] = {k[len(HALF) :]: v.clone() for k, v in state.items() if k.startswith(HALF)}
        parts[c] = reply.arrays
        assert sorted(reply.arrays) == sorted(k for k in initial if k.startswith(prefix))
    for c, partner in ((0, 1), (1, 0)):
        client.handle(Message("train_rest", arrays=parts[partner]), ctxs[c])
        assert not any(k.startswith(HALF) for k in ctxs[c].state.arrays)  # round state dropped
    # E = 3: one epoch before the exchange, two after.
    assert [(c, p, e) for c, p, e, _ in starts] == [
        (0, "train-first", 1),
        (1, "train-first", 1),
        (0, "train-rest", 2),
        (1, "train-rest", 2),
    ]
    assert not torch.equal(halves[0]["head.weight"], halves[1]["head.weight"])
    assert not torch.equal(halves[0]["body.fc1.weight"], initial["body.fc1.weight"])
    for c, partner in ((0, 1), (1, 0)):
        at_rest = starts[2 + c][3]
        for k, v in at_rest.items():
            source = halves[partner] if k.startswith(prefix) else halves[c]
            assert torch.equal(v, source[k]), (c, k)


@pytest.mark.parametrize("epochs, params", [(1, {}), (2, {"exchange": "none"})])
def test_without_an_exchange_a_round_is_one_exchange(epochs, params):
    # E = 1: floor(E/2) = 0, an exchange before training would swap identical global heads.
    fed = make_fed([[0], [1]])
    server, engine = make_run(FedCMEParams(**params), fed, small_mlp(fed), epochs=epochs)
    engine.begin_round(0)
    metrics = server.round(0, [0, 1], engine)
    assert len(engine.log) == 1 and engine.log[0][0][0].kind == "train"
    assert engine.log[0][0][0].scalars == {}
    assert EVAL_VECTOR not in engine.log[0][1][0].arrays  # no matching, so no vector
    assert metrics["exchanged"] == 0 and server.vectors == {}


# --- global features: memory and alignment ----------------------------------------------------


def test_memory_fills_missing_classes_with_the_global_feature():
    # C = 4, d = 2. Known before: classes 0 and 1 (features (1, 1) and (2, 2)).
    # A (weight 1) holds class 0 at (3, 3); B (weight 3) holds class 2 at (4, 0). Nobody has 3.
    glob = torch.tensor([[1.0, 1.0], [2.0, 2.0], [0.0, 0.0], [0.0, 0.0]])
    known = torch.tensor([True, True, False, False])
    a = torch.tensor([[3.0, 3.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    b = torch.tensor([[0.0, 0.0], [0.0, 0.0], [4.0, 0.0], [0.0, 0.0]])
    present = [torch.tensor([True, False, False, False]), torch.tensor([False, False, True, False])]
    feats, new_known = aggregate_features(glob, known, [a, b], present, [1.0, 3.0])
    # class 0: (1*3 + 3*1) / 4 = 1.5 (B contributes the memory); class 1: both remember (2, 2);
    # class 2: never seen before, only B has it -> (4, 0); class 3: never observed, skipped.
    expected = torch.tensor([[1.5, 1.5], [2.0, 2.0], [4.0, 0.0], [0.0, 0.0]])
    assert torch.allclose(feats, expected)
    assert new_known.tolist() == [True, True, True, False]
    uniform, _ = aggregate_features(glob, known, [a, b], present, [1.0, 1.0])
    assert torch.allclose(uniform[0], torch.tensor([2.0, 2.0]))  # (3 + 1) / 2


def test_server_aggregates_features_sent_only_for_present_classes():
    fed = make_fed([[0], [1]])
    server, _ = make_run(FedCMEParams(feature_weights="samples"), fed, small_mlp(fed))
    server.features = torch.tensor([[1.0, 1.0], [2.0, 2.0], [0.0, 0.0]])
    server.known = torch.tensor([True, True, False])
    model = dict(server.global_arrays)

    def reply(rows, present, n):
        arrays = {**model, "features": torch.tensor(rows), "present": torch.tensor(present)}
        return Message("trained", arrays=arrays, scalars={"num_samples": n, "loss": 0.0})

    replies = {
        0: reply([[3.0, 3.0]], [True, False, False], 1.0),
        1: reply([[5.0, 1.0], [4.0, 0.0]], [False, True, True], 3.0),
    }
    server.aggregate([0, 1], replies)
    # class 0: (1*3 + 3*1)/4 = 1.5; class 1: (1*2 + 3*5, 1*2 + 3*1)/4 = (4.25, 1.25); class 2: B's.
    expected = torch.tensor([[1.5, 1.5], [4.25, 1.25], [4.0, 0.0]])
    assert torch.allclose(server.features, expected) and server.known.all()


def test_alignment_loss_is_the_mean_of_per_class_mean_squared_distances():
    features = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0], [5.0, 5.0]], requires_grad=True)
    y = torch.tensor([0, 0, 1, 2])
    glob = torch.tensor([[2.0, 0.0], [0.0, 0.0], [9.0, 9.0]])
    known = torch.tensor([True, True, False])  # class 2 has no global feature: skipped
    loss = alignment_loss(features, y, glob, known)
    # class 0: (1 + 1) / 2 = 1; class 1: 4 / 1 = 4; mean over the two classes: 2.5.
    assert loss.item() == pytest.approx(2.5)
    loss.backward()
    # d/df_i = 2 (f_i - g_c) / (|B_c| * classes): (-0.5, 0), (0.5, 0), (0, 2), (0, 0).
    grad = torch.tensor([[-0.5, 0.0], [0.5, 0.0], [0.0, 2.0], [0.0, 0.0]])
    assert torch.allclose(features.grad, grad)
    none_known = alignment_loss(features, y, glob, torch.zeros(3, dtype=torch.bool))
    assert none_known.item() == 0.0


def test_loss_is_cross_entropy_plus_mu_times_alignment():
    model = identity_model()
    glob = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    known = torch.tensor([True, True, False])
    x, y = HAND_X, HAND_Y
    out = fedcme_loss(0.1, glob, known)(model, x, y)
    logits = x  # identity body and head
    ce = -torch.log_softmax(logits, 1)[torch.arange(6), y].mean()
    # class 0 rows each at squared distance 1 from the origin; class 1 rows at 2 from (1, 1, 1).
    assert out.loss.item() == pytest.approx(ce.item() + 0.1 * (1.0 + 2.0) / 2, rel=1e-6)
    assert torch.equal(out.features, x) and torch.equal(out.logits, x)


# --- evaluation vector and cold start --------------------------------------------------------


def test_evaluation_vector_is_per_class_accuracy_of_the_model():
    fed = FederatedData(HAND_X, HAND_Y, [np.arange(6)], 3)
    vector = evaluation_vector(identity_model(), fed.client(0), torch.arange(6))
    assert vector.tolist() == HAND_VECTOR  # class 2 absent: 0


def test_eval_subset_is_a_fifth_with_every_present_class():
    labels = torch.tensor([0] * 60 + [1] * 39 + [2])  # class 2 has one sample
    subsets = []
    for rnd in range(3):
        rows = eval_subset(labels, 0.2, torch_rng(0, rnd, 5, "eval"))
        assert len(set(rows.tolist())) == len(rows)
        assert 20 <= len(rows) <= 22
        assert set(labels[rows].tolist()) == {0, 1, 2}
        subsets.append(sorted(rows.tolist()))
    assert subsets[0] != subsets[1]


def test_cold_start_evaluates_the_global_model_on_never_seen_clients_only(monkeypatch):
    # Clients 0 and 1 hold HAND_X / HAND_Y; client 2 holds one sample of each class.
    x = torch.cat([HAND_X, HAND_X, torch.eye(3)])
    y = torch.cat([HAND_Y, HAND_Y, torch.tensor([0, 1, 2])])
    fed = FederatedData(x, y, [np.arange(6), np.arange(6, 12), np.arange(12, 15)], 3)
    model = identity_model()
    server, engine = make_run(FedCMEParams(eval_fraction=1.0), fed, model)
    global_model = {k: v.clone() for k, v in server.global_arrays.items()}
    server.vectors = {0: torch.tensor([0.0, 1.0, 0.0])}
    starts = {}
    real = local.train_client  # what run_plain calls

    def spy(ctx, **kw):
        starts.setdefault(ctx.client_id, get_arrays(ctx.model))
        return real(ctx, **kw)

    monkeypatch.setattr(local, "train_client", spy)
    engine.begin_round(0)
    metrics = server.round(0, [0, 1, 2], engine)
    evaluate, evaluated = engine.log[0]
    assert [m.kind for m in evaluate.values()] == ["evaluate", "evaluate"]
    assert sorted(evaluate) == [1, 2]  # client 0 already has a vector
    assert evaluated[1].arrays[EVAL_VECTOR].tolist() == HAND_VECTOR
    assert evaluated[2].arrays[EVAL_VECTOR].tolist() == [1.0, 1.0, 1.0]
    assert list(evaluated[1].arrays) == [EVAL_VECTOR]
    # Matching on (0,1,0), (0.75,0,0), (1,1,1): mean (0.583, 0.667, 0.333); cos 0.754, 0.659,
    # 0.925 -> order 1, 0, 2; cos(1, 0) = 0 < cos(1, 2) -> (1, 0); client 2 is alone.
    assert partners(engine.log[1]) == {0: 1, 1: 0, 2: -1}
    first = engine.log[1][0]
    assert set(global_model) <= set(first[0].arrays)  # client 0 gets the model now
    assert not set(global_model) & set(first[1].arrays)  # 1 and 2 keep the one they evaluated
    assert not set(global_model) & set(first[2].arrays)
    for c in (0, 1, 2):
        assert all(torch.equal(starts[c][k], v) for k, v in global_model.items())
        assert not any(k.startswith("fedcme/") for k in engine.client_states[c].arrays)
    assert metrics["cold_starts"] == 2


# --- end to end through the CLI, with the exact bytes of every round --------------------------

SWITCHES = [
    ("1", []),
    ("2", []),
    ("2", ["exchange=body"]),
    ("2", ["exchange=model"]),
    ("2", ["exchange=none"]),
    ("2", ["matching=many-to-one"]),
    ("2", ["matching=random"]),
    ("2", ["cold_start=random"]),
    ("2", ["feature_weights=uniform"]),
    ("2", ["mu=0"]),
    ("2", ["mu=0.1"]),
]


@pytest.fixture(scope="module")
def digits_default():
    """Class counts per client and model sizes of the default digits run."""
    prep = prepare(ExperimentConfig(algorithm="fedcme"))
    model = new_model(prep)
    state = model.state_dict()
    nbytes = {k: v.numel() * v.element_size() for k, v in state.items()}
    return {
        "counts": prep.fed.class_counts(),
        "model": sum(nbytes.values()),
        "head": sum(n for k, n in nbytes.items() if k.startswith("head.")),
        "body": sum(n for k, n in nbytes.items() if k.startswith("body.")),
        "d": model.feature_dim,
    }


def expected_traffic(rows, params: dict[str, str], epochs: int, sizes) -> list[tuple[int, int]]:
    """Bytes down and up of each round, from what FedCME must send (see the module doc)."""
    mu = float(params.get("mu", 0.01))
    exchange = params.get("exchange", "head")
    matching = params.get("matching", "one-to-one")
    cold = params.get("cold_start", "evaluate")
    counts, B, d = sizes["counts"], sizes["model"], sizes["d"]
    C = counts.shape[1]
    part = {"head": sizes["head"], "body": sizes["body"], "model": B}.get(exchange, 0)
    exchanging = exchange != "none" and epochs // 2 > 0
    vectors = exchanging and matching != "random"
    seen: set[int] = set()
    known = np.zeros(C, dtype=bool)
    out = []
    for r in rows:
        clients = r["clients"]
        M = len(clients)
        new = [c for c in clients if c not in seen] if vectors and cold == "evaluate" else []
        kn = int(known.sum()) if mu > 0 else 0
        down = M * B + (M * (4 * kn * d + C) if kn else 0)
        up = 4 * C * len(new)  # cold-start vectors; their model came in that exchange
        if exchanging:
            down += 8 * M  # partner
            if matching == "many-to-one":
                down += 8 * M + M * part  # share, and every client receives a part
                up += int(r["donors"]) * part
            else:
                paired = M - M % 2
                down += paired * part
                up += paired * part
        for c in clients:
            up += B + 16  # model, num_samples, loss
            if mu > 0:
                up += 4 * int((counts[c] > 0).sum()) * d + C  # present features and mask
            if vectors:
                up += 4 * C
        out.append((down, up))
        if vectors:
            seen.update(clients)
        if mu > 0:
            known |= (counts[clients] > 0).any(axis=0)
    return out


@pytest.mark.parametrize(
    "epochs, switches", SWITCHES, ids=[f"E{e}-{'+'.join(s) or 'default'}" for e, s in SWITCHES]
)
def test_cli_runs_every_switch_with_exact_traffic(tmp_path, digits_default, epochs, switches):
    args = ["run", "-a", "fedcme", "--rounds", "3", "--local-epochs", epochs, "-q"]
    args += ["-o", str(tmp_path), "--name", "r"]
    for s in switches:
        args += ["-p", s]
    assert main(args) == 0
    rows = [
        json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["accuracy"]) and 0 <= r["accuracy"] <= 1 for r in rows)
    params = dict(s.split("=", 1) for s in switches)
    expected = expected_traffic(rows, params, int(epochs), digits_default)
    assert [(r["bytes_down"], r["bytes_up"]) for r in rows] == expected
    exchanging = int(epochs) >= 2 and params.get("exchange") != "none"
    assert {r["exchanges"] for r in rows[1:]} <= ({1} if not exchanging else {2, 3})
    if exchanging:
        assert all(r["exchanged"] == len(r["clients"]) for r in rows)
    # FedCME's extra over FedAvg is bounded: one part each way per client plus small vectors.
    fedavg = [len(r["clients"]) * (digits_default["model"] + 16) for r in rows]
    assert all(r["bytes_up"] >= f for r, f in zip(rows, fedavg, strict=True))


class Killed(Exception):
    pass


def test_a_killed_run_resumes_with_the_stored_vectors_and_features(tmp_path):
    """The evaluation vectors and global features survive a checkpoint: the resumed run
    sends and scores exactly what the uninterrupted one did (no second cold start)."""
    common = dict(algorithm="fedcme", rounds=4, local_epochs=2, quiet=True, seed=3)
    run(ExperimentConfig(out_dir=str(tmp_path / "a"), name="r", **common))

    def kill_after_two(record):
        if record["round"] == 2:
            raise Killed

    with pytest.raises(Killed):
        run(ExperimentConfig(out_dir=str(tmp_path / "b"), name="r", **common), kill_after_two)
    assert main(["run", "--resume", str(tmp_path / "b" / "r.incomplete"), "-q"]) == 0
    keys = ("clients", "bytes_down", "bytes_up", "cold_starts", "accuracy", "loss")

    def rows(folder):
        lines = (folder / "metrics.jsonl").read_text().splitlines()
        return [{k: json.loads(x)[k] for k in keys} for x in lines]

    assert rows(tmp_path / "b" / "r") == rows(tmp_path / "a" / "r")
