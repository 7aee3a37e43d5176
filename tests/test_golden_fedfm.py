"""Golden runs: every algorithm and every FedFM variant (the candidate remedies on and off,
FedFM-Lite, the feature-matching plug-in) on a tiny digits run, against metrics recorded
in ``golden_fedfm.json``.

The JSON was written by the code *before* the remedies moved out of ``fedfm.py`` into
``fedfm_remedies.py`` (commit c7617d3), by running this file as a script against that
tree::

    OMP_NUM_THREADS=1 PYTHONPATH=<tree of c7617d3>/src \
        python tests/test_golden_fedfm.py tests/golden_fedfm.json

so the test holds the moved code to the numbers of the original. The move itself was checked
bit for bit on one machine; here the tolerance is rel 1e-6. The JSON also records the machine
that wrote it (CPU model, torch's CPU capability, torch): another CPU may pick other kernels
(oneDNN and MKL dispatch by CPU), whose rounding training amplifies far beyond 1e-6 within
three rounds, so on another machine a difference is reported as a skip naming both machines
(rerun the generator there to hold that machine to it), and on the same kind of machine it
fails. Timing fields are not compared.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path

import pytest

GOLDEN = Path(__file__).with_name("golden_fedfm.json")

# --denormals keep: the recording is of code from before the option existed, which computed
# with IEEE denormals (torch's default); flushing them changes a run by rounding only
# (tests/test_denormals.py), which three rounds amplify beyond rel 1e-6.
# --partition dirichlet-niidbench: the recording's partition, what dirichlet drew before
# partition_version 2 (the same configuration hash and draws; a tree from before it knows the
# scheme as dirichlet, so regenerate there with that name).
TINY = (
    "--num-clients 6 --clients-per-round 3 --rounds 3 --local-epochs 1 "
    "--checkpoint-every 0 --workers 0 --quiet --denormals keep --partition dirichlet-niidbench"
).split()

BASELINES = (
    "creff fedacd fedavg fedcme feddecorr feddyn fedlc fednh fednova fedntd fedproto fedprox "
    "fedrod fedrs moon scaffold"
).split()

FM = "-p lam=5 -p start_round=1"
WARMUP = "-p lam_warmup=2"
PRE_RELU = "-p match_on=pre_relu"
PLUG_IN = "--feature-matching " + FM

# Parameters added after the recording, at the default that leaves a run as it was: the
# recorded parameter lists cannot hold them (FedACD's max_weight = 1 caps nothing).
ADDED_SINCE_THE_RECORDING = {"max_weight": 1.0}

# name -> the run's arguments after TINY
RUNS: dict[str, list[str]] = {
    **{a: ["-a", a] for a in BASELINES},
    **{
        name: args.split()
        for name, args in {
            "fedfm": f"-a fedfm {FM}",
            "fedfm-warmup2": f"-a fedfm {FM} {WARMUP}",
            "fedfm-prerelu": f"-a fedfm {FM} {PRE_RELU}",
            "fedfm-warmup2-prerelu": f"-a fedfm {FM} {WARMUP} {PRE_RELU}",
            "fedfm-l2-uniform-prerelu": f"-a fedfm {FM} -p fm_loss=l2 -p anchor_agg=uniform "
            + PRE_RELU,
            "fedfm-features": f"-a fedfm {FM} -p match_on=features -p lam_warmup=0",
            "fedfm-lite": f"-a fedfm-lite {FM} -p a=2",
            "fedfm-lite-warmup2": f"-a fedfm-lite {FM} -p a=2 {WARMUP}",
            "fedavg+fm": f"-a fedavg {PLUG_IN}",
            "fedavg+fm-warmup2": f"-a fedavg {PLUG_IN} {WARMUP}",
            "fedprox+fm": f"-a fedprox {PLUG_IN}",
            "fedprox+fm-warmup2": f"-a fedprox {PLUG_IN} {WARMUP}",
            "moon+fm": f"-a moon {PLUG_IN}",
            "moon+fm-warmup2": f"-a moon {PLUG_IN} {WARMUP}",
            # FedACD has its own lam: the plug-in's is fm_lam
            "fedacd+fm-warmup2": "-a fedacd --feature-matching -p fm_lam=5 -p start_round=1 "
            + WARMUP,
        }.items()
    },
}


def run_one(out: Path, name: str) -> dict:
    """The run's metrics (timing fields left out), resolved parameters in their recorded
    order, and config hash."""
    from fedskew.apps.cli import main
    from fedskew.config import config_hash
    from fedskew.runs.folder import saved_config

    assert main(["run", "-o", str(out), "--name", name, *TINY, *RUNS[name]]) == 0
    folder = out / name
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    metrics = [{k: v for k, v in row.items() if "seconds" not in k} for row in rows]
    config = json.loads((folder / "config.json").read_text())
    return {
        "metrics": metrics,
        "params": list(config["resolved"]["algorithm_params"].items()),
        "config_hash": config_hash(saved_config(folder)),
    }


def close(got: object, want: object, rel: float) -> bool:
    if isinstance(want, float) and isinstance(got, float):
        if math.isnan(want) or math.isnan(got):
            return math.isnan(want) and math.isnan(got)
        return got == pytest.approx(want, rel=rel, abs=1e-12)
    if isinstance(want, dict) and isinstance(got, dict):
        return want.keys() == got.keys() and all(close(got[k], want[k], rel) for k in want)
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return False
        return all(close(g, w, rel) for g, w in zip(got, want, strict=True))
    return got == want


def this_machine() -> dict[str, str]:
    """What decides which CPU kernels compute a run (see the module docstring)."""
    import torch

    from fedskew.core.machine import machine_facts

    return {
        "cpu": str(machine_facts()["cpu"]),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
    }


@pytest.mark.parametrize("name", list(RUNS))
def test_run_matches_the_metrics_of_the_code_before_the_remedies_moved(tmp_path, name):
    golden = json.loads(GOLDEN.read_text())
    want = golden[name]
    got = json.loads(json.dumps(run_one(tmp_path, name)))  # lists, as in the JSON
    # Parameters and the configuration hash do not depend on the machine.
    params = [
        [key, value]
        for key, value in got["params"]
        if ADDED_SINCE_THE_RECORDING.get(key, object()) != value
    ]
    assert params == want["params"]
    assert got["config_hash"] == want["config_hash"]
    same = all(close(g, w, rel=1e-6) for g, w in zip(got["metrics"], want["metrics"], strict=True))
    if not same and golden["_machine"] != this_machine():
        pytest.skip(
            f"metrics differ beyond rel 1e-6 on {this_machine()}; the golden values come "
            f"from {golden['_machine']} (other kernels): rerun the generator on this machine"
        )
    for row_got, row_want in zip(got["metrics"], want["metrics"], strict=True):
        assert close(row_got, row_want, rel=1e-6), (row_got, row_want)


def test_the_comparison_sees_a_difference():
    assert close([{"a": 1.0, "b": [2.0]}], [{"a": 1.0, "b": [2.0]}], 1e-6)
    assert not close([{"a": 1.0}], [{"a": 1.00001}], 1e-6)
    assert not close([{"a": 1.0}], [{"a": 1.0, "b": 2.0}], 1e-6)
    assert not close([float("nan")], [1.0], 1e-6)


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)  # as under tests/conftest.py: the thread count changes float sums
    with tempfile.TemporaryDirectory() as tmp:
        found = {name: run_one(Path(tmp), name) for name in RUNS}
    found["_machine"] = this_machine()
    Path(sys.argv[1]).write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
