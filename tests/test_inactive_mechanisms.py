"""Mechanisms that never act within a run: each algorithm declares its own
(``Algorithm.inactive_mechanisms``), the run warns at its start and records them in
config.json (kept by a resume), and a bring-your-own algorithm can declare its own."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import pytest

from fedskew.algorithms import get_algorithm
from fedskew.algorithms.fedavg import FedAvg
from fedskew.apps.cli import main
from fedskew.config import ExperimentConfig
from fedskew.runs.loop import run
from fedskew.training.interface import InactiveMechanism, RunShape


def inactive(name: str, params: dict, rounds: int, epochs: int = 2, per_round: int = 4):
    cls = get_algorithm(name.removesuffix("+fm"), feature_matching=name.endswith("+fm"))
    found = cls.inactive_mechanisms(cls.make_params(params), RunShape(rounds, epochs, per_round))
    return [(m.mechanism, m.options) for m in found]


def test_feature_matching_launched_after_the_last_round():
    assert inactive("fedfm", {}, rounds=6) == [
        ("feature matching", {"start_round": 20, "rounds": 6})
    ]
    assert inactive("fedfm", {}, rounds=20) == [
        ("feature matching", {"start_round": 20, "rounds": 20})
    ]
    assert inactive("fedfm", {}, rounds=21) == []  # acts in round 21
    assert inactive("fedfm", {"lam": 0}, rounds=6) == []  # switched off on purpose
    assert inactive("fedavg+fm", {"start_round": 5}, rounds=5) == [
        ("feature matching", {"start_round": 5, "rounds": 5})
    ]
    assert inactive("fedavg+fm", {"start_round": 4}, rounds=5) == []
    assert inactive("fedavg", {}, rounds=1) == []


def test_fedfm_lite_launch_and_model_period():
    # Round 0 has no anchors: matching cannot act before round 1 (0-based).
    assert inactive("fedfm-lite", {"start_round": 0, "a": 1}, rounds=1) == [
        ("feature matching", {"start_round": 0, "rounds": 1})
    ]
    assert inactive("fedfm-lite", {"start_round": 0, "a": 1}, rounds=2) == []
    assert inactive("fedfm-lite", {"start_round": 0, "a": 10}, rounds=6) == [
        ("model averaging every a rounds", {"a": 10, "rounds": 6})
    ]
    assert inactive("fedfm-lite", {"start_round": 0, "a": 6}, rounds=6) == []


def test_fedcme_exchange_and_alignment():
    assert inactive("fedcme", {}, rounds=5, epochs=1) == [
        ("classifier exchange", {"exchange": "head", "local_epochs": 1})
    ]
    assert inactive("fedcme", {}, rounds=5, per_round=1) == [
        ("classifier exchange", {"exchange": "head", "clients_per_round": 1})
    ]
    assert inactive("fedcme", {"exchange": "none"}, rounds=5, epochs=1) == []
    assert inactive("fedcme", {}, rounds=1) == [("feature alignment", {"mu": 0.01, "rounds": 1})]
    assert inactive("fedcme", {"mu": 0}, rounds=1) == []


def test_baselines_whose_term_needs_a_previous_round():
    assert inactive("fedproto", {}, rounds=1) == [
        ("prototype regulariser", {"ld": 1.0, "rounds": 1})
    ]
    assert inactive("scaffold", {}, rounds=1) == [("control-variate correction", {"rounds": 1})]
    assert inactive("moon", {}, rounds=1) == [("model-contrastive term", {"mu": 5.0, "rounds": 1})]
    for name in ("fedproto", "scaffold", "moon"):
        assert inactive(name, {}, rounds=2) == []


@dataclass
class WarmParams:
    warmup_rounds: int = 3


class WarmFedAvg(FedAvg):
    """A user's algorithm whose mechanism starts after ``warmup_rounds``."""

    name = "warm-fedavg"
    Params = WarmParams

    @classmethod
    def inactive_mechanisms(cls, params, shape):
        if params.warmup_rounds < shape.rounds:
            return []
        options = {"warmup_rounds": params.warmup_rounds, "rounds": shape.rounds}
        return [InactiveMechanism("warm thing", options, "it starts after the warm-up")]


def test_bring_your_own_algorithm_declares_its_own():
    found = WarmFedAvg.inactive_mechanisms(WarmParams(), RunShape(3, 1, 2))
    assert found[0].line() == (
        "warm thing never acts in this run (warmup_rounds=3, rounds=3): it starts after the warm-up"
    )
    assert WarmFedAvg.inactive_mechanisms(WarmParams(), RunShape(4, 1, 2)) == []


def test_a_run_warns_once_and_its_folder_keeps_the_record_through_a_resume(tmp_path, caplog):
    class Killed(Exception):
        pass

    def kill_after_round_1(record):
        if record["round"] == 1:
            raise Killed

    cfg = ExperimentConfig(
        algorithm="fedfm", rounds=2, local_epochs=1, num_clients=4, clients_per_round=2,
        out_dir=str(tmp_path), name="short", quiet=True,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="fedskew"):
        with pytest.raises(Killed):
            run(cfg, on_round=kill_after_round_1)
    warnings = [r.getMessage() for r in caplog.records if "never acts" in r.getMessage()]
    assert warnings == [
        "fedfm: feature matching never acts in this run (start_round=20, rounds=2): it first "
        "acts in round 21, the run has 2; every round trains and aggregates as FedAvg"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fedskew"):
        assert main(["run", "--resume", str(tmp_path / "short.incomplete"), "-q"]) == 0
    assert sum("never acts" in r.getMessage() for r in caplog.records) == 1  # this process's
    resolved = json.loads((tmp_path / "short" / "config.json").read_text())["resolved"]
    assert resolved["inactive_mechanisms"] == [
        {
            "mechanism": "feature matching",
            "options": {"start_round": 20, "rounds": 2},
            "reason": "it first acts in round 21, the run has 2; every round trains and "
            "aggregates as FedAvg",
        }
    ]
    # And the report marks the row.
    assert main(["report", str(tmp_path / "short"), "-o", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "report.md").read_text()
    assert "| fedfm † |" in text
    assert "† fedfm: feature matching never acted (start_round=20, rounds=2)" in text
