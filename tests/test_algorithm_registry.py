"""The algorithm registry names every built-in algorithm without importing it, and imports a
module only when its algorithm is asked for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from fedskew.algorithms import ALGORITHMS, BUILT_IN, discover


def test_the_table_of_built_in_algorithms_is_what_the_modules_define() -> None:
    found = discover()
    assert list(BUILT_IN) == sorted(BUILT_IN)  # `fedskew list` shows them in this order
    assert set(BUILT_IN) == set(found), "add the new algorithm's line to BUILT_IN"
    for name, cls in found.items():
        assert ALGORITHMS[name] is cls
        assert cls.__module__ == f"fedskew.algorithms.{BUILT_IN[name]}"
    assert ALGORITHMS.get("no-such-algorithm") is None


def test_a_run_imports_its_own_algorithm_only(tmp_path: Path) -> None:
    """Before, importing the training loop imported all seventeen algorithm modules."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    code = (
        "import json, sys\n"
        "from fedskew.config import ExperimentConfig\n"
        "from fedskew.runs.loop import run\n"
        "def names():\n"
        "    return sorted(m.rsplit('.', 1)[1] for m in sys.modules\n"
        "                  if m.startswith('fedskew.algorithms.'))\n"
        "before = names()\n"
        "run(ExperimentConfig(algorithm='fedprox', rounds=1, num_clients=4,\n"
        f"    clients_per_round=2, workers=0, quiet=True, out_dir={str(tmp_path)!r}))\n"
        "print(json.dumps([before, names()]))\n"
    )
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    before, after = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(before) <= {"local"}, before  # the shared local loop, no algorithm
    # FedProx is FedAvg's server with a proximal term: its module and what it builds on.
    assert set(after) <= {"fedprox", "fedavg", "local"}, after
