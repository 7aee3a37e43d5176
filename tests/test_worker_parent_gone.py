"""A worker whose parent is gone as it starts (the run killed while its workers load) ends
quietly: no BrokenPipeError traceback on the terminal, exit status 0."""

from __future__ import annotations

import subprocess
import sys

import pytest

# A worker started on a pipe whose parent end is already closed, as after a kill.
WORKER = """
import json, multiprocessing as mp, sys
from fedskew.config import ExperimentConfig
from fedskew.engines.workers import worker_main
parent, child = mp.Pipe(duplex=True)
parent.close()
cfg = {**ExperimentConfig(num_clients=4, clients_per_round=2, rounds=1).to_dict(),
       "workers": 0, "engine": "inprocess", "quiet": True}
config = sys.argv[1] if sys.argv[1] != "good" else json.dumps(cfg)
worker_main(child, config, json.dumps({"threads": 1}))
"""


@pytest.mark.parametrize("config", ["good", "{not json"])
def test_a_worker_whose_parent_is_gone_ends_quietly(config):
    # "good": the worker builds its runtime, then finds nobody to tell it is ready; else its
    # start-up fails and nobody is there to hear why.
    done = subprocess.run([sys.executable, "-c", WORKER, config], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    assert done.returncode == 0, done.stderr
