"""The executors' options and files from elsewhere: a Slurm ``runs.json`` edited by hand or
planted, and any executor option in a compare file, either work or stop with one line of
error; a runs list never trains a run outside its grid folder."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedskew.apps.cli import main
from fedskew.grid import launch
from fedskew.grid.launch import Outcome

GRID = """
[compare]
out_dir = "{out}"
seeds = [0]
threads = 1
[experiment]
dataset = "digits"
num_clients = 4
clients_per_round = 2
rounds = 1
local_epochs = 1
[methods.fedavg]
[methods.prox]
algorithm = "fedprox"
"""
FUZZ = dict(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def written_runs_list(folder: Path) -> Path:
    """A grid's runs.json as `compare --executor slurm --dry-run` writes it."""
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / "grid.toml"
    file.write_text(GRID.format(out=folder / "out"))
    assert main(["compare", "-c", str(file), "--executor", "slurm", "--dry-run"]) == 0
    return folder / "out" / "slurm" / "runs.json"


@pytest.fixture(scope="module")
def runs_list(tmp_path_factory) -> dict[str, Any]:
    return json.loads(written_runs_list(tmp_path_factory.mktemp("grid")).read_text())


def one_line_error(capsys, code: int) -> str:
    captured = capsys.readouterr()
    assert code == 2, (code, captured.err)
    assert captured.err.count("\n") == 1 and captured.err.startswith("fedskew: error: "), (
        captured.err
    )
    return captured.err


def test_a_runs_list_entry_that_leaves_the_grid_is_refused(tmp_path, capsys):
    listing_file = written_runs_list(tmp_path)
    listing = json.loads(listing_file.read_text())
    entry = listing["runs"][0]
    entry["values"]["out_dir"] = str(tmp_path / "out" / ".." / "outside")
    listing_file.write_text(json.dumps(listing))
    code = main(["grid-task", str(listing_file), "--index", "0"])
    err = one_line_error(capsys, code)
    assert "is not fedavg-s0 inside the grid" in err
    assert not (tmp_path / "outside").exists()
    # The same with a relative out_dir, which the run would take from its working folder.
    entry["values"]["out_dir"] = "../outside"
    listing_file.write_text(json.dumps(listing))
    one_line_error(capsys, main(["grid-task", str(listing_file), "--index", "0"]))
    assert not list(tmp_path.parent.glob("outside*"))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda x: x["runs"][0].pop("values"), "'values' must be a dict"),
        (lambda x: x["runs"][0].pop("folder"), "'folder' must be a str"),
        (lambda x: x["runs"].__setitem__(0, [1]), "is not an object"),
        (lambda x: x.pop("runs"), "'runs' must be a list"),
        (lambda x: x.__setitem__("grid", 3), "'grid' must be an absolute path"),
        (lambda x: x.__setitem__("threads", "four"), "'threads' must be an integer"),
        (lambda x: x["runs"][0].__setitem__("folder", "../x"), "folder '../x' is not"),
        (lambda x: x["runs"][0]["values"].pop("name"), "values.name must be a path"),
        (lambda x: x["runs"][0]["values"].__setitem__("track_dir", "/"), "track_dir '/' is"),
    ],
)
def test_a_damaged_runs_list_is_one_line(tmp_path, capsys, damage, message):
    listing_file = written_runs_list(tmp_path)
    listing = json.loads(listing_file.read_text())
    damage(listing)
    listing_file.write_text(json.dumps(listing))
    err = one_line_error(capsys, main(["grid-task", str(listing_file), "--index", "0"]))
    assert message in err, err


# ------------------------------------------------------------------------------ fuzzing

ATOMS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=True),
    st.text(max_size=8), st.sampled_from(["..", "/", "../outside", "fedavg-s0", "\x00", "a\nb"]),
)  # fmt: skip
VALUES = st.recursive(
    ATOMS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


def mutate(draw: Any, value: Any, depth: int = 0) -> Any:
    """``value`` with one part replaced, removed or added somewhere inside it."""
    if isinstance(value, dict) and value and draw(st.integers(0, 3)) and depth < 4:
        key = draw(st.sampled_from(sorted(value, key=str)))
        action = draw(st.sampled_from(["replace", "remove", "recurse", "recurse"]))
        copy = dict(value)
        if action == "remove":
            del copy[key]
        elif action == "replace":
            copy[key] = draw(VALUES)
        else:
            copy[key] = mutate(draw, value[key], depth + 1)
        return copy
    if isinstance(value, list) and value and draw(st.integers(0, 3)) and depth < 4:
        i = draw(st.integers(0, len(value) - 1))
        return [*value[:i], mutate(draw, value[i], depth + 1), *value[i + 1 :]]
    return draw(VALUES)


def grid_task_problems(listing: Any, index: int, capsys, monkeypatch, base: Path) -> list[str]:
    """What is wrong with `fedskew grid-task` on ``listing``: it must end with a status of 0
    or 1 after a run inside its grid, or 2 with one line of error; never a traceback."""
    started: list[Path] = []

    def fake_run_grid(grid, runs, print_line=print):  # training is not what is fuzzed
        started.extend(Path(r.values["out_dir"]) / r.values["name"] for r in runs)
        return [Outcome(r, "finished") for r in runs]

    monkeypatch.setattr(launch, "run_grid", fake_run_grid)
    file = base / "runs.json"
    file.write_text(json.dumps(listing) if not isinstance(listing, str) else listing)
    try:
        code = main(["grid-task", str(file), "--index", str(index)])
    except SystemExit as exc:  # argparse's own
        code = exc.code
    except Exception as exc:  # noqa: BLE001 - the property: never
        return [f"traceback: {type(exc).__name__}: {exc}"[:200]]
    err = capsys.readouterr().err
    problems = []
    if code == 2 and err.count("\n") != 1:
        problems.append(f"not one line: {err!r:.200}")
    if code not in (0, 1, 2):
        problems.append(f"exit {code}")
    grid = Path(listing["grid"]).resolve() if code in (0, 1) else None
    for folder in started:
        if grid is None or grid not in folder.resolve().parents:
            problems.append(f"a run outside the grid: {folder}")
    return problems


def fuzz_runs_list(draw: Any, valid: dict[str, Any]) -> tuple[Any, int]:
    listing = valid
    for _ in range(draw(st.integers(1, 3))):
        listing = mutate(draw, listing)
    if draw(st.integers(0, 9)) == 0:
        listing = draw(st.sampled_from(["", "{", "[]", "null", '{"format": 1}']))
    return listing, draw(st.integers(-1, 2))


@settings(max_examples=60, **FUZZ)
@given(data=st.data())
def test_any_runs_list_runs_inside_its_grid_or_is_one_line(data, runs_list, capsys, monkeypatch,
                                                           tmp_path):  # fmt: skip
    base = Path(tempfile.mkdtemp(dir=tmp_path))
    try:
        listing, index = fuzz_runs_list(data.draw, runs_list)
        assert grid_task_problems(listing, index, capsys, monkeypatch, base) == []
    finally:
        shutil.rmtree(base, ignore_errors=True)


def count_failures(examples: int, seed: int = 0) -> dict[str, int]:
    """The runs-list fuzz without stopping at the first failure: how often each kind of
    problem came up (for the report of a fix; from tests/: ``python -c 'import
    test_grid_files as t; print(t.count_failures(200))'``)."""
    from hypothesis import Phase
    from hypothesis import seed as hseed

    kinds: dict[str, int] = {}
    valid = json.loads(written_runs_list(Path(tempfile.mkdtemp())).read_text())

    class Quiet:
        def readouterr(self):
            import io
            import sys

            err = sys.stderr.getvalue() if isinstance(sys.stderr, io.StringIO) else ""
            sys.stderr = io.StringIO()
            return type("C", (), {"err": err, "out": ""})()

    @hseed(seed)
    @settings(max_examples=examples, phases=[Phase.generate], **FUZZ)
    @given(data=st.data())
    def probe(data):
        import io
        import sys

        base = Path(tempfile.mkdtemp())
        saved = sys.stderr
        sys.stderr = io.StringIO()
        with pytest.MonkeyPatch.context() as monkeypatch:
            try:
                listing, index = fuzz_runs_list(data.draw, valid)
                for problem in grid_task_problems(listing, index, Quiet(), monkeypatch, base):
                    kind = problem.split(":")[0] + ":" + problem.split(":")[1][:30]
                    kinds[kind] = kinds.get(kind, 0) + 1
            finally:
                sys.stderr = saved
                shutil.rmtree(base, ignore_errors=True)

    probe()
    return kinds


# ------------------------------------------------------------------- executor options

OPTION_VALUES = {
    "executor": st.sampled_from(["local", "ray", "slurm", "kubernetes", "", None]),
    "cpus_per_run": ATOMS | st.integers(0, 64),
    "gpus_per_run": ATOMS | st.floats(-1, 4) | st.just(float("inf")),
    "ray_address": st.sampled_from([None, "auto", "127.0.0.1:1", "nohost", ":", "a b", "\x00:1",
                                    "127.0.0.1:99999", "ray://127.0.0.1:1", 7, ""]),
    "retries": ATOMS,
    "slurm_partition": ATOMS,
    "slurm_time": ATOMS | st.just("4:00:00"),
    "slurm_cpus": ATOMS,
    "slurm_gpus": ATOMS,
    "slurm_mem": ATOMS | st.just("8G"),
    "slurm_extra": ATOMS | st.lists(ATOMS | st.just("--qos=low"), max_size=3),
}  # fmt: skip


def executor_problems(values: dict[str, Any], threads: Any, jobs: int, dry_run: bool) -> list[str]:
    """What is wrong with the executor settings of ``values``: checking them must give
    settings or one line of UsageError, never another exception."""
    from fedskew.core.errors import UsageError
    from fedskew.grid.executors import dispatch, ray_executor
    from fedskew.grid.plan import Grid
    from fedskew.report.tables import Options

    grid = Grid(out_dir=Path("unused"), base={}, methods={}, settings={}, seeds=[],
                options=Options(), jobs=jobs, threads=threads, executor=values)  # fmt: skip
    try:
        settings = dispatch.executor_settings(grid, dry_run)
        # (getattr: count_executor_failures also runs on code from before check_reachable)
        check_reachable = getattr(ray_executor, "check_reachable", None)
        if settings.executor == "ray" and check_reachable is not None:
            check_reachable(settings.ray_address, seconds=0.5)
    except UsageError as exc:
        return [] if "\n" not in str(exc) else [f"not one line: {exc!r:.200}"]
    except Exception as exc:  # noqa: BLE001 - the property: never
        return [f"traceback: {type(exc).__name__}: {exc}"[:200]]
    if settings.executor == "local" and values.get("cpus_per_run") is not None:
        if grid.threads != settings.cpus_per_run:
            return ["cpus-per-run ignored by the local executor"]
    return []


def executor_case(draw: Any) -> tuple[dict[str, Any], Any, int, bool]:
    keys = draw(st.lists(st.sampled_from(sorted(OPTION_VALUES)), max_size=5, unique=True))
    values = {k: draw(OPTION_VALUES[k]) for k in keys}
    threads = draw(st.sampled_from([None, 1, 2]))
    return values, threads, draw(st.integers(1, 2)), draw(st.booleans())


@settings(max_examples=200, **FUZZ)
@given(data=st.data())
def test_any_executor_options_work_or_are_one_line(data, monkeypatch):
    monkeypatch.setattr(launch, "available_cores", lambda: 4)
    monkeypatch.setenv("PATH", "/nonexistent")  # no sbatch: submitting is refused in one line
    assert executor_problems(*executor_case(data.draw)) == []


def count_executor_failures(examples: int, seed: int = 0) -> dict[str, int]:
    """The executor-options fuzz without stopping at the first failure (as count_failures)."""
    from hypothesis import Phase
    from hypothesis import seed as hseed

    kinds: dict[str, int] = {}

    @hseed(seed)
    @settings(max_examples=examples, phases=[Phase.generate], **FUZZ)
    @given(data=st.data())
    def probe(data):
        with pytest.MonkeyPatch.context() as monkeypatch:
            monkeypatch.setattr(launch, "available_cores", lambda: 4)
            monkeypatch.setenv("PATH", "/nonexistent")
            for problem in executor_problems(*executor_case(data.draw)):
                kind = ":".join(problem.split(":")[:2])[:60]
                kinds[kind] = kinds.get(kind, 0) + 1

    probe()
    return kinds
