"""FedFM, FedFM-Lite and the feature matching plug-in: each mechanism against a value
computed independently here, the launching round, the bytes on the wire, and the CLI."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedskew.algorithms import get_algorithm
from fedskew.algorithms.feature_matching import AnchorChannel, with_feature_matching
from fedskew.algorithms.fedavg import FedAvg, FedAvgParams
from fedskew.algorithms.fedfm import (
    ANCHORS,
    COUNTS,
    REUSED,
    FedFM,
    FMSettings,
    aggregate_anchors,
    anchor_metrics,
    cg_loss,
    l2_loss,
    matching_term,
    uniform_anchors,
    weighted_anchors,
)
from fedskew.algorithms.fedfm_lite import FedFMLite
from fedskew.algorithms.fedfm_remedies import pre_relu_cross_entropy, pre_relu_layers
from fedskew.apps.cli import main
from fedskew.assembly.prepare import new_model, prepare
from fedskew.config import ExperimentConfig
from fedskew.core.errors import UsageError
from fedskew.data.federated import sample_clients
from fedskew.engines.inprocess import InProcessEngine
from fedskew.training.interface import ClientContext, ClientLogic, ServerSetup
from fedskew.training.protocol import ClientState, Message

FAST = ["--rounds", "3", "--local-epochs", "1", "--quiet"]
C = 10  # digits classes


def run_cli(tmp: Path, name: str, *args: str) -> list[dict]:
    assert main(["run", "-o", str(tmp), "--name", name, *FAST, *args]) == 0
    lines = (tmp / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def model_facts() -> tuple[int, int]:
    """(model bytes, feature dim) of the default digits model, built independently."""
    prep = prepare(ExperimentConfig())
    model = new_model(prep)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return nbytes, model.feature_dim


# --- anchor aggregation -----------------------------------------------------------------------

# Two clients, three classes, d = 2. Client 0 holds classes 0 and 1, client 1 only class 0;
# nobody holds class 2.
LOCAL = torch.tensor([[[1.0, 0.0], [0.0, 2.0], [0.0, 0.0]], [[3.0, 2.0], [0.0, 0.0], [0.0, 0.0]]])
COUNTS_KC = torch.tensor([[3, 1, 0], [1, 0, 0]])
PREVIOUS = torch.tensor([[9.0, 9.0], [9.0, 9.0], [5.0, -5.0]])


def test_weighted_anchor_aggregation_by_hand():
    out = weighted_anchors(LOCAL, COUNTS_KC, PREVIOUS)
    # class 0: (3 * [1, 0] + 1 * [3, 2]) / 4; class 1: client 0 alone; class 2: nobody -> previous
    expected = torch.tensor([[1.5, 0.5], [0.0, 2.0], [5.0, -5.0]])
    assert torch.allclose(out, expected)
    # No previous anchors (round 0): an unheld class stays zero, i.e. undefined.
    first = weighted_anchors(LOCAL, COUNTS_KC, None)
    assert torch.allclose(first, torch.tensor([[1.5, 0.5], [0.0, 2.0], [0.0, 0.0]]))


def test_uniform_anchor_aggregation_fills_missing_classes_with_previous_anchor():
    out = uniform_anchors(LOCAL, PREVIOUS)
    # class 0: ([1, 0] + [3, 2]) / 2, counts ignored; class 1: client 1 lacks it and
    # contributes the previous [9, 9]: ([0, 2] + [9, 9]) / 2; class 2: both fill in [5, -5].
    expected = torch.tensor([[2.0, 1.0], [4.5, 5.5], [5.0, -5.0]])
    assert torch.allclose(out, expected)
    assert torch.allclose(uniform_anchors(LOCAL, None), torch.tensor([[2.0, 1.0], [0, 1], [0, 0]]))


def test_aggregate_anchors_reads_the_replies():
    replies = [Message("r", arrays={ANCHORS: LOCAL[k], COUNTS: COUNTS_KC[k]}) for k in range(2)]
    assert torch.allclose(
        aggregate_anchors(replies, PREVIOUS, "weighted"),
        weighted_anchors(LOCAL, COUNTS_KC, PREVIOUS),
    )
    no_counts = [Message("r", arrays={ANCHORS: LOCAL[k]}) for k in range(2)]
    assert torch.allclose(
        aggregate_anchors(no_counts, PREVIOUS, "uniform"), uniform_anchors(LOCAL, PREVIOUS)
    )


# --- the matching losses ----------------------------------------------------------------------


def _cos(u: np.ndarray, v: np.ndarray) -> float:
    return float(u @ v / (np.linalg.norm(u) * np.linalg.norm(v)))


def test_cg_loss_is_cross_entropy_of_cosine_over_temperature():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(6, 4, generator=g)
    a = torch.randn(3, 4, generator=g)
    y = torch.tensor([0, 1, 2, 2, 1, 0])
    tau = 0.1
    hn, an = h.double().numpy(), a.double().numpy()
    expected = 0.0
    for i in range(6):
        s = np.array([_cos(hn[i], an[n]) / tau for n in range(3)])
        expected += -(s[y[i]] - math.log(np.exp(s).sum()))
    expected /= 6
    assert cg_loss(h, y, a, tau).item() == pytest.approx(expected, rel=1e-5)
    s = FMSettings(lam=50.0, tau=tau, start_round=0, loss="cg", agg="weighted")
    term = matching_term(a, s, 0)
    assert term(h, torch.zeros(6, 3), y).item() == pytest.approx(50 * expected, rel=1e-5)


def test_cg_loss_leaves_undefined_anchors_out():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(4, 3, generator=g, requires_grad=True)
    a = torch.randn(3, 3, generator=g)
    a[2] = 0.0  # class 2 never seen: no direction
    y = torch.tensor([0, 1, 2, 0])
    tau = 0.5
    hn, an = h.detach().double().numpy(), a.double().numpy()
    expected = 0.0
    for i in range(4):
        if y[i] == 2:
            continue  # its anchor is undefined: the sample adds nothing
        s = np.array([_cos(hn[i], an[n]) / tau for n in range(2)])  # softmax over classes 0, 1
        expected += -(s[y[i]] - math.log(np.exp(s).sum()))
    expected /= 4  # still the mean over the whole batch
    loss = cg_loss(h, y, a, tau)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    loss.backward()
    assert torch.isfinite(h.grad).all() and h.grad[2].abs().sum() == 0


def test_l2_loss_is_mse_between_normalised_feature_and_anchor():
    g = torch.Generator().manual_seed(2)
    h = torch.randn(5, 4, generator=g)
    a = torch.randn(3, 4, generator=g)
    y = torch.tensor([2, 0, 1, 1, 0])
    hn, an = h.double().numpy(), a.double().numpy()
    diffs = [hn[i] / np.linalg.norm(hn[i]) - an[y[i]] / np.linalg.norm(an[y[i]]) for i in range(5)]
    expected = float(np.mean(np.square(diffs)))  # F.mse_loss: mean over batch x dimension
    assert l2_loss(h, y, a).item() == pytest.approx(expected, rel=1e-5)
    s = FMSettings(lam=3.0, tau=0.1, start_round=0, loss="l2", agg="uniform")
    term = matching_term(a, s, 0)
    assert term(h, torch.zeros(5, 3), y).item() == pytest.approx(3 * expected, rel=1e-5)


def test_no_term_without_any_defined_anchor_or_with_lam_zero():
    s = FMSettings(lam=50.0, tau=0.1, start_round=0, loss="cg", agg="weighted")
    assert matching_term(torch.zeros(3, 4), s, 0) is None
    assert matching_term(torch.ones(3, 4), dataclasses.replace(s, lam=0.0), 0) is None


def test_anchor_metrics_measure_how_far_apart_the_anchors_are():
    orthogonal = anchor_metrics(True, torch.eye(4) * 3, tau=0.1)
    assert orthogonal["fm_anchor_classes"] == 4.0
    assert orthogonal["fm_anchor_cos_max"] == pytest.approx(0.0, abs=1e-6)
    # on its own anchor: cos 1 against 0 for the three others, over tau = 0.1
    assert orthogonal["fm_cg_floor"] == pytest.approx(math.log(1 + 3 * math.exp(-10)), rel=1e-3)
    same = anchor_metrics(True, torch.ones(4, 5), tau=0.1)
    assert same["fm_anchor_cos_max"] == pytest.approx(1.0)
    assert same["fm_cg_floor"] == pytest.approx(math.log(4), rel=1e-5)
    one = anchor_metrics(False, torch.tensor([[1.0, 0.0], [0.0, 0.0]]), tau=0.1)
    assert one == {"fm_active": 0.0, "fm_anchor_classes": 1.0}  # nothing to compare with


def test_lam_warmup_grows_lam_linearly_from_the_launching_round():
    s = FMSettings(lam=50.0, tau=0.1, start_round=3, loss="cg", agg="weighted", warmup=4)
    assert [s.lam_in(r) for r in range(2, 9)] == [0.0, 12.5, 25.0, 37.5, 50.0, 50.0, 50.0]
    off = dataclasses.replace(s, warmup=0)
    assert [off.lam_in(r) for r in (0, 3, 9)] == [50.0, 50.0, 50.0]
    torch.manual_seed(0)
    h, y, a = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2]), torch.randn(3, 4)
    full = matching_term(a, off, 4)(h, torch.zeros(6, 3), y).item()
    share = matching_term(a, s, 4)(h, torch.zeros(6, 3), y).item()
    assert share == pytest.approx(full / 2, rel=1e-6)  # round 4 = 2 of the 4 warm-up rounds


# --- anchors come from the global model, before training ---------------------------------------


def _setup(**cfg_values):
    cfg = ExperimentConfig(local_epochs=1, **cfg_values)
    prep = prepare(cfg)
    model = new_model(prep)
    setup = ServerSetup(
        initial_arrays=model.state_dict(),
        num_clients=len(prep.partition),
        num_classes=prep.dataset.num_classes,
        client_sizes=prep.fed.sizes(),
        seed=cfg.seed,
        train=prep.train,
        rounds=cfg.rounds,
    )
    server = prep.algorithm.Server(prep.params, setup)
    engine = InProcessEngine(prep.algorithm.Client(prep.params), prep.fed, model, prep.train, 0)
    return prep, server, engine


def _class_means(arrays, prep, clients) -> torch.Tensor:
    """Class means of body features over the clients' data, by masks, in eval mode."""
    model = new_model(prep)
    model.load_state_dict(arrays)
    model.eval()
    idx = np.concatenate([prep.partition[c] for c in clients])
    with torch.no_grad():
        feats = model.body(prep.dataset.x_train[idx])
    labels = prep.dataset.y_train[idx]
    return torch.stack([feats[labels == c].mean(dim=0) for c in range(C)])


@pytest.mark.parametrize("plugin", [False, True], ids=["fedfm", "fedavg+fm"])
def test_anchors_are_class_means_under_the_global_model_not_the_trained_one(plugin):
    if plugin:
        prep, server, engine = _setup(
            algorithm="fedavg", feature_matching=True, params={"start_round": 0}
        )
    else:
        prep, server, engine = _setup(algorithm="fedfm", params={"start_round": 0})
    initial = {k: v.clone() for k, v in server.global_arrays.items()}
    clients = sample_clients(0, 0, len(prep.partition), 8)
    engine.begin_round(0)
    metrics = server.round(0, clients, engine)
    assert metrics["fm_active"] == 1.0
    # Count-weighted local means over all clients = class means over the union of their data.
    under_global = _class_means(initial, prep, clients)
    union = np.concatenate([prep.partition[c] for c in clients])
    held = torch.bincount(prep.dataset.y_train[union], minlength=C) > 0
    assert torch.allclose(server.fm_anchors[held], under_global[held], atol=1e-5)
    under_trained = _class_means(server.global_arrays, prep, clients)
    assert not torch.allclose(server.fm_anchors[held], under_trained[held], atol=1e-3)
    for cid in clients:
        state = engine.client_states[cid]
        if plugin:
            # The model kept for the inner round was used and deleted; the anchors stay
            # (an inner round may train in a later exchange) until the next anchor exchange.
            assert not [k for k in state.arrays if k.startswith("fm.kept/")]
            assert torch.equal(state.arrays["fm.anchors"], server.fm_anchors)
        else:
            # FedFM keeps the model of step 1 only until step 2 has loaded it.
            assert not state.arrays and not state.scalars


# --- the launching round: no FM term before it ------------------------------------------------

COMPARED = ("accuracy", "loss", "train_loss", "per_class_accuracy", "clients")


def _same(a: dict, b: dict) -> bool:
    return all(a[k] == b[k] for k in COMPARED)


def test_before_the_launching_round_fedfm_is_exactly_fedavg(tmp_path):
    avg = run_cli(tmp_path, "avg", "-a", "fedavg")
    # start_round = 2 (0-based): rounds 0 and 1 are FedAvg's, round 2 has the FM term.
    fm = run_cli(tmp_path, "fm", "-a", "fedfm", "-p", "start_round=2")
    assert [r["fm_active"] for r in fm] == [0.0, 0.0, 1.0]
    assert _same(avg[0], fm[0]) and _same(avg[1], fm[1])
    assert fm[2]["train_loss"] != avg[2]["train_loss"]
    assert all(r["exchanges"] == 2 for r in fm)


def test_plugin_on_fedavg_is_fedfm(tmp_path):
    plug = run_cli(tmp_path, "plug", "-a", "fedavg", "--feature-matching", "-p", "start_round=1")
    fm = run_cli(tmp_path, "fm", "-a", "fedfm", "-p", "start_round=1")
    assert all(_same(a, b) for a, b in zip(plug, fm, strict=True))
    assert [r["bytes_down"] for r in plug] == [r["bytes_down"] for r in fm]
    summary = json.loads((tmp_path / "plug" / "summary.json").read_text())
    assert summary["algorithm"] == "fedavg+fm"


# --- bytes per round ---------------------------------------------------------------------------


@pytest.mark.parametrize("agg", ["weighted", "uniform"])
def test_fedfm_bytes_are_fedavgs_plus_anchors(tmp_path, agg):
    model_bytes, d = model_facts()
    k = 8  # 40 % of 20 clients
    avg = run_cli(tmp_path, "avg", "-a", "fedavg", "--rounds", "2")
    fm = run_cli(
        tmp_path,
        "fm",
        "-a",
        "fedfm",
        "--rounds",
        "2",
        "-p",
        "start_round=1",
        "-p",
        f"anchor_agg={agg}",
    )
    # FedAvg: the model down; the model and two numbers (samples, loss) up.
    assert all(r["bytes_down"] == k * model_bytes for r in avg)
    assert all(r["bytes_up"] == k * (model_bytes + 2 * 8) for r in avg)
    anchors = C * d * 4  # float32
    counts = C * 8 if agg == "weighted" else 0  # int64, not sent under uniform aggregation
    # Down: the model once (anchor exchange), the 1-byte "*" marker in the inner message, and
    # the anchors from the launching round (round index 1) on.
    assert fm[0]["bytes_down"] == k * (model_bytes + 1)
    assert fm[1]["bytes_down"] == k * (model_bytes + 1 + anchors)
    for r in fm:
        assert r["bytes_up"] == k * (anchors + counts + model_bytes + 2 * 8)


@pytest.mark.parametrize("a", [2, 3])
def test_fedfm_lite_bytes_follow_the_model_period(tmp_path, a):
    model_bytes, d = model_facts()
    rounds = 4
    rows = run_cli(
        tmp_path, "lite", "-a", "fedfm-lite", "--rounds", str(rounds), "-p", f"a={a}",
        "-p", "start_round=0",
    )  # fmt: skip
    anchors, counts = C * d * 4, C * 8
    # Rounds with a model upload: every a-th, and always the last one.
    sync = [(t + 1) % a == 0 or t == rounds - 1 for t in range(rounds)]
    assert [r["model_round"] for r in rows] == [float(s) for s in sync]
    for t, r in enumerate(rows):
        clients = r["clients"]
        # The global model version in round t; a client needs the model unless it was
        # sampled earlier in the same version.
        version = sum(sync[:t])
        earlier = {c for s in range(t) if sum(sync[:s]) == version for c in rows[s]["clients"]}
        need_model = sum(1 for c in clients if c not in earlier)
        assert r["models_sent"] == need_model
        with_anchors = t >= 1  # no anchors exist before round 0 has been aggregated
        down = need_model * model_bytes + len(clients) * (8 + (anchors if with_anchors else 0))
        up = len(clients) * (anchors + counts + 8 + ((model_bytes + 8) if sync[t] else 0))
        assert (r["bytes_down"], r["bytes_up"]) == (down, up), t
        assert r["fm_active"] == float(with_anchors)


def test_fedfm_lite_with_a_1_and_full_participation_sends_the_model_every_round(tmp_path):
    model_bytes, d = model_facts()
    rows = run_cli(tmp_path, "lite1", "-a", "fedfm-lite", "-n", "5", "--participation", "1",
                   "-p", "a=1", "-p", "anchor_agg=uniform")  # fmt: skip
    anchors = C * d * 4
    for t, r in enumerate(rows):
        assert r["models_sent"] == 5
        # default start_round 20: no anchors go down, and uniform aggregation uploads no counts
        assert r["bytes_down"] == 5 * (model_bytes + 8)
        assert r["bytes_up"] == 5 * (anchors + 8 + model_bytes + 8), t


def test_fedfm_lite_keeps_the_local_model_only_between_model_rounds():
    prep, server, engine = _setup(algorithm="fedfm-lite", params={"a": 2}, rounds=4)
    n = len(prep.partition)
    first = sample_clients(0, 0, n, 8)
    engine.begin_round(0)
    server.round(0, first, engine)
    for cid in first:  # no model round: the trained model stays on the client
        kept = [k for k in engine.client_states[cid].arrays if k.startswith("fmlite.model/")]
        assert len(kept) == len(server.global_arrays)
    second = sample_clients(0, 1, n, 8)
    engine.begin_round(1)
    server.round(1, second, engine)
    for cid in second:  # uploaded in the model round: nothing kept
        assert not engine.client_states[cid].arrays
    assert server.model_version == 1


# --- the plug-in is generic --------------------------------------------------------------------


@dataclasses.dataclass
class ToyParams(FedAvgParams):
    lam: float = 1.0  # clashes with the plug-in's lam

    def validate(self) -> None:
        if self.lam < 0:
            raise UsageError("toy: lam must be >= 0")


class Toy(FedAvg):
    name = "toy"
    description = "toy"
    Params = ToyParams

    @classmethod
    def adapt_model(cls, params, model):
        model.toy_marker = params.lam
        return model


def test_plugin_combines_params_renames_clashes_and_delegates_adapt_model():
    wrapped = with_feature_matching(Toy)
    assert wrapped.name == "toy+fm" and wrapped is with_feature_matching(Toy)
    names = [f.name for f in dataclasses.fields(wrapped.Params)]
    assert names == [
        "server_lr", "lam", "fm_lam", "cg_tau", "start_round", "fm_loss", "anchor_agg",
        "lam_warmup",
    ]  # fmt: skip
    p = wrapped.make_params({"lam": 2, "fm_lam": "7", "fm_loss": "l2"})
    assert (p.lam, p.fm_lam, p.fm_loss, p.start_round) == (2.0, 7.0, "l2", 20)
    assert isinstance(p, ToyParams)
    with pytest.raises(UsageError, match="toy: lam"):
        wrapped.make_params({"lam": -1})
    with pytest.raises(UsageError, match="fm_lam must be >= 0"):
        wrapped.make_params({"fm_lam": -1})
    with pytest.raises(UsageError, match="fm_loss must be one of"):
        wrapped.make_params({"fm_loss": "kl"})
    with pytest.raises(UsageError, match="anchor_agg"):
        FedFM.make_params({"anchor_agg": "median"})
    with pytest.raises(UsageError, match="a must be >= 1"):
        FedFMLite.make_params({"a": 0})
    model = wrapped.adapt_model(p, torch.nn.Linear(1, 1))
    assert model.toy_marker == 2.0
    # No double matching: FedFM and FedFM-Lite come back unchanged.
    assert get_algorithm("fedfm", feature_matching=True) is FedFM
    assert get_algorithm("fedfm-lite", feature_matching=True) is FedFMLite
    assert get_algorithm("fedavg", feature_matching=True) is with_feature_matching(FedAvg)


class _Recorder:
    def __init__(self):
        self.sent = {}

    def exchange(self, messages, expect=None):
        self.sent = dict(messages)
        return {c: Message("ok") for c in messages}


def test_channel_drops_only_what_the_anchor_exchange_delivered_and_client_restores_it():
    delivered = {"body.w": torch.ones(2, 2), "head.w": torch.zeros(3)}
    anchors = torch.ones(C, 4)
    rec = _Recorder()
    channel = AnchorChannel(rec, delivered, [0, 1], anchors)
    changed = {"body.w": torch.ones(2, 2), "head.w": torch.ones(3), "extra": torch.ones(1)}
    channel.exchange({0: Message("train", arrays=changed, scalars={"x": 1.0})})
    out = rec.sent[0]
    assert set(out.arrays) == {"head.w", "extra", ANCHORS}  # body.w equal -> dropped
    assert out.strings[REUSED] == "body.w" and out.scalars == {"x": 1.0}
    # A second message to the same client in the round passes untouched.
    second = Message("more", arrays=dict(delivered))
    channel.exchange({0: second})
    assert rec.sent[0] is second

    seen = {}

    class InnerClient(ClientLogic):
        def on_train(self, msg, ctx):
            seen["arrays"] = {k: v.clone() for k, v in msg.arrays.items()}
            seen["terms"] = len(ctx.loss_terms)
            return Message("done")

    class Inner(FedAvg):
        name = "inner"
        Client = InnerClient

    client = with_feature_matching(Inner).Client(with_feature_matching(Inner).make_params({}))
    state = ClientState(arrays={"fm.kept/body.w": torch.full((2, 2), 5.0)})
    ctx = ClientContext(0, 3, 0, None, None, state, None)
    client.handle(out, ctx)
    assert set(seen["arrays"]) == {"body.w", "head.w", "extra"}
    assert torch.equal(seen["arrays"]["body.w"], torch.full((2, 2), 5.0))  # restored from state
    assert seen["terms"] == 1 and ctx.loss_terms == []  # installed for the handler only
    assert "fm.kept/body.w" not in state.arrays and state.scalars["fm.anchors_round"] == 3.0


def test_channel_counts_a_diverged_model_as_delivered():
    # FedFM never sends the model twice, so neither may the plug-in when the model is NaN
    # (NaN is not equal to itself by value; the inner message holds a different tensor).
    nan = torch.tensor([1.0, float("nan")])
    delivered = {"w": nan.clone()}
    rec = _Recorder()
    AnchorChannel(rec, delivered, [0], None).exchange({0: Message("train", arrays={"w": nan})})
    assert rec.sent[0].arrays == {} and rec.sent[0].strings[REUSED] == "*"
    other = {"w": torch.tensor([2.0, float("nan")])}
    AnchorChannel(rec, delivered, [0], None).exchange({0: Message("train", arrays=other)})
    assert set(rec.sent[0].arrays) == {"w"} and rec.sent[0].strings[REUSED] == ""


# --- the CLI, every switch ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["-a", "fedfm"],
        ["-a", "fedfm", "-p", "fm_loss=l2"],
        ["-a", "fedfm", "-p", "anchor_agg=uniform"],
        ["-a", "fedfm", "-p", "lam=10", "-p", "cg_tau=0.5"],
        ["-a", "fedavg", "--feature-matching"],
        ["-a", "fedfm-lite", "-p", "a=2"],
        ["-a", "fedfm-lite", "-p", "a=2", "-p", "fm_loss=l2", "-p", "anchor_agg=uniform"],
        ["-a", "fedfm", "-p", "lam_warmup=2"],
        ["-a", "fedprox", "--feature-matching", "-p", "lam_warmup=2"],
    ],
    ids=lambda a: " ".join(a),
)
def test_cli_runs_every_switch(tmp_path, args):
    rows = run_cli(tmp_path, "r", *args, "-p", "start_round=0")
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["accuracy"]) and math.isfinite(r["train_loss"]) for r in rows)
    assert rows[-1]["fm_active"] == 1.0


def test_lam_warmup_of_one_round_is_the_paper_and_longer_warmups_change_the_run(tmp_path):
    base = ["-a", "fedfm", "-p", "start_round=1", "-p", "lam=50"]
    paper = run_cli(tmp_path, "paper", *base)
    one = run_cli(tmp_path, "one", *base, "-p", "lam_warmup=1")
    three = run_cli(tmp_path, "three", *base, "-p", "lam_warmup=3")
    keys = ("accuracy", "train_loss", "loss")
    assert [[r[k] for k in keys] for r in one] == [[r[k] for k in keys] for r in paper]
    assert three[0]["accuracy"] == paper[0]["accuracy"]  # before the launching round
    assert three[1]["train_loss"] < paper[1]["train_loss"]  # a third of lam 50 in round 2


def test_cli_rejects_bad_fm_values(tmp_path, capsys):
    assert main(["run", "-o", str(tmp_path), *FAST, "-a", "fedfm", "-p", "fm_loss=kl"]) == 2
    assert "fm_loss must be one of cg, l2" in capsys.readouterr().err
    assert main(["run", "-o", str(tmp_path), *FAST, "-a", "fedfm", "-p", "lam_warmup=-1"]) == 2
    assert "lam_warmup must be >= 0 rounds" in capsys.readouterr().err


# --- match_on = pre_relu: anchors and matching before the body's last ReLU --------------------


def _pre_relu_class_means(arrays, prep, clients) -> torch.Tensor:
    """Class means of the body's output before its last ReLU, computed layer by layer."""
    model = new_model(prep)
    model.load_state_dict(arrays)
    model.eval()
    idx = np.concatenate([prep.partition[c] for c in clients])
    layers = list(model.body)
    assert isinstance(layers[-1], torch.nn.ReLU)
    with torch.no_grad():
        z = prep.dataset.x_train[idx]
        for layer in layers[:-1]:
            z = layer(z)
    labels = prep.dataset.y_train[idx]
    return torch.stack([z[labels == c].mean(dim=0) for c in range(C)])


def test_pre_relu_anchors_are_class_means_before_the_last_relu():
    prep, server, engine = _setup(
        algorithm="fedfm", params={"start_round": 0, "match_on": "pre_relu"}
    )
    initial = {k: v.clone() for k, v in server.global_arrays.items()}
    clients = sample_clients(0, 0, len(prep.partition), 8)
    engine.begin_round(0)
    server.round(0, clients, engine)
    union = np.concatenate([prep.partition[c] for c in clients])
    held = torch.bincount(prep.dataset.y_train[union], minlength=C) > 0
    expected = _pre_relu_class_means(initial, prep, clients)
    assert torch.allclose(server.fm_anchors[held], expected[held], atol=1e-5)
    assert (server.fm_anchors[held] < 0).any()  # not post-ReLU means, which are all >= 0
    post = _class_means(initial, prep, clients)
    assert not torch.allclose(server.fm_anchors[held], post[held], atol=1e-3)


def test_pre_relu_loss_keeps_the_network_and_hands_pre_relu_features_to_the_term():
    prep = prepare(ExperimentConfig())
    model = new_model(prep)
    x, y = prep.dataset.x_train[:16], prep.dataset.y_train[:16]
    out = pre_relu_cross_entropy(pre_relu_layers(model), model, x, y)
    assert torch.allclose(out.logits, model(x), atol=1e-6)  # the same network
    assert torch.allclose(torch.relu(out.features), model.body(x), atol=1e-6)
    assert (out.features < 0).any()
    assert out.loss.item() == pytest.approx(F.cross_entropy(model(x), y).item(), rel=1e-6)


def test_pre_relu_matches_features_before_the_launching_round_and_differs_after(tmp_path):
    base = ["-a", "fedfm", "-p", "start_round=1", "-p", "lam=5"]
    post = run_cli(tmp_path, "post", *base)
    pre = run_cli(tmp_path, "pre", *base, "-p", "match_on=pre_relu")
    assert _same(pre[0], post[0])  # round 1: plain cross-entropy either way
    assert pre[1]["train_loss"] != post[1]["train_loss"]
    assert pre[1]["fm_anchor_cos_max"] < post[1]["fm_anchor_cos_max"]


def test_pre_relu_is_refused_where_the_body_does_not_end_with_a_relu(tmp_path, capsys):
    args = ["run", "-o", str(tmp_path), *FAST, "-a", "fedfm", "-p", "match_on=pre_relu"]
    assert main([*args, "-m", "resnet18", "--model-option", "width=2"]) == 2
    err = capsys.readouterr().err
    assert "match_on=pre_relu needs a model whose body ends with a ReLU" in err
    assert "Traceback" not in err
    assert main(["run", "-o", str(tmp_path), *FAST, "-a", "fedfm", "-p", "match_on=x"]) == 2
    assert "match_on must be one of features, pre_relu" in capsys.readouterr().err
