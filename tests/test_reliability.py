"""Reliability: resume reconciles the checkpoint with the metrics, corrupt or foreign files
give one line, bad values are refused, divergence stops (or is dropped) by name, Ctrl-C
says how to continue."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest

from fedskew.apps.cli import main
from fedskew.config import ExperimentConfig
from fedskew.core.errors import FedskewError
from fedskew.runs.checkpoint import read_checkpoint, save_checkpoint
from fedskew.runs.loop import RunInterrupted, run

SMALL = dict(num_clients=4, clients_per_round=2, rounds=3, local_epochs=1, quiet=True, seed=1)
TIMING = ("seconds", "eval_seconds")


def lines(folder: Path) -> list[dict]:
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def stop_after(n: int):
    def hook(record):
        if record["round"] == n:
            raise KeyboardInterrupt

    return hook


def unfinished(tmp: Path, rounds_done: int = 2, **kw) -> Path:
    cfg = ExperimentConfig(out_dir=str(tmp), name="r", **{**SMALL, **kw})
    with pytest.raises(RunInterrupted) as info:
        run(cfg, on_round=stop_after(rounds_done))
    folder = tmp / "r.incomplete"
    assert info.value.folder == folder
    assert f"fedskew run --resume {folder}" in str(info.value)
    return folder


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ref")
    folder, _ = run(ExperimentConfig(out_dir=str(out), name="r", **SMALL))
    return lines(folder)


def resume_cli(folder: Path, capsys) -> tuple[int, str]:
    code = main(["run", "--resume", str(folder), "-q"])
    err = capsys.readouterr().err
    return code, err


def test_kill_between_checkpoint_and_metrics_line_loses_nothing(tmp_path, reference, capsys):
    folder = unfinished(tmp_path)
    metrics = folder / "metrics.jsonl"
    first = metrics.read_text().splitlines()[0]
    metrics.write_text(first + "\n")  # round 2's line never written; its checkpoint was
    assert read_checkpoint(folder / "checkpoint.npz").round == 2
    assert resume_cli(folder, capsys)[0] == 0
    assert lines(tmp_path / "r") == reference


def test_half_written_last_line_is_dropped_and_rerun(tmp_path, reference, capsys):
    folder = unfinished(tmp_path)
    with open(folder / "metrics.jsonl", "a") as fh:
        fh.write('{"round": 3, "clients": [0')  # a kill in the middle of round 3's line
    assert resume_cli(folder, capsys)[0] == 0
    assert lines(tmp_path / "r") == reference


@pytest.mark.parametrize("damage", ["deleted", "garbage", "wrong round"])
def test_metrics_that_cannot_be_reconciled_stop_the_resume(tmp_path, capsys, damage):
    folder = unfinished(tmp_path)
    metrics = folder / "metrics.jsonl"
    if damage == "deleted":
        metrics.unlink()
    elif damage == "garbage":
        metrics.write_bytes(b"\x00\xffnot json\n{}\n")
    else:
        metrics.write_text(json.dumps({"round": 5}) + "\n")
    code, err = resume_cli(folder, capsys)
    assert code == 1 and err.count("\n") == 1 and "metrics" in err
    assert not (tmp_path / "r").exists()


def _corrupt(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "empty":
        path.write_bytes(b"")
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "bitflip":
        middle = len(data) // 2
        path.write_bytes(data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :])
    else:
        path.write_bytes(b"PK\x03\x04" + b"\x00" * 40)


@pytest.mark.parametrize("how", ["empty", "truncated", "bitflip", "foreign"])
@pytest.mark.parametrize("name", ["checkpoint.npz", "partition.npz"])
def test_corrupt_files_of_a_run_give_one_line(tmp_path, capsys, name, how):
    folder = unfinished(tmp_path)
    _corrupt(folder / name, how)
    code, err = resume_cli(folder, capsys)
    assert code != 0
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert name in err or "partition" in err


@pytest.mark.parametrize("content", [b"not json", b"[1, 2]", b"\xff\xfe\x00"])
def test_corrupt_config_json_gives_one_line(tmp_path, capsys, content):
    folder = unfinished(tmp_path)
    (folder / "config.json").write_bytes(content)
    code, err = resume_cli(folder, capsys)
    assert code != 0 and err.count("\n") == 1 and "config.json" in err


def test_checkpoint_of_another_algorithm_is_refused(tmp_path, capsys):
    mine = unfinished(tmp_path / "a")
    other = unfinished(tmp_path / "b", algorithm="scaffold")
    shutil.copy(other / "checkpoint.npz", mine / "checkpoint.npz")
    code, err = resume_cli(mine, capsys)
    assert code == 1 and "scaffold" in err and "fedavg" in err


@pytest.mark.parametrize("problem", ["round", "nan", "shape", "config"])
def test_checkpoints_that_do_not_fit_the_run_are_refused(tmp_path, capsys, problem):
    import torch

    from fedskew.algorithms.fedavg import FedAvg
    from fedskew.assembly.prepare import new_model, prepare
    from fedskew.config import build_config, config_hash, normalise_keys
    from fedskew.runs.loop import server_setup

    folder = unfinished(tmp_path)
    saved = json.loads((folder / "config.json").read_text())
    saved.pop("resolved")
    cfg = build_config(normalise_keys(saved, "test"), {})
    prep = prepare(cfg)
    server = FedAvg.Server(FedAvg.make_params({}), server_setup(prep, new_model(prep)))
    rnd, digest = 2, config_hash(cfg)
    name = next(iter(server.global_arrays))
    if problem == "round":
        rnd = 99
    elif problem == "nan":
        server.global_arrays[name] = torch.full_like(server.global_arrays[name], float("nan"))
    elif problem == "shape":
        server.global_arrays[name] = torch.zeros(3)
    else:
        digest = "0" * 16
    save_checkpoint(folder / "checkpoint.npz", rnd, server, {}, algorithm="fedavg",
                    config_hash=digest)  # fmt: skip
    code, err = resume_cli(folder, capsys)
    assert code == 1 and err.count("\n") == 1 and "checkpoint.npz" in err, err


@pytest.mark.parametrize(
    "args",
    [
        ["--lr", "nan"],
        ["--lr", "inf"],
        ["--weight-decay", "nan"],
        ["--grad-clip", "nan"],
        ["--momentum", "nan"],
        ["--name", "../x"],
        ["--name", "a/b"],
        ["--name", ".."],
    ],
)
def test_bad_values_are_refused_before_anything_runs(tmp_path, capsys, args):
    code = main(["run", "-o", str(tmp_path / "out"), "-q", *args])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "x").exists() and not (tmp_path / "out" / "a").exists()


@pytest.mark.parametrize(
    "text", ["rounds: true\n", "lr: .nan\n", "seed: false\n", "name: 5\n", "workers: true\n"]
)
def test_yaml_values_of_the_wrong_kind_are_refused(tmp_path, capsys, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert main(["run", "-c", str(path), "-o", str(tmp_path), "-q"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_config_file_that_is_not_utf8(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_bytes(b"rounds = 2\n\xff\xfe")
    assert main(["run", "-c", str(path), "-o", str(tmp_path), "-q"]) == 2
    assert "UTF-8" in capsys.readouterr().err


def test_divergence_stops_the_run_naming_round_and_client(tmp_path, capsys):
    args = ["run", "-o", str(tmp_path), "--name", "d", "-q", "--lr", "1e30", "-n", "4",
            "--clients-per-round", "2", "-r", "3", "-e", "1"]  # fmt: skip
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "round 1: client" in err and "diverged" in err
    folder = tmp_path / "d.incomplete"
    assert not (folder / "checkpoint.npz").exists()  # nothing non-finite was checkpointed
    assert not (folder / "metrics.jsonl").exists()


def test_divergence_drop_leaves_the_replies_out(tmp_path):
    cfg = ExperimentConfig(out_dir=str(tmp_path), name="d", lr=1e30, on_divergence="drop",
                           **SMALL)  # fmt: skip
    # Every reply diverged, so every round was skipped: the run trained nothing and fails
    # (issue 50: it used to finish with the initial model), its rows kept in the folder.
    with pytest.raises(FedskewError, match=r"every round \(3\) was skipped"):
        run(cfg)
    rows = lines(tmp_path / "d.incomplete")
    assert [r["skipped"] for r in rows] == [1.0] * 3
    assert all(sorted(r["diverged_replies"]) == sorted(r["clients"]) for r in rows)
    assert all(r["samples"] == 0 for r in rows)


def test_interrupt_from_the_command_line_names_the_folder(tmp_path, capsys, monkeypatch):
    import fedskew.runs.loop as experiment

    real = experiment.keep_round

    def keep_then_interrupt(state, rnd, record):
        real(state, rnd, record)
        raise KeyboardInterrupt

    monkeypatch.setattr(experiment, "keep_round", keep_then_interrupt)
    assert main(["run", "-o", str(tmp_path), "--name", "i", "-q", "-r", "3"]) == 130
    err = capsys.readouterr().err
    assert f"fedskew run --resume {tmp_path / 'i.incomplete'}" in err


def _fifo_in_place_of(path: Path) -> threading.Thread:
    """A FIFO where ``path`` was. A writer thread waits on it, so a reader that wrongly
    opens it sees end-of-file and fails the test instead of blocking it for ever."""
    path.unlink(missing_ok=True)
    os.mkfifo(path)

    def writer() -> None:
        with open(path, "wb"):
            pass

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    return thread


def _release(path: Path, thread: threading.Thread) -> None:
    if thread.is_alive():  # nobody opened it: let the writer go
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        thread.join(5)
        os.close(fd)


@pytest.mark.parametrize("name", ["checkpoint.npz", "partition.npz", "metrics.jsonl"])
def test_a_fifo_where_a_run_file_belongs_is_refused_not_waited_on(tmp_path, capsys, name):
    folder = unfinished(tmp_path)
    thread = _fifo_in_place_of(folder / name)
    try:
        code, err = resume_cli(folder, capsys)
    finally:
        _release(folder / name, thread)
    assert code != 0 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "is not a regular file" in err and name in err


def test_a_fifo_given_as_partition_file_is_refused(tmp_path, capsys):
    fifo = tmp_path / "clients.json"
    thread = _fifo_in_place_of(fifo)
    try:
        code = main(["run", "--partition-file", str(fifo), "-n", "4", "-r", "1", "-q",
                     "-o", str(tmp_path / "out")])  # fmt: skip
    finally:
        _release(fifo, thread)
    err = capsys.readouterr().err
    assert code != 0 and err.count("\n") == 1 and "is not a regular file" in err, err


@pytest.mark.parametrize(
    "text,needle",
    [
        ("rounds = 1e3\n", "rounds must be an integer"),
        ('out_dir = ["a", "b"]\n', "out-dir expects text"),
        ("name = 3\n", "name expects text"),
        ('name = "r.incomplete"\n', "ends in .incomplete"),
        ('data_dir = "no-such-folder"\nrounds = 1\n', "no such folder"),
    ],
)
def test_values_of_the_wrong_kind_are_refused_from_any_source(
    tmp_path, capsys, monkeypatch, text, needle
):
    """A float where an integer belongs, a list where a path belongs, a name that would pass
    for an unfinished folder, a data folder that is not there: refused from a file and
    through the Python API alike, before any run folder is made."""
    import tomllib

    import fedskew
    from fedskew.core.errors import UsageError

    monkeypatch.chdir(tmp_path)
    path = tmp_path / "f.toml"
    path.write_text(text)
    assert main(["run", "-c", str(path), "-q"]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err
    with pytest.raises(UsageError, match=needle.split()[0]):
        fedskew.run(**tomllib.loads(text), quiet=True)
    assert not list(tmp_path.rglob("config.json"))


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["run", "--rounds", "abc", "-r", "1"], "rounds"),
        (["run", "--lr", "x", "--lr", "0.1", "-r", "1"], "lr"),
        (["run", "--workers", "many", "--workers", "0", "-r", "1"], "workers"),
        (["partition", "--seed", "x", "--seed", "0"], "seed"),
    ],
)
def test_a_bad_value_overridden_by_a_later_one_is_still_refused(tmp_path, capsys, argv, needle):
    assert main([*argv, "-o", str(tmp_path)] if argv[0] == "run" else argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fedskew: error:") and needle in err, err
    assert not list(tmp_path.iterdir())


def test_a_global_model_whose_dtype_drifts_stops_before_its_checkpoint(
    tmp_path, capsys, reference, monkeypatch
):
    """A user algorithm whose clients reply in float64 would turn the global model float64
    and every later checkpoint unresumable: the round stops instead, its last good
    checkpoint kept, and the resume ends like an uninterrupted run."""
    from fedskew.algorithms.fedavg import FedAvgServer

    played = FedAvgServer.round

    def float64_in_round_2(self, rnd, clients, channel):
        metrics = played(self, rnd, clients, channel)
        if rnd == 1:
            self.global_arrays = {k: v.double() for k, v in self.global_arrays.items()}
        return metrics

    monkeypatch.setattr(FedAvgServer, "round", float64_in_round_2)
    cfg = ExperimentConfig(out_dir=str(tmp_path), name="r", **SMALL)
    assert main(["run", "-c", _config_file(tmp_path, cfg), "-q"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "round 2" in err and "float64" in err, err
    monkeypatch.setattr(FedAvgServer, "round", played)
    code, _ = resume_cli(tmp_path / "r.incomplete", capsys)
    assert code == 0 and lines(tmp_path / "r") == reference


def _config_file(tmp_path: Path, cfg: ExperimentConfig) -> str:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({k: v for k, v in cfg.to_dict().items() if v is not None}))
    return str(path)


def test_memory_exhaustion_is_one_line_with_what_was_asked(tmp_path, capsys):
    # A 10^7-wide MLP asks for ~4e14 bytes: the allocator refuses it at once (no swapping).
    args = ["run", "--rounds", "1", "-m", "mlp", "--model-option", "hidden=10000000",
            "--quiet", "-o", str(tmp_path)]  # fmt: skip
    assert main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("fedskew: error: out of host memory: an allocation of ")
    assert "GiB available of" in err[0] and "Traceback" not in err[0]


def test_a_model_larger_than_the_memory_left_is_refused_before_it_is_built(
    tmp_path, capsys, monkeypatch
):
    """A 25 GB model on a 24 GiB host: the kernel let its allocation through and the OOM
    killer ended the run (exit -9, no line, issue 50's replay); the host's memory is shrunk
    here so that the same check meets a small model. Refused before its weights exist."""
    import fedskew.assembly.prepare as prepare

    monkeypatch.setattr(prepare, "available_memory_bytes", lambda: 3 * 2**20, raising=False)
    args = ["run", "--rounds", "1", "-m", "mlp", "--model-option", "hidden=1000", "--quiet",
            "-o", str(tmp_path)]  # fmt: skip
    assert main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(
        "fedskew: error: out of host memory: an allocation of 4.1 MiB for "
        "model mlp's weights cannot be met (3.0 MiB available of "
    )
    assert not list(tmp_path.iterdir())  # refused before a run folder was made
    monkeypatch.setattr(prepare, "available_memory_bytes", lambda: None)  # unknown: no check
    assert main([*args[:-2], "-o", str(tmp_path / "unknown")]) == 0


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (MemoryError("Unable to allocate 25.0 GiB for an array with shape (1,)"), "of 25.0 GiB"),
        (
            RuntimeError(
                "DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                "2147483648 bytes. Error code 12"
            ),
            "of 2.00 GiB",
        ),  # fmt: skip
        (MemoryError(), "out of host memory: an allocation failed"),
    ],
)
def test_every_kind_of_memory_error_reads_as_one_line(monkeypatch, capsys, exc, expected):
    def fail(_args: object) -> int:
        raise exc

    import fedskew.apps.cli as cli

    monkeypatch.setattr(cli, "cmd_list", fail)
    assert main(["list"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err


@pytest.mark.parametrize("command", ["run", "compare"])
def test_a_huge_configuration_file_is_refused_before_it_is_read(tmp_path, capsys, command):
    path = tmp_path / "big.toml"
    with path.open("w") as fh:  # 17 MiB: a value no configuration needs
        fh.write('name = "')
        fh.write("x" * (17 * 2**20))
        fh.write('"\n')
    assert main([command, "-c", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is 17.0 MiB; at most 16 MiB is read" in err[0], err
