"""Failures named: a run that stops with an error says so in its folder (diverged at round N,
or failed), and the tables, the report, the LaTeX table and ``fedskew compare`` name it as
such, with its round and the policy for the means, apart from runs still running or merely
unfinished. The divergences here are real: a learning rate of 1e30 on digits, and a global
model that turns NaN and is caught by the run loop's own check (tests/stopping_algorithm.py)."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from fedskew.apps import compare
from fedskew.apps.cli import main
from fedskew.config import ExperimentConfig
from fedskew.core.errors import Diverged
from fedskew.grid.status import status_lines
from fedskew.report.document import plain_text
from fedskew.report.latex import comparison_latex
from fedskew.report.runs import find_runs
from fedskew.report.tables import Options, comparison_blocks, comparison_csv, per_run_table
from fedskew.runs.checkpoint import read_checkpoint
from fedskew.runs.folder import RunFolder
from fedskew.runs.loop import run

TESTS = Path(__file__).resolve().parent
TINY = {"num_clients": 4, "clients_per_round": 2, "local_epochs": 1, "quiet": True}


class Killed(Exception):
    pass


def _kill_after_round_1(record):
    if record["round"] == 1:
        raise Killed


def _stop(folder: Path) -> dict:
    return json.loads((folder / "stopped.json").read_text())


def _rounds(folder: Path) -> int:
    path = folder / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_a_real_divergence_is_recorded_with_its_round(tmp_path, capsys):
    args = ["run", "-o", str(tmp_path), "--name", "hot", "-q", "--lr", "1e30", "-n", "4",
            "--clients-per-round", "2", "-r", "3", "-e", "1"]  # fmt: skip
    assert main(args) == 1
    assert "round 1: client" in capsys.readouterr().err
    stop = _stop(tmp_path / "hot.incomplete")
    assert stop["state"] == "diverged" and stop["round"] == 1 and stop["rounds_done"] == 0
    assert "diverged (NaN or Inf" in stop["reason"]


def test_a_global_model_that_turns_nan_diverges_at_that_round(tmp_path):
    cfg = ExperimentConfig(algorithm="stopping_algorithm:NaNAt", params={"at_round": 3},
                           rounds=5, out_dir=str(tmp_path), name="nan", **TINY)  # fmt: skip
    with pytest.raises(Diverged, match="round 3: the global model has NaN") as caught:
        run(cfg)
    assert caught.value.round == 3
    folder = tmp_path / "nan.incomplete"
    stop = _stop(folder)
    assert (stop["state"], stop["round"], stop["rounds_done"]) == ("diverged", 3, 2)
    assert _rounds(folder) == 2  # the rounds before it are kept, the NaN one is not


def test_a_crash_is_recorded_as_failed_not_diverged(tmp_path):
    cfg = ExperimentConfig(algorithm="stopping_algorithm:CrashAt", params={"at_round": 2},
                           rounds=3, out_dir=str(tmp_path), name="crash", **TINY)  # fmt: skip
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(cfg)
    stop = _stop(tmp_path / "crash.incomplete")
    assert (stop["state"], stop["round"], stop["rounds_done"]) == ("failed", 2, 1)
    assert stop["reason"] == "RuntimeError: simulated crash in round 2"


def test_a_caller_stopping_the_run_is_no_failure_and_a_resume_clears_a_record(tmp_path):
    cfg = ExperimentConfig(rounds=2, out_dir=str(tmp_path), name="cut", **TINY)
    with pytest.raises(Killed):  # raised by the caller's on_round (a pruner, say)
        run(cfg, on_round=_kill_after_round_1)
    folder = tmp_path / "cut.incomplete"
    assert not (folder / "stopped.json").exists()
    RunFolder.reopen(folder).record_stop("failed", 2, 1, "an earlier attempt's error")
    done, _ = run(cfg, resume=folder)
    assert not (done / "stopped.json").exists()


@pytest.fixture(scope="module")
def stopped_grid(tmp_path_factory) -> Path:
    """fedavg (2 seeds, finished), hot (lr 1e30: seed 0 diverges in round 1; seed 1 is a
    NaN global model in round 2), crash (seed 0 fails in round 2), slow (seed 0 interrupted
    after round 1: unfinished, not failed)."""
    root = tmp_path_factory.mktemp("stops")

    def one(name: str, seed: int, **values) -> ExperimentConfig:
        return ExperimentConfig(**{**TINY, "rounds": 3, "seed": seed, "out_dir": str(root),
                                   "name": f"{name}-s{seed}", **values})  # fmt: skip

    for seed in (0, 1):
        run(one("fedavg", seed))
    with pytest.raises(Diverged):
        run(one("hot", 0, lr=1e30))
    with pytest.raises(Diverged):
        run(one("hot", 1, algorithm="stopping_algorithm:NaNAt", params={"at_round": 2}))
    with pytest.raises(RuntimeError):
        run(one("crash", 0, algorithm="stopping_algorithm:CrashAt", params={"at_round": 2}))
    with pytest.raises(Killed):
        run(one("slow", 0), on_round=_kill_after_round_1)
    return root


def test_tables_name_diverged_and_failed_runs_with_their_round(stopped_grid):
    records = find_runs(stopped_grid)
    status = {r.folder.name: r.status.label() for r in records}
    assert status == {
        "fedavg-s0": "finished",
        "fedavg-s1": "finished",
        "hot-s0.incomplete": "diverged at round 1",
        "hot-s1.incomplete": "diverged at round 2",
        "crash-s0.incomplete": "failed at round 2: RuntimeError: simulated crash in round 2",
        "slow-s0.incomplete": "unfinished",
    }
    options = Options(reference="fedavg", last=2)
    blocks = comparison_blocks(records, options)
    table = blocks[1]
    rows = {plain_text(r[0]): [plain_text(c) for c in r] for r in table.rows}
    assert rows["hot"][1] == "0 (+2 diverged: seed 0 at round 1, seed 1 at round 2)"
    assert rows["hot"][2] == "none: every seed diverged"
    assert rows["crash"][1:3] == ["0 (+1 failed: seed 0 at round 2)", "no finished run"]
    assert rows["slow"][1] == "0 (+1 unfinished)"
    assert rows["fedavg"][1] == "2"
    note = plain_text(blocks[2].text)
    named = note.removeprefix("Not in the means: ").split(". ")[0].split("; ")
    assert sorted(named) == [
        "crash seed 0 failed at round 2: RuntimeError: simulated crash in round 2",
        "hot seed 0 diverged at round 1",
        "hot seed 1 diverged at round 2",
        "slow seed 0 unfinished",
    ]
    assert "left out of mean ± std and counted beside it" in note

    # Every run: its rounds and where it stands; no accuracy for a run that stopped.
    per_run = {(r[1], r[2]): r for r in per_run_table(records, options).rows}
    assert per_run["hot", "0"][3:5] == ["0/3 (diverged at round 1)", ""]
    assert per_run["hot", "1"][3:5] == ["1/3 (diverged at round 2)", ""]
    assert per_run["crash", "0"][3].startswith("1/3 (failed at round 2: RuntimeError")
    assert per_run["slow", "0"][3] == "1/3 (unfinished)"
    assert per_run["slow", "0"][4] != ""  # its rounds so far are shown, as a running run's

    rows_csv = {
        r["method"]: r for r in csv.DictReader(comparison_csv(records, options).splitlines())
    }
    assert (rows_csv["hot"]["diverged"], rows_csv["hot"]["diverged_at"]) == ("2", "0:1;1:2")
    assert (rows_csv["crash"]["failed"], rows_csv["crash"]["failed_at"]) == ("1", "0:2")
    assert rows_csv["slow"]["unfinished"] == "1" and rows_csv["hot"]["unfinished"] == "0"

    tex = comparison_latex(records, options)
    assert "hot & diverged {\\scriptsize (2 seeds)}" in tex
    assert "hot seed 0 diverged at round 1; hot seed 1 diverged at round 2" in tex
    assert "left out of mean $\\pm$ std" in tex


def test_a_row_with_some_seeds_diverged_averages_the_others(stopped_grid, tmp_path):
    # fedavg's seed 1 folder copied as a "hot" seed 2 that finished: the row's mean is of it
    # alone, and the diverged seeds are counted beside it.
    shutil.copytree(stopped_grid, tmp_path / "g")
    folder = tmp_path / "g" / "hot-s2"
    shutil.copytree(tmp_path / "g" / "fedavg-s1", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "seed": 2}))
    records = find_runs(tmp_path / "g")
    table = comparison_blocks(records, Options(reference="fedavg", last=2))[1]
    hot = next([plain_text(c) for c in r] for r in table.rows if plain_text(r[0]) == "hot")
    assert hot[1] == "1 (+2 diverged: seed 0 at round 1, seed 1 at round 2)"
    assert hot[2].endswith("(1 seed)")
    assert "$ {\\scriptsize (+2 diverged)}" in comparison_latex(records, Options(last=2))


def test_a_live_process_makes_a_run_running_not_unfinished(stopped_grid):
    folder = RunFolder.reopen(stopped_grid / "slow-s0.incomplete")
    folder.claim()
    try:
        rec = next(r for r in find_runs(stopped_grid) if r.method == "slow")
    finally:
        folder.release()
    assert rec.status.kind == "running" and rec.status.label().startswith("running (pid ")


def test_report_names_the_divergence(stopped_grid, tmp_path):
    out = tmp_path / "report"
    assert main(["report", str(stopped_grid), "-o", str(out), "--latex"]) == 0
    md = (out / "report.md").read_text()
    page = (out / "report.html").read_text()
    assert "6 run folder(s) under" in md
    assert "2 finished, 2 diverged, 1 failed, 1 unfinished" in md
    for text in (md, page):
        assert "hot seed 1 diverged at round 2" in text
        assert "0/3 (diverged at round 1)" in text
    assert "hot seed 0 diverged at round 1" in (out / "report.tex").read_text()


def test_compare_counts_diverged_and_failed_and_fails_only_on_failed(tmp_path, capsys,
                                                                     monkeypatch):  # fmt: skip
    paths = [str(TESTS), str(TESTS.parent / "src"), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
    out, file = tmp_path / "grid", tmp_path / "grid.toml"
    grid = (
        f'[compare]\nout_dir = "{out}"\nseeds = [0]\njobs = 1\nthreads = 1\n'
        '[experiment]\ndataset = "digits"\nnum_clients = 4\nclients_per_round = 2\n'
        "rounds = 2\nlocal_epochs = 1\n[methods.fedavg]\n"
        '[methods.hot]\nalgorithm = "fedavg"\nlr = 1e30\n'
    )  # fmt: skip
    crash = '[methods.crash]\nalgorithm = "stopping_algorithm:CrashAt"\nparams = { at_round = 2 }\n'
    file.write_text(grid + crash)
    assert main(["compare", "-c", str(file)]) == 1
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1] == "3 runs: 1 finished, 1 diverged (hot-s0 at round 1), 1 failed (crash-s0)"
    assert any(x.startswith("[") and "hot-s0: diverged in " in x for x in printed)
    md = (out / "comparison.md").read_text()
    assert "| hot | 0 (+1 diverged: seed 0 at round 1) | none: every seed diverged |" in md
    assert "crash seed 0 failed at round 2: RuntimeError: simulated crash in round 2" in md
    runs = {r["folder"]: r for r in csv.DictReader((out / "runs.csv").open())}
    assert (runs["hot-s0.incomplete"]["status"], runs["hot-s0.incomplete"]["stopped_round"]) == (
        "diverged", "1")  # fmt: skip

    # A diverged run is a result: not run again, and no failure (exit status 0).
    file.write_text(grid)
    assert main(["compare", "-c", str(file)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert any("hot-s0: diverged before: round 1: client" in x for x in printed)
    assert printed[-1] == "2 runs: 1 finished, 1 diverged (hot-s0 at round 1), 0 failed"
    processes = (out / "hot-s0.incomplete" / "processes.jsonl").read_text().splitlines()
    assert len(processes) == 1  # the first attempt's only

    assert main(["compare", "-c", str(file), "--report-only"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "2 runs in the tables: 1 finished, 1 diverged, 0 failed"
    )
    planned = compare.grid_from(compare.read_file(file), str(file), {}, None, {})
    lines = status_lines(planned, compare.plan(planned))
    assert [x.split(None, 1) for x in lines[:2]] == [
        ["fedavg-s0", lines[0].split(None, 1)[1]],
        ["hot-s0", "diverged at round 1, after 0 of 2 rounds"],
    ]
    assert (
        lines[-1] == "1 finished, 1 diverged, 0 training, 0 unfinished, 0 not run"
    )  # no time left


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium")
def test_chromium_shows_the_divergence_in_the_report(stopped_grid, tmp_path):
    """The report as a browser renders it (headless Chromium's DOM after layout), not only
    the HTML text: the divergence and its round are on the page."""
    assert main(["report", str(stopped_grid), "-o", str(tmp_path)]) == 0
    page = (tmp_path / "report.html").resolve().as_uri()
    profile = f"--user-data-dir={tmp_path / 'profile'}"
    cmd = ["chromium", "--headless", "--no-sandbox", "--disable-gpu",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--no-first-run", profile, "--dump-dom", page]  # fmt: skip
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=180).stdout
    text = re.sub(r"<[^>]+>", "", dom)
    assert "hot seed 1 diverged at round 2" in text
    assert "0 (+2 diverged: seed 0 at round 1, seed 1 at round 2)" in text
    assert "2 finished, 2 diverged, 1 failed, 1 unfinished" in text


def test_overview_of_settings_counts_the_runs_beside_each_cell():
    from dataclasses import replace

    from fake_runs import record

    from fedskew.report.tables import group, overview_table

    def diverged(method, seed, setting, at):
        rec = record(method, seed, [30.0] * (at - 1), setting=setting)
        return replace(rec, summary=None, stop={"state": "diverged", "round": at, "reason": ""})

    records = [
        record("fedavg", 0, [50.0, 60.0], setting="a"),
        record("fedavg", 0, [40.0, 45.0], setting="b"),
        record("fedfm", 0, [55.0, 65.0], setting="a"),
        diverged("fedfm", 1, "a", 9),
        diverged("fedfm", 0, "b", 4),
    ]
    options = Options(reference=None, last=2)
    table = overview_table(group(records, options), options)
    cells = {plain_text(r[0]): [plain_text(c) for c in r[1:]] for r in table.rows}
    assert cells["fedfm"] == [
        "60.00 (1 seed) (+1 diverged)",
        "diverged (1 seed)",
    ]
    blocks = comparison_blocks(records, options)
    assert any(
        plain_text(getattr(b, "text", "")).startswith(
            "Not in the means: fedfm seed 1 diverged at round 9; fedfm seed 0 diverged at round 4."
        )
        for b in blocks
    )
    tex = comparison_latex(records, options)
    assert (
        "fedfm & $\\mathbf{60.00}$ {\\scriptsize (+1 diverged)} & diverged {\\scriptsize (1 seed)}"
        in tex
    )


def test_a_divergence_travels_back_from_a_ray_task_or_slurm_array():
    from fedskew.grid.executors.plain_runs import outcome_data, outcome_from
    from fedskew.grid.launch import Outcome, closing_line

    planned = compare.plan(compare.grid_from({}, "", {"rounds": 2}, ["fedavg"], {}))[0]
    back = outcome_from(planned, outcome_data(Outcome(planned, "diverged", "NaN", 1.0, 1, 7)))
    assert (back.status, back.round) == ("diverged", 7)
    assert closing_line([back]) == "1 run: 0 finished, 1 diverged (fedavg-s0 at round 7), 0 failed"


def test_a_server_state_that_overflows_diverges_and_is_not_checkpointed(tmp_path, monkeypatch):
    """Two clients send finite but extreme SCAFFOLD control deltas in round 2: each reply
    passes the NaN check, their sum overflows the server's c to Inf. The run stops there, the
    checkpoint of round 1 is kept (before, it ended normally with Inf in its checkpoint)."""
    import fedskew.runs.loop as loop

    exchange = loop.FiniteReplies.exchange

    def poisoned(self, messages, expect=None):
        replies = exchange(self, messages, expect)
        if self.round == 1:
            for reply in replies.values():
                for k, v in reply.arrays.items():
                    if k.startswith("dc/"):
                        reply.arrays[k] = torch.full_like(v, 3e38)
        return replies

    monkeypatch.setattr(loop.FiniteReplies, "exchange", poisoned)
    cfg = ExperimentConfig(algorithm="scaffold", rounds=3, out_dir=str(tmp_path), name="sc",
                           **TINY)  # fmt: skip
    with pytest.raises(Diverged, match="round 2: the server state has NaN or Inf in 'c.") as got:
        run(cfg)
    assert got.value.round == 2
    folder = tmp_path / "sc.incomplete"
    assert (_stop(folder)["state"], _rounds(folder)) == ("diverged", 1)
    saved = read_checkpoint(folder / "checkpoint.npz")
    assert saved.round == 1
    assert all(bool(torch.isfinite(t).all()) for t in saved.server["c"].values())
