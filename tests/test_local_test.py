"""Local test splits (--local-test-fraction): the split, the per-client numbers on every
engine, their spread, resume, and replies that must be refused."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from run_metrics import rows

from fedskew.apps.cli import main
from fedskew.assembly.prepare import new_model, prepare
from fedskew.config import ExperimentConfig, config_hash
from fedskew.core.errors import FedskewError
from fedskew.data.local_test import held_out_per_class, split_local_test
from fedskew.data.partition import load_partition
from fedskew.metrics.client_spread import client_spread
from fedskew.runs.checkpoint import load_checkpoint
from fedskew.runs.local_evaluation import evaluate_on_clients
from fedskew.runs.loop import run
from fedskew.training.local_evaluation import LOCAL_RESULT
from fedskew.training.protocol import Message

CLIENT_KEYS = ("client_accuracy", "client_personal_accuracy")


# --------------------------------------------------------------------------- the split


def test_held_out_counts_follow_the_classes_and_round_the_total():
    rng = np.random.default_rng(0)
    # 16 samples, F = 0.2: round(3.2) = 3 held out; floors 2, 1, 0 already give 3.
    assert held_out_per_class(np.array([10, 5, 1]), 0.2, rng).tolist() == [2, 1, 0]
    # 9 samples, F = 0.5: round(4.5) = 5; floors 1, 1, 1 and two of the equal remainders.
    got = held_out_per_class(np.array([3, 3, 3]), 0.5, rng)
    assert got.sum() == 5 and sorted(got.tolist()) == [1, 2, 2]
    # One sample: it stays for training; two samples at F = 0.9: one stays.
    assert held_out_per_class(np.array([0, 1]), 0.5, rng).tolist() == [0, 0]
    assert held_out_per_class(np.array([2, 0]), 0.9, rng).tolist() == [1, 0]


def test_split_is_stratified_disjoint_complete_and_addressed():
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 5, size=600)
    order = rng.permutation(600)
    partition = [order[:50], order[50:300], order[300:301], order[301:]]
    train, test = split_local_test(partition, labels, 5, 0.25, seed=7)
    for whole, a, b in zip(partition, train, test, strict=True):
        assert len(a) >= 1
        assert sorted([*a, *b]) == sorted(whole) and not set(a) & set(b)
        # both parts keep the partition's order
        position = {int(v): i for i, v in enumerate(whole)}
        assert [position[int(v)] for v in a] == sorted(position[int(v)] for v in a)
        assert [position[int(v)] for v in b] == sorted(position[int(v)] for v in b)
        assert len(b) == min(math.floor(0.25 * len(whole) + 0.5), len(whole) - 1)
        counts = np.bincount(labels[whole], minlength=5)
        held = np.bincount(labels[b], minlength=5)
        # stratified: each class within one sample of its share
        assert np.all(np.abs(held - 0.25 * counts) < 1)
    again, test_again = split_local_test(partition, labels, 5, 0.25, seed=7)
    assert all(np.array_equal(x, y) for x, y in zip(test, test_again, strict=True))
    _, other = split_local_test(partition, labels, 5, 0.25, seed=8)
    assert any(not np.array_equal(x, y) for x, y in zip(test, other, strict=True))
    none_train, none_test = split_local_test(partition, labels, 5, 0.0, seed=7)
    assert all(np.array_equal(x, y) for x, y in zip(partition, none_train, strict=True))
    assert all(len(t) == 0 for t in none_test)


def test_client_spread_by_hand():
    spread = client_spread([0.1, 0.5, None, 0.9, 0.3])
    values = [0.1, 0.5, 0.9, 0.3]
    mean = sum(values) / 4
    assert spread["mean"] == pytest.approx(mean)
    assert spread["std"] == pytest.approx(math.sqrt(sum((v - mean) ** 2 for v in values) / 4))
    assert spread["worst10"] == pytest.approx(0.1)  # ceil(4 / 10) = 1 client
    assert spread["gap"] == pytest.approx(0.8)
    eleven = [i / 10 for i in range(11)]  # ceil(1.1) = 2 clients per tenth
    assert client_spread(eleven)["worst10"] == pytest.approx(0.05)
    assert client_spread(eleven)["gap"] == pytest.approx(0.95 - 0.05)
    assert client_spread([None, None]) == {}


def test_option_is_validated_and_leaves_old_configurations_alone(capsys):
    for bad in ("1", "1.5", "-0.1", "nan"):
        assert main(["run", "--local-test-fraction", bad, "-r", "1", "-q"]) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "local-test-fraction" in err[0]
    # A run folder from before the option hashes as it did: 0 is left out of the hash.
    assert config_hash(ExperimentConfig()) == config_hash(ExperimentConfig(local_test_fraction=0.0))
    assert config_hash(ExperimentConfig()) != config_hash(ExperimentConfig(local_test_fraction=0.2))


# --------------------------------------------------------------------------- the runs

COMMON = dict(
    algorithm="fedrod", num_clients=4, clients_per_round=3, rounds=3, local_epochs=1,
    local_test_fraction=0.2, quiet=True, seed=4,
)  # fmt: skip


def test_per_client_numbers_agree_on_every_engine_and_after_a_resume(tmp_path):
    pytest.importorskip("flwr")
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from flower_grid import LocalGrid

    from fedskew.apps.flower.server import serve

    folder, summary = run(ExperimentConfig(out_dir=str(tmp_path / "a"), name="r", **COMMON))
    reference = rows(folder)
    assert all(
        len(r["client_accuracy"]) == 4 and len(r["client_personal_accuracy"]) == 4
        for r in reference
    )
    # FedROD's personal head exists only once a client trained: round 1 leaves one out.
    assert reference[0]["client_personal_accuracy"].count(None) == 1
    last = reference[-1]
    for key in ("mean", "std", "worst10", "gap"):
        assert summary[f"final_client_accuracy_{key}"] == last[f"client_accuracy_{key}"]
    assert last["local_eval_bytes_down"] > 0 and "local_eval_missing" not in last

    # Computed here without fedskew's evaluation: the final global model on each split.
    cfg = ExperimentConfig(out_dir=str(tmp_path / "a"), **COMMON)
    prep = prepare(cfg)
    whole, _ = load_partition(folder / "partition.npz")
    labels = prep.dataset.y_train.numpy()
    _, tests = split_local_test(whole, labels, prep.dataset.num_classes, 0.2, cfg.seed)
    _, server, _, _ = load_checkpoint(folder / "checkpoint.npz")
    model = new_model(prep)
    model.load_state_dict(server["global_arrays"])
    model.eval()
    with torch.no_grad():
        for cid, idx in enumerate(tests):
            x = prep.dataset.x_train[torch.from_numpy(idx)]
            y = prep.dataset.y_train[torch.from_numpy(idx)]
            expected = (model(x).argmax(1) == y).double().mean().item()
            assert last["client_accuracy"][cid] == pytest.approx(expected, abs=1e-6)

    # Worker processes and Flower nodes hold the split themselves: the same numbers.
    workers, _ = run(ExperimentConfig(out_dir=str(tmp_path / "w"), name="r", workers=2, **COMMON))
    flower, _ = serve(LocalGrid(4), ExperimentConfig(out_dir=str(tmp_path / "f"), **COMMON))
    for other in (rows(workers), rows(flower)):
        for ra, rb in zip(reference, other, strict=True):
            for key in ("accuracy", *CLIENT_KEYS):
                assert ra[key] == rb[key], (ra["round"], key)

    # A run stopped after round 2 and resumed has every number of the uninterrupted one.
    class Killed(Exception):
        pass

    def kill(record: dict) -> None:
        if record["round"] == 2:
            raise Killed

    with pytest.raises(Killed):
        run(ExperimentConfig(out_dir=str(tmp_path / "b"), name="r", **COMMON), on_round=kill)
    assert main(["run", "--resume", str(tmp_path / "b" / "r.incomplete"), "-q"]) == 0
    assert rows(tmp_path / "b" / "r") == reference
    resumed = json.loads((tmp_path / "b" / "r" / "summary.json").read_text())
    assert resumed["final_client_accuracy_mean"] == summary["final_client_accuracy_mean"]


def test_methods_without_a_personal_part_report_no_personalised_accuracy(tmp_path):
    folder, summary = run(
        ExperimentConfig(out_dir=str(tmp_path), **{**COMMON, "algorithm": "fedavg", "rounds": 1})
    )
    (record,) = rows(folder)
    assert "client_personal_accuracy" not in record
    assert "final_client_personal_accuracy_mean" not in summary
    config = json.loads((folder / "config.json").read_text())
    assert config["local_test_fraction"] == 0.2
    whole, _ = load_partition(folder / "partition.npz")  # the clients' data before the split
    expected = sum(min(math.floor(0.2 * len(p) + 0.5), len(p) - 1) for p in whole)
    assert config["resolved"]["local_test_samples"] == expected


class _Replies:
    """An engine stand-in that answers with given replies."""

    def __init__(self, replies: dict[int, Message], lossy: bool) -> None:
        self.replies = replies
        self.may_lose_replies = lossy

    def exchange(self, messages, expect=None):
        return {c: r for c, r in self.replies.items() if c in messages}


def _result(correct: float, total: float, **extra: float) -> Message:
    return Message(LOCAL_RESULT, scalars={"correct": correct, "total": total, **extra})


def test_counts_that_cannot_be_a_clients_are_refused(caplog):
    sizes = [10, 10, 10, 10, 0]
    replies = {
        0: _result(7, 10),
        1: _result(11, 10),  # more hits than samples
        2: _result(3.5, 10),  # not a whole number
        3: _result(5, 1e30),  # claims another split size
    }
    got = evaluate_on_clients(_Replies(replies, lossy=True), 0, {}, sizes, personal=False)
    assert got["client_accuracy"] == [0.7, None, None, None, None]
    assert got["local_eval_missing"] == [1, 2, 3]  # client 4 holds no split: not asked
    assert got["client_accuracy_mean"] == pytest.approx(0.7)
    assert sum("refused" in r.message for r in caplog.records) == 3
    # Where clients run fedskew's own code, such a reply is a fault: the run stops.
    with pytest.raises(FedskewError, match="client 1"):
        evaluate_on_clients(_Replies(replies, lossy=False), 0, {}, sizes, personal=False)
    mine = {0: _result(7, 10, personal_correct=-1)}
    with pytest.raises(FedskewError, match="personal_correct"):
        evaluate_on_clients(_Replies(mine, lossy=False), 0, {}, [10], personal=True)


def test_a_fraction_that_holds_out_nothing_is_refused_or_named(tmp_path, capsys, caplog):
    # Digits over 10 clients: the largest holds ~111 samples, so 0.001 rounds to none on all.
    args = ["run", "--rounds", "1", "--quiet", "-o", str(tmp_path)]
    assert main([*args, "--local-test-fraction", "0.001"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "local-test-fraction 0.001 holds out no sample on any client" in err[0]
    assert not list(tmp_path.iterdir())  # refused before a folder was made
    with pytest.raises(FedskewError, match="validation-fraction 0.001 holds out no sample"):
        prepare(ExperimentConfig(validation_fraction=0.001))
    # 20 clients: only those under 1 / (2 x 0.006) = 84 samples hold out nothing.
    cfg = ExperimentConfig(num_clients=20, local_test_fraction=0.006)
    with caplog.at_level("WARNING", logger="fedskew"):
        prep = prepare(cfg)
    empty = [k for k, t in enumerate(prep.fed.local_test) if len(t) == 0]
    assert 0 < len(empty) < 20
    assert f"holds out no sample on {len(empty)} of 20 clients (first: client {empty[0]}" in (
        caplog.text
    )
