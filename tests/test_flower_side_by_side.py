"""benchmarks/flower_side_by_side.py without running anything: rounds become samples/s
(round 1 left out, slow rounds weighed by their length), the ratios and goal verdicts are
computed from the runs, the run order alternates, the default configurations follow the
CPU's bf16 flags, and the report says what was measured and what was left out. Also the
Flower app's pinned client choice and its denormal probe (which must see torch's pool
threads too)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
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
        run(sbs, "flower-tricks-fp32", 1200, 1), run(sbs, "flower-tricks-fp32", 1200, 2),
    ]  # fmt: skip
    rows = {(r["numerator"], r["denominator"]): r for r in sbs.compare(runs, "idle")}
    fp32 = rows["fedskew-fp32", "flower-docs"]
    # pooled: 4000 samples in 4000/1600 + 4000/1400 s against 4000 samples in 4 s
    pooled = 4000 / (2000 / 1600 + 2000 / 1400)
    assert fp32["ratio"] == pytest.approx(pooled / 1000)
    assert fp32["per_repeat"] == pytest.approx([1.6, 1.4])
    assert fp32["goal"] == 1.5 and fp32["reached"] is (pooled / 1000 >= 1.5)
    tricks32 = rows["fedskew-fp32", "flower-tricks-fp32"]
    assert tricks32["ratio"] == pytest.approx(pooled / 1200)
    assert tricks32["per_repeat"] == pytest.approx([1600 / 1200, 1400 / 1200])
    assert tricks32["goal"] == 1.0 and tricks32["reached"] is True
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
    assert row["missing"] == ["flower-tricks"] and row["not_run"] == []
    assert sbs.verdict(row) == "not measured (no finished run of flower-tricks)"
    # configurations that were not run at all (left out by default, or by --only)
    rows = sbs.compare([run(sbs, "flower-docs", 1000)], "idle")
    tricks32 = next(r for r in rows if r["denominator"] == "flower-tricks-fp32")
    assert tricks32["ratio"] is None and tricks32["reached"] is None
    assert sbs.verdict(tricks32) == "not measured (fedskew-fp32 and flower-tricks-fp32 not run)"


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
    n = len(sbs.CONFIGS)
    assert [c for c, _ in first[:n]] == list(sbs.CONFIGS)
    assert [c for c, _ in first[n:]] == list(reversed(sbs.CONFIGS))
    assert {cond for _, cond in first[n:]} == {"busy"}
    assert [c for c, _ in second] == list(reversed(sbs.CONFIGS))
    some = ("flower-docs", "fedskew-fp32")
    assert sbs.run_order(1, busy=True, configs=some) == [
        ("fedskew-fp32", "idle"), ("flower-docs", "idle"),
        ("flower-docs", "busy"), ("fedskew-fp32", "busy"),
    ]  # fmt: skip


def cpu(**flags: bool) -> dict:
    names = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return {"torch_cpu_capability": "AVX2", "flags": {f: flags.get(f, False) for f in names}}


def test_default_configurations_follow_the_cpus_bf16_flags(sbs) -> None:
    fp32 = ["flower-docs", "flower-tricks-fp32", "fedskew-fp32"]
    assert set(sbs.CONFIGS) == set(fp32) | {"flower-tricks", "fedskew-bf16"}
    avx2 = sbs.selection(cpu(avx2=True), None)
    assert avx2["configs"] == fp32 and avx2["left_out"] == ["flower-tricks", "fedskew-bf16"]
    assert all(sbs.PRECISION[c] == "fp32" for c in avx2["configs"])
    assert "avx512_bf16 no, amx_bf16 no" in avx2["reason"] and "--only" in avx2["reason"]
    for flag in ("avx512_bf16", "amx_bf16"):
        has = sbs.selection(cpu(avx2=True, **{flag: True}), None)
        assert has["configs"] == list(sbs.CONFIGS) and has["reason"] is None
    asked = sbs.selection(cpu(avx2=True), ["fedskew-bf16", "flower-tricks"])
    assert asked["configs"] == ["flower-tricks", "fedskew-bf16"] and asked["reason"] is None


def test_accuracy_gaps_pair_runs_of_the_same_repeat(sbs) -> None:
    a, b = run(sbs, "fedskew-fp32", 1000), run(sbs, "flower-docs", 1000)
    b["rounds"] = rounds([1.0, 1.0, 1.0], accuracy=0.47)
    other = run(sbs, "flower-docs", 1000, repeat=2)
    other["rounds"] = rounds([1.0, 1.0, 1.0], accuracy=0.1)
    gaps = sbs.accuracy_gaps([a, b, other])
    row = next(g for g in gaps if g["pair"] == "fedskew-fp32 - flower-docs")
    assert row["max"] == pytest.approx(3.0) and row["mean"] == pytest.approx(3.0)


def report_of(sbs, runs: list[dict], chosen: dict | None = None) -> dict:
    """A report as main() builds it, around ``runs``."""
    for r in runs:
        r.update(precision=sbs.PRECISION[r["config"]], command="cmd", environment="env",
                 wall_seconds=10.0, startup_seconds=1.0, load1_before=0.5, load1_after=0.6,
                 clients_as_planned=True, samples_as_planned=True)  # fmt: skip
        r["details"] = {"same_partition": True, "dataset_source": "src", "train_samples": 9,
                        "test_samples": 3, "flwr": "1.42.0", "ray": "2"}  # fmt: skip
    report = {
        "machine": {"cpu": "CPU", "cores": 2, "memory_gib": 8, "python": "3", "torch": "2"},
        "cpu_features": cpu(avx2=True),
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
    if chosen is not None:
        report["selection"] = chosen
    sbs.summarize(report)
    return report


def test_report_states_the_computed_verdicts(sbs) -> None:
    runs = [run(sbs, c, rate) for c, rate in
            (("flower-docs", 1000), ("flower-tricks", 1000), ("fedskew-fp32", 1600),
             ("fedskew-bf16", 900), ("flower-tricks-fp32", 1280))]  # fmt: skip
    chosen = sbs.selection(cpu(avx2=True), list(sbs.CONFIGS))  # --only: all five
    report = report_of(sbs, runs, chosen)
    assert report["checks"]["clients"] and report["checks"]["partition"]
    text = sbs.report_md(report)
    assert "fedskew-fp32 / flower-docs = **1.60**" in text
    assert "fedskew-fp32 / flower-tricks-fp32 = **1.25**" in text
    assert "goal >= 1.5: **reached**" in text
    assert "fedskew-bf16 / flower-tricks = **0.90**" in text
    assert "goal >= 1: **not reached**" in text
    assert "no bf16 instructions" in text and "were left out" not in text
    assert "- busy:" not in text  # no busy runs, no busy ratios
    assert "| flower-tricks-fp32 | fp32 |" in text and "| flower-tricks | bf16 |" in text
    assert "channels_last model and batches" in text and "fp32 (no autocast)" in text


def test_report_says_why_the_default_left_the_bf16_rows_out(sbs) -> None:
    rates = (("flower-docs", 1000), ("flower-tricks-fp32", 1250), ("fedskew-fp32", 1500))
    runs = [run(sbs, c, rate) for c, rate in rates]
    chosen = sbs.selection(cpu(avx2=True), None)
    text = sbs.report_md(report_of(sbs, runs, chosen))
    assert chosen["reason"] in text and "avx512_bf16 no, amx_bf16 no" in text
    assert (
        "fedskew-fp32 / flower-docs = **1.50** (per repeat: 1.50); goal >= 1.5: **reached**" in text
    )
    assert (
        "fedskew-fp32 / flower-tricks-fp32 = **1.20** (per repeat: 1.20); goal >= 1: **reached**"
        in text
    )
    assert (
        "fedskew-bf16 / flower-tricks = not measured (fedskew-bf16 and flower-tricks not run)"
        in text
    )
    assert "| flower-tricks |" not in text and "| fedskew-bf16 |" not in text
    assert "torch emulates bf16 here, so the bf16 rows" not in text  # no bf16 row to warn of


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


PROBE_CASES = """
import importlib.util, json, sys, torch
spec = importlib.util.spec_from_file_location("app", sys.argv[1])
app = importlib.util.module_from_spec(spec)
spec.loader.exec_module(app)
torch.set_num_threads(2)
torch.ones(1 << 22).mul_(2.0)  # the pool thread starts here, not flushing
torch.set_flush_denormal(True)  # this thread only
out = {"pool_not_flushing": app.denormals_flushed()}
torch.set_num_threads(1)  # no pool: this thread does all the work (the actors' case)
out["one_thread"] = app.denormals_flushed()
print(json.dumps(out))
"""


def test_denormal_probe_sees_a_pool_thread_that_does_not_flush() -> None:
    """The flag is per thread and torch's OpenMP pool threads keep the one they started
    with: a probe that flushes on the calling thread only must say so. (A fresh process:
    the test process's pool threads are in whatever state earlier tests left.)"""
    pytest.importorskip("flwr")
    code = [sys.executable, "-c", PROBE_CASES, str(BENCHMARKS / "flower_side_by_side_app.py")]
    src = str(BENCHMARKS.parent / "src")
    env = {**os.environ, "PYTHONPATH": src}
    done = subprocess.run(code, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {"pool_not_flushing": False, "one_thread": True}
