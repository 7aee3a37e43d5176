"""benchmarks/round_fixed_costs.py: the dry run of issue 47's fixed per-round costs runs on the
CPU, its categories add up to each round's wall time, and every fraction it reports is computed
from the seconds it measured."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


@pytest.fixture(scope="module")
def costs(benchmark_script):  # type: ignore[no-untyped-def]
    return benchmark_script("round_fixed_costs.py")


@pytest.fixture(scope="module")
def report(costs, tmp_path_factory) -> tuple[dict[str, Any], str]:  # type: ignore[no-untyped-def]
    out = tmp_path_factory.mktemp("fixed") / "fixed.md"
    assert costs.main(["--dry-run", "--out", str(out)]) == 0
    first = out.read_text()
    # --report-only summarises the .json again: the same tables, and it says so.
    assert costs.main(["--report-only", "--out", str(out)]) == 0
    again = out.read_text()
    assert "summarised again (--report-only)" in again
    assert first.split("\n", 3)[3] == again.split("\n", 3)[3]
    return json.loads(out.with_suffix(".json").read_text()), again


def test_categories_add_up_to_each_round(costs, report) -> None:  # type: ignore[no-untyped-def]
    data, _ = report
    assert data["dry_run"] and data["device"] == "cpu" and data["commit"]
    assert [r["algorithm"] for r in data["runs"]] == ["fedavg", costs.HOST_REPLIES, "fedfm"]
    for run in data["runs"]:
        assert run["settings"]["eval_every"] == 1 and run["settings"]["checkpoint_every"] == 1
        assert run["rounds"], run
        for rnd in [run["warm_up"], *run["rounds"]]:
            assert list(rnd["seconds"]) == costs.NAMES
            # Exclusive time: the categories are the round's wall time, to the clock's grain.
            assert math.isclose(sum(rnd["seconds"].values()), rnd["wall_s"], abs_tol=1e-6)
            for name in ("training", "aggregation", "checkpoint", "evaluation"):
                assert rnd["seconds"][name] > 0, (run["algorithm"], name)
            # No device boundary on the CPU: nothing is moved, and nothing is booked there.
            assert rnd["bytes_to_device"] == rnd["bytes_to_host"] == 0
            assert rnd["seconds"]["host<->device copies"] == 0
        anchor = run["rounds"][0]["seconds"]["anchor pass"]
        assert (anchor > 0) == (run["algorithm"] == "fedfm")


def test_fractions_are_computed_from_the_seconds(costs, report) -> None:  # type: ignore[no-untyped-def]
    data, text = report
    assert "**Dry run**" in text and "**CPU**" in text
    assert "## FedAvg: replies averaged where they are against brought to the host" in text
    nan = data["nan_check"]
    assert nan["before_s"] > 0 and nan["now_s"] > 0 and nan["models_per_round"] == 11
    assert f"{nan['before_s']:.4f} s the way fedskew checked before" in text
    for run in data["runs"]:
        s, rounds = run["summary"], run["rounds"]
        assert s["wall_s"] == min(r["wall_s"] for r in rounds)  # the least disturbed round
        (typical,) = [r for r in rounds if r["round"] == s["round"]]
        wall = typical["wall_s"]
        for row in s["rows"]:
            seconds = typical["seconds"][row["category"]]
            assert row["seconds"] == seconds
            assert math.isclose(row["of_round"], seconds / wall)
            assert math.isclose(row["of_goal"], seconds / costs.GOAL_ROUND_S)
            assert (
                f"| {row['category']} | {row['seconds']:.4f} | {100 * row['of_round']:.2f} % | "
                f"{100 * row['of_goal']:.2f} % |" in text
            )
        fixed = sum(r["seconds"] for r in s["rows"] if r["category"] != "training")
        assert math.isclose(s["fixed_s"], fixed)
        assert s["fixed_within_goal"] == (fixed / costs.GOAL_ROUND_S < costs.GOAL_SHARE)
        verdict = "within" if s["fixed_within_goal"] else "**over**"
        assert f"Fixed costs {verdict} 5 % of the goal round" in text


def test_the_timers_count_device_bytes_and_are_put_back(costs) -> None:  # type: ignore[no-untyped-def]
    """The copy row's wrappers book to_device to its category and count the bytes that cross
    (here to the meta device: no CUDA needed); afterwards fedskew's functions are its own."""
    runtime = sys.modules["fedskew.engines.client_runtime"]
    before = runtime.to_device, runtime.to_cpu, runtime.train_together
    ledger = costs.Ledger(base=costs.OTHER)
    crossing = costs.BoundaryBytes()
    with costs.instrumented(ledger, crossing, {}):
        moved = runtime.to_device({"w": torch.zeros(10), "b": torch.zeros(3)}, torch.device("meta"))
        assert moved["w"].device.type == "meta"
        assert crossing.count({"w": torch.zeros(4, device="meta")}, None) == 16
    assert crossing.down == 13 * 4 and crossing.up == 0
    assert ledger.calls["host<->device copies"] == 1
    assert (runtime.to_device, runtime.to_cpu, runtime.train_together) == before
