"""benchmarks/gpu_check.py on the CPU: the report is written step by step and a failed step is
a red row (never a missing file), the throughput table finds data offline or says it used a
stand-in, and an equivalence row cannot pass for a curve that does not learn."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from fedskew.core.errors import DataError

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def gpu_check():
    sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(
        "gpu_check_under_test", BENCHMARKS / "gpu_check.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)
    sys.path.remove(str(BENCHMARKS))


def curve(accuracy: list[float], train_loss: list[float]) -> list[dict]:
    return [{"accuracy": a, "train_loss": t} for a, t in zip(accuracy, train_loss, strict=True)]


CPU = curve([0.1, 0.3, 0.6, 0.8, 0.9, 0.92], [2.0, 1.2, 0.6, 0.4, 0.3, 0.28])


def test_a_device_curve_that_does_not_learn_fails(gpu_check) -> None:
    flat = curve([0.1, 0.1, 0.11, 0.1, 0.1, 0.1], [2.0, 2.3, 2.3, 2.3, 2.3, 2.3])
    assert gpu_check.gaps(CPU, flat)["verdict"].startswith("FAIL: the device curve ends at")
    # The CPU not learning makes the row say nothing either way: red, not green.
    assert gpu_check.gaps(flat, flat)["verdict"].startswith("uninformative")


def test_a_wrong_first_round_loss_fails_and_drift_within_the_noise_passes(gpu_check) -> None:
    wrong = curve([0.1, 0.3, 0.6, 0.8, 0.9, 0.92], [2.2, 1.2, 0.6, 0.4, 0.3, 0.28])
    assert gpu_check.gaps(CPU, wrong)["verdict"] == "FAIL: round 1's train_loss 10.0% away"
    drifted = curve([0.1, 0.45, 0.7, 0.82, 0.88, 0.93], [2.02, 1.1, 0.5, 0.45, 0.35, 0.3])
    assert gpu_check.gaps(CPU, drifted)["verdict"] == "ok"
    lower = curve([0.1, 0.3, 0.5, 0.6, 0.7, 0.75], [2.0, 1.2, 0.6, 0.4, 0.3, 0.28])
    assert gpu_check.gaps(CPU, lower)["verdict"].startswith("FAIL: last 3 rounds' accuracy")


def test_throughput_data_falls_back_to_a_labelled_stand_in(gpu_check, monkeypatch) -> None:
    def nothing(name, *args, **kwargs):
        raise DataError(f"{name}: no data found")

    monkeypatch.setattr(gpu_check, "load_dataset", nothing)
    name, described = gpu_check.throughput_dataset(None)
    assert name == gpu_check.SYNTHETIC and "synthetic stand-in" in described
    from fedskew.data.sources import load_dataset

    data = load_dataset(name, download=False)
    assert tuple(data.x_train.shape) == (60000, 1, 28, 28) and data.num_classes == 10


def test_throughput_data_is_looked_for_in_the_carried_data_folder(
    gpu_check, monkeypatch, tmp_path: Path
) -> None:
    """docs/gpu.md says to carry data/ to the GPU machine: the check must look there (a
    run's loader does not), after --data-dir, before the loader's own places."""
    asked = []

    def found(name, data_dir, download):
        asked.append(data_dir)
        raise DataError(f"{name}: no data found")

    monkeypatch.setattr(gpu_check, "load_dataset", found)
    monkeypatch.setattr(gpu_check, "ROOT", tmp_path)
    assert gpu_check.data_dir_of(None) is None  # no data/ here: the loader's places only
    (tmp_path / "data").mkdir()
    assert gpu_check.data_dir_of(None) == str(tmp_path / "data")
    assert gpu_check.data_dir_of("elsewhere") == "elsewhere"
    gpu_check.throughput_dataset(gpu_check.data_dir_of(None))
    assert asked == [str(tmp_path / "data")] * 2  # Fashion-MNIST, then MNIST


def test_the_report_survives_a_failing_step_and_exits_non_zero(
    gpu_check, monkeypatch, tmp_path: Path
) -> None:
    """Before, a throughput step without Fashion-MNIST ended the script with a traceback
    and no report at all."""

    def no_data(args):
        raise DataError("fmnist: no data found and download disabled")

    monkeypatch.setattr(gpu_check.clients_together, "measure", no_data)
    out = tmp_path / "check.md"
    code = gpu_check.main(["--device", "cpu", "--only", "fedavg", "--out", str(out)])
    assert code == 1
    report = json.loads(out.with_suffix(".json").read_text())
    steps = {s["step"]: s for s in report["steps"]}
    assert steps["throughput"]["status"] == "error"
    assert "no data found" in steps["throughput"]["error"]
    (row,) = steps["equivalence"]["rows"]
    # On the CPU the "device" is the CPU: one after another is the same run, together is
    # the vmap path, and FedAvg learns in this setting.
    assert row["verdict"] == "ok", row
    assert row["one_after_another"]["round1_train_loss_gap"] == 0
    assert "together" in row
    text = out.read_text()
    assert "| throughput | **error**: DataError: fmnist: no data found" in text
    assert "1 red row(s): throughput: error" in text
