"""benchmarks/flower_side_by_side.py without running anything: rounds become samples/s
(round 1 left out, slow rounds weighed by their length), the ratios and goal verdicts are
computed from the runs, the run order alternates, and the report says what was measured.
Also the Flower app's pinned client choice and its denormal probe."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(filename: str):
    name = f"{Path(filename).stem}_under_test"
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / filename)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sbs():
    sys.path.insert(0, str(BENCHMARKS))
    yield load("flower_side_by_side.py")
    sys.modules.pop("flower_side_by_side_under_test", None)
    sys.path.remove(str(BENCHMARKS))


def rounds(seconds: list[float], samples: int = 1000, accuracy: float = 0.5) -> list[dict]:
    return [
        {"round": k + 1, "samples": samples, "seconds": s, "accuracy": accuracy}
        for k, s in enumerate(seconds)
    ]


def run(sbs, config: str, rate: float, repeat: int = 1, condition: str = "idle") -> dict:
    """A finished run whose measured rounds (2 and 3) trained at ``rate`` samples/s."""
    rs = rounds([100.0, 1000 / rate, 1000 / rate])
    return {"config": config, "condition": condition, "repeat": repeat, "rounds": rs,
            "throughput": sbs.throughput(rs), "details": {}}  # fmt: skip


def test_throughput_leaves_round_one_out_and_weighs_slow_rounds(sbs) -> None:
    t = sbs.throughput(rounds([50.0, 1.0, 4.0]))
    assert t["rounds"] == [2, 3]
    # 2000 samples in 5 s, not the mean of 1000 and 250 samples/s
    assert t["samples_per_s"] == pytest.approx(400.0)
    assert t["per_round_samples_per_s"] == pytest.approx([1000.0, 250.0])
    assert t["spread"] == pytest.approx(4.0)
    with pytest.raises(ValueError):
        sbs.throughput(rounds([3.0]))


def test_ratios_pool_the_runs_and_compute_the_goals(sbs) -> None:
    runs = [
        run(sbs, "flower-docs", 1000, 1), run(sbs, "fedskew-fp32", 1600, 1),
        run(sbs, "flower-docs", 1000, 2), run(sbs, "fedskew-fp32", 1400, 2),
        run(sbs, "flower-tricks", 2000, 1), run(sbs, "fedskew-bf16", 1900, 1),
    ]  # fmt: skip
    rows = {(r["numerator"], r["denominator"]): r for r in sbs.compare(runs, "idle")}
    fp32 = rows["fedskew-fp32", "flower-docs"]
    # pooled: 4000 samples in 4000/1600 + 4000/1400 s against 4000 samples in 4 s
    pooled = 4000 / (2000 / 1600 + 2000 / 1400)
    assert fp32["ratio"] == pytest.approx(pooled / 1000)
    assert fp32["per_repeat"] == pytest.approx([1.6, 1.4])
    assert fp32["goal"] == 1.5 and fp32["reached"] is (pooled / 1000 >= 1.5)
    bf16 = rows["fedskew-bf16", "flower-tricks"]
    assert bf16["ratio"] == pytest.approx(0.95) and bf16["reached"] is False
    cross = rows["fedskew-bf16", "flower-docs"]
    assert cross["goal"] is None and cross["reached"] is None
    assert cross["ratio"] == pytest.approx(1.9)


def test_a_configuration_without_finished_runs_is_not_measured(sbs) -> None:
    failed = {"config": "flower-tricks", "condition": "idle", "repeat": 1, "error": "killed"}
    runs = [run(sbs, "fedskew-bf16", 1000), failed]
    row = next(r for r in sbs.compare(runs, "idle") if r["denominator"] == "flower-tricks")
    assert row["ratio"] is None and row["reached"] is None
    assert row["missing"] == ["flower-tricks"]
    assert "not measured" in sbs.verdict(row)


def test_busy_runs_are_compared_apart(sbs) -> None:
    runs = [run(sbs, "flower-docs", 1000), run(sbs, "fedskew-fp32", 2000),
            run(sbs, "flower-docs", 500, condition="busy"),
            run(sbs, "fedskew-fp32", 500, condition="busy")]  # fmt: skip
    idle = sbs.compare(runs, "idle")[0]
    busy = sbs.compare(runs, "busy")[0]
    assert (idle["ratio"], idle["reached"]) == (pytest.approx(2.0), True)
    assert (busy["ratio"], busy["reached"]) == (pytest.approx(1.0), False)


def test_run_order_alternates_and_busy_runs_follow(sbs) -> None:
    first, second = sbs.run_order(0, busy=True), sbs.run_order(1, busy=False)
    assert [c for c, _ in first[:4]] == list(sbs.CONFIGS)
    assert [c for c, _ in first[4:]] == list(reversed(sbs.CONFIGS))
    assert {cond for _, cond in first[4:]} == {"busy"}
    assert [c for c, _ in second] == list(reversed(sbs.CONFIGS))


def test_accuracy_gaps_pair_runs_of_the_same_repeat(sbs) -> None:
    a, b = run(sbs, "fedskew-fp32", 1000), run(sbs, "flower-docs", 1000)
    b["rounds"] = rounds([1.0, 1.0, 1.0], accuracy=0.47)
    other = run(sbs, "flower-docs", 1000, repeat=2)
    other["rounds"] = rounds([1.0, 1.0, 1.0], accuracy=0.1)
    gaps = sbs.accuracy_gaps([a, b, other])
    row = next(g for g in gaps if g["pair"] == "fedskew-fp32 - flower-docs")
    assert row["max"] == pytest.approx(3.0) and row["mean"] == pytest.approx(3.0)


def test_report_states_the_computed_verdicts(sbs) -> None:
    runs = [run(sbs, c, rate) for c, rate in
            (("flower-docs", 1000), ("flower-tricks", 1000), ("fedskew-fp32", 1600),
             ("fedskew-bf16", 900))]  # fmt: skip
    for r in runs:
        r.update(precision=sbs.PRECISION[r["config"]], command="cmd", environment="env",
                 wall_seconds=10.0, startup_seconds=1.0, load1_before=0.5, load1_after=0.6,
                 clients_as_planned=True, samples_as_planned=True)  # fmt: skip
        r["details"] = {"same_partition": True, "dataset_source": "src", "train_samples": 9,
                        "test_samples": 3, "flwr": "1.42.0", "ray": "2"}  # fmt: skip
    report = {
        "machine": {"cpu": "CPU", "cores": 2, "memory_gib": 8, "python": "3", "torch": "2"},
        "cpu_features": {"torch_cpu_capability": "AVX2", "flags": {"avx512_bf16": False}},
        "invocation": "python benchmarks/flower_side_by_side.py",
        "setting": {"rounds": 3, "num_clients": 20, "beta": 0.1, "seed": 0,
                    "clients_per_round": 8, "epochs": 5, "batch_size": 64, "lr": 0.01,
                    "momentum": 0.9, "model": "fedavg-cnn", "data_dir": "",
                    "train_samples": 9, "test_samples": 3, "partition_command": "fedskew p",
                    "sizes": [1, 2], "clients": [[0], [1], [0]],
                    "planned_samples": [1, 2, 1]},  # fmt: skip
        "load1_start": 0.5, "load1_end": 0.6, "runs": runs,
        "code": {"commit": "abc", "src_changes_uncommitted": False,
                 "src_unchanged_during_runs": True},
    }  # fmt: skip
    sbs.summarize(report)
    assert report["checks"]["clients"] and report["checks"]["partition"]
    text = sbs.report_md(report)
    assert "fedskew-fp32 / flower-docs = **1.60**" in text
    assert "goal >= 1.5: **reached**" in text
    assert "fedskew-bf16 / flower-tricks = **0.90**" in text
    assert "goal >= 1: **not reached**" in text
    assert "no bf16 instructions" in text
    assert "- busy:" not in text  # no busy runs, no busy ratios


def test_flower_app_sends_to_the_pinned_clients_and_probes_denormals() -> None:
    pytest.importorskip("flwr")
    from flwr.app import ArrayRecord, ConfigRecord, MessageType

    sys.path.insert(0, str(BENCHMARKS))
    try:
        app = load("flower_side_by_side_app.py")
        strategy = app.PinnedFedAvg([[3, 7], [1, 2]], {1: 11, 2: 12, 3: 13, 7: 17})
        # A Message needs a running Flower app: record what FedAvg would be asked to build.
        strategy._construct_messages = lambda record, nodes, kind: [
            (record, n, kind) for n in nodes
        ]
        arrays = ArrayRecord({"w": torch.zeros(2)})
        messages = strategy.configure_train(2, arrays, ConfigRecord({"lr": 0.1}), grid=None)
        assert [node for _, node, _ in messages] == [11, 12]
        assert {kind for _, _, kind in messages} == {MessageType.TRAIN}
        assert messages[0][0]["config"]["server-round"] == 2
        before = app.denormals_flushed()
        try:
            torch.set_flush_denormal(True)
            assert app.denormals_flushed()
            torch.set_flush_denormal(False)
            assert not app.denormals_flushed()
        finally:
            torch.set_flush_denormal(before)
    finally:
        sys.modules.pop("flower_side_by_side_app_under_test", None)
        sys.path.remove(str(BENCHMARKS))
