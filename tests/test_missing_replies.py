"""Every server works with the replies that arrive: on a real deployment a node can die
mid-round or its reply can fail validation, and the channel then returns fewer replies."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import pytest
import torch

from fedskew.algorithms import ALGORITHMS, get_algorithm
from fedskew.algorithms.feature_matching import ANCHORS, COUNTS
from fedskew.assembly.prepare import Prepared, new_model, prepare
from fedskew.config import ExperimentConfig
from fedskew.engines.inprocess import InProcessEngine
from fedskew.training.interface import ServerSetup
from fedskew.training.protocol import Expected, Message, NoReplies

# Method settings that keep one round short and make every exchange happen in it.
PARAMS: dict[str, dict[str, object]] = {
    "creff": {"match_epochs": 2, "crt_epochs": 2, "num_features": 4},
    "fedfm": {"start_round": 0},
    "fedfm-lite": {"start_round": 0, "a": 5},
    "fedavg+fm": {"start_round": 0},
    "fedcme+fm": {"start_round": 0},
}
# FedCME exchanges parts only when half the local epochs is at least one.
EPOCHS = {"fedcme": 2, "fedcme+fm": 2}
CASES = [*sorted(ALGORITHMS), "fedavg+fm", "fedcme+fm"]
# Exchanges of the first round, for the methods with more than one.
MULTI_EXCHANGE = {"fedfm": 2, "fedavg+fm": 2, "fedcme": 3, "fedcme+fm": 4}
ROUNDS = [[0, 1, 2, 3, 4], [1, 2, 5, 6, 0]]  # 5 clients: after one drop FedCME pairs them all


class Dropping:
    """The in-process engine behind a channel that loses replies.

    In every exchange the reply of the first addressed client is dropped (when more than one
    was addressed, so that the round can go on); ``drop_all`` names the exchanges (counted
    from 0 over the whole test) in which every reply is lost. Every message and every reply
    the clients produced is kept in ``log``.
    """

    def __init__(self, engine: InProcessEngine, drop_all: frozenset[int] = frozenset()) -> None:
        self.engine = engine
        self.drop_all = drop_all
        self.count = 0
        self.log: list[tuple[dict[int, Message], dict[int, Message], list[int]]] = []

    def exchange(
        self, messages: Mapping[int, Message], expect: Expected | None = None
    ) -> dict[int, Message]:
        index, self.count = self.count, self.count + 1
        if index in self.drop_all:
            self.log.append((dict(messages), {}, list(messages)))
            return {}
        replies = self.engine.exchange(messages, expect)
        dropped = list(messages)[:1] if len(messages) > 1 else []
        self.log.append((dict(messages), dict(replies), dropped))
        return {c: r for c, r in replies.items() if c not in dropped}


@pytest.fixture(scope="module")
def base() -> Prepared:
    return prepare(ExperimentConfig(num_clients=8, local_epochs=1, quiet=True, seed=3))


def make(base: Prepared, case: str, drop_all: frozenset[int] = frozenset()):
    name, fm = case.removesuffix("+fm"), case.endswith("+fm")
    algorithm = get_algorithm(name, feature_matching=fm)
    params = algorithm.make_params(PARAMS.get(case, {}))
    train = dataclasses.replace(base.train, epochs=EPOCHS.get(case, 1))
    prep = dataclasses.replace(base, algorithm=algorithm, params=params, train=train)
    model = new_model(prep)
    setup = ServerSetup(
        initial_arrays=model.state_dict(),
        num_clients=len(prep.partition),
        num_classes=prep.dataset.num_classes,
        client_sizes=prep.fed.sizes(),
        seed=prep.cfg.seed,
        train=train,
        rounds=len(ROUNDS),
    )
    server = algorithm.Server(params, setup)
    engine = InProcessEngine(
        algorithm.Client(params),
        prep.fed,
        model,
        train,
        prep.cfg.seed,
        test=(prep.dataset.x_test, prep.dataset.y_test),
    )
    return server, engine, Dropping(engine, drop_all)


def run_round(server, engine: InProcessEngine, channel: Dropping, rnd: int) -> dict[str, float]:
    engine.begin_round(rnd)
    return server.round(rnd, list(ROUNDS[rnd]), channel)


def finite(arrays: Mapping[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in arrays.values() if v.is_floating_point())


@pytest.mark.parametrize("case", CASES)
def test_every_server_goes_on_with_the_replies_that_arrived(base, case):
    server, engine, channel = make(base, case)
    for rnd in range(len(ROUNDS)):
        start = len(channel.log)
        metrics = run_round(server, engine, channel, rnd)
        log = channel.log[start:]
        assert log[0][2], "the first exchange lost a reply"
        if rnd == 0 and case in MULTI_EXCHANGE:
            assert len(log) == MULTI_EXCHANGE[case]
            assert sum(1 for *_, dropped in log if dropped) >= 2, "a later exchange lost one"
        # Later exchanges of the round address only clients that replied to the earlier ones.
        lost: set[int] = set()
        for messages, _, dropped in log:
            assert not lost & set(messages)
            lost |= set(dropped)
        assert finite(server.global_arrays) and finite(server.eval_arrays())
        assert metrics and all(math.isfinite(v) for v in metrics.values())


def test_fedavg_averages_exactly_the_survivors(base):
    server, engine, channel = make(base, "fedavg")
    metrics = run_round(server, engine, channel, 0)
    [(messages, replies, dropped)] = channel.log
    assert dropped == [0]
    survivors = [c for c in ROUNDS[0] if c not in dropped]
    n = {c: replies[c].scalars["num_samples"] for c in survivors}
    assert [n[c] for c in survivors] == [float(len(base.partition[c])) for c in survivors]
    total = sum(n.values())
    for key, value in server.global_arrays.items():
        if not value.is_floating_point():
            continue
        expected = sum(n[c] * replies[c].arrays[key].double() for c in survivors) / total
        torch.testing.assert_close(value.double(), expected, rtol=1e-6, atol=1e-7)
    # ...and not the average with the lost reply in it.
    everyone = sum(replies[c].scalars["num_samples"] for c in ROUNDS[0])
    key = "head.weight"
    with_lost = sum(
        replies[c].scalars["num_samples"] * replies[c].arrays[key].double() for c in ROUNDS[0]
    )
    assert not torch.allclose(server.global_arrays[key].double(), with_lost / everyone)
    loss = sum(replies[c].scalars["loss"] for c in survivors) / len(survivors)
    assert metrics["train_loss"] == pytest.approx(loss, rel=1e-12)


def test_scaffold_moves_c_by_the_arrived_deltas_over_all_clients(base):
    server, engine, channel = make(base, "scaffold")
    run_round(server, engine, channel, 0)
    [(_, replies, dropped)] = channel.log
    survivors = [c for c in ROUNDS[0] if c not in dropped]
    for key, c in server.c.items():
        total = sum(replies[k].arrays["dc/" + key].double() for k in survivors)
        torch.testing.assert_close(c.double(), total / 8, rtol=1e-6, atol=1e-8)  # N = 8
        models = [replies[k].arrays[key].double() for k in survivors]
        torch.testing.assert_close(
            server.global_arrays[key].double(), sum(models) / len(models), rtol=1e-6, atol=1e-7
        )


def test_feddyn_h_sums_the_arrived_drifts_over_all_clients(base):
    server, engine, channel = make(base, "feddyn")
    theta = {k: v.clone() for k, v in server.global_arrays.items()}
    run_round(server, engine, channel, 0)
    [(_, replies, dropped)] = channel.log
    survivors = [c for c in ROUNDS[0] if c not in dropped]
    alpha = server.params.alpha
    for key, h in server.h.items():
        drift = sum(replies[c].arrays[key].double() - theta[key].double() for c in survivors)
        expected_h = -alpha / 8 * drift
        torch.testing.assert_close(h.double(), expected_h, rtol=1e-5, atol=1e-9)
        mean = sum(replies[c].arrays[key].double() for c in survivors) / len(survivors)
        torch.testing.assert_close(
            server.global_arrays[key].double(), mean - expected_h / alpha, rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize("case", ["fedfm", "fedfm-lite"])
def test_anchors_come_from_the_anchor_replies_that_arrived(base, case):
    server, engine, channel = make(base, case)
    run_round(server, engine, channel, 0)
    _, replies, dropped = channel.log[0]
    survivors = [c for c in ROUNDS[0] if c not in dropped]
    counts = torch.stack([replies[c].arrays[COUNTS] for c in survivors]).double()
    anchors = torch.stack([replies[c].arrays[ANCHORS] for c in survivors]).double()
    total = counts.sum(0)
    expected = (counts[..., None] * anchors).sum(0) / total.clamp(min=1)[:, None]
    torch.testing.assert_close(server.fm_anchors.double(), expected, rtol=1e-5, atol=1e-7)


def test_fedfm_lite_sends_the_model_again_to_a_client_whose_reply_was_lost(base):
    server, engine, channel = make(base, "fedfm-lite")
    run_round(server, engine, channel, 0)  # not a model round (a = 5): models stay local
    run_round(server, engine, channel, 1)
    (_, _, dropped), (messages, _, _) = channel.log
    assert dropped == [0]
    model_keys = set(server.global_arrays)
    # Client 0's reply was lost: it may have lost its model with it, so it is sent again.
    assert model_keys <= set(messages[0].arrays)
    for c in (1, 2):  # replied in round 0: they keep training their own model
        assert not model_keys & set(messages[c].arrays)


def test_fedcme_partner_of_a_lost_half_finishes_with_its_own_head(base):
    server, engine, channel = make(base, "fedcme")
    metrics = run_round(server, engine, channel, 0)
    (_, _, lost_eval), (first, _, [lost_half]), (rest, _, [lost_final]) = channel.log
    assert lost_eval == [0] and 0 not in first  # no vector: left out of the round
    partner = int(first[lost_half].scalars["partner"])
    assert partner >= 0 and lost_half not in rest
    assert rest[partner].arrays == {}  # nothing to relay: it keeps its own head
    others = [c for c in rest if c != partner]
    assert others and all(rest[c].arrays for c in others)
    assert metrics["exchanged"] == len(others) and metrics["donors"] == len(others)
    assert lost_final in rest


@pytest.mark.parametrize("case", CASES)
def test_no_reply_at_all_raises_no_replies(base, case):
    server, engine, channel = make(base, case, drop_all=frozenset({0}))
    with pytest.raises(NoReplies):
        run_round(server, engine, channel, 0)


@pytest.mark.parametrize(("case", "exchange"), [("fedfm", 1), ("fedcme", 1), ("fedcme", 2)])
def test_no_reply_in_a_later_exchange_raises_no_replies(base, case, exchange):
    server, engine, channel = make(base, case, drop_all=frozenset({exchange}))
    with pytest.raises(NoReplies):
        run_round(server, engine, channel, 0)
