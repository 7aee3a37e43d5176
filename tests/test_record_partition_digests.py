"""reproduction/record_partition_digests.py: it writes into config.json the digest of the
folder's own partition.npz (the one a run now records when it starts), never one rebuilt
from the configuration, and refuses a config.json that disagrees with the file."""

from __future__ import annotations

import json

import pytest

from fedskew.config import ExperimentConfig
from fedskew.runs.loop import run


@pytest.fixture(scope="module")
def script(reproduction_script):
    return reproduction_script("record_partition_digests.py")


def test_digest_is_taken_from_the_folders_partition_file(script, tmp_path):
    cfg = ExperimentConfig(
        algorithm="fedavg", num_clients=4, clients_per_round=2, rounds=1, local_epochs=1,
        out_dir=str(tmp_path), name="r", quiet=True,
    )  # fmt: skip
    run(cfg)
    folder = tmp_path / "r"
    path = folder / "config.json"
    recorded = json.loads(path.read_text())["resolved"]["partition_digest"]
    assert script.record(folder) == "agrees"

    # A folder from before config.json recorded it gets the same digest back from its file.
    config = json.loads(path.read_text())
    del config["resolved"]["partition_digest"]
    path.write_text(json.dumps(config, indent=2) + "\n")
    assert script.record(folder) == "added"
    assert json.loads(path.read_text())["resolved"]["partition_digest"] == recorded

    config["resolved"]["partition_digest"] = "0" * 16
    path.write_text(json.dumps(config, indent=2) + "\n")
    with pytest.raises(SystemExit, match="differs from partition.npz"):
        script.record(folder)

    # Without partition.npz nothing is invented.
    del config["resolved"]["partition_digest"]
    path.write_text(json.dumps(config, indent=2) + "\n")
    (folder / "partition.npz").unlink()
    assert script.record(folder) == "no partition.npz"
    assert "partition_digest" not in json.loads(path.read_text())["resolved"]
