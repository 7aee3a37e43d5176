"""Metrics the papers use: feature quality (FedFM Table IV), the t-SNE plot, the risk of local
models over client distributions (FedACD) and FedROD's personalised accuracy."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from fedskew.apps.cli import load_config, make_parser
from fedskew.assembly.prepare import new_model, prepare
from fedskew.config import ExperimentConfig, config_hash
from fedskew.core.errors import UsageError
from fedskew.metrics.features import (
    body_features,
    feature_quality,
    feature_sample,
    local_model_risk,
)
from fedskew.models.base import BodyHeadModel
from fedskew.runs.checkpoint import read_checkpoint
from fedskew.runs.loop import run
from fedskew.runs.measurements import LocalModels, due, whole_model
from fedskew.training.local import set_arrays
from fedskew.training.protocol import Message

SMALL = dict(rounds=3, num_clients=6, clients_per_round=3, local_epochs=1, workers=0, quiet=True)
NEW_KEYS = {
    "feature_nmi",
    "feature_silhouette",
    "feature_seconds",
    "local_risk",
    "local_risk_models",
    "local_risk_seconds",
}


def lines(folder: Path) -> list[dict]:
    return [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ the computations alone


def blobs(seed: int = 0, per_class: int = 40, flip: float = 0.2):
    """Four well-separated Gaussian blobs in 5-D; a fraction ``flip`` of the labels is
    changed to another class, so the labels and the blobs (what k-means finds) differ."""
    rng = np.random.default_rng(seed)
    centres = 20.0 * np.eye(4, 5)
    blob = np.repeat(np.arange(4), per_class)
    x = centres[blob] + rng.normal(0, 0.5, size=(len(blob), 5))
    labels = blob.copy()
    flipped = rng.random(len(blob)) < flip
    labels[flipped] = (blob[flipped] + rng.integers(1, 4, flipped.sum())) % 4
    return x, labels, blob


def nmi_by_hand(a: np.ndarray, b: np.ndarray) -> float:
    """I(a; b) / ((H(a) + H(b)) / 2) from the contingency table."""
    n = len(a)
    joint = np.zeros((a.max() + 1, b.max() + 1))
    np.add.at(joint, (a, b), 1)
    p = joint / n
    pa, pb = p.sum(1), p.sum(0)
    nz = p > 0
    mi = float((p[nz] * np.log(p[nz] / np.outer(pa, pb)[nz])).sum())

    def h(q):
        return float(-(q[q > 0] * np.log(q[q > 0])).sum())

    return mi / ((h(pa) + h(pb)) / 2)


def silhouette_by_hand(x: np.ndarray, labels: np.ndarray) -> float:
    d = np.sqrt(((x[:, None, :] - x[None, :, :]) ** 2).sum(-1))
    scores = []
    for i in range(len(x)):
        own = labels == labels[i]
        if own.sum() == 1:
            scores.append(0.0)
            continue
        a = d[i, own].sum() / (own.sum() - 1)
        b = min(d[i, labels == c].mean() for c in np.unique(labels) if c != labels[i])
        scores.append((b - a) / max(a, b))
    return float(np.mean(scores))


def test_nmi_and_silhouette_match_independent_computations():
    x, labels, blob = blobs()
    quality = feature_quality(x, labels, num_classes=4, seed=0)
    # k-means with k = 4 finds the four blobs, so the NMI is that of blobs vs labels.
    assert quality.nmi == pytest.approx(nmi_by_hand(labels, blob), abs=1e-9)
    assert 0.3 < quality.nmi < 0.9  # the flipped labels cost something, not everything
    assert quality.silhouette == pytest.approx(silhouette_by_hand(x, labels), abs=1e-9)
    # Labels equal to the clusters: perfect NMI, silhouette close to 1.
    clean = feature_quality(x, blob, num_classes=4, seed=0)
    assert clean.nmi == pytest.approx(1.0)
    assert clean.silhouette == pytest.approx(silhouette_by_hand(x, blob), abs=1e-9)
    assert clean.silhouette > 0.9
    # Features that carry no class information: NMI near 0, silhouette near 0.
    noise = np.random.default_rng(1).normal(size=x.shape)
    poor = feature_quality(noise, blob, num_classes=4, seed=0)
    assert poor.nmi < 0.1 and abs(poor.silhouette) < 0.05


def test_one_class_gives_an_undefined_silhouette():
    x, _, _ = blobs()
    quality = feature_quality(x, np.zeros(len(x), dtype=int), num_classes=4, seed=0)
    assert np.isnan(quality.silhouette)


def test_the_feature_sample_is_fixed_seeded_and_sized():
    a, b = feature_sample(10_000, seed=3), feature_sample(10_000, seed=3)
    assert len(a) == 2000 and np.array_equal(a, b)
    assert len(np.unique(a)) == 2000 and np.all(np.diff(a) > 0) and a.max() < 10_000
    assert not np.array_equal(a, feature_sample(10_000, seed=4))
    assert np.array_equal(feature_sample(300, seed=3), np.arange(300))  # smaller: whole set


def one_hot_model(num_classes: int, mapping: list[int]) -> BodyHeadModel:
    """A model that predicts ``mapping[c]`` for the one-hot input of class c."""
    head = nn.Linear(num_classes, num_classes)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        for c, predicted in enumerate(mapping):
            head.weight[predicted, c] = 1.0
    return BodyHeadModel(nn.Identity(), head, num_classes)


def test_local_risk_is_the_test_error_reweighted_to_each_client():
    num_classes = 4
    rng = np.random.default_rng(0)
    y = rng.integers(0, num_classes, 400)
    x = np.eye(num_classes, dtype=np.float32)[y] + rng.normal(0, 0.01, (400, 4)).astype(np.float32)
    mapping = [0, 1, 1, 0]  # classes 0, 1 right; 2 and 3 always wrong
    model = one_hot_model(num_classes, mapping)
    counts = np.array([[10, 0, 5, 5], [0, 30, 0, 10], [0, 0, 0, 0], [1, 1, 1, 1]])

    risk = local_model_risk(model, torch.from_numpy(x), torch.from_numpy(y), num_classes, counts)

    # Independently: per-class test error of the predictions, weighted by each client's label
    # proportions, averaged over the clients that hold data (FedACD Eq. 3).
    predicted = np.array(mapping)[np.argmax(x, axis=1)]
    error = np.array([np.mean(predicted[y == c] != c) for c in range(num_classes)])
    held = counts[counts.sum(1) > 0]
    expected = np.mean((held / held.sum(1, keepdims=True)) @ error)
    assert risk == pytest.approx(expected, abs=1e-12)
    assert expected == pytest.approx(np.mean([0.5, 0.25, 0.5]))


# ------------------------------------------------------------------ local models from replies


class FakeChannel:
    def __init__(self, replies):
        self.replies = replies

    def exchange(self, messages, expect=None):
        return {c: self.replies[c] for c in messages}


def test_replies_with_a_whole_model_are_kept_and_others_are_not():
    model = one_hot_model(3, [0, 1, 2])
    state = model.state_dict()
    reference = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
    full = {k: v + 1 for k, v in state.items()}
    replies = {
        0: Message("trained", arrays={**full, "extra": torch.zeros(2)}),  # model + more: kept
        1: Message("trained", arrays={"head.weight": state["head.weight"]}),  # a part: not
        2: Message("trained", arrays={**full, "head.bias": torch.zeros(5)}),  # wrong shape
    }
    kept: dict = {}
    channel = LocalModels(FakeChannel(replies), reference, kept)
    assert channel.exchange({0: Message("train"), 1: Message("train"), 2: Message("train")})
    assert sorted(kept) == [0]
    assert set(kept[0]) == set(state)
    assert torch.equal(kept[0]["head.weight"], full["head.weight"])
    full["head.weight"].add_(5)  # a copy: the server changing its replies changes nothing
    assert not torch.equal(kept[0]["head.weight"], full["head.weight"])
    assert whole_model({}, reference) is None


def test_due_rounds_include_every_nth_and_the_last():
    assert [r + 1 for r in range(7) if due(3, r, 7)] == [3, 6, 7]
    assert not any(due(0, r, 7) for r in range(7))


# ------------------------------------------------------------------ in a run


def test_run_writes_requested_metrics_tsne_and_leaves_the_rest_unchanged(tmp_path):
    plain_folder, plain = run(ExperimentConfig(out_dir=str(tmp_path), name="plain", **SMALL))
    cfg = ExperimentConfig(
        out_dir=str(tmp_path),
        name="measured",
        feature_metrics_every=2,
        local_risk_every=2,
        tsne=True,
        **SMALL,
    )
    folder, summary = run(cfg)
    rows = lines(folder)
    assert [sorted(NEW_KEYS & set(r)) for r in rows] == [[], sorted(NEW_KEYS), sorted(NEW_KEYS)]
    for r in rows[1:]:
        assert 0 <= r["feature_nmi"] <= 1 and -1 <= r["feature_silhouette"] <= 1
        assert 0 <= r["local_risk"] <= 1 and r["local_risk_models"] == 3
    # Training is untouched: the lines without the new keys (and timings) are the same.
    timing = {"seconds", "eval_seconds"}
    assert [{k: v for k, v in r.items() if k not in NEW_KEYS | timing} for r in rows] == [
        {k: v for k, v in r.items() if k not in timing} for r in lines(plain_folder)
    ]
    assert summary["final_accuracy"] == plain["final_accuracy"]
    assert summary["final_feature_nmi"] == rows[-1]["feature_nmi"]
    assert summary["final_local_risk"] == rows[-1]["local_risk"]
    assert not any(k.startswith("final_feature") or k == "final_local_risk" for k in plain)

    # The last line's feature metrics are those of the final global model (the checkpoint's)
    # on the seeded subsample.
    prep = prepare(cfg)
    model = new_model(prep)
    set_arrays(model, read_checkpoint(folder / "checkpoint.npz").server["global_arrays"])
    sample = feature_sample(len(prep.dataset.y_test), cfg.seed)
    features = body_features(model, prep.dataset.x_test[torch.from_numpy(sample)])
    quality = feature_quality(
        features, prep.dataset.y_test[sample].numpy(), prep.dataset.num_classes, cfg.seed
    )
    assert rows[-1]["feature_nmi"] == pytest.approx(quality.nmi, abs=1e-9)
    assert rows[-1]["feature_silhouette"] == pytest.approx(quality.silhouette, abs=1e-9)

    assert (folder / "tsne.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with np.load(folder / "tsne.npz") as points:
        assert points["coords"].shape == (len(sample), 2)
        assert np.array_equal(points["indices"], sample)
    assert not (plain_folder / "tsne.png").exists()


def test_local_risk_of_a_lone_client_is_the_global_models_risk(tmp_path):
    # One client per round: FedAvg's global model is that client's local model, so the local
    # risk equals 1 - the global model's accuracy on the clients' label distributions.
    cfg = ExperimentConfig(
        out_dir=str(tmp_path), local_risk_every=1, **{**SMALL, "clients_per_round": 1}
    )
    folder, _ = run(cfg)
    for r in lines(folder):
        assert r["local_risk_models"] == 1
        assert r["local_risk"] == pytest.approx(1 - r["client_dist_accuracy"], abs=1e-12)


def test_replies_without_the_local_model_report_no_local_risk(tmp_path, caplog):
    cfg = ExperimentConfig(
        out_dir=str(tmp_path), algorithm="fednova", local_risk_every=1, **{**SMALL, "rounds": 2}
    )
    with caplog.at_level(logging.WARNING, logger="fedskew"):
        folder, _ = run(cfg)
    assert not any("local_risk" in r for r in lines(folder))
    said = [m for m in caplog.messages if "local_risk is not reported" in m]
    assert len(said) == 1 and "fednova" in said[0]


def test_fedrod_personal_accuracy_is_in_the_lines_and_the_summary(tmp_path):
    cfg = ExperimentConfig(out_dir=str(tmp_path), algorithm="fedrod", **{**SMALL, "rounds": 2})
    folder, summary = run(cfg)
    rows = lines(folder)
    assert all(0 <= r["personal_accuracy"] <= 1 for r in rows)
    assert summary["final_personal_accuracy"] == rows[-1]["personal_accuracy"]
    saved = json.loads((folder / "summary.json").read_text())
    assert saved["final_personal_accuracy"] == rows[-1]["personal_accuracy"]


# ------------------------------------------------------------------ options


def test_options_from_the_command_line_and_their_checks():
    args = make_parser().parse_args(
        ["run", "--feature-metrics-every", "5", "--local-risk-every", "10", "--tsne"]
    )
    cfg = load_config(args)
    assert (cfg.feature_metrics_every, cfg.local_risk_every, cfg.tsne) == (5, 10, True)
    plain = load_config(make_parser().parse_args(["run"]))
    assert (plain.feature_metrics_every, plain.local_risk_every, plain.tsne) == (0, 0, False)
    # They measure, they do not train: a checkpoint made without them still fits.
    assert config_hash(cfg) == config_hash(plain)
    for bad in (-1, 1.5, True):
        with pytest.raises(UsageError, match="feature-metrics-every"):
            ExperimentConfig(feature_metrics_every=bad).validate()  # type: ignore[arg-type]
