"""benchmarks/graph_step_check.py and gpu_session.sh's dry run: the device check of the local
step as a CUDA graph runs its code at tiny size on the CPU, green, and computes its ratios
from the numbers it measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


@pytest.fixture(scope="module")
def check(benchmark_script):  # type: ignore[no-untyped-def]
    return benchmark_script("graph_step_check.py")


def test_the_dry_run_is_green_and_its_ratios_are_computed(check, tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "graph_step.md"
    argv = ["--dry-run", "--models", "fedavg-cnn", "--precisions", "fp32", "--out", str(out),
            "--processes", "2"]  # fmt: skip
    assert check.main(argv) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    bits = [c for c in data["cells"] if c["kind"] == "bits"]
    assert len(bits) == 1 and bits[0]["graph_equals_eager"] and bits[0]["eager_equals_eager"]
    assert not bits[0]["graph_captured"]  # the CPU runs the step eagerly, and says so
    paths = {c["path"]: c for c in data["cells"] if c["kind"] == "path"}
    measured = {**check.PATHS, **check.process_paths([2], mps=False)}
    mps = "N processes (2, MPS)"
    assert set(paths) == set(measured) | {mps} | set(check.FUTURE_PATHS)
    bare = paths[check.BARE]["samples_per_second"]
    for name in measured:
        cell = paths[name]
        assert not cell.get("error"), cell
        assert cell["samples_per_second"] > 0
        assert cell["over_bare_loop"] == round(cell["samples_per_second"] / bare, 3)
    # Each new path says what it ran: fused for real, the streams' CPU stand-in, N processes.
    assert paths[check.FUSED]["clients_together"] == "fused"
    fused_graph = paths[check.FUSED_GRAPH]
    assert fused_graph["clients_together"] == "fused" and fused_graph["cuda_graphs"] == "off"
    assert "no CUDA graphs on cpu" in fused_graph["note"]  # the CPU's eager step, said
    assert "2 replicas one after another (no streams on cpu)" in paths[check.STREAMS]["note"]
    two = paths["N processes (2)"]
    assert two["processes"] == 2 and two["note"].startswith("2 processes at once")
    assert paths[mps]["samples_per_second"] is None and "MPS is CUDA's" in paths[mps]["note"]
    for name in check.FUTURE_PATHS:  # the hook, reported, not dropped
        assert "not built" in paths[name]["note"]
    text = out.read_text()
    assert (
        "Dry run on the CPU" in text and "| fedavg-cnn | fp32 | 3 | False | True | True |" in text
    )


def test_n_process_rows_run_at_the_precisions_asked(check, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Each N-process row starts N processes: at a precision not asked for, a row says so."""
    out = tmp_path / "g.md"
    argv = ["--dry-run", "--models", "fedavg-cnn", "--precisions", "bf16", "--out", str(out),
            "--paths", "N processes (3)", "--processes", "3", "--no-mps"]  # fmt: skip
    assert check.main(argv) == 0
    (cell,) = [c for c in json.loads(out.with_suffix(".json").read_text())["cells"]
               if c["kind"] == "path"]  # fmt: skip
    assert cell["note"] == "not measured at bf16: --processes-precisions fp32"
    assert "samples_per_second" not in cell


def test_a_registered_path_joins_the_table(check, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The hook the fused model's path uses: register_path adds a row beside the others."""
    monkeypatch.setattr(check, "PATHS", dict(check.PATHS))
    check.register_path("fused", lambda s: {"samples_per_second": 1.0, "note": "stand-in"})
    out = tmp_path / "g.md"
    argv = ["--dry-run", "--models", "fedavg-cnn", "--precisions", "fp32", "--out", str(out),
            "--paths", "fused", check.BARE]  # fmt: skip
    assert check.main(argv) == 0
    cells = json.loads(out.with_suffix(".json").read_text())["cells"]
    fused = next(c for c in cells if c.get("path") == "fused")
    assert fused["samples_per_second"] == 1.0 and fused["over_bare_loop"] is not None


@pytest.mark.slow
def test_gpu_session_dry_run(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The whole session's dry run (every model and precision of step 1, on the CPU)."""
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(BENCHMARKS / "gpu_session.sh"), "--dry-run", str(tmp_path / "s")],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((tmp_path / "s" / "graph_step.json").read_text())
    assert all(c["graph_equals_eager"] for c in data["cells"] if c["kind"] == "bits")
    assert not [c for c in data["cells"] if c.get("error")]
    # Issue 47's rows, with numbers for both models at fp32: fused (also with its step as a
    # graph, eager on the CPU), streams, N processes.
    for model in ("resnet18", "fedavg-cnn"):
        rows = {c["path"]: c for c in data["cells"]
                if c["kind"] == "path" and c["model"] == model and c["precision"] == "fp32"}
        for name in ("fedskew round, clients together (fused)",
                     "fedskew round, fused + CUDA graph",
                     "CUDA streams, one replica per client", "N processes (2)",
                     "N processes (4)"):  # fmt: skip
            assert rows[name]["samples_per_second"] > 0, (model, name)
    text = (tmp_path / "s" / "graph_step.md").read_text()
    assert "| N processes (4, MPS) | - | - | - | - | not measured: MPS is CUDA's" in text
    # Step 2's dry run too: issue 47's fixed per-round costs, FedAvg and FedFM.
    fixed = json.loads((tmp_path / "s" / "round_fixed_costs.json").read_text())
    names = [r["algorithm"] for r in fixed["runs"]]
    assert fixed["dry_run"] and names == ["fedavg", "fedavg@host", "fedfm"]
