"""A run's torch threads are pinned the same way on every executor, so that one grid
computes the same numbers wherever it runs, and each run records them in processes.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedskew.apps.cli import main
from fedskew.grid import launch

GRID = """
[compare]
out_dir = "{out}"
seeds = [0]
jobs = 1
[experiment]
dataset = "digits"
num_clients = 4
clients_per_round = 2
rounds = 3
local_epochs = 1
[methods.fedavg]
"""


def grid_file(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / "grid.toml"
    file.write_text(GRID.format(out=folder / "out"))
    return file


def threads_and_metrics(run: Path) -> tuple[list[int], list[dict]]:
    processes = [json.loads(x) for x in (run / "processes.jsonl").read_text().splitlines()]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    keep = ("round", "clients", "accuracy", "loss", "bytes_down", "bytes_up")
    return [p["torch_threads"] for p in processes], [{k: r.get(k) for k in keep} for r in rows]


def test_local_and_slurm_tasks_pin_the_same_threads_and_agree(tmp_path, monkeypatch, capsys):
    # Many cores: the local executor used to give a lone run all of them (cores / jobs),
    # while a Ray task or a Slurm array task ran on 1 thread.
    monkeypatch.setattr(launch, "available_cores", lambda: 4)
    local = grid_file(tmp_path / "local")
    assert main(["compare", "-c", str(local)]) == 0
    slurm = grid_file(tmp_path / "slurm")
    assert main(["compare", "-c", str(slurm), "--executor", "slurm", "--dry-run"]) == 0
    runs_list = tmp_path / "slurm" / "out" / "slurm" / "runs.json"
    assert main(["grid-task", str(runs_list), "--index", "0"]) == 0
    capsys.readouterr()
    threads, metrics = threads_and_metrics(tmp_path / "local" / "out" / "fedavg-s0")
    assert threads == [1]
    assert threads_and_metrics(tmp_path / "slurm" / "out" / "fedavg-s0") == (threads, metrics)
    # Asked for, the threads are the run's (and recorded).
    again = grid_file(tmp_path / "two")
    assert main(["compare", "-c", str(again), "--threads", "2"]) == 0
    assert threads_and_metrics(tmp_path / "two" / "out" / "fedavg-s0")[0] == [2]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--cpus-per-run", "2"], "1 jobs x 2 threads = 2 threads on 1 cores"),
        (["--cpus-per-run", "1", "--threads", "2"], "cpus-per-run 1 and threads 2 disagree"),
        (["--cpus-per-run", "1", "--jobs", "2"], "2 jobs x 1 threads = 2 threads on 1 cores"),
    ],
)
def test_cpus_per_run_is_the_local_runs_threads(tmp_path, monkeypatch, capsys, args, message):
    # --cpus-per-run was read by Ray alone: a local grid ran with other threads, silently.
    monkeypatch.setattr(launch, "available_cores", lambda: 1)
    file = grid_file(tmp_path)
    assert main(["compare", "-c", str(file), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_cpus_per_run_sets_a_local_runs_threads(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(launch, "available_cores", lambda: 4)
    file = grid_file(tmp_path)
    assert main(["compare", "-c", str(file), "--cpus-per-run", "2"]) == 0
    assert threads_and_metrics(tmp_path / "out" / "fedavg-s0")[0] == [2]
