"""A study is never lost, empty or silently stale: an in-memory storage, a tune file edited
under an existing study, ``--results-only`` on a folder or study that does not exist, a
study where no trial completed, a float range for an integer option, ``rounds`` as a search
dimension and ``--seed`` are each one line and a non-zero exit, and no tuned.json that looks
usable is written. The report marks diverged and chance-level trials and cautions on fANOVA
importances from few trials; tune shows each trial's rounds as they run."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna")

from fedskew.apps.cli import main  # noqa: E402

TUNE = """
[tune]
trials = {trials}
seeds = [100]
last = 1
pruner = "none"
sampler = "random"

[compare]
seeds = [0]
threads = 1

[experiment]
dataset = "digits"
num_clients = 4
clients_per_round = 2
rounds = {rounds}
local_epochs = 1
batch_size = 64

[methods.fedavg.search]
{search}
"""


def tune_file(tmp_path: Path, search: str = "lr = { log = [0.01, 0.1] }", trials: int = 1,
              rounds: int = 1) -> Path:  # fmt: skip
    file = tmp_path / "study.toml"
    file.write_text(TUNE.format(trials=trials, rounds=rounds, search=search))
    return file


def one_line(capsys: pytest.CaptureFixture[str], *words: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, err
    return err


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:",
                                 "sqlite:///file:x?mode=memory&uri=true"])  # fmt: skip
def test_an_in_memory_storage_is_refused(tmp_path, capsys, url):
    out = tmp_path / "out"
    assert main(["tune", "-c", str(tune_file(tmp_path)), "-o", str(out), "--storage", url]) == 2
    one_line(capsys, "in-memory")
    assert not out.exists()


@pytest.mark.parametrize(
    ("search", "words"),
    [
        ("local_epochs = { float = [1, 3] }", ("local-epochs must be an integer",)),
        ("rounds = { int = [1, 3] }", ("'rounds' cannot be tuned",)),
    ],
)
def test_a_search_no_trial_could_run_is_refused(tmp_path, capsys, search, words):
    out = tmp_path / "out"
    assert main(["tune", "-c", str(tune_file(tmp_path, search)), "-o", str(out)]) == 2
    one_line(capsys, *words)
    assert not out.exists()


def test_seed_is_refused_not_ignored(tmp_path, capsys):
    assert main(["tune", "-c", str(tune_file(tmp_path)), "--seed", "3"]) == 2
    one_line(capsys, "drop --seed")


def test_a_study_where_no_trial_completed_fails_and_writes_no_tuned_file(tmp_path, capsys):
    out = tmp_path / "out"
    file = tune_file(tmp_path, "lr = { log = [1e8, 1e9] }")  # every trial diverges
    assert main(["tune", "-c", str(file), "-o", str(out)]) == 1
    captured = capsys.readouterr()
    assert "no trial of fedavg completed" in captured.err and "Traceback" not in captured.err
    assert "1 fail" in captured.out and "fedskew compare -c" not in captured.out
    assert not (out / "tuned.json").exists()
    record = json.loads((out / "tune.json").read_text())
    assert record["results"]["fedavg"]["trials"] == {"fail": 1}
    assert record["results"]["fedavg"]["marked"]["0"].startswith("diverged at round 1")
    assert "| fail, diverged at round 1 |" in (out / "tune_report.md").read_text()


def test_results_only_never_makes_a_study_nor_overwrites_a_good_tuned_file(tmp_path, capsys):
    file = tune_file(tmp_path)
    out = tmp_path / "out"
    assert main(["tune", "-c", str(file), "-o", str(out)]) == 0
    good = (out / "tuned.json").read_text()
    assert json.loads(good)["methods"]["fedavg"]["lr"] > 0
    capsys.readouterr()
    assert main(["tune", "-c", str(file), "-o", str(tmp_path / "typo"), "--results-only"]) == 2
    one_line(capsys, "no study in")
    assert not (tmp_path / "typo" / "tuned.json").exists()
    assert main(["tune", "-c", str(file), "-o", str(out), "--results-only",
                 "--study", "other"]) == 2  # fmt: skip
    one_line(capsys, "has no study other.fedavg")
    assert (out / "tuned.json").read_text() == good
    assert main(["tune", "-c", str(file), "-o", str(out), "--results-only"]) == 0
    assert (out / "tuned.json").read_text() == good


def test_an_edited_tune_file_does_not_continue_the_old_study(tmp_path, capsys):
    file = tune_file(tmp_path)
    out = tmp_path / "out"
    assert main(["tune", "-c", str(file), "-o", str(out)]) == 0
    capsys.readouterr()
    file.write_text(file.read_text().replace("rounds = 1", "rounds = 2"))
    assert main(["tune", "-c", str(file), "-o", str(out), "--trials", "2"]) == 2
    one_line(capsys, "made from another tune file", "runs.100.rounds: 1 -> 2")
    file.write_text(file.read_text().replace("rounds = 2", "rounds = 1").replace(
        "0.01, 0.1", "0.001, 0.1"))  # fmt: skip
    assert main(["tune", "-c", str(file), "-o", str(out), "--results-only"]) == 2
    one_line(capsys, "made from another tune file", "search")
    # The budget is not part of what a study is: raising it continues the study.
    file.write_text(file.read_text().replace("0.001, 0.1", "0.01, 0.1"))
    assert main(["tune", "-c", str(file), "-o", str(out), "--trials", "2"]) == 0


def test_chance_level_trials_are_marked_and_few_trials_caution_the_importances():
    from fedskew.grid.tune_results import importance_caution, trial_mark

    dist = optuna.distributions.FloatDistribution(0.01, 0.1)
    study = optuna.create_study(direction="maximize")
    for i, value in enumerate([12.0, 55.0, 60.0]):
        study.add_trial(optuna.trial.create_trial(
            value=value, params={"lr": 0.01 + i / 100}, distributions={"lr": dist},
            user_attrs={"num_classes": 10, "slot": i}))  # fmt: skip
    marks = [trial_mark(t) for t in study.trials]
    assert marks == ["chance level (10 % with 10 classes)", "", ""]
    caution = importance_caution(study)
    assert "from 3 completed trials only" in caution
    for i in range(3, 12):
        study.add_trial(optuna.trial.create_trial(
            value=50.0 + i, params={"lr": 0.01 + i / 200}, distributions={"lr": dist},
            user_attrs={"slot": i}))  # fmt: skip
    assert importance_caution(study) == ""


def test_live_line_redraws_on_a_terminal_and_writes_plain_lines_in_a_log():
    from fedskew.core.progress import LiveLine

    log = io.StringIO()
    line = LiveLine(log)
    line("round 1/2")
    line("round 2/2")
    line.print("done")
    assert log.getvalue() == "round 1/2\nround 2/2\ndone\n"

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = Terminal()
    line = LiveLine(term)
    line("round 1/20, accuracy 10.00 %")
    line("round 2/20")
    line.print("done")
    assert term.getvalue().startswith("\rround 1/20, accuracy 10.00 %\rround 2/20")
    assert term.getvalue().endswith("\rdone\n") and term.getvalue().count("\n") == 1


def test_tune_prints_each_round_of_a_running_trial_and_marks_chance_level(tmp_path, capsys):
    out = tmp_path / "out"
    file = tune_file(tmp_path, "lr = { log = [1e-9, 1e-8] }", rounds=2)  # learns nothing
    assert main(["tune", "-c", str(file), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "fedavg trial 0 seed 100: round 1/2, accuracy" in printed
    assert "fedavg trial 0 seed 100: round 2/2, accuracy" in printed
    assert "[chance level (10 % with 10 classes)]" in printed
    assert "complete, chance level (10 % with 10 classes)" in (out / "tune_report.md").read_text()
