"""SIGKILL of a Flower ServerApp running central DP with adaptive clipping under SecAgg+,
then a resume: the resumed run equals the uninterrupted one (issue 50).

The ServerApp's body (``fedskew.apps.flower.server.serve``) runs over the in-memory grid of
tests/flower_grid.py, with Flower's SecAgg+ mods on the ClientApp side, in a forked child.
tests/kill_child.py's instrumentation SIGKILLs the child inside the run folder's writes (the
checkpoint between its temp file and its rename, a metrics line half written) or at a random
time; the parent then resumes the folder in another child until it finishes, and compares
every metrics line, the privacy accounting (epsilon, the clip norm, the noise) and the
final model with the uninterrupted run's.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import traceback
from pathlib import Path

import pytest

pytest.importorskip("dp_accounting")
pytest.importorskip("flwr")

from kill_child import Killer, differences, instrument  # noqa: E402

EXTRA = dict(
    algorithm="fedavg", num_clients=4, clients_per_round=3, rounds=3, local_epochs=1,
    quiet=True, workers=0, secure_aggregation=True, dp="central", dp_clipping="adaptive",
    dp_clip=0.5, seed=3,
)  # fmt: skip


def child(out: Path, name: str, spec: dict | None, resume: Path | None, log: Path) -> int:
    """Fork; the child serves the run (or resumes ``resume``) under the kill ``spec``."""
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 2)
            killer = Killer(spec)
            instrument(killer)
            if spec and "after" in spec:
                timer = threading.Timer(spec["after"], os.kill, (os.getpid(), signal.SIGKILL))
                timer.daemon = True
                timer.start()
            from flower_grid import LocalGrid

            from fedskew.apps.flower.server import serve
            from fedskew.config import build_config

            cfg = build_config({}, {**EXTRA, "out_dir": str(out), "name": name})
            serve(LocalGrid(EXTRA["num_clients"]), cfg, resume=resume)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


KILLS = {
    "checkpoint-before-rename": {"event": "replace:checkpoint.npz", "occurrence": 2},
    "mid-metrics-line": {"event": "write:metrics.jsonl", "occurrence": 2},
    "at-random-time": {"after": round(random.uniform(1.0, 6.0), 2)},
}


def test_a_killed_dp_secagg_flower_run_resumes_to_the_same_run(tmp_path):
    out = tmp_path / "out"
    assert child(out, "reference", None, None, tmp_path / "reference.log") == 0
    reference = out / "reference"
    for name, spec in KILLS.items():
        first = child(out, name, spec, None, tmp_path / f"{name}-0.log")
        folder = out / f"{name}.incomplete"
        if "event" in spec:
            assert first == -9, (name, (tmp_path / f"{name}-0.log").read_text()[-2000:])
        for attempt in range(1, 4):
            if (out / name).is_dir() or not (folder / "config.json").exists():
                break
            log = tmp_path / f"{name}-{attempt}.log"
            assert child(out, name, None, folder, log) == 0, log.read_text()[-2000:]
        if not (out / name).is_dir():
            # Only a random kill before the folder had its configuration: nothing to resume.
            assert "after" in spec and not (folder / "config.json").exists(), name
            continue
        assert differences(out / name, reference) == [], name
