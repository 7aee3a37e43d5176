"""Every algorithm resumes from its checkpoint exactly: server state named in
``checkpoint_fields`` and per-client state both survive a kill."""

from __future__ import annotations

import json

import pytest

from fedskew.algorithms import ALGORITHMS
from fedskew.apps.cli import main
from fedskew.config import ExperimentConfig
from fedskew.runs.loop import run

# Small but stateful: 6 clients, 3 per round, so clients are sampled again after a pause.
COMMON = dict(rounds=4, local_epochs=1, num_clients=6, clients_per_round=3, quiet=True, seed=2)
PARAMS = {
    "fedfm": {"start_round": 1},
    "fedfm-lite": {"start_round": 1, "a": 2},
    "creff": {"match_epochs": 3, "crt_epochs": 3, "num_features": 5},
}
KEYS = ("round", "clients", "accuracy", "loss", "bytes_down", "bytes_up")


class Killed(Exception):
    pass


def _kill_after(n):
    def hook(record):
        if record["round"] == n:
            raise Killed

    return hook


def _rows(folder):
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [{k: json.loads(x).get(k) for k in KEYS} for x in lines]


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_algorithm_resumes_exactly(tmp_path, algorithm):
    params = PARAMS.get(algorithm, {})
    full, _ = run(
        ExperimentConfig(
            algorithm=algorithm, params=params, out_dir=str(tmp_path / "a"), name="r", **COMMON
        )  # fmt: skip
    )
    cfg = ExperimentConfig(
        algorithm=algorithm, params=params, out_dir=str(tmp_path / "b"), name="r", **COMMON
    )
    with pytest.raises(Killed):
        run(cfg, on_round=_kill_after(2))
    assert main(["run", "--resume", str(tmp_path / "b" / "r.incomplete"), "-q"]) == 0
    assert _rows(tmp_path / "b" / "r") == _rows(full)
