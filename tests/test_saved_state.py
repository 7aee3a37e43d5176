"""A resume checks the state it reads back from a run folder (issue 40): the checkpoint's
server state and client states against what the algorithm declares and builds fresh, the
metrics lines against what the run loop needs and what the checkpoint recorded of them, and
the trackers' record against the run's folders. A tampered or damaged folder gives one
line; it never crashes inside an algorithm nor resumes with other numbers.

Runs are tiny (digits, 4 clients, 2 per round, 3 rounds, cut after round 2) so that the
unit tests and the fuzz test together take some twenty seconds.
"""

from __future__ import annotations

import io
import json
import random
import shutil
import tempfile
import traceback
from contextlib import redirect_stderr
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedskew.apps.cli import main
from fedskew.config import ExperimentConfig
from fedskew.runs.checkpoint import _Packer, _unpack, load_server_state
from fedskew.runs.loop import RunInterrupted, run
from fedskew.training.interface import ServerLogic

SMALL = dict(num_clients=4, clients_per_round=2, rounds=3, local_epochs=1, quiet=True, seed=1)
# Stateful on both sides: SCAFFOLD (c, every client's c_k), FedFM-Lite (anchors that start
# as None, a version per client, clients keeping their local model between model rounds),
# FedCME (evaluation vectors per client, class features that start as None).
ALGORITHMS = {
    "scaffold": {},
    "fedfm-lite": dict(params={"start_round": 1, "a": 2}),
    "fedcme": dict(local_epochs=2),
}
TIMING = ("seconds", "eval_seconds", "wall_seconds_this_process", "train_seconds",
          "train_samples_per_second", "processes")  # fmt: skip


# ------------------------------------------------------------------------- run folders


def stop_after(n: int):
    def hook(record: dict[str, Any]) -> None:
        if record["round"] == n:
            raise KeyboardInterrupt

    return hook


def make_runs(root: Path, algorithm: str) -> tuple[Path, Path]:
    """(an uninterrupted run's folder, the same run cut after round 2)."""
    options = {**SMALL, **ALGORITHMS[algorithm]}
    full, _ = run(ExperimentConfig(algorithm=algorithm, out_dir=str(root / "full"), name="r",
                                   **options))  # fmt: skip
    cfg = ExperimentConfig(algorithm=algorithm, out_dir=str(root / "cut"), name="r", **options)
    with pytest.raises(RunInterrupted):
        run(cfg, on_round=stop_after(2))
    return full, root / "cut" / "r.incomplete"


def read_tree(path: Path) -> dict[str, Any]:
    """A checkpoint's index with its arrays in place: what a tamperer could change."""
    with np.load(path, allow_pickle=False) as data:
        index = json.loads(bytes(data["__index__"]).decode("utf-8"))
        return {k: _unpack(v, data) for k, v in index.items()}


def write_tree(path: Path, tree: dict[str, Any]) -> None:
    """``tree`` as a well-formed checkpoint file (only its content is changed)."""
    packer = _Packer()
    index = {k: packer.pack(v) for k, v in tree.items()}
    header = np.frombuffer(json.dumps(index).encode("utf-8"), dtype=np.uint8)
    with open(path, "wb") as fh:
        np.savez(fh, __index__=header, **packer.arrays)


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def write_rows(path: Path, rows: list[Any]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def results(folder: Path) -> dict[str, Any]:
    """What a finished run computed: its metrics lines and summary without timings, and its
    last checkpoint (model, server state, client states)."""
    rows = [{k: v for k, v in r.items() if k not in TIMING} for r in read_rows(
        folder / "metrics.jsonl")]  # fmt: skip
    summary = json.loads((folder / "summary.json").read_text())
    tree = read_tree(folder / "checkpoint.npz")
    # A client with an empty state is one without: an engine makes the entry on first use.
    clients = {c: s for c, s in tree["clients"].items() if s["arrays"] or s["scalars"]}
    state = {"round": tree["round"], "server": tree["server"], "clients": clients}
    return {"rows": rows, "summary": {k: v for k, v in summary.items() if k not in TIMING},
            "state": state}  # fmt: skip


def same(a: Any, b: Any) -> bool:
    """Deep equality with tensors compared exactly (dtype, shape and values)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
        )  # fmt: skip
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and (a == b or a != a and b != b)  # NaN == NaN here


def resume(folder: Path) -> tuple[int, str]:
    err = io.StringIO()
    with redirect_stderr(err):
        code = main(["run", "--resume", str(folder), "-q"])
    return code, err.getvalue()


def outcome(folder: Path, reference: dict[str, Any]) -> str:
    """'same' (exit 0, the uninterrupted run's results), 'refused' (one line), or the kind
    of failure: the exception and where in fedskew it was raised, a different result, an
    error that is not one line."""
    try:
        code, err = resume(folder)
    except Exception as exc:  # noqa: BLE001 - what the test counts and reports
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "fedskew" in f.filename]
        where = f"{Path(frames[-1].filename).name}:{frames[-1].name}" if frames else "?"
        return f"{type(exc).__name__} in {where}"
    if code != 0:
        lines = err.splitlines()
        ok = len(lines) == 1 and lines[0].startswith("fedskew: error: ")
        return "refused" if ok and "Traceback" not in err else f"unclean error: {err!r:.200}"
    finished = folder.parent / folder.name.removesuffix(".incomplete")
    return "same" if same(results(finished), reference) else "different result, exit 0"


# ---------------------------------------------------------------------------- mutations


def sites(node: Any, path: tuple = ()) -> list[tuple]:
    """Every (container, key, path) under ``node``: dict entries and list items."""
    found = []
    if isinstance(node, dict):
        for key in list(node):
            found.append((node, key, (*path, key)))
            found.extend(sites(node[key], (*path, key)))
    elif isinstance(node, list):
        for i in range(len(node)):
            found.append((node, i, (*path, i)))
            found.extend(sites(node[i], (*path, i)))
    return found


JSON_VALUES = [None, "x", 0, 1.5, True, [], {}, [1, 2], {"a": 1}]


def other_tensor(t: torch.Tensor, rng: random.Random) -> Any:
    """``t`` with another dtype or shape, or as another kind of value."""
    how = rng.choice(["dtype", "flat", "extra dim", "shorter", "empty", "ndarray", "list"])
    if how == "dtype":
        dtypes = [torch.float64, torch.float16, torch.int64, torch.int32, torch.bool,
                  torch.float32, torch.uint8]  # fmt: skip
        return t.to(rng.choice([d for d in dtypes if d != t.dtype]))
    if how == "flat":
        return t.reshape(-1) if t.dim() != 1 else t.reshape(1, -1)
    if how == "extra dim":
        return t.unsqueeze(0)
    if how == "shorter":
        return t[: max(0, t.shape[0] - 1)] if t.dim() else t.reshape(1)
    if how == "empty":
        return torch.zeros(0)
    if how == "ndarray":
        return t.numpy().copy()
    return t.tolist()


def mutate_value(value: Any, rng: random.Random, tensors: bool) -> Any:
    if isinstance(value, torch.Tensor) and rng.random() < 0.7:
        return other_tensor(value, rng)
    choices = JSON_VALUES + ([torch.zeros(2), torch.ones(3, dtype=torch.int64)] if tensors else [])
    return rng.choice([v for v in choices if not same(v, value)])


def mutate_tree(tree: Any, rng: random.Random, tensors: bool) -> str:
    """One change somewhere in ``tree``: a key dropped or renamed, a value of another kind,
    dtype or shape, a list cut short. Says what it did."""
    found = sites(tree)
    if not found:
        return "nothing to change"
    container, key, path = rng.choice(found)
    how = rng.choice(["drop", "rename", "retype", "retype"])
    if how == "drop":
        del container[key]
    elif how == "rename" and isinstance(container, dict):
        new = key + 100 if isinstance(key, int) else rng.choice([f"{key}_", "aggregate", "round"])
        container[new if new not in container else f"{new}_"] = container.pop(key)
    elif how == "rename":  # a list: items swapped or one repeated
        container.append(container[key])
    else:
        container[key] = mutate_value(container[key], rng, tensors)
    return f"{how} {path}"


def damage(folder: Path, rng: random.Random) -> str:
    """One change to the checkpoint or metrics.jsonl of an unfinished run folder; sometimes
    after the last metrics line went missing (a kill between checkpoint and line), so that
    the checkpoint's own record is read."""
    checkpoint, metrics = folder / "checkpoint.npz", folder / "metrics.jsonl"
    said = []
    if rng.random() < 0.3:
        write_rows(metrics, read_rows(metrics)[:-1])
        said.append("last line gone")
    target = rng.choice(["checkpoint"] * 6 + ["metrics"] * 3 + ["bytes"])
    if target == "checkpoint":
        tree = read_tree(checkpoint)
        said.append("checkpoint: " + mutate_tree(tree, rng, tensors=True))
        write_tree(checkpoint, tree)
    elif target == "metrics":
        rows = read_rows(metrics)
        said.append("metrics: " + mutate_tree(rows, rng, tensors=False))
        write_rows(metrics, rows)
    else:
        path = rng.choice([checkpoint, metrics])
        data = path.read_bytes()
        path.write_bytes(data[: rng.randrange(len(data))])
        said.append(f"{path.name} truncated")
    return "; ".join(said)


@pytest.fixture(scope="module")
def templates(tmp_path_factory) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Per algorithm: an unfinished run folder (cut after round 2) and the results of the
    same run uninterrupted."""
    out = {}
    for algorithm in ALGORITHMS:
        full, cut = make_runs(tmp_path_factory.mktemp(algorithm), algorithm)
        out[algorithm] = (cut, results(full))
    return out


@pytest.fixture
def copy_of(templates, tmp_path):
    """A copy of an algorithm's unfinished run folder, to damage."""

    def make(algorithm: str) -> Path:
        folder = Path(tempfile.mkdtemp(dir=tmp_path)) / "r.incomplete"
        shutil.copytree(templates[algorithm][0], folder)
        return folder

    return make


def refused(folder: Path) -> str:
    """The one line of a resume that must be refused."""
    code, err = resume(folder)
    lines = err.splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("fedskew: error: "), err
    assert not (folder.parent / "r").exists()
    return lines[0]


def edit_checkpoint(folder: Path, change) -> None:
    tree = read_tree(folder / "checkpoint.npz")
    change(tree)
    write_tree(folder / "checkpoint.npz", tree)


# ------------------------------------------------------------------------ server state


def test_a_server_field_of_another_shape_is_refused(copy_of):
    folder = copy_of("scaffold")
    edit_checkpoint(folder, lambda t: t["server"]["c"].update({"head.bias": torch.zeros(3)}))
    line = refused(folder)
    assert "server state 'c'" in line and "'head.bias'" in line and "(3,)" in line


def test_a_server_field_of_another_dtype_is_refused(copy_of):
    # Before: SCAFFOLD ran on with c in float64 and gave other numbers, exit 0.
    folder = copy_of("scaffold")
    edit_checkpoint(folder, lambda t: t["server"]["c"].update(
        {"head.bias": t["server"]["c"]["head.bias"].double()}))  # fmt: skip
    assert "torch.float64, expected (10) torch.float32" in refused(folder)


def test_a_missing_server_field_is_refused(copy_of):
    folder = copy_of("fedfm-lite")
    edit_checkpoint(folder, lambda t: t["server"].pop("model_version"))
    assert "lacks the server state 'model_version' that fedfm-lite saves" in refused(folder)


def test_a_missing_scaffold_control_variate_is_refused(copy_of):
    # Before: a KeyError inside SCAFFOLD's server (c gone) or its client (one entry gone).
    folder = copy_of("scaffold")
    edit_checkpoint(folder, lambda t: t["server"].pop("c"))
    assert "lacks the server state 'c' that scaffold saves" in refused(folder)
    folder = copy_of("scaffold")
    edit_checkpoint(folder, lambda t: t["server"]["c"].pop("head.weight"))
    assert "server state 'c' lacks 'head.weight'" in refused(folder)


def test_an_extra_server_field_is_refused(copy_of):
    folder = copy_of("scaffold")
    edit_checkpoint(folder, lambda t: t["server"].update(extra=torch.zeros(2)))
    assert "holds server state 'extra', which scaffold does not save" in refused(folder)


def test_a_saved_field_named_like_a_method_of_the_server_is_refused(copy_of):
    # Before: setattr(server, "round", ...) replaced the server's round method.
    folder = copy_of("scaffold")
    edit_checkpoint(folder, lambda t: t["server"].update(round=3))
    assert "'round' (a method of its server), which scaffold does not save" in refused(folder)


def test_only_declared_fields_are_ever_restored():
    class Server(ServerLogic):
        checkpoint_fields = ("c",)

    server = Server.__new__(Server)
    load_server_state(server, {"global_arrays": {}, "c": 1, "round": 5})
    assert server.c == 1 and callable(server.round)


def test_a_per_client_server_entry_that_is_missing_is_refused(copy_of):
    # Before: FedFM-Lite sent that client the model again, and the traffic differed.
    folder = copy_of("fedfm-lite")
    sent = read_tree(folder / "checkpoint.npz")["server"]["version_sent"]
    cid = next(iter(sent))
    edit_checkpoint(folder, lambda t: t["server"]["version_sent"].pop(cid))
    assert f"'version_sent' lacks the entry of client {cid}" in refused(folder)


def test_a_field_that_starts_empty_is_checked_as_its_algorithm_declares(copy_of):
    folder = copy_of("fedcme")  # features: None at first, then (classes, feature size)
    edit_checkpoint(folder, lambda t: t["server"].update(features=torch.zeros(10, 7)))
    assert "server state 'features' is (10, 7)" in refused(folder)


# ------------------------------------------------------------------------ client state


def test_a_client_without_its_state_is_refused(copy_of):
    # Before: SCAFFOLD restarted that client's c_k from zeros, other numbers, exit 0.
    folder = copy_of("scaffold")
    clients = read_tree(folder / "checkpoint.npz")["clients"]
    cid = next(c for c, s in clients.items() if s["arrays"])
    edit_checkpoint(folder, lambda t: t["clients"][cid]["arrays"].clear())
    line = refused(folder)
    assert f"client {cid}'s state lacks 'scaffold.c_k/" in line and "it has trained" in line


def test_a_client_state_in_pieces_or_with_more_is_refused(copy_of):
    folder = copy_of("scaffold")
    clients = read_tree(folder / "checkpoint.npz")["clients"]
    cid = next(c for c, s in clients.items() if s["arrays"])
    edit_checkpoint(folder, lambda t: t["clients"][cid]["arrays"].pop("scaffold.c_k/head.bias"))
    assert "it lacks 'scaffold.c_k/head.bias'" in refused(folder)
    folder = copy_of("scaffold")
    edit_checkpoint(folder, lambda t: t["clients"][cid]["arrays"].update(x=torch.zeros(1)))
    assert "holds 'x', which scaffold's clients do not keep" in refused(folder)


def test_a_client_state_of_another_shape_is_refused(copy_of):
    folder = copy_of("scaffold")
    clients = read_tree(folder / "checkpoint.npz")["clients"]
    cid = next(c for c, s in clients.items() if s["arrays"])
    name = "scaffold.c_k/head.bias"
    edit_checkpoint(folder, lambda t: t["clients"][cid]["arrays"].update({name: torch.zeros(2)}))
    assert f"'{name}' is (2,) torch.float32, expected (10) torch.float32" in refused(folder)


# ----------------------------------------------------------------------- metrics lines


def test_a_record_that_lost_fields_is_refused(copy_of):
    # The checkpoint's own record is read when its metrics line never got written.
    # Before: a KeyError in the summary, after the whole run.
    folder = copy_of("scaffold")
    write_rows(folder / "metrics.jsonl", read_rows(folder / "metrics.jsonl")[:-1])
    edit_checkpoint(folder, lambda t: t["record"].pop("bytes_up"))
    line = refused(folder)
    assert "checkpoint.npz: its metrics record of round 2 lacks the number 'bytes_up'" in line


def test_a_metrics_line_that_lost_fields_is_refused(copy_of):
    # Before: the summary took its last evaluation from an earlier line, exit 0.
    folder = copy_of("scaffold")
    rows = read_rows(folder / "metrics.jsonl")
    del rows[1]["accuracy"]
    write_rows(folder / "metrics.jsonl", rows)
    line = refused(folder)
    assert "metrics.jsonl: line 2 lacks 'accuracy' (an evaluated round)" in line


def test_a_metrics_line_that_lost_any_value_is_refused(copy_of):
    # An algorithm's own metric is no field the run loop reads, but the line is not the one
    # the checkpoint recorded: before, the run finished with it missing.
    folder = copy_of("scaffold")
    rows = read_rows(folder / "metrics.jsonl")
    del rows[0]["train_loss"]
    write_rows(folder / "metrics.jsonl", rows)
    assert "the lines of rounds 1..2 are not those checkpoint.npz recorded" in refused(folder)


def test_a_checkpoint_without_metrics_digest_still_resumes(copy_of, templates):
    # Checkpoints written before the digest was kept: the fields are still checked.
    folder = copy_of("scaffold")
    edit_checkpoint(folder, lambda t: t.pop("metrics_digest"))
    assert outcome(folder, templates["scaffold"][1]) == "same"


# ----------------------------------------------------------------------------- the fuzz


def try_damage(template: tuple[Path, dict[str, Any]], rng: random.Random) -> tuple[str, str]:
    """(what was damaged, the outcome of resuming) for a copy of ``template``."""
    source, reference = template
    where = Path(tempfile.mkdtemp())
    try:
        folder = where / "r.incomplete"
        shutil.copytree(source, folder)
        what = damage(folder, rng)
        return what, outcome(folder, reference)
    finally:
        shutil.rmtree(where, ignore_errors=True)


def test_an_undamaged_copy_resumes_to_the_same_results(templates):
    for template in templates.values():
        source, reference = template
        where = Path(tempfile.mkdtemp())
        try:
            shutil.copytree(source, where / "r.incomplete")
            assert outcome(where / "r.incomplete", reference) == "same"
        finally:
            shutil.rmtree(where, ignore_errors=True)


@settings(
    max_examples=45,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(algorithm=st.sampled_from(sorted(ALGORITHMS)), rng=st.randoms(use_true_random=False))
def test_a_damaged_folder_resumes_the_same_or_gives_one_line(templates, algorithm, rng):
    """The property: one change to the checkpoint or metrics.jsonl of an unfinished run
    (a key dropped or renamed, a value of another kind, dtype or shape, a list cut short, a
    file truncated), and the resume ends like the uninterrupted run or with one line.
    Before the checks, 1000 such changes found 26 kinds of crash (an exception type and the
    place it came from), an error line with a warning printed before it, and 213 resumes
    that finished with other numbers; after them, none."""
    what, result = try_damage(templates[algorithm], rng)
    assert result in ("same", "refused"), f"{algorithm}, {what}: {result}"
