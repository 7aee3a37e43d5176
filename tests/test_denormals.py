"""Denormal floats: flushed to zero by default in every process and thread that trains or
evaluates (the run's own, worker processes, Flower clients), kept with ``--denormals keep``,
recorded in the run folder, and run folders from before the option resume as they ran."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from fedskew.config import (
    EXECUTION_ONLY,
    LEGACY,
    MEASUREMENT_ONLY,
    ExperimentConfig,
    build_config,
    config_hash,
)
from fedskew.core.denormals import apply_denormals, denormals_state
from fedskew.core.errors import UsageError
from fedskew.runs.folder import saved_config
from fedskew.runs.loop import run

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(num_clients=4, clients_per_round=2, rounds=2, local_epochs=1, quiet=True)


class Killed(Exception):
    pass


def processes(folder: Path) -> list[dict]:
    return [json.loads(x) for x in (folder / "processes.jsonl").read_text().splitlines()]


def curves(folder: Path) -> list[tuple]:
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    return [(r["round"], r["accuracy"], r["loss"], r.get("train_loss")) for r in rows]


def in_thread(fn):
    """fn's result, computed in a new thread (a thread pool of its own)."""
    out: list = []
    errors: list = []

    def body():
        try:
            out.append(fn())
        except BaseException as exc:  # handed to the test's thread
            errors.append(exc)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return out[0]


def test_apply_reaches_every_thread_of_a_pool_that_already_runs():
    """torch.set_flush_denormal sets the calling thread only; a pool started before keeps
    its threads' behaviour unless they are reached one by one."""
    script = (
        "import torch\n"
        "from fedskew.core.denormals import apply_denormals, denormals_state\n"
        "torch.set_num_threads(2)\n"
        "x = torch.full((1 << 18,), 1e-39); (x * 1.0).sum()\n"  # the pool is running now
        "torch.set_flush_denormal(True)\n"
        "print(denormals_state())\n"  # what torch's own call gives
        "print(apply_denormals('flush'), denormals_state())\n"
        "print(apply_denormals('keep'), denormals_state())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    assert lines[0] == "mixed"  # why apply_denormals exists
    assert lines[1] == "flush flush"
    assert lines[2] == "keep keep"


def test_the_option_is_checked_and_defaults_to_flush():
    assert ExperimentConfig().denormals == "flush"
    with pytest.raises(UsageError, match="denormals must be one of flush, keep"):
        build_config({}, {"denormals": "zero"}).validate()


def test_a_run_and_its_worker_processes_flush_and_record_it(tmp_path):
    before = denormals_state()
    folder, _ = run(ExperimentConfig(**TINY, workers=2, out_dir=str(tmp_path / "w")))
    (process,) = processes(folder)
    assert process["denormals"] == "flush"
    assert process["client_denormals"] == {"flush": 2}  # what each worker measured
    assert json.loads((folder / "config.json").read_text())["denormals"] == "flush"
    assert denormals_state() == before  # the caller's setting is put back after the run

    kept, _ = run(
        ExperimentConfig(**TINY, workers=2, denormals="keep", out_dir=str(tmp_path / "k"))
    )
    (process,) = processes(kept)
    assert process["denormals"] == "keep" and process["client_denormals"] == {"keep": 2}


def test_the_run_flushes_in_a_thread_whose_pool_kept_denormals(tmp_path):
    def body():
        apply_denormals("keep")
        folder, _ = run(ExperimentConfig(**TINY, workers=0, out_dir=str(tmp_path)))
        return processes(folder)[0]["denormals"], denormals_state()

    during, after = in_thread(body)
    assert during == "flush" and after == "keep"


@pytest.mark.skipif(importlib.util.find_spec("flwr") is None, reason="needs flwr")
def test_flower_clients_flush_in_the_threads_that_call_them(tmp_path):
    """The ClientApp is called from threads it did not start (Flower's simulation, or this
    test's): each node holds the run's setting while it handles a message, reports what it
    measured in its setup reply, which the server records, and leaves the calling thread
    as it found it (a test process's floats, say, must stay IEEE)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from flower_grid import LocalGrid

    from fedskew.apps.flower.server import serve

    def body():
        apply_denormals("keep")  # the server's handshake delivers in this very thread
        cfg = build_config({}, {**TINY, "out_dir": str(tmp_path)})
        folder, _ = serve(LocalGrid(4), cfg)
        return processes(folder)[0], denormals_state()

    process, after = in_thread(body)
    assert process["client_denormals"] == {"flush": 4}
    assert process["denormals"] == "flush"
    assert after == "keep"


def test_flushing_changes_the_numbers_only_by_rounding_and_is_repeatable(tmp_path):
    """Same settings, same metrics; flush against keep: the same run up to rounding."""
    a, _ = run(ExperimentConfig(**TINY, workers=0, out_dir=str(tmp_path / "a")))
    b, _ = run(ExperimentConfig(**TINY, workers=0, out_dir=str(tmp_path / "b")))
    k, _ = run(ExperimentConfig(**TINY, workers=0, denormals="keep", out_dir=str(tmp_path / "k")))
    assert curves(a) == curves(b)
    for flushed, kept in zip(curves(a), curves(k), strict=True):
        assert flushed[0] == kept[0]
        assert flushed[1] == pytest.approx(kept[1], abs=1 / 360)
        assert flushed[2] == pytest.approx(kept[2], rel=1e-3)


def test_a_folder_from_before_the_option_resumes_with_ieee_denormals(tmp_path):
    """A run folder whose config.json has no 'denormals' key ran with torch's default
    (kept): it resumes with that, its checkpoint's configuration hash still matches, and
    the resumed run ends with the metrics of an uninterrupted run that kept denormals."""
    # NIID-Bench's loop: what "dirichlet" drew when folders had no denormals key.
    legacy = dict(TINY, rounds=3, workers=0, partition="dirichlet-niidbench")
    reference, _ = run(ExperimentConfig(**legacy, denormals="keep", out_dir=str(tmp_path / "r")))

    def kill(record):
        if record["round"] == 1:
            raise Killed

    with pytest.raises(Killed):
        run(
            ExperimentConfig(**legacy, denormals="keep", out_dir=str(tmp_path / "old")),
            on_round=kill,
        )
    (unfinished,) = (tmp_path / "old").iterdir()
    config = json.loads((unfinished / "config.json").read_text())
    del config["denormals"]  # as a folder written before the option existed
    del config["partition_version"]  # which came later still
    config["partition"] = "dirichlet"
    (unfinished / "config.json").write_text(json.dumps(config))

    cfg = saved_config(unfinished)
    assert cfg.denormals == "keep"
    # What such a folder's config held: none of the options added since (config.LEGACY).
    old_style = {k: v for k, v in cfg.to_dict().items() if k not in LEGACY}
    old_style["partition"] = config["partition"]
    assert config_hash(cfg) == _old_hash(old_style)
    folder, _ = run(cfg, resume=unfinished)
    assert curves(folder) == curves(reference)
    assert [p["denormals"] for p in processes(folder)] == ["keep", "keep"]


def test_committed_run_folders_read_back_as_ieee_runs():
    """Every run folder committed before the option existed reads back as a run that kept
    denormals (so its report and a rerun of its grid describe what it computed)."""
    folders = sorted(p.parent for p in ROOT.glob("*/results/runs/**/config.json"))
    folders += sorted(p.parent for p in ROOT.glob("reproduction/runs/**/config.json"))
    old = [f for f in folders if "denormals" not in json.loads((f / "config.json").read_text())]
    if not old:
        pytest.skip("no committed run folder predates the option")
    for folder in old[:5]:
        assert saved_config(folder).denormals == "keep", folder


def _old_hash(values: dict) -> str:
    """The configuration hash as it was computed before the option existed: sha256 of the
    sorted JSON of every key but the execution and measurement ones, first 16 digits."""
    skip = set(EXECUTION_ONLY) | set(MEASUREMENT_ONLY)
    kept = {k: v for k, v in values.items() if k not in skip}
    text = json.dumps(kept, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
