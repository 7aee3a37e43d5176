"""`fedskew compare`'s progress line: runs done, running (with their rounds) and left, and
the time left from the rounds trained so far; live on a terminal, plain lines in a log."""

from __future__ import annotations

import io
import json
from pathlib import Path

from fedskew.apps.cli import main
from fedskew.config import ExperimentConfig
from fedskew.grid.plan import PlannedRun
from fedskew.grid.progress import CLEAR, GridProgress, duration


def planned(folder: str, rounds: int, setting: str = "") -> PlannedRun:
    return PlannedRun(setting, folder.split("-")[0], 0, folder, {}, ExperimentConfig(rounds=rounds))


def write_rounds(root: Path, folder: str, rounds: int) -> None:
    where = root / f"{folder}.incomplete"
    where.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"round": r, "accuracy": 0.5}) for r in range(1, rounds + 1)]
    (where / "metrics.jsonl").write_text("".join(x + "\n" for x in lines))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_line_counts_runs_and_judges_time_from_rounds(tmp_path):
    runs = [planned(f"m{i}-s0", 10) for i in range(4)]
    clock, lines = Clock(), []
    progress = GridProgress(runs, tmp_path, 2, lines.append, clock=clock)
    assert progress.line() == (
        "grid: 0 of 4 done, 0 running, 4 left; time left: known after the first round"
    )
    progress.begin(runs[0])
    progress.begin(runs[1])
    clock.now += 50
    write_rounds(tmp_path, "m0-s0", 5)  # 10 s per round
    line = progress.line()
    assert line.startswith("grid: 0 of 4 done, 2 running (m0-s0 5/10, m1-s0 0/10 rounds), 2 left")
    # Rounds left: 5 + 10 + 10 + 10 = 35 at 10 s each, 2 at once: 175 s.
    assert line.endswith("time left: about 3 min"), line
    # m0 finishes: 10 rounds in 100 s; m1 has done nothing yet.
    clock.now += 50
    write_rounds(tmp_path, "m0-s0", 10)
    progress.finish(runs[0], 100.0, trained=True)
    line = progress.line()
    assert "grid: 1 of 4 done, 1 running (m1-s0 0/10 rounds), 2 left" in line
    assert line.endswith("about 3 min"), line  # 30 rounds x 10 s / 2 = 150 s
    # A run found finished before (no rounds trained here) does not change the rate.
    progress.finish(runs[2], 0.0, trained=False)
    assert progress.line().endswith("about 2 min")  # 20 rounds x 10 s / 2 = 100 s


def test_each_setting_has_its_own_rate(tmp_path):
    slow, fast = planned("a-s0", 10, "big"), planned("b-s0", 10, "small")
    later = [planned("c-s0", 10, "big"), planned("d-s0", 10, "small")]
    clock = Clock()
    progress = GridProgress([slow, fast, *later], tmp_path, 1, clock=clock)
    for run, seconds in ((slow, 600.0), (fast, 60.0)):
        progress.begin(run)
        progress.finish(run, seconds, trained=True)
    # 10 rounds at 60 s + 10 rounds at 6 s.
    assert progress.line().endswith("time left: about 11 min")


def test_durations():
    assert duration(59) == "under a minute"
    assert duration(90) == "about 2 min"
    assert duration(3 * 3600 + 5 * 60) == "about 3 h 05 min"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_the_line_is_redrawn_in_place_and_stays_below(tmp_path):
    runs = [planned("m0-s0", 4), planned("m1-s0", 4)]
    screen = Terminal()

    def print_line(text: str) -> None:
        screen.write(text + "\n")

    progress = GridProgress(runs, tmp_path, 1, print_line, live=True, stream=screen)
    progress.begin(runs[0])
    progress.tick()
    progress.tick()
    progress.finish(runs[0], 4.0, trained=True)
    progress.say("[1/2] m0-s0: finished in 4 s")
    progress.close()
    text = screen.getvalue()
    # Each drawing starts by erasing the line; the run's own line is printed on an erased
    # line, and the progress line is drawn again under it, then erased at the end.
    drawn = CLEAR + "grid: 0 of 2 done, 1 running (m0-s0 0/4 rounds), 1 left"
    assert text.startswith(drawn)
    assert text.count(drawn) == 2 and "\n" not in text.split("[1/2]")[0]
    after = text.split("[1/2] m0-s0: finished in 4 s\n")[1]
    assert after.startswith(CLEAR + "grid: 1 of 2 done, 0 running, 1 left")
    assert text.endswith(CLEAR)


GRID = """
[compare]
out_dir = "{out}"
seeds = [0]
jobs = 1
threads = 1
[experiment]
dataset = "digits"
num_clients = 4
clients_per_round = 2
rounds = 12
local_epochs = 1
[methods.fedavg]
[methods.prox]
algorithm = "fedprox"
"""


def test_in_a_log_compare_prints_plain_progress_lines(tmp_path, capsys):
    file = tmp_path / "grid.toml"
    file.write_text(GRID.format(out=tmp_path / "out"))
    assert main(["compare", "-c", str(file), "--progress-every", "0.5"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    progress = [x for x in lines if x.startswith("grid: ")]
    assert "\r" not in out and "\033" not in out
    # The first at once, before any run has a round; then lines while runs train.
    assert progress[0].startswith("grid: 0 of 2 done, 1 running (fedavg-s0 0/12 rounds), 1 left")
    assert any(" 1 of 2 done, 1 running (prox-s0 " in x for x in progress), progress
    assert any("time left: under a minute" in x for x in progress), progress
    assert lines.index(progress[0]) < lines.index(next(x for x in lines if "fedavg-s0: fin" in x))
    # --progress-every 0: none; a negative value is one line of error.
    assert main(["compare", "-c", str(file), "--progress-every", "0"]) == 0
    assert "grid: " not in capsys.readouterr().out
    assert main(["compare", "-c", str(file), "--progress-every", "-1"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_runs_whose_folder_is_held_count_as_running(tmp_path):
    # The Ray executor starts no run itself: a run is running while a process holds it.
    from fedskew.runs.folder import RunFolder

    runs = [planned("m0-s0", 10), planned("m1-s0", 10)]
    progress = GridProgress(runs, tmp_path, 2, watch_locks=True)
    assert ", 0 running, 2 left" in progress.line()
    folder = RunFolder.create(tmp_path, "m0-s0")
    (folder.path / "config.json").write_text("{}")
    held = RunFolder.reopen(folder.path)
    held.claim()
    try:
        assert "grid: 0 of 2 done, 1 running (m0-s0 0/10 rounds), 1 left" in progress.line()
    finally:
        held.release()
    assert ", 1 running" in progress.line()  # until it ends (a retry may hold it again)
    progress.finish(runs[0], 10.0, trained=True)
    assert "grid: 1 of 2 done, 0 running, 1 left" in progress.line()
