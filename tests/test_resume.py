"""Checkpoints and resume: a killed run loses no finished round and continues exactly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fedskew.apps.cli import main
from fedskew.config import ExperimentConfig
from fedskew.runs.checkpoint import load_checkpoint, save_checkpoint
from fedskew.runs.loop import run
from fedskew.training.protocol import ClientState

KEYS = ("round", "clients", "accuracy", "loss", "bytes_down", "bytes_up")


class Killed(Exception):
    pass


def metrics(folder: Path) -> list[dict]:
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    return [{k: r.get(k) for k in KEYS} for r in rows]


def kill_after(n: int):
    def hook(record):
        if record["round"] == n:
            raise Killed

    return hook


@pytest.mark.parametrize("algorithm", ["fedavg"])
def test_resume_continues_exactly_where_it_stopped(tmp_path, algorithm):
    common = dict(algorithm=algorithm, rounds=6, local_epochs=1, quiet=True, seed=3)
    full, _ = run(ExperimentConfig(out_dir=str(tmp_path / "a"), name="r", **common))
    cfg = ExperimentConfig(out_dir=str(tmp_path / "b"), name="r", **common)
    with pytest.raises(Killed):
        run(cfg, on_round=kill_after(3))
    unfinished = tmp_path / "b" / "r.incomplete"
    assert unfinished.is_dir() and not (tmp_path / "b" / "r").exists()
    assert [r["round"] for r in metrics(unfinished)] == [1, 2, 3]
    assert main(["run", "--resume", str(unfinished), "-q"]) == 0
    resumed = tmp_path / "b" / "r"
    assert metrics(resumed) == metrics(full)
    summary = json.loads((resumed / "summary.json").read_text())
    assert (
        summary["final_accuracy"]
        == json.loads((full / "summary.json").read_text())["final_accuracy"]
    )
    # Each process that worked on the run says where it ran and from which round.
    processes = [json.loads(x) for x in (resumed / "processes.jsonl").read_text().splitlines()]
    assert [p["from_round"] for p in processes] == [1, 4]
    assert all(p["cpu"] and p["torch"] == torch.__version__ for p in processes)
    assert summary["processes"] == processes


def test_metrics_after_the_last_checkpoint_are_rerun(tmp_path):
    common = dict(rounds=5, local_epochs=1, quiet=True, seed=1, checkpoint_every=2)
    full, _ = run(ExperimentConfig(out_dir=str(tmp_path / "a"), name="r", **common))
    with pytest.raises(Killed):
        run(
            ExperimentConfig(out_dir=str(tmp_path / "b"), name="r", **common),
            on_round=kill_after(3),
        )
    unfinished = tmp_path / "b" / "r.incomplete"
    done, *_ = load_checkpoint(unfinished / "checkpoint.npz")
    assert done == 2  # round 3 finished but was not checkpointed: it will run again
    assert main(["run", "--resume", str(unfinished), "-q"]) == 0
    assert metrics(tmp_path / "b" / "r") == metrics(full)


def test_resume_refuses_finished_runs_and_extra_options(tmp_path, capsys):
    folder, _ = run(ExperimentConfig(rounds=1, local_epochs=1, quiet=True, out_dir=str(tmp_path)))
    assert main(["run", "--resume", str(folder)]) == 1
    assert "finished run" in capsys.readouterr().err
    assert main(["run", "--resume", str(folder), "--rounds", "3"]) == 2
    assert "drop: rounds" in capsys.readouterr().err


def test_resume_may_change_where_and_how_it_executes(tmp_path, capsys):
    # An in-process run continued in two worker processes, with the data folder named: the
    # same rounds as the uninterrupted run, and the change recorded.
    common = dict(algorithm="scaffold", num_clients=6, clients_per_round=4, rounds=3,
                  local_epochs=1, quiet=True, seed=2)  # fmt: skip
    full, _ = run(ExperimentConfig(out_dir=str(tmp_path / "a"), name="r", **common))
    with pytest.raises(Killed):
        run(ExperimentConfig(out_dir=str(tmp_path / "b"), name="r", **common), kill_after(1))
    unfinished = tmp_path / "b" / "r.incomplete"
    data_dir = str(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").mkdir()  # a folder named must exist (digits needs no files)
    args = ["run", "--resume", str(unfinished), "-q", "--workers", "2", "--data-dir", data_dir]
    assert main(args) == 0
    resumed = tmp_path / "b" / "r"
    assert metrics(resumed) == metrics(full)
    processes = [json.loads(x) for x in (resumed / "processes.jsonl").read_text().splitlines()]
    assert [(p["from_round"], p["workers"]) for p in processes] == [(1, 0), (2, 2)]
    # The saved configuration is the experiment's; execution options are not written back.
    assert json.loads((resumed / "config.json").read_text())["workers"] == "auto"


def test_checkpoint_round_trip_without_pickle(tmp_path):
    class Server:
        checkpoint_fields = ("c", "store", "count")

    server = Server()
    server.global_arrays = {"w": torch.arange(6.0).reshape(2, 3), "n": torch.tensor(4)}
    server.c = torch.ones(3, dtype=torch.bfloat16)
    server.store = {7: torch.tensor([0.5, 0.25]), 9: None}
    server.count = 5
    clients = {2: ClientState(arrays={"prev": torch.zeros(2)}, scalars={"steps": 4.0})}
    path = tmp_path / "ck.npz"
    save_checkpoint(path, 3, server, clients)
    with np.load(path, allow_pickle=False) as data:  # loads with pickle disabled
        assert "__index__" in data.files
    rnd, state, states, _ = load_checkpoint(path)
    assert rnd == 3
    assert torch.equal(state["global_arrays"]["w"], server.global_arrays["w"])
    assert state["c"].dtype == torch.bfloat16 and torch.equal(state["c"], server.c)
    assert torch.equal(state["store"][7], server.store[7]) and state["store"][9] is None
    assert state["count"] == 5
    assert torch.equal(states[2].arrays["prev"], torch.zeros(2))
    assert states[2].scalars == {"steps": 4.0}
    with pytest.raises(TypeError):
        server.count = object()
        save_checkpoint(path, 4, server, clients)


def test_cli_api_compare_and_flower_resume_a_folder_alike(tmp_path, capsys, monkeypatch):
    """One way back from a run folder (runs.folder.saved_config) for every caller: the same
    unfinished folder resumed by the CLI, by fedskew.run, by fedskew compare and by a Flower
    ServerApp (its clients on the real ClientApp, through an in-memory Grid) ends with the
    uninterrupted run's metrics; the API keeps the execution options it is given (workers
    was silently dropped before) and refuses the others. Without flwr installed the Flower
    leg is left out."""
    import importlib.util
    import shutil

    import fedskew
    from fedskew.apps import compare
    from fedskew.core.errors import UsageError

    grid_file = tmp_path / "grid.toml"
    grid_file.write_text(
        f'[compare]\nout_dir = "{tmp_path / "grid"}"\nseeds = [0]\n\n'
        '[experiment]\ndataset = "digits"\nnum_clients = 4\nclients_per_round = 2\n'
        "rounds = 3\nlocal_epochs = 1\n\n[methods.fedavg]\n"
    )
    grid = compare.grid_from(compare.read_file(grid_file), str(grid_file), {}, None, {})
    (planned,) = compare.plan(grid)
    values = planned.values
    reference, _ = run(ExperimentConfig(**{**values, "out_dir": str(tmp_path / "ref")}))
    with pytest.raises(Killed):
        run(ExperimentConfig(**values), on_round=kill_after(1))
    unfinished = tmp_path / "grid" / f"{planned.folder}.incomplete"
    copies = {}
    with_flower = importlib.util.find_spec("flwr") is not None
    for how in ("cli", "api", "flower") if with_flower else ("cli", "api"):
        copies[how] = tmp_path / how / unfinished.name
        shutil.copytree(unfinished, copies[how])

    assert main(["run", "--resume", str(copies["cli"]), "-q", "--workers", "0"]) == 0
    with pytest.raises(UsageError, match=r"resume=...\) takes .* drop: rounds"):
        fedskew.run(resume=copies["api"], rounds=5)
    with pytest.raises(UsageError, match="drop: config"):
        fedskew.run({"rounds": 5}, resume=copies["api"])
    result = fedskew.run(resume=copies["api"], workers=2, quiet=True)
    # One thread, as this process's runs: compare's child otherwise takes every core, and a
    # thread count changes float sums in the last bits on some CPUs (seen on an AVX2-only
    # AMD EPYC: the resumed round's test loss moved by 2e-7).
    assert main(["compare", "-c", str(grid_file), "--threads", "1"]) == 0
    assert f"{planned.folder}: resumed" in capsys.readouterr().out
    if with_flower:
        from flower_grid import LocalGrid
        from flwr.app import Context, RecordDict

        from fedskew.apps.flower.run_config import OUTPUT_ROOT_VARIABLE
        from fedskew.apps.flower.server import _server_main

        monkeypatch.setenv(OUTPUT_ROOT_VARIABLE, str(tmp_path / "flower"))
        context = Context(run_id=2, node_id=0, node_config={}, state=RecordDict(),
                          run_config={"resume": unfinished.name})  # fmt: skip
        _server_main(LocalGrid(values["num_clients"]), context)

    finished = {
        "cli": tmp_path / "cli" / planned.folder,
        "api": result.folder,
        "compare": tmp_path / "grid" / planned.folder,
    }
    if with_flower:
        finished["flower"] = tmp_path / "flower" / planned.folder
    for how, folder in finished.items():
        assert metrics(folder) == metrics(reference), how
        processes = [json.loads(x) for x in (folder / "processes.jsonl").read_text().splitlines()]
        assert [p["from_round"] for p in processes] == [1, 2], how
    api_processes = (finished["api"] / "processes.jsonl").read_text().splitlines()
    assert json.loads(api_processes[-1])["workers"] == 2
