"""The command line end to end: runs, run folders, determinism and error paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedskew.apps.cli import main

FAST = ["--rounds", "3", "--local-epochs", "1", "--quiet"]


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    return subprocess.run(
        [sys.executable, "-m", "fedskew", *args], capture_output=True, text=True, cwd=cwd, env=env
    )


def read_metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_default_run_writes_a_complete_run_folder(tmp_path):
    assert main(["run", "-o", str(tmp_path), "--name", "r", *FAST]) == 0
    folder = tmp_path / "r"
    assert sorted(p.name for p in folder.iterdir()) == [
        "checkpoint.npz",
        "config.json",
        "metrics.jsonl",
        "partition.npz",
        "processes.jsonl",
        "summary.json",
    ]
    config = json.loads((folder / "config.json").read_text())
    assert config["algorithm"] == "fedavg" and config["dataset"] == "digits"
    assert config["resolved"]["clients_per_round"] == 8
    rows = read_metrics(folder)
    assert [r["round"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert len(r["clients"]) == 8
        assert r["bytes_down"] > 0 and r["bytes_up"] > r["bytes_down"]  # up adds scalars
        assert 0 <= r["accuracy"] <= 1 and len(r["per_class_accuracy"]) == 10
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["final_accuracy"] == rows[-1]["accuracy"]
    assert not list(tmp_path.glob("*.incomplete"))


def test_same_config_and_seed_give_identical_metrics(tmp_path):
    keys = ("accuracy", "loss", "clients", "bytes_down", "bytes_up", "per_class_accuracy")
    for name in ("a", "b"):
        main(["run", "-o", str(tmp_path), "--name", name, "--seed", "4", *FAST])
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [{k: r[k] for k in keys} for r in a] == [{k: r[k] for k in keys} for r in b]
    main(["run", "-o", str(tmp_path), "--name", "c", "--seed", "5", *FAST])
    c = read_metrics(tmp_path / "c")
    assert [r["clients"] for r in a] != [r["clients"] for r in c]


def test_config_file_with_options_overriding(tmp_path):
    toml = tmp_path / "exp.toml"
    toml.write_text(
        "rounds = 2\nnum_clients = 10\nlocal_epochs = 1\nclients_per_round = 5\nquiet = true\n"
        "[partition_params]\nbeta = 0.3\n"
    )
    assert main(["run", "-c", str(toml), "-o", str(tmp_path), "--name", "t", "--rounds", "1"]) == 0
    cfg = json.loads((tmp_path / "t" / "config.json").read_text())
    assert cfg["rounds"] == 1 and cfg["num_clients"] == 10
    assert cfg["partition_params"] == {"beta": 0.3}
    yaml_file = tmp_path / "exp.yaml"
    yaml_file.write_text("rounds: 1\nparticipation: 0.5\nquiet: true\nlocal_epochs: 1\n")
    assert main(["run", "-c", str(yaml_file), "-o", str(tmp_path), "--name", "y"]) == 0
    cfg = json.loads((tmp_path / "y" / "config.json").read_text())
    assert cfg["resolved"]["clients_per_round"] == 10


@pytest.mark.parametrize(
    "args, needle",
    [
        (["run", "--algorithm", "nope"], "unknown algorithm 'nope'"),
        (["run", "--dataset", "nope"], "unknown dataset 'nope'"),
        (["run", "--model", "nope"], "unknown model 'nope'"),
        (["run", "--partition", "nope"], "unknown partition 'nope'"),
        (["run", "--beta", "0"], "beta"),
        (["run", "--beta", "-1"], "beta"),
        (["run", "--participation", "1.5"], "participation"),
        (["run", "--participation", "0"], "participation"),
        (["run", "--num-clients", "5000"], "client"),
        (["run", "--rounds", "0"], "rounds"),
        (["run", "--param", "mu=1"], "no parameter 'mu'"),
        (["run", "--config", "missing.toml"], "config file not found"),
        (["run", "--dataset", "mnist", "--data-dir", "empty", "--no-download"], "mnist"),
        (["partition", "--partition", "classes", "-P", "classes_per_client=11"], "classes"),
        (["run", "--rounds", "x"], "rounds expects int, got 'x'"),
    ],
)
def test_bad_input_gives_one_line_and_exit_2_or_1(tmp_path, args, needle):
    (tmp_path / "empty").mkdir()
    proc = run_cli(*args, "--quiet" if args[0] == "run" else "--seed=0", cwd=tmp_path)
    assert proc.returncode in (1, 2), proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr
    assert needle in lines[-1]
    if "usage" not in proc.stderr:
        assert len(lines) == 1, proc.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_usage_errors_exit_2(tmp_path):
    assert run_cli("run", "--algorithm", "nope", cwd=tmp_path).returncode == 2
    assert run_cli("run", "--participation", "2", cwd=tmp_path).returncode == 2


def test_unwritable_output_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    proc = run_cli("run", "-o", str(blocker / "sub"), "--quiet", cwd=tmp_path)
    assert proc.returncode != 0
    assert "cannot write to output dir" in proc.stderr and "Traceback" not in proc.stderr


def test_corrupt_data_file(tmp_path):
    data = tmp_path / "d"
    data.mkdir()
    for name in (
        "train-images-idx3-ubyte.gz",
        "train-labels-idx1-ubyte.gz",
        "t10k-images-idx3-ubyte.gz",
        "t10k-labels-idx1-ubyte.gz",
    ):
        (data / name).write_bytes(b"not a gzip file")
    proc = run_cli(
        "run", "-d", "mnist", "--data-dir", str(data), "--no-download", "--quiet", cwd=tmp_path
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_list_and_partition_commands(tmp_path, capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for word in (
        "fedavg",
        "digits",
        "fmnist",
        "cifar10",
        "simple-cnn",
        "resnet18",
        "dirichlet",
        "niid2",
        "missing",
        "quantity",
    ):
        assert word in out
    png = tmp_path / "p.png"
    assert main(["partition", "--beta", "0.1", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "dirichlet partition of digits" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_partition_prints_holders_and_largest_share_per_class(capsys):
    """Per class, the clients holding >= 1 % of it and the largest one's share, as computed
    from the printed counts."""
    assert main(["partition", "-n", "10", "--partition", "dirichlet-niidbench"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("client "))
    counts = [[int(v) for v in line.split()[1:-1]] for line in lines[start + 1 : start + 11]]
    by_class = list(zip(*counts, strict=True))
    holders = next(line for line in lines if line.startswith("  holders ")).split()[1:]
    largest = next(line for line in lines if line.startswith("  largest ")).split()[1:]
    assert [int(h) for h in holders] == [
        sum(v >= 0.01 * sum(col) and v > 0 for v in col) for col in by_class
    ]
    assert [float(x) for x in largest] == [round(max(col) / sum(col), 2) for col in by_class]


def test_partition_with_an_empty_client_is_one_line(capsys):
    assert main(["partition", "-n", "100", "--beta", "0.01", "--min-size", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "partition 'dirichlet' leaves" in err and "min_size >= 1" in err


def imported_modules(*args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """``python -m fedskew ARGS`` and the modules it imported (Python's -X importtime)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "fedskew", *args],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    names = {
        line.rsplit("|", 1)[1].strip()
        for line in done.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }
    assert "fedskew.apps.cli" in names, done.stderr[-2000:]  # importtime did report
    return done, names


def test_help_and_list_import_no_torch():
    # torch's import is about 1.5 s of CPU (2.6-2.9 s for `fedskew --help` or `list` on a
    # loaded 2-core machine before): asking for help or the names should not wait for it.
    from fedskew.apps.cli import make_parser

    [commands] = [a.choices for a in make_parser()._actions if a.dest == "command"]
    for args in (["--help"], *([name, "--help"] for name in commands), ["list"]):
        done, names = imported_modules(*args)
        assert done.returncode == 0, (args, done.stderr[-500:])
        assert "usage: fedskew" in done.stdout or args == ["list"], args
        heavy = sorted(n for n in names if n.split(".")[0] in ("torch", "torchvision", "flwr"))
        assert not heavy, (args, heavy[:5])
    assert "  fedavg " in done.stdout and "  digits " in done.stdout and "  mlp " in done.stdout


def test_list_reads_every_built_in_from_source_as_the_registries_have_it(monkeypatch):
    from fedskew.algorithms import ALGORITHMS
    from fedskew.apps import catalogue
    from fedskew.data.datasets import DATASETS
    from fedskew.models import MODELS

    registries = {
        "algorithms": {name: cls.description for name, cls in ALGORITHMS.items()},
        "datasets": {name: info.description for name, info in DATASETS.items()},
        "models": {name: info.description for name, info in MODELS.items()},
    }
    # Read without importing: a description the source does not state as a literal fails
    # here (and `fedskew list` imports the registries for it).
    assert catalogue.algorithms_from_source() == registries["algorithms"]
    assert catalogue.datasets_from_source() == registries["datasets"]
    assert catalogue.models_from_source() == registries["models"]
    # Without the source (or with a computed description) it imports them: the same text.
    monkeypatch.setattr(catalogue, "PACKAGE", Path("/nonexistent/fedskew"))
    assert catalogue.algorithms() == registries["algorithms"]
    assert catalogue.datasets() == registries["datasets"]
    assert catalogue.models() == registries["models"]
