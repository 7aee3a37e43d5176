"""`fedskew tune`: each method gets its budget of trials (pruner on), a killed tune resumes
its cut-off trial's run folder, two tune processes on one SQLite study share the budget
without running a trial twice, the tuned compare file reproduces the best trial exactly, and
bad input is one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from run_metrics import rows

optuna = pytest.importorskip("optuna")

from fedskew.apps.cli import main  # noqa: E402
from fedskew.grid.plan import grid_from, plan, read_file  # noqa: E402
from fedskew.runs.loop import run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

TUNE = """
[tune]
trials = {trials}
seeds = [100]
last = 2
pruner = "{pruner}"
pruner_warmup = {warmup}

[compare]
seeds = [0, 1]
threads = 1

[experiment]
dataset = "digits"
# The partition the pruning expectations below were written against (NIID-Bench's loop, what
# dirichlet was before partition_version 2): with another draw no trial may be weak enough.
partition = "dirichlet-niidbench"
num_clients = 4
clients_per_round = 2
rounds = 2
local_epochs = 1
batch_size = 64
{methods}
"""

TWO_METHODS = """
[methods.fedavg.search]
lr = { log = [0.01, 0.1] }

[methods.prox]
algorithm = "fedprox"
[methods.prox.search]
lr = { log = [0.01, 0.1] }
params.mu = { choice = [0.01, 0.1] }
"""

ONE_METHOD = """
[methods.fedavg.search]
lr = { log = [0.01, 0.1] }
"""


def tune_file(
    tmp_path: Path, trials: int, methods: str, pruner: str = "median", warmup: int = 0
) -> Path:
    file = tmp_path / "study.toml"
    file.write_text(TUNE.format(trials=trials, pruner=pruner, methods=methods, warmup=warmup))
    return file


def study(out: Path, method: str, name: str = "study") -> optuna.Study:
    storage = f"sqlite:///{(out / 'study.db').resolve()}"
    return optuna.load_study(study_name=f"{name}.{method}", storage=storage)


def finished(s: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    done = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    return s.get_trials(deepcopy=False, states=done)


def env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def test_two_methods_get_their_budget_and_the_tuned_file_reproduces_the_best(tmp_path, capsys):
    file = tune_file(tmp_path, 3, TWO_METHODS, pruner="successive-halving")
    out = tmp_path / "tuned"
    assert main(["tune", "-c", str(file), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "3 trials per method" in printed and "params.mu in [0.01, 0.1]" in printed
    pruned = []
    for method in ("fedavg", "prox"):
        trials = finished(study(out, method))
        assert len(trials) == 3
        pruned += [f"{method}-t{t.number}" for t in trials if t.state.name == "PRUNED"]
    assert pruned and "pruned at round 1" in printed  # the weakest draw, after one round
    assert (out / "trials" / f"{pruned[0]}-s100.incomplete" / "metrics.jsonl").is_file()
    record = json.loads((out / "tune.json").read_text())
    assert record["trials_per_method"] == 3 and record["tuning_seeds"] == [100]
    assert record["search_space"]["prox"] == {
        "lr": {"log": [0.01, 0.1]},
        "params.mu": {"choice": [0.01, 0.1]},
    }
    assert (out / "tune_report.md").read_text().count("| best so far (%) |") == 2
    pictures = sorted(p.name for p in (out / "tune_report_files").iterdir())
    assert pictures == [
        f"tune_{m}_{k}.png" for m in ("fedavg", "prox") for k in ("history", "slices")
    ]
    assert all((out / "tune_report_files" / n).read_bytes()[:4] == b"\x89PNG" for n in pictures)
    assert 'src="data:image/png;base64,' in (out / "tune_report.html").read_text()

    # The tuned compare file, run on the tuning seed with the trials' validation split,
    # gives the best trial's rounds exactly.
    best = record["results"]["prox"]
    tuned = json.loads((out / "tuned.json").read_text())
    assert tuned["compare"]["seeds"] == [0, 1] and tuned["compare"]["out_dir"].endswith(
        "evaluation"
    )
    assert tuned["methods"]["prox"]["params"]["mu"] == best["best_params"]["params.mu"]
    split = {"validation_fraction": record["validation"]["fraction"]}
    grid = grid_from(read_file(out / "tuned.json"), "tuned.json", split, ["prox"],
                     {"seeds": [100]})  # fmt: skip
    (planned,) = plan(grid)
    folder, _ = run(planned.cfg)  # as compare's run process runs it, here in-process
    assert rows(folder) == rows(out / "trials" / best["best_folders"][0])


KILL_AFTER_FIRST_ROUND = """
import os, signal, sys
import fedskew.grid.tune as tune
real = tune.run
def killed_after_a_round(cfg, on_round=None, **kwargs):
    def hook(record):
        on_round(record)
        os.kill(os.getpid(), signal.SIGKILL)
    return real(cfg, on_round=hook, **kwargs)
tune.run = killed_after_a_round
from fedskew.apps.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_killed_tune_resumes_its_cut_off_trial(tmp_path):
    file = tune_file(tmp_path, 2, ONE_METHOD)
    out = tmp_path / "tuned"
    cmd = [sys.executable, "-c", KILL_AFTER_FIRST_ROUND, "tune", "-c", str(file), "-o", str(out)]
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    cut = out / "trials" / "fedavg-t0-s100.incomplete"
    assert len((cut / "metrics.jsonl").read_text().splitlines()) == 1

    assert main(["tune", "-c", str(file), "-o", str(out)]) == 0
    trials = study(out, "fedavg").get_trials(deepcopy=False)
    states = [t.state.name for t in trials]
    assert states == ["FAIL", "COMPLETE", "COMPLETE"]  # the cut-off trial, its retry, one more
    retry = trials[1]
    assert retry.user_attrs["folder"] == "fedavg-t0" and retry.user_attrs["retry_of"] == 0
    assert retry.user_attrs["slot"] == 0  # its place in the study, as the uninterrupted one
    assert retry.params == trials[0].params
    resumed = out / "trials" / "fedavg-t0-s100"
    assert len(rows(resumed)) == 2 and not cut.exists()
    processes = (resumed / "processes.jsonl").read_text().splitlines()
    assert len(processes) == 2  # round 1 by the killed process, round 2 by the resume
    assert json.loads((out / "tune.json").read_text())["results"]["fedavg"]["trials"] == {
        "complete": 2
    }


def test_two_processes_share_one_study_without_running_a_trial_twice(tmp_path):
    file = tune_file(tmp_path, 3, ONE_METHOD)
    out = tmp_path / "tuned"
    cmd = [sys.executable, "-m", "fedskew", "tune", "-c", str(file), "-o", str(out)]
    procs = [subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]  # fmt: skip
    outputs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    trials = study(out, "fedavg").get_trials(deepcopy=False)
    assert sorted(t.number for t in finished(study(out, "fedavg"))) == [0, 1, 2]
    assert len(trials) == 3
    folders = sorted(p.name for p in (out / "trials").iterdir())
    assert folders == [f"fedavg-t{n}-s100" for n in range(3)]
    for folder in folders:  # each trial ran once, by one process
        assert len((out / "trials" / folder / "processes.jsonl").read_text().splitlines()) == 1
    ran = [line for o, _ in outputs for line in o.splitlines() if "] trial " in line]
    assert len(ran) == 3


@pytest.mark.parametrize(
    ("search", "message"),
    [
        ("lr = { log = [0.01, 0.1] }\nparams.nope = { int = [0, 3] }", "nope"),
        ("lr = { float = [0.1, 0.1] }", "low must be below high"),
        ("lr = { log = [0.0, 0.1] }", "a log range needs low > 0"),
        ("lr = { uniform = [0.0, 0.1] }", "unknown kind 'uniform'"),
        ("learning_rate = { log = [0.01, 0.1] }", "unknown option 'learning_rate'"),
        ("num_clients = { int = [2, 4] }", "decides the partition"),
    ],
)
def test_a_bad_search_space_is_one_line(tmp_path, capsys, search, message):
    file = tune_file(tmp_path, 2, f"[methods.fedavg.search]\n{search}\n")
    assert main(["tune", "-c", str(file), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_tuning_seeds_that_are_evaluation_seeds_are_refused(tmp_path, capsys):
    file = tune_file(tmp_path, 2, ONE_METHOD)
    file.write_text(file.read_text().replace("seeds = [0, 1]", "seeds = [0, 100]"))
    assert main(["tune", "-c", str(file)]) == 2
    err = capsys.readouterr().err
    assert "share [100]" in err and err.count("\n") == 1


def test_without_optuna_tune_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "optuna", None)  # import optuna raises ImportError
    assert main(["tune", "-c", str(tune_file(tmp_path, 2, ONE_METHOD))]) == 2
    assert "pip install 'fedskew[tune]'" in capsys.readouterr().err


def test_compare_reads_past_the_tune_tables(tmp_path):
    file = tune_file(tmp_path, 2, TWO_METHODS)
    grid = grid_from(read_file(file), str(file), {}, None, {})
    assert grid.methods["prox"] == {"algorithm": "fedprox"} and grid.seeds == [0, 1]


@pytest.mark.parametrize(("warmup", "startup"), [(0, 1), (2, 1), (2, 3)])
def test_the_pruner_waits_for_its_warmup_rounds_and_startup_trials(warmup, startup):
    """A trial far below the others is pruned at the first round after `pruner_warmup`
    rounds, and only once `pruner_startup` trials have completed."""
    from fedskew.grid.tune import make_pruner

    s = optuna.create_study(direction="maximize", pruner=make_pruner("median", warmup, startup))
    for _ in range(2):  # two good trials, complete
        good = s.ask()
        for rnd in range(1, 6):
            good.report(50.0 + rnd, rnd)
        s.tell(good, 55.0)
    bad = s.ask()
    stopped = None
    for rnd in range(1, 6):
        bad.report(10.0, rnd)
        if bad.should_prune():
            stopped = rnd
            break
    assert stopped == (warmup + 1 if startup <= 2 else None)


def test_pruner_warmup_is_recorded_and_checked(tmp_path, capsys):
    file = tune_file(tmp_path, 2, ONE_METHOD)
    text = file.read_text().replace("pruner_warmup = 0", "pruner_warmup = 1")
    file.write_text(text)
    out = tmp_path / "tuned"
    assert main(["tune", "-c", str(file), "-o", str(out)]) == 0
    assert (
        "pruner median (from 1 rounds after the round in which a trial's last mechanism "
        "first acted, once 5 trials completed)" in (capsys.readouterr().out)
    )
    record = json.loads((out / "tune.json").read_text())
    assert (record["pruner_warmup"], record["pruner_startup"]) == (1, 5)
    file.write_text(text.replace("pruner_warmup = 1", "pruner_warmup = -1"))
    assert main(["tune", "-c", str(file), "-o", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert "pruner_warmup (rounds) must be an integer >= 0" in err and err.count("\n") == 1


def test_the_default_storage_is_named_by_its_place_not_its_absolute_path(tmp_path):
    """A committed report says where the study is, not where it first ran; another storage
    keeps its URL, without the password."""
    from fedskew.grid.tune import tune_from
    from fedskew.grid.tune_results import budget_lines

    file = tune_file(tmp_path, 2, ONE_METHOD)
    raw = read_file(str(file))
    out = str(tmp_path / "tuned")
    tune = tune_from(raw, str(file), {}, None, {"out_dir": out})
    first = budget_lines(tune)[0]
    assert "study.db in the study's folder" in first and str(tmp_path) not in first.split("(")[1]
    raw["tune"]["storage"] = "postgresql://fl:secret@db.example/studies"
    tune = tune_from(raw, str(file), {}, None, {"out_dir": out})
    first = budget_lines(tune)[0]
    assert "db.example/studies" in first and "secret" not in first


def test_pruner_steps_run_on_from_one_tuning_seed_to_the_next(tmp_path):
    """The step a trial reports a round at and the (seed, round) a report names read back
    each other: seed after seed, one step per round."""
    from fedskew.grid.tune import step_round, trial_step, tune_from

    file = tune_file(tmp_path, 2, ONE_METHOD)
    file.write_text(file.read_text().replace("seeds = [100]", "seeds = [100, 101]"))
    tune = tune_from(read_file(file), str(file), {}, None, {})
    rounds = tune.runs["fedavg"][100].cfg.rounds
    assert rounds == 2
    steps = [trial_step(tune, "fedavg", i, rnd) for i in range(2) for rnd in (1, 2)]
    assert steps == [1, 2, 3, 4]
    assert [step_round(tune, "fedavg", s) for s in steps] == [
        (100, 1),
        (100, 2),
        (101, 1),
        (101, 2),
    ]
