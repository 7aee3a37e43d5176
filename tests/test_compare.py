"""`fedskew compare`: a grid runs (one process per run), skips finished runs, resumes an
unfinished one, gives every method of a (setting, seed) the same partition and clients, and
writes tables whose numbers are those of metrics.jsonl."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fedskew.apps import compare
from fedskew.apps.cli import main
from fedskew.config import ExperimentConfig, config_hash
from fedskew.core.errors import UsageError
from fedskew.runs.loop import run
from fedskew.training.protocol import ClientState, largest_state

ROOT = Path(__file__).resolve().parents[1]

GRID = """
[compare]
out_dir = "{out}"
seeds = [0, 1]
reference = "fedavg"
last = 2
target = 30
jobs = 2
threads = 1

[experiment]
dataset = "digits"
num_clients = 4
clients_per_round = 2
rounds = 2
local_epochs = 1
batch_size = 64

[methods.fedavg]

[methods.prox]
algorithm = "fedprox"
params = {{ mu = 0.1 }}
"""


class Killed(Exception):
    pass


def _kill_after_round_1(record):
    if record["round"] == 1:
        raise Killed


def _metrics(folder: Path) -> list[dict]:
    return [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]


def test_grid_runs_skips_resumes_and_tables_match_metrics(tmp_path, capsys):
    out = tmp_path / "grid"
    file = tmp_path / "grid.toml"
    file.write_text(GRID.format(out=out))
    grid = compare.grid_from(compare.read_file(file), str(file), {}, None, {})
    planned = compare.plan(grid)
    assert [r.folder for r in planned] == ["fedavg-s0", "prox-s0", "fedavg-s1", "prox-s1"]

    # An unfinished run of the grid, as a killed compare leaves it: round 1 of 2 done.
    prox1 = next(r for r in planned if r.folder == "prox-s1")
    with pytest.raises(Killed):
        run(ExperimentConfig(**prox1.values), on_round=_kill_after_round_1)
    assert (out / "prox-s1.incomplete").is_dir()

    assert main(["compare", "-c", str(file)]) == 0
    printed = capsys.readouterr().out
    assert "prox-s1: resumed" in printed and printed.count(": finished") == 3
    folders = {r.folder: out / r.folder for r in planned}
    assert all((f / "summary.json").is_file() for f in folders.values())
    processes = [json.loads(x) for x in (folders["prox-s1"] / "processes.jsonl").read_text()
                 .splitlines()]  # fmt: skip
    assert [p["from_round"] for p in processes] == [1, 2]  # continued, not restarted

    # One partition and one client stream per seed, whatever the method.
    for seed in (0, 1):
        a, b = folders[f"fedavg-s{seed}"], folders[f"prox-s{seed}"]
        with np.load(a / "partition.npz") as pa, np.load(b / "partition.npz") as pb:
            assert np.array_equal(pa["indices"], pb["indices"])
            assert np.array_equal(pa["offsets"], pb["offsets"])
        assert [m["clients"] for m in _metrics(a)] == [m["clients"] for m in _metrics(b)]
    with (
        np.load(folders["fedavg-s0"] / "partition.npz") as p0,
        np.load(folders["fedavg-s1"] / "partition.npz") as p1,
    ):
        assert not np.array_equal(p0["indices"], p1["indices"])  # seeds do differ

    # Tables: every number recomputed here from metrics.jsonl.
    rows = {r["method"]: r for r in csv.DictReader((out / "comparison.csv").open())}
    assert set(rows) == {"fedavg", "prox"}
    acc = {
        name: {s: [100 * m["accuracy"] for m in _metrics(out / f"{name}-s{s}")] for s in (0, 1)}
        for name in ("fedavg", "prox")
    }
    for name, per_seed in acc.items():
        row = rows[name]
        finals = [per_seed[s][-1] for s in (0, 1)]
        lasts = [np.mean(per_seed[s][-2:]) for s in (0, 1)]
        bests = [max(per_seed[s]) for s in (0, 1)]
        assert float(row["final_mean"]) == pytest.approx(np.mean(finals), abs=1e-3)
        assert float(row["final_std"]) == pytest.approx(np.std(finals, ddof=1), abs=1e-3)
        assert float(row["last_mean"]) == pytest.approx(np.mean(lasts), abs=1e-3)
        assert row["last_rounds"] == "2"
        assert float(row["best_mean"]) == pytest.approx(np.mean(bests), abs=1e-3)
        reached = [next((i + 1 for i, a in enumerate(per_seed[s]) if a >= 30), None)
                   for s in (0, 1)]  # fmt: skip
        assert int(row["seeds_reaching_target"]) == sum(r is not None for r in reached)
        traffic = [
            np.mean([m["bytes_down"] for m in _metrics(out / f"{name}-s{s}")]) for s in (0, 1)
        ]
        assert float(row["bytes_down_per_round"]) == pytest.approx(np.mean(traffic), abs=0.1)
    paired = [np.mean(acc["prox"][s][-2:]) - np.mean(acc["fedavg"][s][-2:]) for s in (0, 1)]
    assert float(rows["prox"]["paired_mean"]) == pytest.approx(np.mean(paired), abs=1e-3)
    assert float(rows["prox"]["paired_std"]) == pytest.approx(np.std(paired, ddof=1), abs=1e-3)
    assert rows["fedavg"]["paired_seeds"] == "0"
    # FedAvg and FedProx keep nothing on the client between rounds.
    assert rows["fedavg"]["client_state_bytes_max"] == "0"
    cpu = json.loads((out / "fedavg-s0" / "processes.jsonl").read_text().splitlines()[0])["cpu"]
    assert rows["fedavg"]["machines"] == cpu  # both seeds on this machine
    md = (out / "comparison.md").read_text()
    # 2 seeds: mean ± t(0.975, 1) s / sqrt(2), t from a printed table.
    half = 12.7062047 * np.std(paired, ddof=1) / np.sqrt(2)
    low, high = np.mean(paired) - half, np.mean(paired) + half
    assert float(rows["prox"]["paired_ci95_low"]) == pytest.approx(low, abs=1e-3)
    ahead = sum(d > 0 for d in paired)
    assert f"{np.mean(paired):+.2f} [{low:+.2f}, {high:+.2f}]; ahead in {ahead}/2 seeds" in md
    assert "identical across methods in 2 of 2" in md
    runs = list(csv.DictReader((out / "runs.csv").open()))
    assert len(runs) == 4 and all(r["finished"] == "True" for r in runs)
    assert all(r["git commit"] and r["torch"] != "not recorded" for r in runs)
    manifest = json.loads((out / "compare.json").read_text())
    assert [r["folder"] for r in manifest["runs"]] == list(folders)

    # A second call runs nothing: every run is finished with the planned configuration.
    before = {f: (f / "metrics.jsonl").stat().st_mtime_ns for f in folders.values()}
    assert main(["compare", "-c", str(file)]) == 0
    assert capsys.readouterr().out.count("done before") == 4
    assert before == {f: (f / "metrics.jsonl").stat().st_mtime_ns for f in folders.values()}

    # Another configuration under the same names is refused, not silently mixed in.
    assert main(["compare", "-c", str(file), "--lr", "0.2"]) == 1
    out_text = capsys.readouterr().out
    assert out_text.count("another configuration") == 4
    # ... naming what differs (here the lr given now against the grid file's)
    assert out_text.count("lr: 0.05 there, 0.2 here") == 4, out_text

    # --report-only rebuilds the tables from the folder alone.
    (out / "comparison.csv").unlink()
    assert main(["compare", "--report-only", "-o", str(out)]) == 0
    assert {r["method"] for r in csv.DictReader((out / "comparison.csv").open())} == set(rows)


def _grid(text: str, tmp_path: Path, **kw) -> compare.Grid:
    file = tmp_path / "g.toml"
    file.write_text(text)
    return compare.grid_from(compare.read_file(file), str(file), {}, None, kw)


def test_axes_and_settings_name_the_runs(tmp_path):
    grid = _grid(
        """
[experiment]
num_clients = 4
[methods.fedavg]
[methods.fedfm-fm]
algorithm = "fedavg"
feature_matching = true
[settings.small]
rounds = 2
[axes]
partition = ["dirichlet", "quantity"]
"partition_params.min_size" = [5, 10]
""",
        tmp_path,
    )
    assert list(grid.settings) == [
        "small-dirichlet-min_size5", "small-dirichlet-min_size10",
        "small-quantity-min_size5", "small-quantity-min_size10",
    ]  # fmt: skip
    assert grid.settings["small-quantity-min_size10"] == {
        "rounds": 2, "partition": "quantity", "partition_params": {"min_size": 10},
    }  # fmt: skip
    runs = compare.plan(grid)
    assert len(runs) == 8 and runs[1].folder == "small-dirichlet-min_size5/fedfm-fm-s0"
    assert runs[1].cfg.feature_matching and runs[1].cfg.algorithm == "fedavg"


@pytest.mark.parametrize(
    "text, message",
    [
        ("[methods.a]\nalgorithm = 'fedavg'\nnum_clients = 3\n", "decides the partition"),
        ("[methods.fedavg]\nseed = 3\n", "decides the partition"),
        ("[methods.nope]\n", "unknown algorithm"),
        ("[methods.fedprox]\nparams = { zeta = 1 }\n", "zeta"),
        ("[compare]\ntarget = 0.8\n[methods.fedavg]\n", "percent"),
        ("[compare]\nseeds = [1, 1]\n[methods.fedavg]\n", "seeds repeat"),
        ("[compare]\nfoo = 1\n", "no key 'foo'"),
        ("[experiment]\nlrr = 1\n", "unknown option"),
        ("[methods.'a/b']\nalgorithm = 'fedavg'\n", "names folders"),
        ("[experiment]\npartition_params = { zeta = 1 }\n[methods.fedavg]\n", "'zeta'"),
    ],
)
def test_bad_grids_fail_with_one_line(tmp_path, text, message):
    with pytest.raises(UsageError, match=message):
        compare.plan(_grid(text, tmp_path))


def test_a_setting_with_another_partition_drops_the_base_partition_params(tmp_path):
    """The base's Dirichlet beta was given for Dirichlet: a setting that picks another
    scheme starts from that scheme's own parameters; one that keeps the scheme keeps it."""
    grid = _grid(
        """
[experiment]
num_clients = 4
partition = "dirichlet"
partition_params = { beta = 0.5, min_size = 3 }
[methods.fedavg]
[settings.same]
partition_params = { min_size = 5 }
[settings.shards]
partition = "niid2"
partition_params = { shard_size = 50 }
[settings.missing]
partition = "missing"
""",
        tmp_path,
    )
    cfgs = {r.setting: r.cfg for r in compare.plan(grid)}
    assert cfgs["same"].partition_params == {"beta": 0.5, "min_size": 5}
    assert (cfgs["shards"].partition, cfgs["shards"].partition_params) == (
        "niid2", {"shard_size": 50},
    )  # fmt: skip
    assert (cfgs["missing"].partition, cfgs["missing"].partition_params) == ("missing", {})


def test_jobs_times_threads_fit_the_cores():
    assert compare.threads_per_run(2, None, 2) == 1
    assert compare.threads_per_run(1, None, 8) == 1  # the same on every executor
    with pytest.raises(UsageError, match="jobs x threads <= cores"):
        compare.threads_per_run(2, 2, 2)


@pytest.mark.parametrize("preset", ["methods", "baselines"])
def test_benchmark_presets_plan_the_committed_runs(preset):
    """configs/compare/<preset>.toml plans the runs benchmarks/compare.py made: the same
    folder names, and every committed run folder has the planned configuration."""
    file = ROOT / "configs" / "compare" / f"{preset}.toml"
    grid = compare.grid_from(compare.read_file(file), str(file), {}, None, {})
    grid.out_dir = ROOT / grid.out_dir
    runs = compare.plan(grid)
    committed = sorted(p for p in grid.out_dir.iterdir() if (p / "config.json").is_file())
    assert committed, "no committed runs"
    planned = {r.folder: r for r in runs}
    for folder in committed:
        assert folder.name in planned, folder.name
        assert compare.saved_hash(folder) == config_hash(planned[folder.name].cfg), folder.name


def test_paper_configs_plan(tmp_path):
    """Every file in configs/ and reproduction/ parses and plans (names, models, algorithm
    and partition parameters checked)."""
    files = [
        *sorted((ROOT / "configs").rglob("*.toml")),
        *sorted((ROOT / "configs").rglob("*.yaml")),
        *sorted((ROOT / "reproduction").glob("*.toml")),
    ]
    assert files
    for file in files:
        grid = compare.grid_from(compare.read_file(file), str(file), {}, None, {})
        assert compare.plan(grid), file


def test_client_state_size_outlives_the_checkpoint(tmp_path):
    """The summary keeps the largest client state, so the tables still have it when the
    (gitignored) checkpoint.npz is gone."""
    cfg = ExperimentConfig(
        algorithm="scaffold", num_clients=4, clients_per_round=2, rounds=2, out_dir=str(tmp_path)
    )
    folder, summary = run(cfg)
    from_checkpoint = compare.client_state_memory(folder)
    assert from_checkpoint is not None and from_checkpoint[0] > 0  # SCAFFOLD's c_k
    assert (summary["client_state_bytes_max"], summary["clients_with_state"]) == from_checkpoint
    (folder / "checkpoint.npz").unlink()
    [rec] = compare.collect(folder)
    assert (rec.client_state_bytes, rec.client_state_clients) == from_checkpoint
    # A summary written before the record: the checkpoint, when there is one, still says it.
    older = folder.parent / "older"
    folder, _ = run(dataclasses.replace(cfg, out_dir=str(older)))
    path = folder / "summary.json"
    kept = json.loads(path.read_text())
    del kept["client_state_bytes_max"], kept["clients_with_state"]
    path.write_text(json.dumps(kept))
    [rec] = compare.collect(folder)
    assert (rec.client_state_bytes, rec.client_state_clients) == from_checkpoint


def test_empty_client_states_are_not_counted():
    """Engines keep an entry for every client met; a method that carries nothing between
    rounds leaves empty ones, which hold no memory and are not counted as holders."""
    c = torch.zeros(10)
    states = {0: ClientState(), 1: ClientState(arrays={"c": c}), 2: ClientState(scalars={"t": 1.0})}
    assert largest_state(states) == (40, 2)
    assert largest_state({0: ClientState(), 1: ClientState()}) == (0, 0)
    assert largest_state({}) == (0, 0)


def test_a_success_removes_the_failure_log_of_an_earlier_attempt(tmp_path):
    """A failed attempt leaves logs/<run>.log; once the run finishes that log would claim a
    failure that is no longer true (reports read failures from it), so it goes."""
    out = tmp_path / "grid"
    file = tmp_path / "grid.toml"
    text = GRID.format(out=out).replace("seeds = [0, 1]", "seeds = [0]")
    file.write_text(text.split("[methods.prox]")[0])
    stale = out / "logs" / "fedavg-s0.log"
    stale.parent.mkdir(parents=True)
    stale.write_text("$ fedskew run ...\n(exit 1)\nround 1: client 0 diverged\n")
    assert main(["compare", "-c", str(file), "-q"]) == 0
    assert (out / "fedavg-s0" / "summary.json").is_file()
    assert not stale.exists()
