"""benchmarks/gpu_check.py on the CPU: the report is written step by step and a failed step is
a red row (never a missing file), the throughput table finds data offline or says it used a
stand-in, and an equivalence row cannot pass for a curve that does not learn."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from unittest import mock

import pytest
import torch

from fedskew.core.errors import DataError

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def gpu_check(benchmark_script):  # type: ignore[no-untyped-def]
    return benchmark_script("gpu_check.py")


def curve(accuracy: list[float], train_loss: list[float]) -> list[dict]:
    return [{"accuracy": a, "train_loss": t} for a, t in zip(accuracy, train_loss, strict=True)]


CPU = curve([0.1, 0.3, 0.6, 0.8, 0.9, 0.92], [2.0, 1.2, 0.6, 0.4, 0.3, 0.28])


def test_a_device_curve_that_does_not_learn_fails(gpu_check) -> None:
    tol = gpu_check.Tolerance(0.05, 0.08)
    flat = curve([0.1, 0.1, 0.11, 0.1, 0.1, 0.1], [2.0, 2.3, 2.3, 2.3, 2.3, 2.3])
    assert gpu_check.gaps(CPU, flat, tol)["verdict"].startswith("FAIL: the device curve ends at")
    # The CPU not learning makes the row say nothing either way: red, not green.
    assert gpu_check.gaps(flat, flat, tol)["verdict"].startswith("uninformative")


def test_a_wrong_first_round_loss_fails_and_drift_within_the_tolerance_passes(gpu_check) -> None:
    tol = gpu_check.Tolerance(0.05, 0.08)
    wrong = curve([0.1, 0.3, 0.6, 0.8, 0.9, 0.92], [2.2, 1.2, 0.6, 0.4, 0.3, 0.28])
    assert gpu_check.gaps(CPU, wrong, tol)["verdict"] == (
        "FAIL: round 1's train_loss 10.0% away (tolerance 5.0%)"
    )
    drifted = curve([0.1, 0.45, 0.7, 0.82, 0.88, 0.93], [2.02, 1.1, 0.5, 0.45, 0.35, 0.3])
    assert gpu_check.gaps(CPU, drifted, tol)["verdict"] == "ok"
    lower = curve([0.1, 0.3, 0.5, 0.6, 0.7, 0.75], [2.0, 1.2, 0.6, 0.4, 0.3, 0.28])
    assert gpu_check.gaps(CPU, lower, tol)["verdict"].startswith("FAIL: last 3 rounds' accuracy")
    # The same drift passes where the algorithm's rounding spread is wider.
    assert gpu_check.gaps(CPU, lower, gpu_check.Tolerance(0.05, 0.2))["verdict"] == "ok"
    # Without a measured tolerance the row cannot pass, and says why.
    verdict = gpu_check.gaps(CPU, drifted, "x was not measured")["verdict"]
    assert verdict == "no tolerance: x was not measured"


def test_the_tolerances_are_derived_from_the_measured_spread(gpu_check) -> None:
    """benchmarks/results/gpu_check_spread.json holds every algorithm's rounding spread on
    gpu_check's own experiment, and the tolerance it derives: MARGIN x spread, floored."""
    import rounding_spread

    from fedskew.algorithms import ALGORITHMS

    data = json.loads(gpu_check.SPREAD_FILE.read_text())
    measured = gpu_check.load_tolerances()
    assert set(measured) == set(ALGORITHMS)
    for row in data["rows"]:
        tol = measured[row["algorithm"]]
        spread = row["last3_accuracy_spread"]
        assert tol.last3_accuracy == round(
            max(rounding_spread.LAST3_FLOOR, rounding_spread.MARGIN * spread), 3
        )
        round1 = row["round1_train_loss_spread"]
        assert tol.round1_train_loss == round(
            max(rounding_spread.ROUND1_FLOOR, rounding_spread.MARGIN * round1), 4
        )
        assert row["lowest_last_accuracy"] >= gpu_check.LEARNED  # every nudged curve learns


def test_tolerances_of_another_experiment_are_refused(gpu_check, monkeypatch, tmp_path) -> None:
    data = json.loads(gpu_check.SPREAD_FILE.read_text())
    data["experiment"]["setting"]["rounds"] = 3
    stale = tmp_path / "spread.json"
    stale.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="measured on another experiment: run python bench"):
        gpu_check.load_tolerances(stale)
    with pytest.raises(ValueError, match="is missing"):
        gpu_check.load_tolerances(tmp_path / "none.json")


def test_the_nudge_moves_every_weight_in_its_last_bits(gpu_check) -> None:
    """x * (1 +- 2**-23) rounded to float32: one or two units in the last place, a relative
    change of at most 2**-22 / 1.5, up or down."""
    import rounding_spread

    model = torch.nn.Linear(50, 20)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rounding_spread.nudge(model, seed=3)
    for name, value in model.state_dict().items():
        change = value.double() / before[name].double() - 1
        assert change.abs().max() <= 2.0**-22 / 1.5, name
        assert (change > 0).any() and (change < 0).any(), name


@contextlib.contextmanager
def _broken(what: str):
    """A broken gradient: flipped in the one-client optimiser step, zeroed in the stacked
    step (engines/together.py)."""
    from fedskew.engines import together

    if what == "flip":
        step = torch.optim.SGD.step

        def flipped(self, *args, **kwargs):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.neg_()
            return step(self, *args, **kwargs)

        with mock.patch.object(torch.optim.SGD, "step", flipped):
            yield
    else:
        sgd = together._sgd_step

        def zeroed(weights, grads, *args, **kwargs):
            grads = [None if g is None else torch.zeros_like(g) for g in grads]
            return sgd(weights, grads, *args, **kwargs)

        with mock.patch.object(together, "_sgd_step", zeroed):
            yield


@pytest.mark.slow  # three ResNet curves: about 30 s idle, minutes on a loaded machine
def test_a_broken_gradient_turns_the_row_red(gpu_check, monkeypatch, tmp_path) -> None:
    """The tolerances widened by the rounding spread still catch a wrong gradient: the dry
    run's device curves with the gradient flipped (one after another) and zeroed (together)."""
    real = gpu_check.curve
    calls: list[str] = []

    def planted(algorithm, device, together, out_dir):
        calls.append(together)
        if len(calls) == 1:  # the CPU curve: as it is
            return real(algorithm, device, together, out_dir)
        with _broken("flip" if together == "off" else "zero"):
            return real(algorithm, device, together, out_dir)

    monkeypatch.setattr(gpu_check, "curve", planted)
    row = gpu_check.equivalence_row("fedavg", "cpu", str(tmp_path))
    assert calls == ["off", "off", "vmap"]
    assert row["verdict"] != "ok", row
    for side in ("one_after_another", "together"):
        assert row[side]["verdict"].startswith("FAIL"), (side, row[side])


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
