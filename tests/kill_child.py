"""SIGKILL at chosen points of ``fedskew run``, then ``fedskew run --resume`` (issue 15).

Not a test module: tests/test_kill.py and benchmarks/kill_soak.py use it, as a script
(``python tests/kill_child.py PLAN.json RESULT.json``) or as a library. The script imports
fedskew once and forks one child per run; a child wraps, from outside the package, the
primitives of ``fedskew.core.durable`` (open, each write, fsync, rename) and the final rename of
``fedskew.runs.folder``, counts these events as ``kind:file``, and at the chosen event kills
itself with SIGKILL (at a write, after writing half of its bytes), or kills itself after a
delay; then it calls ``fedskew.apps.cli.main``. The package has no hook for this.

Event kinds: ``open`` (before a file is opened for writing), ``write`` (each write call),
``fsync`` (before a file's or folder's fsync), ``replace`` (temp file complete, before the
rename), ``replaced`` (after the rename, before the folder's fsync). Files are named
without ``.tmp``; the run folder's final rename is ``folder``.

A kill spec: None (no kill), ``{"event": "write:metrics.jsonl", "occurrence": 3}``,
``{"index": 17}`` (the 18th event of the run), or ``{"after": 0.8}`` (seconds into main).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

TIMING = ("seconds", "eval_seconds")
SUMMARY_TIMING = ("train_seconds", "eval_seconds", "wall_seconds_this_process", "processes",
                  "train_samples_per_second")  # fmt: skip

# ----------------------------------------------------------------- inside a child


class Killer:
    """Counts events; SIGKILLs this process at the one its spec names."""

    def __init__(self, spec: dict[str, Any] | None) -> None:
        self.spec = spec or {}
        self.counts: dict[str, int] = {}
        self.trace: list[str] = []

    def event(self, kind: str, name: str, before_kill=None) -> None:
        key = f"{kind}:{name}"
        self.counts[key] = self.counts.get(key, 0) + 1
        index = len(self.trace)
        self.trace.append(key)
        spec = self.spec
        if spec.get("index") == index or (
            spec.get("event") == key and spec.get("occurrence", 1) == self.counts[key]
        ):
            if before_kill is not None:
                before_kill()
            os.kill(os.getpid(), signal.SIGKILL)


def _label(path: Any) -> str:
    name = Path(path).name
    return re.sub(r"\.\d+-\d+\.tmp$", "", name)


class _File:
    """A file opened by fedskew.core.durable: each write is an event."""

    def __init__(self, fh: Any, name: str, killer: Killer, fd_names: dict[int, str]) -> None:
        self._fh, self._name, self._killer = fh, name, killer
        fd_names[fh.fileno()] = name

    def write(self, data: Any) -> Any:
        def half() -> None:  # a kill in the middle of this write
            self._fh.write(data[: len(data) // 2])
            self._fh.flush()

        self._killer.event("write", self._name, half)
        return self._fh.write(data)

    def __enter__(self) -> _File:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._fh.close()

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._fh, attr)


class _Os:
    """``os`` as fedskew.core.durable and fedskew.runs.folder see it: fsync and rename are
    events."""

    def __init__(self, killer: Killer, fd_names: dict[int, str]) -> None:
        self._killer, self._fd_names = killer, fd_names

    def __getattr__(self, attr: str) -> Any:
        return getattr(os, attr)

    def open(self, path: Any, flags: int, *args: Any) -> int:
        fd = os.open(path, flags, *args)
        self._fd_names[fd] = "dir"
        return fd

    def fsync(self, fd: int) -> None:
        self._killer.event("fsync", self._fd_names.get(fd, "?"))
        os.fsync(fd)

    def replace(self, src: Any, dst: Any) -> None:
        name = "folder" if Path(src).is_dir() else _label(dst)
        self._killer.event("replace", name)
        os.replace(src, dst)
        self._killer.event("replaced", name)


def instrument(killer: Killer) -> None:
    import fedskew.core.durable as durable
    import fedskew.runs.folder as runfolder

    fd_names: dict[int, str] = {}

    def open_(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        name = _label(path)
        killer.event("open", name)
        return _File(open(path, mode, *args, **kwargs), name, killer, fd_names)

    durable.open = open_  # a module global shadows the builtin
    durable.os = _Os(killer, fd_names)
    runfolder.os = _Os(killer, fd_names)


def run_child(argv: list[str], spec: dict | None, log: Path, trace: Path | None) -> int:
    """Fork; the child runs ``fedskew`` with ``argv`` and the kill ``spec``, its stderr to
    ``log``. The parent's result: the exit code, or -9 for a SIGKILL."""
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 70
        killer = Killer(spec)
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 2)
            os.dup2(fd, 1)
            sys.stderr = os.fdopen(2, "w", buffering=1)
            sys.stdout = os.fdopen(1, "w", buffering=1)
            instrument(killer)
            if spec and "after" in spec:
                timer = threading.Timer(spec["after"], os.kill, (os.getpid(), signal.SIGKILL))
                timer.daemon = True
                timer.start()
            from fedskew.apps.cli import main

            code = main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 2
        except BaseException:
            traceback.print_exc()
            code = 70
        finally:
            if trace is not None:
                trace.write_text(json.dumps(killer.trace))
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


# -------------------------------------------------------------- scenarios and checks


def run_scenario(argv: list[str], out: Path, name: str, kills: list[dict | None],
                 work: Path, max_resumes: int = 6) -> dict[str, Any]:  # fmt: skip
    """A fresh run killed at ``kills[0]``, resumes killed at ``kills[1:]``, then resumes
    until the run is finished (or a resume fails). Returns each step's outcome."""
    work.mkdir(parents=True, exist_ok=True)
    steps: list[dict[str, Any]] = []
    folder = out / f"{name}.incomplete"
    for attempt in range(len(kills) + max_resumes):
        spec = kills[attempt] if attempt < len(kills) else None
        if attempt == 0:
            args = [*argv, f"--out-dir={out}", f"--name={name}"]
        elif folder.exists():
            args = ["run", "--resume", str(folder), "--quiet"]
        else:
            break
        log = work / f"step{attempt}.log"
        code = run_child(args, spec, log, None)
        steps.append({"args": args, "kill": spec, "code": code, "log": log.read_text()})
        if code not in (0, -9):
            break
    return {"steps": steps, "finished": str(out / name) if (out / name).is_dir() else None}


def metrics_lines(folder: Path) -> list[dict]:
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def differences(folder: Path, reference: Path) -> list[str]:
    """How a finished run folder differs from the reference (timing and processes.jsonl
    aside): every metrics line, the summary, the configuration, the final model."""
    import numpy as np

    from fedskew.runs.checkpoint import read_checkpoint

    found = []
    if sorted(p.name for p in folder.iterdir()) != sorted(p.name for p in reference.iterdir()):
        found.append(f"files {sorted(p.name for p in folder.iterdir())}")
    if metrics_lines(folder) != metrics_lines(reference):
        found.append("metrics.jsonl")

    def summary(f: Path) -> dict:
        s = json.loads((f / "summary.json").read_text())
        return {k: v for k, v in s.items() if k not in SUMMARY_TIMING}

    if summary(folder) != summary(reference):
        found.append("summary.json")

    def config(f: Path) -> dict:  # the run's name aside
        return {k: v for k, v in json.loads((f / "config.json").read_text()).items()
                if k != "name"}  # fmt: skip

    if config(folder) != config(reference):
        found.append("config.json")
    a = read_checkpoint(folder / "checkpoint.npz").server["global_arrays"]
    b = read_checkpoint(reference / "checkpoint.npz").server["global_arrays"]
    if a.keys() != b.keys() or any(not np.array_equal(a[k], b[k]) for k in a):
        found.append("checkpoint.npz (final model)")
    return found


def warm_up(argv: list[str], out: Path) -> None:
    """One round in this process before any fork: the children start with every module
    imported (a run imports many lazily; seconds of CPU per child otherwise). One torch
    thread, so that no thread pool is copied into the forks."""
    import torch

    from fedskew.apps.cli import main

    torch.set_num_threads(1)
    assert main([*argv, "--rounds=1", f"--out-dir={out}", "--name=warm-up"]) == 0


def main() -> int:
    """``kill_child.py PLAN RESULT``: PLAN holds {"argv", "out", "reference", "trace",
    "scenarios": [{"name", "kills"}]}; the reference run goes first (with its event trace),
    then every scenario; RESULT gets their outcomes."""
    plan = json.loads(Path(sys.argv[1]).read_text())
    out, work = Path(plan["out"]), Path(plan["out"]) / "logs"
    work.mkdir(parents=True, exist_ok=True)
    warm_up(plan["argv"], work / "warm-up")

    reference = plan["reference"]
    trace = work / "trace.json"
    code = run_child([*plan["argv"], f"--out-dir={out}", f"--name={reference}"], None,
                     work / "reference.log", trace)  # fmt: skip
    result: dict[str, Any] = {"reference_code": code, "trace": json.loads(trace.read_text())}
    result["scenarios"] = [
        run_scenario(plan["argv"], out, s["name"], s["kills"], work / s["name"])
        for s in plan["scenarios"]
    ]
    Path(sys.argv[2]).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
