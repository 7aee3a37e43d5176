"""FedAvg end to end on the embedded digits data reaches a real accuracy."""

from __future__ import annotations

import pytest

from fedskew.config import ExperimentConfig
from fedskew.runs.loop import run


@pytest.mark.parametrize(
    "partition, params, floor",
    [
        ("iid", {}, 0.90),
        ("dirichlet", {"beta": 0.5}, 0.85),
        ("shards", {"shards_per_client": 2}, 0.70),
    ],
)
def test_fedavg_on_digits_learns(tmp_path, partition, params, floor):
    cfg = ExperimentConfig(
        partition=partition, partition_params=params, rounds=20, out_dir=str(tmp_path), quiet=True
    )
    _, summary = run(cfg)
    # A 10-class problem: chance is 0.10. These floors sit below what the runs reach
    # (seed 0, 20 rounds: 0.94 IID, 0.91 Dirichlet, 0.90 shards) and far above what a
    # broken loop gives.
    assert summary["final_accuracy"] >= floor, summary
    assert summary["final_loss"] < 1.0


def test_skew_costs_accuracy_under_few_rounds(tmp_path):
    common = dict(rounds=5, local_epochs=5, out_dir=str(tmp_path), quiet=True, seed=1)
    _, iid = run(ExperimentConfig(partition="iid", **common))
    _, skew = run(
        ExperimentConfig(partition="dirichlet", partition_params={"beta": 0.05}, **common)
    )
    assert iid["final_accuracy"] > skew["final_accuracy"]
