"""Kill -9 inside every kind of file write, then resume (issue 15).

A small run (SCAFFOLD, whose clients keep state in the checkpoint, on digits, 3 rounds) is
killed with SIGKILL at chosen points: in the middle of a write, between a temp file and
its rename, after a rename before the folder's fsync, between a round's checkpoint and its
metrics line, in the middle of a metrics line, before the final rename, at a random time,
and again while a resume rewrites metrics.jsonl. Each is then resumed with
``fedskew run --resume``; every resumed run must equal the uninterrupted one in every
metrics line, the summary, the configuration and the final model (timing keys and
processes.jsonl aside). The kills are done from outside the package by tests/kill_child.py;
benchmarks/kill_soak.py runs many random ones.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

from kill_child import differences

HERE = Path(__file__).resolve().parent
ARGV = ["run", "--algorithm=scaffold", "--num-clients=4", "--clients-per-round=2",
        "--rounds=3", "--local-epochs=1", "--workers=0", "--seed=2", "--quiet"]  # fmt: skip


def at(event: str, occurrence: int = 1) -> dict:
    return {"event": event, "occurrence": occurrence}


# name -> kills: of the fresh run, then of the resumes (resumes go on until it finishes)
SCENARIOS = {
    # Before config.json is in place: nothing to resume, nothing lost.
    "mid-partition-write": [at("write:partition.npz")],
    "config-before-rename": [at("replace:config.json")],
    # During the rounds.
    "config-after-rename": [at("replaced:config.json")],
    "mid-processes-line": [at("write:processes.jsonl")],
    "mid-checkpoint-write": [at("write:checkpoint.npz", 3)],
    "checkpoint-before-rename": [at("replace:checkpoint.npz", 2)],
    "checkpoint-after-rename": [at("replaced:checkpoint.npz", 1)],
    "between-checkpoint-and-metrics": [at("open:metrics.jsonl", 2)],
    "mid-metrics-line": [at("write:metrics.jsonl", 3)],
    "metrics-before-fsync": [at("fsync:metrics.jsonl", 1)],
    # At the end.
    "mid-summary-write": [at("write:summary.json")],
    "before-final-rename": [at("replace:folder")],
    "after-final-rename": [at("replaced:folder")],
    # Chained: killed again while the resume rewrites metrics.jsonl, then in round 3.
    "twice-in-resume": [
        at("open:metrics.jsonl", 2),
        at("write:metrics.jsonl", 1),
        at("replace:checkpoint.npz", 1),
    ],
    "at-random-time": [{"after": round(random.uniform(0.05, 1.5), 3)}],
}
NOT_RESUMABLE = {"mid-partition-write", "config-before-rename"}


def test_kill_anywhere_then_resume_equals_the_uninterrupted_run(tmp_path):
    plan = {
        "argv": ARGV,
        "out": str(tmp_path / "out"),
        "reference": "reference",
        "scenarios": [{"name": n, "kills": k} for n, k in SCENARIOS.items()],
    }
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    proc = subprocess.run(
        [sys.executable, str(HERE / "kill_child.py"), str(tmp_path / "plan.json"),
         str(tmp_path / "result.json")],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["reference_code"] == 0
    reference = tmp_path / "out" / "reference"
    events = set(result["trace"])
    for (name, kills), outcome in zip(SCENARIOS.items(), result["scenarios"], strict=True):
        steps = outcome["steps"]
        for number, kill in enumerate(kills):
            if "event" in kill:
                assert kill["event"] in events, (name, kill)  # such a point exists
                assert steps[number]["code"] == -9, (name, number, steps)  # killed there
        for step in steps:
            assert step["code"] in (0, -9, 1), (name, step)
            assert "Traceback" not in step["log"], (name, step["log"])
        folder = tmp_path / "out" / f"{name}.incomplete"
        if steps[-1]["code"] == 1:
            # Only a kill before config.json was in place: the resume says so in one line,
            # and the folder has no round to lose.
            assert name in NOT_RESUMABLE or "after" in kills[0], (name, steps)
            assert "no config.json" in steps[-1]["log"], (name, steps[-1])
            assert steps[-1]["log"].count("\n") == 1, steps[-1]["log"]
            assert not (folder / "metrics.jsonl").exists()
            assert not (folder / "checkpoint.npz").exists()
            continue
        assert name not in NOT_RESUMABLE, (name, steps)
        if outcome["finished"] is None:
            # Only a kill at a random time before the folder existed: nothing to resume.
            assert "after" in kills[0] and not folder.exists(), (name, steps)
            continue
        assert differences(Path(outcome["finished"]), reference) == [], name
