"""Inputs made by Hypothesis for ``fedskew tune`` (issue 50): random and malformed [tune]
tables, search tables and command-line options, and damaged study folders (the SQLite
database truncated, flipped or replaced, lock files and result files garbled, trial folders
removed). The only acceptable outcomes are a clean error (exit 1 or 2, one line on stderr,
or argparse's usage error) or success, never a traceback.

The file fuzz runs no trial (``--results-only`` after the file is read and checked, so a
valid file ends at "no study"); the folder fuzz reads one small study made once. Continuing
a damaged study with trials is slow and marked so.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

optuna = pytest.importorskip("optuna")

from test_properties import FUZZ, clean_outcome, examples, fresh_folder  # noqa: E402

from fedskew.apps.cli import main  # noqa: E402

BASE: dict[str, Any] = {
    "tune": {"trials": 1, "seeds": [100], "last": 1, "pruner": "none", "sampler": "random"},
    "compare": {"seeds": [0], "threads": 1},
    "experiment": {
        "dataset": "digits",
        "num_clients": 4,
        "clients_per_round": 2,
        "rounds": 1,
        "local_epochs": 1,
        "batch_size": 64,
    },  # fmt: skip
    "methods": {"fedavg": {"search": {"lr": {"log": [0.01, 0.1]}}}},
}

ODD = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 10**12), st.floats(allow_nan=True),
    st.text(max_size=12), st.lists(st.integers(-2, 200), max_size=4),
    st.lists(st.floats(), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(),
                                                       max_size=2),
)  # fmt: skip
TUNE_KEYS = ["trials", "seeds", "last", "validation", "pruner", "pruner_warmup",
             "pruner_startup", "sampler", "sampler_seed", "batch", "storage", "study",
             "out_dir", "nope"]  # fmt: skip
OPTIONS = ["lr", "momentum", "weight_decay", "local_epochs", "batch_size", "rounds",
           "params.mu", "params.nope", "seed", "num_clients", "optimizer", "grad_clip",
           "eval_every", "x"]  # fmt: skip
KINDS = ["log", "float", "int", "choice", "uniform"]
STORAGES = ["sqlite://", "sqlite:///:memory:", "sqlite:////nonexistent/dir/x.db", "nope",
            "postgresql://u:secret@127.0.0.1:1/db", "sqlite:///study.db", "://"]  # fmt: skip


def dimension() -> st.SearchStrategy[Any]:
    numbers = st.one_of(st.integers(-5, 100), st.floats(-1e3, 1e3), st.floats())
    return st.one_of(
        st.builds(
            lambda k, v: {k: v},
            st.sampled_from(KINDS),
            st.one_of(st.lists(numbers, min_size=0, max_size=3), ODD),
        ),  # fmt: skip
        ODD,
    )


@st.composite
def tune_tables(draw: st.DrawFn) -> dict[str, Any]:
    raw = json.loads(json.dumps(BASE))
    for key in draw(st.lists(st.sampled_from(TUNE_KEYS), max_size=4, unique=True)):
        value = draw(st.one_of(ODD, st.sampled_from(STORAGES)) if key == "storage" else ODD)
        raw["tune"][key] = value
    if draw(st.booleans()):
        search = {}
        for key in draw(st.lists(st.sampled_from(OPTIONS), min_size=0, max_size=3, unique=True)):
            head, _, leaf = key.partition(".")
            if leaf:
                search.setdefault(head, {})[leaf] = draw(dimension())
            else:
                search[key] = draw(dimension())
        method = draw(st.sampled_from(["fedavg", "prox"]))
        table: dict[str, Any] = {"search": search}
        if method == "prox":
            table["algorithm"] = "fedprox"
        raw["methods"] = {method: table}
    if draw(st.booleans()):
        raw["experiment"][draw(st.sampled_from(["rounds", "validation_fraction", "seed"]))] = draw(
            ODD
        )
    return raw


def _write(path: Path, raw: dict[str, Any]) -> Path:
    path.write_text(json.dumps(raw, allow_nan=True))
    return path


@settings(max_examples=examples(150), **FUZZ)
@given(raw=tune_tables(), extra=st.lists(st.sampled_from(
    ["--trials", "0", "--trials", "-1", "--study", "a/b", "--study", "", "--storage",
     "sqlite://", "--seed", "1", "--jobs", "0", "--jobs", "2", "--methods", "nope",
     "--executor", "local", "--tasks", "2"]), max_size=4))  # fmt: skip
def test_any_tune_file_is_checked_or_one_line(tmp_path, capsys, raw, extra):
    with fresh_folder(tmp_path) as here:
        file = _write(here / "study.json", raw)
        code, _, _ = clean_outcome(
            ["tune", "-c", str(file), "-o", str(here / "out"), "--results-only", *extra], capsys
        )
        assert code != 0  # no study exists here: even a valid file ends at "no study"
        assert not (here / "out" / "tuned.json").exists()


@pytest.fixture(scope="module")
def made_study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One small finished study (2 trials of 1 round), copied by each example."""
    root = tmp_path_factory.mktemp("study")
    raw = json.loads(json.dumps(BASE))
    raw["tune"]["trials"] = 2
    file = _write(root / "study.json", raw)
    assert main(["tune", "-c", str(file), "-o", str(root / "out")]) == 0
    return root


DAMAGE = ["truncate_db", "flip_db", "empty_db", "db_is_dir", "garble_lock", "lock_is_dir",
          "garble_tuned", "garble_record", "drop_trials", "truncate_metrics", "none"]  # fmt: skip


def damage(out: Path, kind: str, data: st.DataObject) -> None:
    db = out / "study.db"
    if kind == "truncate_db":
        size = db.stat().st_size
        db.write_bytes(db.read_bytes()[: data.draw(st.integers(0, size - 1))])
    elif kind == "flip_db":
        body = bytearray(db.read_bytes())
        for _ in range(data.draw(st.integers(1, 16))):
            at = data.draw(st.integers(0, len(body) - 1))
            body[at] ^= 1 << data.draw(st.integers(0, 7))
        db.write_bytes(bytes(body))
    elif kind == "empty_db":
        db.write_bytes(b"")
    elif kind == "db_is_dir":
        db.unlink()
        db.mkdir()
    elif kind in ("garble_lock", "lock_is_dir"):
        locks = out / ".tune-locks"
        for lock in list(locks.glob("*.lock")):
            lock.unlink()
            if kind == "lock_is_dir":
                lock.mkdir()
            else:
                lock.write_bytes(data.draw(st.binary(max_size=16)))
    elif kind in ("garble_tuned", "garble_record"):
        name = "tuned.json" if kind == "garble_tuned" else "tune.json"
        (out / name).write_bytes(data.draw(st.binary(max_size=32)))
    elif kind == "drop_trials":
        shutil.rmtree(out / "trials")
    elif kind == "truncate_metrics":
        for metrics in (out / "trials").rglob("metrics.jsonl"):
            metrics.write_bytes(metrics.read_bytes()[: data.draw(st.integers(0, 10))])


def _copy(made: Path, here: Path) -> tuple[Path, Path]:
    shutil.copy(made / "study.json", here / "study.json")
    shutil.copytree(made / "out", here / "out")
    return here / "study.json", here / "out"


@settings(max_examples=examples(60), **FUZZ)
@given(kind=st.sampled_from(DAMAGE), data=st.data())
def test_a_damaged_study_folder_gives_results_or_one_line(tmp_path, capsys, made_study, kind,
                                                           data):  # fmt: skip
    with fresh_folder(tmp_path) as here:
        file, out = _copy(made_study, here)
        damage(out, kind, data)
        code, _, _ = clean_outcome(["tune", "-c", str(file), "-o", str(out), "--results-only"],
                                   capsys)  # fmt: skip
        if code == 0:
            tuned = json.loads((out / "tuned.json").read_text())
            assert tuned["methods"]["fedavg"]["lr"] > 0  # never an empty tuned file


@pytest.mark.slow
@settings(max_examples=examples(20), **FUZZ)
@given(kind=st.sampled_from(DAMAGE), data=st.data())
def test_continuing_a_damaged_study_runs_or_gives_one_line(tmp_path, capsys, made_study, kind,
                                                            data):  # fmt: skip
    with fresh_folder(tmp_path) as here:
        file, out = _copy(made_study, here)
        damage(out, kind, data)
        code, _, _ = clean_outcome(["tune", "-c", str(file), "-o", str(out), "--trials", "3"],
                                   capsys)  # fmt: skip
        if code == 0:
            assert json.loads((out / "tuned.json").read_text())["methods"]["fedavg"]["lr"] > 0


@pytest.mark.parametrize("at", [4096, 4097, 8192])
def test_a_flipped_page_of_study_db_is_one_line(tmp_path, capsys, made_study, at):
    """The fuzzer's find: one bit flipped at the start of the database's second page made
    SQLite report a malformed image, which reached the user as Optuna's StorageInternalError
    traceback."""
    file, out = _copy(made_study, tmp_path)
    body = bytearray((out / "study.db").read_bytes())
    if at >= len(body):
        pytest.skip(f"study.db has {len(body)} bytes")
    body[at] ^= 1
    (out / "study.db").write_bytes(bytes(body))
    code, _, _ = clean_outcome(["tune", "-c", str(file), "-o", str(out), "--results-only"],
                               capsys)  # fmt: skip
    if code == 0:
        assert json.loads((out / "tuned.json").read_text())["methods"]["fedavg"]["lr"] > 0
