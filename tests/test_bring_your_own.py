"""User code without editing fedskew: module:Name references, entry points, the Python API,
the examples/ folder, partitions from other tools, and what run folders record."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import fedskew
from fedskew.algorithms import get_algorithm
from fedskew.apps.cli import main
from fedskew.data.partition import load_partition

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
FEDSKEW = str(Path(sys.executable).with_name("fedskew"))
TINY = {"num_clients": 4, "clients_per_round": 2, "rounds": 2, "local_epochs": 1, "quiet": True}
TIMING = ("seconds", "eval_seconds")


def lines(folder: Path) -> list[dict]:
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


@pytest.fixture()
def examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))


def test_external_algorithm_from_the_command_line_in_its_folder(tmp_path):
    out = tmp_path / "out"
    cmd = [FEDSKEW, "run", "-a", "fedavgm:FedAvgM", "-p", "beta=0.5", "-r", "2", "-n", "4",
           "--clients-per-round", "2", "-e", "1", "-q", "-o", str(out), "--name", "m"]  # fmt: skip
    done = subprocess.run(cmd, cwd=EXAMPLES, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "m" / "summary.json").read_text())
    assert summary["algorithm"] == "fedavgm" and summary["final_accuracy"] is not None


def test_fedavgm_with_zero_momentum_is_fedavg(tmp_path, examples_on_path):
    from fedavgm import FedAvgM

    plain = fedskew.run({**TINY, "out_dir": str(tmp_path), "name": "a"}, algorithm="fedavg")
    mom0 = fedskew.run(
        {**TINY, "out_dir": str(tmp_path), "name": "b", "params": {"beta": 0.0}},
        algorithm=FedAvgM,
    )
    a, b = lines(plain.folder), lines(mom0.folder)
    for x, y in zip(a, b, strict=True):
        assert x["clients"] == y["clients"]
        assert x["accuracy"] == pytest.approx(y["accuracy"], abs=1e-9)
        assert x["train_loss"] == pytest.approx(y["train_loss"], rel=1e-6)
    # Importable by name: the config records the reference, so resume and workers find it.
    saved = json.loads((mom0.folder / "config.json").read_text())
    assert saved["algorithm"] == "fedavgm:FedAvgM"


def test_momentum_changes_the_model(tmp_path, examples_on_path):
    from fedavgm import FedAvgM

    runs = [
        fedskew.run(
            {**TINY, "rounds": 3, "out_dir": str(tmp_path), "name": f"m{b}", "params": {"beta": b}},
            algorithm=FedAvgM,
        )  # fmt: skip
        for b in (0.0, 0.9)
    ]
    assert lines(runs[0].folder)[0]["accuracy"] == lines(runs[1].folder)[0]["accuracy"]
    assert lines(runs[0].folder)[-1]["loss"] != lines(runs[1].folder)[-1]["loss"]


def test_custom_dataset_through_the_api_and_by_reference(tmp_path, examples_on_path):
    from breast_cancer_dataset import load

    via_object = fedskew.run({**TINY, "out_dir": str(tmp_path), "name": "o"}, dataset=load)
    via_name = fedskew.run(
        {**TINY, "out_dir": str(tmp_path), "name": "n"}, dataset="breast_cancer_dataset:load"
    )
    assert lines(via_object.folder) == lines(via_name.folder)
    resolved = json.loads((via_name.folder / "config.json").read_text())["resolved"]
    assert resolved["model"] == "mlp" and resolved["num_classes"] == 2
    assert "breast_cancer" in resolved["dataset_source"]


def test_objects_defined_in_a_function_run_in_process_only(tmp_path):
    from fedskew.algorithms.fedavg import FedAvg

    class Local(FedAvg):
        name = "local-fedavg"

    result = fedskew.run({**TINY, "out_dir": str(tmp_path), "workers": 2}, algorithm=Local)
    assert result.summary["algorithm"] == "local-fedavg"
    processes = result.summary["processes"]
    assert processes[0]["workers"] == 0  # spawned workers could not import it
    with pytest.raises(fedskew.core.errors.UsageError, match="cannot be imported by name"):
        fedskew.run({**TINY, "out_dir": str(tmp_path), "engine": "flower-sim"}, algorithm=Local)


def test_entry_points_are_found(tmp_path, monkeypatch):
    dist = tmp_path / "myplug-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: myplug\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[fedskew.algorithms]\nplugged = fedskew.algorithms.fedprox:FedProx\n"
        "[fedskew.models]\nplugged-mlp = fedskew.models.cnn:build_mlp\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert get_algorithm("plugged").name == "fedprox"
    assert main(["run", "-a", "plugged", "-m", "plugged-mlp", "-o", str(tmp_path / "o"),
                 "-r", "1", "-n", "4", "--clients-per-round", "2", "-q"]) == 0  # fmt: skip


@pytest.mark.parametrize(
    "args, needle",
    [
        (["-a", "no_such_module_xyz:Alg"], "no module no_such_module_xyz in the working folder"),
        (["-a", "fedskew.config:ExperimentConfig"], "not a subclass"),
        (["-a", "fedskew.algorithms.fedavg:Nope"], "has no Nope"),
        (["-m", "fedskew.config:FINITE"], "not a model builder"),
        (["-d", "fedskew.config:parse_scalar"], "dataset"),
        (["-d", "json:loads"], "dataset"),
    ],
)
def test_bad_references_give_one_line(tmp_path, capsys, args, needle):
    code = main(["run", "-o", str(tmp_path), "-r", "1", "-q", *args])
    err = capsys.readouterr().err
    assert code in (1, 2) and err.count("\n") == 1 and needle in err, err


def test_a_module_outside_the_working_folder_gets_a_hint(tmp_path, monkeypatch, capsys):
    # As a researcher's own method kept in a folder of its own, fedskew started one above.
    (tmp_path / "methods").mkdir()
    (tmp_path / "methods" / "fedadam.py").write_text((EXAMPLES / "fedavgm.py").read_text())
    monkeypatch.chdir(tmp_path)
    args = ["run", "-o", str(tmp_path / "out"), "-r", "1", "-n", "4", "--clients-per-round", "2",
            "-e", "1", "-q"]  # fmt: skip
    assert main([*args, "-a", "fedadam:FedAvgM"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"no module fedadam in the working folder ({tmp_path})" in err
    assert "PYTHONPATH" in err and "(methods/fedadam.py is here: PYTHONPATH=methods)" in err
    # A file path names the module and folder to use instead.
    assert main([*args, "-a", "methods/fedadam.py:FedAvgM"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "give the module (fedadam:FedAvgM)" in err, err
    assert "PYTHONPATH=methods" in err
    # A module that is found but imports a missing one says so, not "no module".
    (tmp_path / "needs_more.py").write_text("import no_such_dependency_xyz\n")
    assert main([*args, "-a", "needs_more:Alg"]) == 2
    err = capsys.readouterr().err
    assert "importing needs_more failed" in err and "no_such_dependency_xyz" in err, err
    assert "working folder" not in err
    # Doing what the hint says runs it.
    monkeypatch.syspath_prepend(str(tmp_path / "methods"))  # PYTHONPATH=methods
    assert main([*args, "-a", "fedadam:FedAvgM"]) == 0


def test_run_folders_of_the_examples_are_not_committed():
    # `cd examples; fedskew run -a fedavgm:FedAvgM` (docs/extending.md) writes examples/runs/.
    root = EXAMPLES.parent
    if not (root / ".git").exists():
        pytest.skip("not a git checkout")
    for path in ("examples/runs/fedavgm-s0/summary.json", "examples/runs/x.incomplete/lock"):
        done = subprocess.run(["git", "check-ignore", "-q", path], cwd=root, timeout=60)
        assert done.returncode == 0, f"{path} is not ignored by git"
    done = subprocess.run(["git", "check-ignore", "-q", "examples/fedavgm.py"], cwd=root)
    assert done.returncode == 1  # the examples themselves are


def _partition_json(tmp_path: Path, clients: list[list[int]]) -> Path:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(clients))
    return path


def test_partition_file_gives_exactly_those_clients(tmp_path):
    rng = np.random.default_rng(0)
    order = rng.permutation(1437)  # the digits training split
    clients = [sorted(order[i::3][:200].tolist()) for i in range(3)]
    path = _partition_json(tmp_path, clients)
    assert main(["run", "--partition-file", str(path), "--clients-per-round", "2", "-r", "1",
                 "-q", "-o", str(tmp_path), "--name", "f"]) == 0  # fmt: skip
    saved, meta = load_partition(tmp_path / "f" / "partition.npz")
    assert [s.tolist() for s in saved] == clients and meta["scheme"] == "file"
    # The run's own partition.npz read back gives the same metrics: the same clients.
    assert main(["run", "--partition-file", str(tmp_path / "f" / "partition.npz"),
                 "--clients-per-round", "2", "-r", "1", "-q", "-o", str(tmp_path),
                 "--name", "g"]) == 0  # fmt: skip
    assert lines(tmp_path / "f") == lines(tmp_path / "g")


@pytest.mark.parametrize(
    "clients, extra, needle",
    [
        ([[0, 1], [1, 2]], [], "more than one client"),
        ([[0, 1], []], [], "no samples"),
        ([[0, 99999]], [], "outside"),
        ([[0, 0, 1]], [], "twice"),
        ([[0, "a"]], [], "not an integer"),
        ([[0, 1], [2, 3]], ["-n", "3"], "has 2 clients"),
    ],
)
def test_bad_partition_files_are_refused(tmp_path, capsys, clients, extra, needle):
    path = _partition_json(tmp_path, clients)
    code = main(["run", "--partition-file", str(path), "--clients-per-round", "1", "-r", "1",
                 "-q", "-o", str(tmp_path), *extra])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and needle in err and err.count("\n") == 1, err


def test_overlap_is_allowed_when_asked(tmp_path):
    path = _partition_json(tmp_path, [list(range(0, 300)), list(range(200, 500))])
    assert main(["run", "--partition-file", str(path), "--partition-overlap", "-r", "1", "-q",
                 "--clients-per-round", "2", "-o", str(tmp_path)]) == 0  # fmt: skip


def test_run_folder_records_provenance(tmp_path):
    result = fedskew.run({**TINY, "out_dir": str(tmp_path)})
    process = result.summary["processes"][0]
    for key in ("fedskew", "git_commit", "git_dirty", "numpy", "torch", "device", "data_source",
                "cpu", "python"):  # fmt: skip
        assert key in process
    assert process["fedskew"] == fedskew.__version__ and process["device"] == "cpu"
    assert process["data_source"] == "scikit-learn (load_digits)"


def test_fedskew_run_runs_the_engine_the_configuration_names(tmp_path, monkeypatch):
    """fedskew.run(engine="flower-sim") goes to Flower's simulation as `fedskew run --engine
    flower-sim` does (it once ran in-process and recorded flower-sim); engine "flower", a
    deployment's, is refused in one line. The simulation itself is tests/test_flower.py's
    (slow); here its entry point is replaced to see which one is called, and with what."""
    pytest.importorskip("flwr")
    import fedskew.apps.flower as flower_app
    from fedskew.core.errors import UsageError

    called = []

    def simulation(cfg, on_round=None, on_start=None, resume=None):
        called.append((cfg.engine, cfg.rounds, resume))
        return tmp_path / "sim", {"rounds": cfg.rounds}

    monkeypatch.setattr(flower_app, "run_simulation", simulation)
    result = fedskew.run(engine="flower-sim", out_dir=str(tmp_path), **TINY)
    assert called == [("flower-sim", 2, None)] and result.summary == {"rounds": 2}
    with pytest.raises(UsageError, match="engine 'flower' is a deployment's"):
        fedskew.run(engine="flower", out_dir=str(tmp_path), **TINY)
    assert not list(tmp_path.glob("*/metrics.jsonl"))  # nothing ran in-process
