"""Secure aggregation (SecAgg+) and differential privacy (central, adaptive, local).

The arithmetic by hand (clipping, noise, the adaptive clip norm, the accountant's epsilon),
SecAgg+'s mean against the plain one within its quantisation error, Flower's own
``secaggplus_mod`` through the real ClientApp (an in-memory Grid) against the in-process
simulation with the same metrics, clients dropping out in the middle of the protocol, the
refusals, and a killed DP run resumed exactly."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from run_metrics import metrics

from fedskew.config import build_config
from fedskew.core.errors import UsageError
from fedskew.training.interface import ClientContext, ClientLogic, LocalTrainConfig
from fedskew.training.privacy import (
    CLIP,
    CLIP_BIT,
    LOCAL_NOISE,
    SUMMED,
    WANT_BIT,
    Privacy,
    PrivateAggregation,
    plain_mean,
    summand_reply,
)
from fedskew.training.protocol import ClientState, Message, Summed, SumRequest


def cfg_of(tmp_path: Path, **extra):
    values = dict(
        algorithm="fedavg", num_clients=4, clients_per_round=3, rounds=2, local_epochs=1,
        out_dir=str(tmp_path), quiet=True, workers=0,
    )  # fmt: skip
    values.update(extra)
    return build_config({}, values)


PRIVATE_KEYS = (
    "dp_clip", "dp_noise_std", "dp_unclipped_fraction", "dp_epsilon", "dp_epsilon_known_sampling",
    "tau_eff",
)  # fmt: skip
COMPARED = ("accuracy", "loss", "train_loss", "bytes_down", "bytes_up", "clients", *PRIVATE_KEYS)


def same_rows(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for ra, rb in zip(a, b, strict=True):
        for key in COMPARED:
            assert ra.get(key) == rb.get(key), (ra["round"], key, ra.get(key), rb.get(key))


# ------------------------------------------------------------------ the client's summand


class _Logic(ClientLogic):
    def __init__(self) -> None:
        super().__init__(None)


def context(cid: int = 1, rnd: int = 0) -> ClientContext:
    return ClientContext(cid, rnd, 7, None, None, ClientState(), LocalTrainConfig())  # type: ignore[arg-type]


def test_a_summand_is_the_clipped_update_with_its_bit():
    sent = Message("train", arrays={"w": torch.zeros(4), "n": torch.tensor(3)},
                   scalars={SUMMED: 1.0, CLIP: 1.0, WANT_BIT: 1.0})  # fmt: skip
    reply = Message("trained", arrays={"w": torch.tensor([3.0, 4.0, 0.0, 0.0]),
                                       "n": torch.tensor(9)},
                    scalars={"num_samples": 5.0, "loss": 0.7})  # fmt: skip
    out = summand_reply(_Logic(), sent, reply, context())
    # the update (3, 4, 0, 0) has norm 5: scaled to norm 1; the integer counter is not sent,
    # nor is the loss (it would leave the client unclipped and unnoised)
    assert torch.allclose(out.arrays["w"], torch.tensor([0.6, 0.8, 0.0, 0.0]))
    assert set(out.arrays) == {"w", CLIP_BIT} and out.arrays[CLIP_BIT].item() == 0.0
    assert out.scalars == {"num_samples": 5.0}
    small = Message("trained", arrays={"w": torch.full((4,), 0.1)}, scalars=reply.scalars)
    kept = summand_reply(_Logic(), sent, small, context())
    assert torch.equal(kept.arrays["w"], torch.full((4,), 0.1)) and kept.arrays[CLIP_BIT] == 1
    # a message outside a summed exchange gets the handler's reply as it is
    assert summand_reply(_Logic(), Message("train", arrays=sent.arrays), reply, context()) is reply


def test_local_noise_has_the_stated_deviation_and_is_addressed():
    sent = Message("train", arrays={"w": torch.zeros(20000)},
                   scalars={SUMMED: 1.0, CLIP: 0.5, LOCAL_NOISE: 2.0})  # fmt: skip
    reply = Message("trained", arrays={"w": torch.zeros(20000)}, scalars={"num_samples": 1.0})
    a = summand_reply(_Logic(), sent, reply, context(1, 3)).arrays["w"]
    assert abs(float(a.std()) - 2.0 * 0.5) < 0.02  # z * S
    assert torch.equal(a, summand_reply(_Logic(), sent, reply, context(1, 3)).arrays["w"])
    assert not torch.equal(a, summand_reply(_Logic(), sent, reply, context(2, 3)).arrays["w"])


# ------------------------------------------------------------------ the server's side


def privacy(**kw) -> Privacy:
    values = dict(secure=False, dp="central", clip=1.0, noise=1.0, adaptive=False,
                  target_quantile=0.5, clip_lr=0.2, count_noise=2.0, delta=1e-5,
                  clip_range=8.0, quantization=2**22)  # fmt: skip
    values.update(kw)
    return Privacy(**values)  # type: ignore[arg-type]


def test_central_noise_is_z_s_over_m_on_the_mean():
    p = privacy(noise=1.5, clip=0.4)
    agg = PrivateAggregation(p, seed=0, client_sizes=[10] * 8)
    replies = {c: Message("trained") for c in range(5)}
    summed = Summed({"w": torch.zeros(50000, dtype=torch.float64)}, 5.0, replies)
    update, m = agg.finish(0, summed, {"clip": 0.4})
    assert m["dp_noise_std"] == pytest.approx(1.5 * 0.4 / 5)
    assert float(update["w"].std()) == pytest.approx(1.5 * 0.4 / 5, rel=0.02)
    again, _ = agg.finish(0, summed, {"clip": 0.4})
    assert torch.equal(update["w"], again["w"])  # addressed: the same noise for the round


def test_adaptive_clipping_moves_the_norm_geometrically():
    p = privacy(adaptive=True, noise=1.0, count_noise=2.0, clip_lr=0.2, target_quantile=0.5)
    # Andrew et al.: the updates' noise multiplier after the count took its part
    assert p.update_noise() == pytest.approx((1.0 - 1 / 16) ** -0.5)
    agg = PrivateAggregation(p, seed=0, client_sizes=[10] * 8)
    replies = {c: Message("trained") for c in range(4)}
    mean = {"w": torch.zeros(3, dtype=torch.float64), CLIP_BIT: torch.tensor([0.75])}
    state = {"clip": 2.0}
    _, m = agg.finish(3, Summed(mean, 4.0, replies), state)
    unclipped = m["dp_unclipped_fraction"]
    assert state["clip"] == pytest.approx(2.0 * math.exp(-0.2 * (unclipped - 0.5)))
    assert m["dp_clip"] == 2.0  # the norm this round used


def test_the_server_clips_a_summand_it_sees():
    request = SumRequest({"w": (2,)}, uniform=True, secure=False, seed=0, round=0, bound=1.0)
    honest = Message(
        "trained", arrays={"w": torch.tensor([0.6, 0.8])}, scalars={"num_samples": 3.0}
    )
    cheat = Message(
        "trained", arrays={"w": torch.tensor([30.0, 40.0])}, scalars={"num_samples": 9.0}
    )
    summed = plain_mean({0: honest, 1: cheat}, request)
    assert torch.allclose(summed.mean["w"], torch.tensor([0.6, 0.8], dtype=torch.float64))
    assert summed.weight == 2.0  # equal weights under central DP, whatever the counts


# ------------------------------------------------------------------ SecAgg+ arithmetic


def test_secure_mean_equals_the_plain_mean_within_the_quantisation_error():
    pytest.importorskip("flwr")
    from fedskew.engines.secure_sum import simulated_secure_mean

    gen = torch.Generator().manual_seed(0)
    shapes = {"a": (30, 7), "b": (11,)}
    sizes = [12, 40, 7, 25, 33]
    replies = {
        c: Message(
            "trained",
            arrays={k: 0.3 * torch.randn(s, generator=gen) for k, s in shapes.items()},
            scalars={"num_samples": float(n)},
        )
        for c, n in enumerate(sizes)
    }
    request = SumRequest(shapes, uniform=False, secure=True, seed=5, round=2, max_weight=40.0)
    secure, extra = simulated_secure_mean(replies, request)
    plain = plain_mean(replies, request)
    # Each client's values, times its weight over max_weight (<= 1), are rounded to a step of
    # 2R/Q; the mean divides their sum by the sum of those ratios.
    step = 2 * request.clip_range / request.quantization
    ratio_sum = sum(round(n / 40 * request.quantization) / request.quantization for n in sizes)
    bound = len(sizes) * step / ratio_sum
    for k in shapes:
        err = float((secure.mean[k] - plain.mean[k]).abs().max())
        assert 0 < err <= bound, (k, err, bound)
    assert secure.weight == pytest.approx(sum(sizes), rel=1e-6)
    assert extra == len(sizes) * (request.masked_nbytes() - 4 * (30 * 7 + 11))
    # the random rounding is addressed: the same request rounds alike
    assert torch.equal(simulated_secure_mean(replies, request)[0].mean["a"], secure.mean["a"])


# ------------------------------------------------------------------ runs and refusals


@pytest.mark.parametrize(
    "extra, message",
    [
        (dict(algorithm="fedcme", secure_aggregation=True), "secure-aggregation: fedcme pairs"),
        (dict(algorithm="scaffold", secure_aggregation=True), "not wired for it yet"),
        (dict(algorithm="fednova", dp="central"), "dp: fednova weighs"),
        (dict(algorithm="fedacd", dp="local"), "dp: fedacd weighs"),
        (dict(algorithm="fedfm", dp="central"), "dp: fedfm sends class anchors"),
    ],
)
def test_algorithms_whose_server_reads_more_than_the_mean_are_refused(tmp_path, extra, message):
    from fedskew.runs.loop import run

    with pytest.raises(UsageError, match=message):
        run(cfg_of(tmp_path, **extra))


@pytest.mark.parametrize(
    "extra, message",
    [
        (dict(secure_aggregation=True, clients_per_round=1), "at least 2 clients per round"),
        (dict(dp="local", dp_clipping="adaptive"), "adaptive is for dp central"),
        (dict(dp="central", local_test_fraction=0.2), "accuracy counts in clear"),
        (dict(dp="central", feature_matching=True), "class anchors"),
        (dict(dp="central", dp_clipping="adaptive", dp_count_noise=0.2), "above 0.5"),
        (dict(secure_aggregation=True, secagg_quantization=2**31), "below 2\\*\\*32"),
        (dict(dp="central", dp_clip=0.0), "dp-clip must be > 0"),
    ],
)
def test_option_combinations_without_a_guarantee_are_refused(tmp_path, extra, message):
    with pytest.raises(UsageError, match=message):
        cfg_of(tmp_path, **extra)


def test_the_run_summary_line_says_what_was_spent(tmp_path):
    from fedskew.apps.cli import format_summary

    summary = dict(
        algorithm="fedavg", dataset="digits", model="mlp", partition="iid", num_clients=4,
        clients_per_round=3, rounds=2, seed=0, final_accuracy=0.5, best_accuracy=0.5,
        final_client_dist_accuracy=0.5, total_bytes_down=0, total_bytes_up=0,
        train_seconds=1.0, train_samples_per_second=1.0, eval_seconds=0.0,
        secure_aggregation=True, dp="central", dp_epsilon=5.968, dp_delta=1e-5, dp_noise=2.0,
        dp_clip=1.0, dp_clipping="fixed",
    )  # fmt: skip
    text = format_summary(summary, tmp_path)
    assert "privacy: secure aggregation; central DP, epsilon 5.97 at delta 1e-05" in text
    assert "privacy" not in format_summary({**summary, "secure_aggregation": False, "dp": "off"},
                                           tmp_path)  # fmt: skip


def test_dp_without_the_accountant_is_refused_in_one_line(tmp_path, monkeypatch):
    import sys

    from fedskew.runs.loop import run

    monkeypatch.setitem(sys.modules, "dp_accounting", None)  # import fails
    with pytest.raises(UsageError, match=r"pip install 'fedskew\[privacy\]'"):
        run(cfg_of(tmp_path, dp="central"))


def test_epsilon_is_the_accountants():
    dpa = pytest.importorskip("dp_accounting")
    from fedskew.metrics.privacy_accounting import central_epsilon, local_epsilon

    relation = dpa.NeighboringRelation.REPLACE_ONE
    acc = dpa.rdp.RdpAccountant(neighboring_relation=relation)
    acc.compose(dpa.SampledWithoutReplacementDpEvent(10, 4, dpa.GaussianDpEvent(0.75)), 7)
    assert central_epsilon(1.5, 10, 4, 7, 1e-5) == pytest.approx(acc.get_epsilon(1e-5))
    full = dpa.rdp.RdpAccountant(neighboring_relation=relation)
    full.compose(dpa.GaussianDpEvent(0.75), 3)
    assert central_epsilon(1.5, 4, 4, 3, 1e-5) == pytest.approx(full.get_epsilon(1e-5))
    assert local_epsilon(1.5, 3, 1e-5) == pytest.approx(full.get_epsilon(1e-5))
    assert central_epsilon(0.0, 4, 4, 3, 1e-5) is None  # no noise: no finite epsilon
    eps = [central_epsilon(1.0, 10, 4, r, 1e-5) for r in (1, 2, 5)]
    assert eps == sorted(eps) and eps[0] > 0


def test_central_epsilon_is_the_tighter_of_amplification_and_the_clients_rounds():
    pytest.importorskip("dp_accounting")
    from types import SimpleNamespace

    from fedskew.data.federated import sample_clients
    from fedskew.metrics.privacy_accounting import central_epsilon, local_epsilon
    from fedskew.runs.privacy import PrivacyLedger

    for n, m in ((4, 3), (20, 4)):
        prep = SimpleNamespace(
            privacy=privacy(noise=1.0), cfg=SimpleNamespace(seed=1), partition=[0] * n
        )
        ledger = PrivacyLedger(prep, m)  # type: ignore[arg-type]
        counts = [0] * n
        for r in range(6):
            for c in sample_clients(1, r, n, m):
                counts[c] += 1
            known = local_epsilon(1.0, max(counts), 1e-5)
            line = ledger.record(r)
            assert line["dp_epsilon_known_sampling"] == known
            assert line["dp_epsilon"] == min(known, central_epsilon(1.0, n, m, r + 1, 1e-5))
    # 3 of 4 a round: sampling without replacement's bound is the looser one there; 4 of 20
    # over 6 rounds: amplification wins
    assert ledger.record(5)["dp_epsilon"] < ledger.record(5)["dp_epsilon_known_sampling"]


def test_local_dp_reports_the_most_sampled_clients_epsilon(tmp_path):
    pytest.importorskip("dp_accounting")
    from fedskew.data.federated import sample_clients
    from fedskew.metrics.privacy_accounting import local_epsilon
    from fedskew.runs.loop import run

    cfg = cfg_of(tmp_path, dp="local", dp_noise=0.2, num_clients=5, clients_per_round=2, rounds=3)
    folder, summary = run(cfg)
    rows = metrics(folder)
    counts = [0] * 5
    for r, row in enumerate(rows):
        for c in sample_clients(cfg.seed, r, 5, 2):
            counts[c] += 1
        assert row["dp_epsilon"] == pytest.approx(local_epsilon(0.2, max(counts), 1e-5))
        assert "train_loss" not in row  # a client's loss would leave it unnoised
    assert summary["dp"] == "local" and summary["dp_epsilon"] == rows[-1]["dp_epsilon"]
    resolved = json.loads((folder / "config.json").read_text())["resolved"]
    assert resolved["privacy_accounting"]["adjacency"].startswith("replace one client")
    # fedskew report shows the final epsilon beside the accuracy
    from fedskew.apps.cli import main

    assert main(["report", str(tmp_path), "-o", str(tmp_path / "report")]) == 0
    md = (tmp_path / "report" / "report.md").read_text()
    header = next(x for x in md.splitlines() if "privacy spent (DP epsilon)" in x)
    row = md.splitlines()[md.splitlines().index(header) + 2]
    cells = [c.strip() for c in row.strip("|").split("|")]
    column = header.strip("|").split("|").index(" privacy spent (DP epsilon) ")
    assert cells[column].startswith(f"{summary['dp_epsilon']:.4f}")


# ------------------------------------------------------------------ every engine alike

flwr = pytest.importorskip("flwr")
from flower_grid import LocalGrid  # noqa: E402
from flwr.common.secure_aggregation.secaggplus_constants import (  # noqa: E402
    RECORD_KEY_CONFIGS,
    Key,
    Stage,
)

from fedskew.apps.flower.server import serve  # noqa: E402
from fedskew.runs.loop import run  # noqa: E402


@pytest.mark.parametrize(
    "extra",
    [
        dict(secure_aggregation=True),
        dict(secure_aggregation=True, dp="central", dp_clipping="adaptive", dp_clip=0.5),
        dict(dp="local", dp_noise=0.05),
        dict(algorithm="fednova", secure_aggregation=True),
    ],
    ids=["secagg", "secagg+central-adaptive", "local", "fednova-secagg"],
)
def test_flower_gives_the_in_process_metrics(tmp_path, extra):
    if extra.get("dp", "off") != "off":
        pytest.importorskip("dp_accounting")
    folder_ip, summary_ip = run(cfg_of(tmp_path / "ip", **extra))
    folder_fl, summary_fl = serve(LocalGrid(4), cfg_of(tmp_path / "fl", **extra))
    rows = metrics(folder_fl)
    assert all(r["missing_replies"] == [] and r["rejected_replies"] == [] for r in rows)
    same_rows(metrics(folder_ip), rows)
    assert summary_ip["final_accuracy"] == summary_fl["final_accuracy"]


@pytest.mark.slow  # two worker processes start: 30 s on a busy 2-core machine
def test_worker_processes_give_the_in_process_metrics(tmp_path):
    """The clients' side (summand, clipping, local noise) in two worker processes, the
    SecAgg+ arithmetic simulated over their replies: the in-process run's numbers."""
    pytest.importorskip("dp_accounting")
    extra = dict(secure_aggregation=True, dp="local", dp_noise=0.05)
    folder_ip, _ = run(cfg_of(tmp_path / "ip", **extra))
    folder_wk, _ = run(cfg_of(tmp_path / "wk", **{**extra, "workers": 2}))
    same_rows(metrics(folder_ip), metrics(folder_wk))


def test_secure_aggregation_is_plain_fedavg_within_its_quantisation(tmp_path):
    """One round from the same model: the model a secure sum makes is FedAvg's, up to the
    quantisation error (the integer batch counters aside, which keep their value)."""
    plain, _ = run(cfg_of(tmp_path / "p", rounds=1))
    secure, _ = run(cfg_of(tmp_path / "s", rounds=1, secure_aggregation=True))
    a, b = metrics(plain)[0], metrics(secure)[0]
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-4) and a["loss"] != b["loss"]
    # int64 masked values instead of float32 ones (and the weight and loss as two more)
    assert 1.99 < b["bytes_up"] / a["bytes_up"] < 2.01


class StageDrops(LocalGrid):
    """Loses the answers of ``pid`` to the SecAgg+ stage ``stage`` in round ``rnd``."""

    def __init__(self, num_nodes: int, rnd: int, pid: int, stage: str) -> None:
        super().__init__(num_nodes)
        self.lost = (rnd, 1000 + pid, stage)

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for msg in messages:
            record = msg.content.config_records.get(RECORD_KEY_CONFIGS)
            stage = record[Key.STAGE] if record is not None else None  # before the mod pops it
            reply = self.deliver(msg)
            key = (int(msg.metadata.group_id), msg.metadata.dst_node_id, stage)
            if reply is not None and key != self.lost:
                replies.append(reply)
        return replies


def test_a_client_dropping_mid_protocol_is_unmasked_away(tmp_path):
    """Client 2 sends its keys and shares, then no masked vector in round 1: the others'
    shares of its key remove its pairwise masks, and the round has the model of a round it
    never joined. One that drops after its masked vector (at unmask) is in the sum."""
    clients = dict(clients_per_round=4, secure_aggregation=True)
    absent, _ = serve(LocalGrid(4, drop={(1, 2)}), cfg_of(tmp_path / "a", **clients))
    mid, _ = serve(
        StageDrops(4, 1, 2, Stage.COLLECT_MASKED_VECTORS), cfg_of(tmp_path / "m", **clients)
    )
    rows_absent, rows_mid = metrics(absent), metrics(mid)
    assert rows_mid[1]["missing_replies"] == [2] == rows_absent[1]["missing_replies"]
    assert rows_mid[1]["accuracy"] == rows_absent[1]["accuracy"]
    assert rows_mid[1]["loss"] == rows_absent[1]["loss"]
    whole, _ = serve(LocalGrid(4), cfg_of(tmp_path / "w", **clients))
    late, _ = serve(StageDrops(4, 1, 2, Stage.UNMASK), cfg_of(tmp_path / "l", **clients))
    assert metrics(late)[1]["missing_replies"] == []
    assert metrics(late)[1]["loss"] == metrics(whole)[1]["loss"]


def test_a_forged_masked_vector_is_rejected_never_summed(tmp_path):
    def forge(content):  # (every reply of the round passes here: the masked vector's only)
        record = content.config_records[RECORD_KEY_CONFIGS]
        if Key.MASKED_PARAMETERS in record:
            record[Key.MASKED_PARAMETERS] = record[Key.MASKED_PARAMETERS][:-1]  # an array short

    cfg = cfg_of(tmp_path, clients_per_round=4, secure_aggregation=True)
    folder, _ = serve(LocalGrid(4, corrupt={(0, 1): forge}), cfg)
    first = metrics(folder)[0]
    assert first["rejected_replies"] == [1] and first["missing_replies"] == [1]
    assert math.isfinite(first["loss"])


class Killed(Exception):
    pass


def kill_after(n: int):
    def hook(record):
        if record["round"] == n:
            raise Killed

    return hook


def test_a_dp_run_resumes_exactly_on_every_engine(tmp_path):
    """Central DP with adaptive clipping under secure aggregation: the noise, the random
    rounding and the clip norm (checkpointed) continue where they stopped, in process and on
    Flower."""
    pytest.importorskip("dp_accounting")
    extra = dict(rounds=3, secure_aggregation=True, dp="central", dp_clipping="adaptive",
                 dp_clip=0.5, name="r")  # fmt: skip
    full, _ = run(cfg_of(tmp_path / "full", **extra))
    reference = metrics(full)
    assert len({r["dp_clip"] for r in reference}) == 3  # the norm moved each round
    # 3 of 4 clients a round: amplification by sampling, unless one knows who took part
    assert all(r["dp_epsilon_known_sampling"] >= r["dp_epsilon"] > 0 for r in reference)
    for how in ("inprocess", "flower"):
        cfg = cfg_of(tmp_path / how, **extra)
        play = run if how == "inprocess" else lambda c, **kw: serve(LocalGrid(4), c, **kw)
        with pytest.raises(Killed):
            play(cfg, on_round=kill_after(1))
        unfinished = tmp_path / how / "r.incomplete"
        folder, _ = play(cfg, resume=unfinished)
        same_rows(reference, metrics(folder))
