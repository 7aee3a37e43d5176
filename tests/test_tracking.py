"""Experiment tracking: what TensorBoard, MLflow and W&B hold after a run, read back with
their own readers (event files, MLflow's tracking API on its SQLite database, W&B's
transaction log), equals the run folder's metrics.jsonl round by round; a missing package,
a tracker failing mid-run, a resume and a compare grid."""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from run_metrics import metrics
from tensorboard_served import Series, data_server_binary, read_served, served_runs, tensorboard

from fedskew.apps import compare
from fedskew.apps.cli import main
from fedskew.config import ExperimentConfig
from fedskew.runs.loop import run
from fedskew.runs.tracking.base import scalars

# Every tracker whose package is here (CI installs all three: .[track]).
MODULES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
INSTALLED = [name for name, module in MODULES.items() if importlib.util.find_spec(module)]
TINY = dict(num_clients=4, clients_per_round=2, rounds=3, local_epochs=1, quiet=True, seed=2)
TIMING = ("seconds", "eval_seconds")  # the only numbers that differ between two runs


def needs(name: str) -> None:
    pytest.importorskip(MODULES[name])


def logged_in_folder(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl as trackers should hold it: each number's (round, value) series."""
    series: dict[str, list[tuple[int, float]]] = {}
    for row in metrics(folder):
        for key, value in scalars(row).items():
            series.setdefault(key, []).append((row["round"], value))
    return series


def without_timing(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


# ---------------------------------------------------------------- reading the trackers back


def shown(name: str, series: Series) -> Series:
    """``series`` as tracker ``name`` shows it: TensorBoard as float32 numbers (the scalars
    every TensorBoard loader reads), the others exactly."""
    if name != "tensorboard":
        return series
    return {k: [(s, float(np.float32(v))) for s, v in steps] for k, steps in series.items()}


def read_tensorboard(log_dir: Path, expected: Series, load_fast: str | None = None) -> Series:
    """What TensorBoard serves for the run of ``log_dir`` (a run folder's
    ``<tensorboard>/<run>``), started on its parent as tracking.md's ``tensorboard --logdir``:
    with its default loader, or ``--load_fast=load_fast``."""
    with tensorboard(log_dir.parent, load_fast) as url:
        got = read_served(url, log_dir.name, expected)
        assert log_dir.name in served_runs(url)
    return got


def mlflow_client(root: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")


def read_mlflow(root: Path, run_id: str) -> dict[str, list[tuple[int, float]]]:
    client = mlflow_client(root)
    keys = client.get_run(run_id).data.metrics
    return {
        key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        for key in keys
    }


def wandb_records(run_dir: Path) -> list[dict]:
    """The records of a W&B run's transaction log (run-*.wandb), as W&B's own inspector
    prints them."""
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def read_wandb(root: Path, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """History of every offline run folder of ``run_id`` (a resumed run has several)."""
    out: dict[str, list[tuple[int, float]]] = {}
    folders = sorted((root / "wandb").glob(f"offline-run-*-{run_id}"))
    assert folders, f"no offline W&B run {run_id} in {root / 'wandb'}"
    for folder in folders:
        for rec in wandb_records(folder):
            if rec["type"] != "history":
                continue
            step = rec["history"]["step"]["num"]
            for key, value in rec["history"]["item"].items():
                if not key.startswith("_"):
                    out.setdefault(key, []).append((step, value))
    return {k: sorted(v) for k, v in out.items()}


def read_back(name: str, folder: Path) -> Series:
    ids = json.loads((folder / "tracking.json").read_text())["trackers"][name]
    if name == "tensorboard":
        return read_tensorboard(Path(ids["log_dir"]), shown(name, logged_in_folder(folder)))
    if name == "mlflow":
        database = Path(ids["tracking_uri"].removeprefix("sqlite:///"))
        return read_mlflow(database.parent, ids["run_id"])
    return read_wandb(Path(ids["dir"]), ids["id"])


# ------------------------------------------------------------------------------ the tests


# Per-client accuracy as runs with --local-test-fraction log it: the list (which trackers do
# not get) and its statistics (which they do). Added to each evaluation of the fixtures' runs.
CLIENTS = [0.5, None, 0.75, 0.25]
SPREAD = {"mean": 0.5, "std": 0.2041241452, "worst10": 0.25, "gap": 0.5}


def with_client_accuracy(evaluate):
    def evaluate_with_clients(state):
        out = evaluate(state)
        for prefix in ("client_accuracy", "client_personal_accuracy"):
            out[prefix] = CLIENTS
            out.update({f"{prefix}_{k}": v for k, v in SPREAD.items()})
        return out

    return evaluate_with_clients


def run_with_clients(cfg: ExperimentConfig, **kwargs) -> Path:
    from fedskew.runs import loop

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            loop, "evaluate_global_model", with_client_accuracy(loop.evaluate_global_model)
        )
        folder, _ = run(cfg, **kwargs)
    return folder


@pytest.fixture(scope="module")
def untracked(tmp_path_factory) -> Path:
    return run_with_clients(ExperimentConfig(out_dir=str(tmp_path_factory.mktemp("plain")), **TINY))


@pytest.fixture(scope="module")
def tracked(tmp_path_factory) -> Path:
    if not INSTALLED:
        pytest.skip("no tracker package installed")
    out = tmp_path_factory.mktemp("tracked")
    return run_with_clients(ExperimentConfig(out_dir=str(out), name="r", track=INSTALLED, **TINY))


@pytest.mark.parametrize("name", list(MODULES))
def test_every_round_reaches_the_tracker_as_in_metrics_jsonl(name, tracked, untracked):
    # TensorBoard's: as its server shows them, started as a user starts it (its default loader).
    needs(name)
    expected = shown(name, logged_in_folder(tracked))
    assert set(expected) >= {"accuracy", "loss", "train_loss", "client_dist_accuracy",
                             "bytes_down", "bytes_up"}  # fmt: skip
    got = read_back(name, tracked)
    assert got == expected
    assert_per_class_and_client_scalars(got, name, tracked)
    # Tracking changes nothing in the run.
    assert without_timing(metrics(tracked)) == without_timing(metrics(untracked))


def assert_per_class_and_client_scalars(got: Series, name: str, folder: Path) -> None:
    # One series per class, named by the class index, as metrics.jsonl's lists have them.
    rows = metrics(folder)
    per_class = {
        f"per_class_accuracy/{c}": [(r["round"], r["per_class_accuracy"][c]) for r in rows]
        for c in range(10)
    }
    assert {k: v for k, v in got.items() if k.startswith("per_class_accuracy/")} == shown(
        name, per_class)  # fmt: skip
    # The clients' statistics are there, their lists are not.
    for prefix in ("client_accuracy", "client_personal_accuracy"):
        for k, v in SPREAD.items():
            key = f"{prefix}_{k}"
            assert got[key] == shown(name, {key: [(r, v) for r in (1, 2, 3)]})[key]
    assert not any(k.startswith("client_accuracy/") or k == "client_accuracy" for k in got)


@pytest.mark.parametrize("load_fast", ["true", "false"], ids=["rust-data-server", "python"])
def test_tensorboard_shows_every_scalar_with_either_loader(load_fast, tracked):
    # The default loader (auto) is the Rust data server wherever tensorboard-data-server has
    # its binary, as `pip install 'fedskew[tensorboard]'` installs it; "true" makes sure this
    # test is served by it (TensorBoard fails rather than fall back). float64 tensor
    # summaries were served by the Python loader only: the run listed empty with the default.
    needs("tensorboard")
    if load_fast == "true" and data_server_binary() is None:
        pytest.skip("tensorboard-data-server has no binary for this platform")
    ids = json.loads((tracked / "tracking.json").read_text())["trackers"]["tensorboard"]
    log_dir = Path(ids["log_dir"])
    assert log_dir == tracked.parent / "tensorboard" / "r"  # tensorboard --logdir runs/tensorboard
    expected = shown("tensorboard", logged_in_folder(tracked))
    got = read_tensorboard(log_dir, expected, load_fast)
    assert got == expected
    assert_per_class_and_client_scalars(got, "tensorboard", tracked)


def test_tensorboard_shows_a_grids_runs_by_setting_and_method(tmp_path):
    # fedskew compare's layout: <grid>/tensorboard/<setting>/<method>-s<seed>, served as
    # runs named setting/method-sSEED by `tensorboard --logdir <grid>/tensorboard`.
    needs("tensorboard")
    from fedskew.runs.tracking.base import RunInfo
    from fedskew.runs.tracking.tensorboard_tracker import TensorBoardTracker

    written: dict[str, Series] = {}
    for method in ("fedavg", "prox"):
        name = f"beta0.5/{method}-s0"
        tracker = TensorBoardTracker(RunInfo(tmp_path, name, "grid", "beta0.5", method, 0, {}), {})
        values = {"accuracy": 0.1 + len(method) / 7, "bytes_up": 123456789, "loss": 1e-9}
        for step in (1, 2):
            tracker.log_round(step, values)
        tracker.close("finished")
        written[name] = shown("tensorboard", {k: [(1, v), (2, v)] for k, v in values.items()})
    with tensorboard(tmp_path / "tensorboard") as url:
        for name, expected in written.items():
            assert read_served(url, name, expected) == expected, name
        assert sorted(served_runs(url)) == sorted(written)


def test_mlflow_holds_params_tags_and_the_run_folder_as_artifacts(tracked):
    needs("mlflow")
    ids = json.loads((tracked / "tracking.json").read_text())["trackers"]["mlflow"]
    assert ids["tracking_uri"] == f"sqlite:///{tracked.parent / 'mlflow.db'}"
    client = mlflow_client(tracked.parent)
    got = client.get_run(ids["run_id"])
    assert got.info.status == "FINISHED" and got.info.run_name == "r"
    assert got.data.params["rounds"] == "3" and got.data.params["resolved.model"] == "mlp"
    assert got.data.tags["method"] == "fedavg" and got.data.tags["seed"] == "2"
    assert client.get_experiment(got.info.experiment_id).name == "fedskew"
    stored = {a.path for a in client.list_artifacts(ids["run_id"])}
    assert {"summary.json", "config.json", "metrics.jsonl", "report"} <= stored
    assert {a.path for a in client.list_artifacts(ids["run_id"], "report")} >= {
        "report/report.md", "report/report.html"}  # fmt: skip
    local = client.download_artifacts(ids["run_id"], "summary.json", str(tracked.parent))
    assert json.loads(Path(local).read_text()) == json.loads((tracked / "summary.json").read_text())
    assert (tracked.parent / "mlartifacts").is_dir()


def test_wandb_is_offline_with_config_and_summary(tracked):
    needs("wandb")
    ids = json.loads((tracked / "tracking.json").read_text())["trackers"]["wandb"]
    [folder] = (tracked.parent / "wandb").glob(f"offline-run-*-{ids['id']}")
    records = wandb_records(folder)
    [start] = [r["run"] for r in records if r["type"] == "run"]
    assert start["project"] == "fedskew" and start["job_type"] == "fedavg"
    assert start["config"]["update"]["rounds"] == 3
    summary = json.loads((tracked / "summary.json").read_text())
    updates = {}
    for r in records:
        if r["type"] == "summary":
            updates.update(r["summary"].get("update", {}))
    assert updates["final_accuracy"] == summary["final_accuracy"]
    assert (folder / "files" / "summary.json").read_text() == (tracked / "summary.json").read_text()
    assert (folder / "files" / "report" / "report.html").is_file()


def test_a_missing_package_is_one_line_before_any_work(tmp_path, monkeypatch, capsys):
    # As where MLflow is not installed: importing it, or any part of it, fails.
    for module in [m for m in sys.modules if m == "mlflow" or m.startswith("mlflow.")]:
        monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.setitem(sys.modules, "mlflow", None)
    monkeypatch.delitem(sys.modules, "fedskew.runs.tracking.mlflow_tracker", raising=False)
    out = tmp_path / "runs"
    assert main(["run", "-r", "1", "-n", "4", "-o", str(out), "--track", "mlflow"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'fedskew[mlflow]'" in err[0], err
    assert "Traceback" not in err[0]
    assert not out.exists() or not any(out.iterdir())  # no run folder
    assert main(["compare", "--methods", "fedavg", "-r", "1", "-n", "4",
                 "-o", str(tmp_path / "grid"), "--track", "mlflow"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'fedskew[mlflow]'" in err[0], err
    assert main(["run", "--track", "neptune"]) == 2
    assert "unknown tracker 'neptune'" in capsys.readouterr().err


def test_a_tracker_failing_mid_run_warns_once_and_changes_nothing(tmp_path, caplog, untracked):
    needs("mlflow")

    def delete_the_mlflow_run(record):
        # As if someone deleted the run in the MLflow UI: logging to it now fails.
        if record["round"] == 1:
            ids = json.loads((folder_path / "tracking.json").read_text())["trackers"]["mlflow"]
            mlflow_client(tmp_path).delete_run(ids["run_id"])

    folder_path = tmp_path / "r.incomplete"
    cfg = ExperimentConfig(out_dir=str(tmp_path), name="r", track=["mlflow"], **TINY)
    with caplog.at_level(logging.WARNING, logger="fedskew"):
        folder = run_with_clients(cfg, on_round=delete_the_mlflow_run)
    warnings = [r for r in caplog.records if "tracking with mlflow stopped" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert (folder / "summary.json").is_file()
    assert without_timing(metrics(folder)) == without_timing(metrics(untracked))
    state = json.loads((folder / "tracking.json").read_text())["trackers"]["mlflow"]
    assert state["logged_through"] == 1


class Killed(Exception):
    pass


@pytest.mark.parametrize("added_on_resume", [False, True], ids=["same", "one-added"])
def test_resume_continues_the_same_tracker_runs_without_repeating_a_round(
    tmp_path, added_on_resume
):
    if not INSTALLED:
        pytest.skip("no tracker package installed")

    def kill_after_round_2(record):
        if record["round"] == 2:
            raise Killed

    # All trackers in both processes; or the first tracker only from the resume on, when it
    # gets rounds 1-2 from metrics.jsonl.
    first = INSTALLED[1:] if added_on_resume and len(INSTALLED) > 1 else INSTALLED
    cfg = ExperimentConfig(out_dir=str(tmp_path), name="r", track=first, **TINY)
    with pytest.raises(Killed):
        run(cfg, on_round=kill_after_round_2)
    unfinished = tmp_path / "r.incomplete"
    before = json.loads((unfinished / "tracking.json").read_text())["trackers"]
    assert {n: s["logged_through"] for n, s in before.items()} == dict.fromkeys(first, 2)
    track = [a for n in INSTALLED for a in ("--track", n)]
    assert main(["run", "--resume", str(unfinished), "-q", *track]) == 0
    folder = tmp_path / "r"
    after = json.loads((folder / "tracking.json").read_text())["trackers"]
    for name in first:  # the same tracker runs as before the kill
        assert {k: v for k, v in after[name].items() if k != "logged_through"} == {
            k: v for k, v in before[name].items() if k != "logged_through"}  # fmt: skip
    expected = logged_in_folder(folder)
    for name in INSTALLED:
        got = read_back(name, folder)
        assert {k: [s for s, _ in v] for k, v in got.items()} == {
            k: [1, 2, 3] for k in expected}, name  # fmt: skip
        assert got == shown(name, expected), name
    if "mlflow" in INSTALLED:
        client = mlflow_client(tmp_path)
        experiment = client.get_experiment_by_name("fedskew")
        assert len(client.search_runs([experiment.experiment_id])) == 1
        assert client.get_run(after["mlflow"]["run_id"]).info.status == "FINISHED"


GRID = """
[compare]
out_dir = "{out}"
seeds = [0]
jobs = 2
threads = 1
track = ["mlflow"]

[experiment]
num_clients = 4
clients_per_round = 2
rounds = 2
local_epochs = 1

[methods.fedavg]

[methods.prox]
algorithm = "fedprox"
params = {{ mu = 0.1 }}

[axes]
"partition_params.beta" = [0.5]
"""


def test_compare_groups_its_runs_by_grid_setting_and_method(tmp_path):
    needs("mlflow")
    out = tmp_path / "mygrid"
    file = tmp_path / "grid.toml"
    file.write_text(GRID.format(out=out))
    assert main(["compare", "-c", str(file)]) == 0
    client = mlflow_client(out)
    experiment = client.get_experiment_by_name("mygrid")
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    assert set(runs) == {"beta0.5/fedavg-s0", "beta0.5/prox-s0"}
    for name, got in runs.items():
        assert got.data.tags["setting"] == "beta0.5"
        assert got.data.tags["method"] == name.split("/")[1][: -len("-s0")]
        assert got.data.tags["seed"] == "0" and got.info.status == "FINISHED"
        assert read_mlflow(out, got.info.run_id) == logged_in_folder(out / name)
    grid = compare.grid_from(compare.read_file(file), str(file), {}, None, {})
    assert all(r.cfg.track == ["mlflow"] for r in compare.plan(grid))


def test_per_class_entries_and_client_statistics_are_scalars():
    record = {
        "round": 4, "clients": [0, 2], "accuracy": 0.5, "fm_active": True,
        "per_class_accuracy": [0.25, None, 1.0],
        "client_accuracy": [0.5, None, 0.75], "client_accuracy_mean": 0.625,
        "client_accuracy_std": 0.125, "client_accuracy_worst10": 0.5,
        "client_accuracy_gap": 0.25, "client_personal_accuracy_mean": 0.7,
    }  # fmt: skip
    assert scalars(record) == {
        "accuracy": 0.5, "per_class_accuracy/0": 0.25, "per_class_accuracy/2": 1.0,
        "client_accuracy_mean": 0.625, "client_accuracy_std": 0.125,
        "client_accuracy_worst10": 0.5, "client_accuracy_gap": 0.25,
        "client_personal_accuracy_mean": 0.7,
    }  # fmt: skip


@pytest.mark.parametrize(
    "name, key, value",
    [
        ("tensorboard", "log_dir", "{elsewhere}/tb"),
        ("mlflow", "tracking_uri", "sqlite:///{elsewhere}/mlflow.db"),
    ],
)
def test_a_tracking_record_naming_a_place_outside_the_run_is_refused(
    tmp_path, capsys, name, key, value
):
    # tracking.json is a file of the run folder: before, a resume wrote where it said.
    needs(name)
    cfg = ExperimentConfig(out_dir=str(tmp_path / "runs"), name="r", track=[name], **TINY)
    with pytest.raises(Killed):
        run(cfg, on_round=lambda record: record["round"] == 2 and _raise(Killed))
    unfinished = tmp_path / "runs" / "r.incomplete"
    state = json.loads((unfinished / "tracking.json").read_text())
    elsewhere = tmp_path / "elsewhere"
    state["trackers"][name][key] = value.format(elsewhere=elsewhere)
    (unfinished / "tracking.json").write_text(json.dumps(state))
    processes = (unfinished / "processes.jsonl").read_text()
    capsys.readouterr()
    assert main(["run", "--resume", str(unfinished), "-q", "--track", name]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tracking.json: its " + name in err, err
    assert not elsewhere.exists()
    assert (unfinished / "processes.jsonl").read_text() == processes  # refused before it ran


def test_a_tracking_record_naming_a_run_that_is_no_id_is_refused(tmp_path):
    needs("wandb")
    from fedskew.runs.tracking.base import RunInfo
    from fedskew.runs.tracking.wandb_tracker import WandbTracker

    run_info = RunInfo(tmp_path, "r", "fedskew", "", "fedavg", 0, {})
    assert WandbTracker.saved_problem({"id": "0a1b2c3d4e5f"}, run_info, tmp_path) is None
    for bad in ("../../x", "a/b", "", 7, None):
        assert "is not a run id" in WandbTracker.saved_problem({"id": bad}, run_info, tmp_path)


def _raise(exc: type[Exception]) -> None:
    raise exc
