"""A tuning study is the same whether or not it was killed and resumed, and on one process
or several (``--jobs``): the same trials (values, states, objectives, where the pruner
stopped them) and the same tuned.json. A trial's values are drawn by its slot (its place in
the uninterrupted study), from the trials before its batch only."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

optuna = pytest.importorskip("optuna")

from fedskew.apps.cli import main  # noqa: E402
from fedskew.grid.tune import held, slot_of  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# Tiny: 5 trials of 3 rounds on the embedded digits, 4 clients; the median pruner judges from
# the first round once one trial completed, so pruning decisions are part of what must agree.
TUNE = """
[tune]
trials = 5
seeds = [100]
last = 2
pruner = "median"
pruner_warmup = 0
pruner_startup = 1
sampler = "tpe"
batch = {batch}

[compare]
seeds = [0]
threads = 1

[experiment]
dataset = "digits"
num_clients = 4
clients_per_round = 2
rounds = 3
local_epochs = 1
batch_size = 64

[methods.fedavg.search]
lr = {{ log = [0.001, 0.5] }}
momentum = {{ float = [0.0, 0.9] }}
"""


def tune_file(tmp_path: Path, batch: int = 1) -> Path:
    file = tmp_path / "study.toml"
    file.write_text(TUNE.format(batch=batch))
    return file


def env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def outcome(out: Path) -> dict[str, Any]:
    """What a study decided, by slot, and its tuned methods (the folder names aside)."""
    storage = f"sqlite:///{(out / 'study.db').resolve()}"
    study = optuna.load_study(study_name="study.fedavg", storage=storage)
    slots = {
        slot: (t.state.name, t.params, t.value, dict(t.intermediate_values))
        for slot, t in held(study.get_trials(deepcopy=False)).items()
    }
    tuned = json.loads((out / "tuned.json").read_text())
    return {"slots": slots, "methods": tuned["methods"]}


def reference(tmp_path: Path, batch: int) -> dict[str, Any]:
    out = tmp_path / "reference"
    assert main(["tune", "-c", str(tune_file(tmp_path, batch)), "-o", str(out)]) == 0
    found = outcome(out)
    assert len(found["slots"]) == 5
    assert {s for s, *_ in found["slots"].values()} >= {"COMPLETE", "PRUNED"}
    return found


def rounds_written(out: Path) -> int:
    """Metrics lines written by every trial so far: the study's progress, whatever the
    machine's speed."""
    total = 0
    for path in (out / "trials").glob("*/metrics.jsonl"):
        try:
            total += path.read_bytes().count(b"\n")
        except OSError:  # renamed from .incomplete as it was read
            pass
    return total


def killed_run(file: Path, out: Path, extra: list[str], marks: list[int]) -> int:
    """Run tune, SIGKILL it (and any --jobs children) once the trials have written each
    mark's number of rounds (counted over all the trials' folders), then finish it; the
    number of kills that landed. Kills follow the study's progress, not the clock, so a slow
    or a fast machine kills at the same points."""
    cmd = [sys.executable, "-m", "fedskew", "tune", "-c", str(file), "-o", str(out), *extra]
    landed = 0
    for mark in marks:
        proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        while proc.poll() is None and rounds_written(out) < mark:
            time.sleep(0.01)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the whole group: kill -9 of every job
            landed += 1
        proc.wait(timeout=60)
    done = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return landed


def test_a_study_killed_at_random_moments_gives_the_uninterrupted_trials(tmp_path):
    expected = reference(tmp_path, batch=1)
    rng = random.Random(0)  # seeded: the moments vary over the run but the test is repeatable
    # 5 trials of 1 to 3 rounds (at least 7 in all): kills after 1 to 5 rounds, ascending so each
    # lands in the part of the study its restart has still to do.
    marks = sorted(rng.sample(range(1, 6), 3))
    out = tmp_path / "killed"
    landed = killed_run(tune_file(tmp_path), out, [], marks)
    assert landed >= 2
    assert outcome(out) == expected
    trials = optuna.load_study(study_name="study.fedavg",
                               storage=f"sqlite:///{out / 'study.db'}").get_trials()  # fmt: skip
    assert len(trials) > 5 or landed  # cut-off trials were retried in their slots
    assert sorted(slot_of(t) for t in held(trials).values()) == list(range(5))


def test_jobs_give_the_trials_of_one_process_even_when_killed(tmp_path):
    """--jobs 2 with batch 2: two trials at once, drawn from the same history; the same
    study as one process, and as one process after kills of both jobs."""
    expected = reference(tmp_path, batch=2)
    file = tune_file(tmp_path, batch=2)
    out = tmp_path / "jobs"
    cmd = ["tune", "-c", str(file), "-o", str(out), "--jobs", "2"]
    proc = subprocess.run([sys.executable, "-m", "fedskew", *cmd], env=env(),
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "[job 0]" in proc.stdout and "[job 1]" in proc.stdout
    assert "A new study created" not in proc.stdout + proc.stderr  # Optuna's INFO lines
    assert outcome(out) == expected
    out = tmp_path / "jobs-killed"
    killed_run(file, out, ["--jobs", "2"], [random.Random(1).randint(2, 6)])
    assert outcome(out) == expected


def test_batch_is_checked(tmp_path, capsys):
    file = tune_file(tmp_path)
    file.write_text(file.read_text().replace("batch = 1", "batch = 0"))
    assert main(["tune", "-c", str(file), "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "batch" in err and err.count("\n") == 1


def test_a_study_from_before_slots_continues_without_reusing_a_folder():
    """Its folders were numbered by Optuna's trial number, which counted a cut-off trial: a
    new trial takes the slot after the last, and its history is every finished one."""
    from types import SimpleNamespace

    from fedskew.grid.tune import counted, history, next_slot

    dist = {"lr": optuna.distributions.FloatDistribution(0.01, 0.1)}
    study = optuna.create_study(direction="maximize")
    state = optuna.trial.TrialState
    made = [("fedavg-t0", state.FAIL, None, {}), ("fedavg-t0", state.COMPLETE, 30.0,
            {"retry_of": 0}), ("fedavg-t2", state.COMPLETE, 40.0, {})]  # fmt: skip
    for folder, st, value, attrs in made:
        study.add_trial(
            optuna.trial.create_trial(
                state=st,
                value=value,
                params={"lr": 0.05},
                distributions=dist,
                user_attrs={"folder": folder, **attrs},
            )
        )
    trials = study.get_trials()
    assert counted(trials) == 2 and next_slot(trials) == 3
    past = history(SimpleNamespace(batch=1), 3, trials)
    assert [t.number for t in past] == [1, 2]
