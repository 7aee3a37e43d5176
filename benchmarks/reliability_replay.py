"""Replay of issue 50's concrete examples, run as a user would run them, on this tree's code.

    python benchmarks/reliability_replay.py [--only NAME ...] [--work DIR] [--no-write]

Each case is one example the issue gives (its classes and its "Still open from before" list):
the fedskew command(s) a careless or hostile user would type, on the embedded digits dataset
with 2-3 rounds, each under a timeout. A case is **clean** when every command it ran ended
within its timeout with no Python traceback on its output, and the case's own check of the
outcome held: a refusal is a non-zero exit whose standard error is one ``fedskew:`` line; a
run that is allowed finishes with the documented warning or with numbers that are what they
claim (finite epsilon, identical tuned.json, the thread count asked for, ...). Anything else
(a traceback, exit 0 with an empty or wrong result, a hang past the timeout) is **not clean**.

Three examples cannot be typed at a shell and are driven by a small Python script (still a
subprocess, with the public entry points): the deployment's ServerApp reading a refused run
config (as ``flwr-serverapp`` logs it), a SCAFFOLD client whose control deltas are extreme,
and nothing else. The examples already replayed by a test of the suite with the same
command (kill -9 of a tune trial, two tune processes, workers whose parent is killed) are
cited, not rerun; those too slow for this machine are listed as skipped, with why.

Writes ``benchmarks/results/reliability_replay.md`` and ``.json``: the machine, the commit,
each case's commands, expected and observed outcome, exit codes and last standard-error
line, and the clean/total count computed here. About 4 minutes on 2 loaded cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "src"))

TUNE = """\
[tune]
trials = 2
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
LR_SEARCH = "lr = { log = [0.01, 0.3] }"

GRID = """\
[compare]
out_dir = "{out}"
seeds = [0]
last = 1
{threads}
[experiment]
dataset = "digits"
num_clients = 4
clients_per_round = 2
rounds = 2
local_epochs = 1
batch_size = 64

[methods.fedavg]
"""
SMALL = ["-n", "4", "--clients-per-round", "2", "-r", "2", "--quiet"]


@dataclass
class Proc:
    """One command of a case and what it did."""

    command: list[str]
    rc: int | None  # None: killed at its timeout
    seconds: float
    stdout: str
    stderr: str

    @property
    def timed_out(self) -> bool:
        return self.rc is None

    @property
    def traceback(self) -> bool:
        return "Traceback (most recent call last)" in self.stderr + self.stdout

    @property
    def err_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]

    @property
    def last_err(self) -> str:
        lines = self.err_lines
        return lines[-1][:300] if lines else ""

    def shown(self) -> str:
        words = [w if w and " " not in w else repr(w) for w in self.command]
        return " ".join(words)


class Ctx:
    """A case's scratch folder and the commands it ran."""

    def __init__(self, work: Path, shared: dict[str, Any]) -> None:
        self.work = work
        self.shared = shared  # built once for several cases (the good tune study)
        self.procs: list[Proc] = []

    def env(self) -> dict[str, str]:
        path = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
        return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1",
                "PYTHONWARNINGS": "ignore"}  # fmt: skip

    def run(self, command: list[str], timeout: float) -> Proc:
        started = time.monotonic()
        proc = subprocess.Popen(command, cwd=self.work, env=self.env(), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)  # fmt: skip
        try:
            out, err = proc.communicate(timeout=timeout)
            rc: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the command and what it started, only ours
            out, err = proc.communicate()
            rc = None
        done = Proc(command, rc, round(time.monotonic() - started, 1), out, err)
        self.procs.append(done)
        return done

    def fedskew(self, *args: str, timeout: float = 90) -> Proc:
        return self.run([sys.executable, "-m", "fedskew", *args], timeout)

    def script(self, name: str, text: str, timeout: float = 120) -> Proc:
        path = self.work / name
        path.write_text(textwrap.dedent(text))
        return self.run([sys.executable, str(path)], timeout)

    def file(self, name: str, text: str) -> Path:
        path = self.work / name
        path.write_text(text)
        return path


Check = tuple[bool, str]


def refused(p: Proc, *needles: str, progress: bool = False) -> Check:
    """A clean refusal: non-zero exit, one ``fedskew:`` line on stderr saying ``needles``
    (``progress``: a command run without --quiet, whose progress lines come before it)."""
    if p.rc == 0:
        return False, "exit 0 where a refusal was expected"
    lines = p.err_lines[-1:] if progress else p.err_lines
    if len(lines) != 1 or not lines[0].startswith("fedskew:"):
        return False, f"exit {p.rc} but {len(lines)} stderr lines"
    missing = [n for n in needles if n.lower() not in lines[0].lower()]
    if missing:
        return False, f"the line does not say {missing}"
    return True, "refused in one line"


def finished(p: Proc) -> Check:
    return (p.rc == 0, "finished" if p.rc == 0 else f"exit {p.rc}: {p.last_err}")


@dataclass
class Case:
    name: str
    example: str  # the words
    expect: str  # the clean outcome
    body: Callable[[Ctx], Check]


CASES: list[Case] = []


def case(name: str, example: str, expect: str) -> Callable[[Callable[[Ctx], Check]], Any]:
    def register(body: Callable[[Ctx], Check]) -> Callable[[Ctx], Check]:
        CASES.append(Case(name, example, expect, body))
        return body

    return register


# --------------------------------------------------------------------------- tune


def tune_file(ctx: Ctx, name: str = "study.toml", rounds: int = 2, search: str = LR_SEARCH) -> str:
    return str(ctx.file(name, TUNE.format(rounds=rounds, search=search)))


def good_study(ctx: Ctx) -> tuple[Path, Path]:
    """A finished 2-trial study, made once and shared by the cases that read it."""
    if "study" not in ctx.shared:
        home = Path(ctx.shared["root"]) / "good-study"
        home.mkdir(exist_ok=True)
        sub = Ctx(home, ctx.shared)
        file = tune_file(sub)
        p = sub.fedskew("tune", "-c", file, "-o", str(home / "out"), timeout=180)
        ctx.procs.extend(sub.procs)
        ctx.shared["study"] = (Path(file), home / "out") if p.rc == 0 else None
    if ctx.shared["study"] is None:
        raise RuntimeError("the shared tune study did not finish")
    return ctx.shared["study"]


@case("tune-sqlite-memory", "an in-memory storage URL (sqlite://) is accepted",
      "refused in one line (for sqlite:// and sqlite:///:memory:)")  # fmt: skip
def _sqlite_memory(ctx: Ctx) -> Check:
    file = tune_file(ctx)
    for url in ("sqlite://", "sqlite:///:memory:"):
        ok, why = refused(ctx.fedskew("tune", "-c", file, "-o", "out", "--storage", url))
        if not ok:
            return False, f"{url}: {why}"
    return True, "both refused in one line"


@case("tune-results-only-good", "a later --results-only overwrites a good tuned.json with {}",
      "exit 0 and tuned.json's methods unchanged")  # fmt: skip
def _results_only_good(ctx: Ctx) -> Check:
    file, out = good_study(ctx)
    before = json.loads((out / "tuned.json").read_text())
    p = ctx.fedskew("tune", "-c", str(file), "-o", str(out), "--results-only")
    if p.rc != 0:
        return False, f"exit {p.rc}"
    after = json.loads((out / "tuned.json").read_text())
    if after != before or not after.get("methods"):
        return False, "tuned.json changed or is empty"
    return True, "tuned.json identical"


@case("tune-results-only-mistyped", "--results-only on a mistyped folder exits 0 with {}",
      "refused in one line; no folder made")  # fmt: skip
def _results_only_mistyped(ctx: Ctx) -> Check:
    file, out = good_study(ctx)
    typo = out.with_name("outt")
    ok, why = refused(ctx.fedskew("tune", "-c", str(file), "-o", str(typo), "--results-only"))
    if ok and typo.exists():
        return False, "refused, but the mistyped folder was made"
    return ok, why


@case("tune-all-diverge", "a study where every trial diverged exits 0 with an empty tuned.json",
      "non-zero exit, one fedskew line at the end, no tuned.json")  # fmt: skip
def _all_diverge(ctx: Ctx) -> Check:
    file = tune_file(ctx, search="lr = { log = [1e4, 1e6] }")
    p = ctx.fedskew("tune", "-c", file, "-o", "out", timeout=180)
    if p.rc == 0:
        return False, "exit 0"
    if (ctx.work / "out" / "tuned.json").exists():
        return False, f"exit {p.rc} but a tuned.json was written"
    if not p.last_err.startswith("fedskew:"):
        return False, f"last stderr line is not fedskew's: {p.last_err!r}"
    return True, f"exit {p.rc}, no tuned.json"


@case("tune-float-for-int", "a float range for an integer option",
      "refused in one line before any trial")  # fmt: skip
def _float_for_int(ctx: Ctx) -> Check:
    file = tune_file(ctx, search="local_epochs = { float = [1.0, 3.0] }")
    ok, why = refused(ctx.fedskew("tune", "-c", file, "-o", "out"), "local_epochs")
    if ok and (ctx.work / "out" / "trials").exists():
        return False, "refused after trials ran"
    return ok, why


@case("tune-edited-file", "editing the tune file (rounds, a range) and rerunning reuses the "
      "old study's trials", "each edit refused in one line naming what changed")  # fmt: skip
def _edited(ctx: Ctx) -> Check:
    _, out = good_study(ctx)
    wider = "lr = { log = [0.01, 0.5] }"
    edits = {"rounds": tune_file(ctx, "rounds.toml", rounds=3),
             "range": tune_file(ctx, "range.toml", search=wider)}  # fmt: skip
    for what, file in edits.items():
        ok, why = refused(ctx.fedskew("tune", "-c", file, "-o", str(out), "--results-only"))
        if not ok:
            return False, f"{what} edit: {why}"
    return True, "both edits refused in one line"


@case("tune-rounds-dimension", "rounds as a search dimension breaks the pruner's steps",
      "refused in one line")  # fmt: skip
def _rounds_dimension(ctx: Ctx) -> Check:
    file = tune_file(ctx, search="rounds = { int = [2, 3] }")
    return refused(ctx.fedskew("tune", "-c", file, "-o", "out"), "rounds")


@case("tune-seed", "--seed on tune is ignored silently", "refused in one line")
def _tune_seed(ctx: Ctx) -> Check:
    return refused(ctx.fedskew("tune", "-c", tune_file(ctx), "-o", "out", "--seed", "5"), "seed")


# --------------------------------------------------------------------------- privacy


def summary(ctx: Ctx, name: str) -> dict[str, Any]:
    path = ctx.work / "runs" / name / "summary.json"
    return json.loads(path.read_text()) if path.exists() else {}


def epsilon_of(s: dict[str, Any]) -> Any:
    return s.get("dp_epsilon", s.get("epsilon"))


def rounds_of(ctx: Ctx, name: str) -> list[dict[str, Any]]:
    for folder in (name, f"{name}.incomplete"):
        path = ctx.work / "runs" / folder / "metrics.jsonl"
        if path.exists():
            return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return []


def finite_epsilon(x: Any) -> bool:
    return isinstance(x, int | float) and 0 <= x < float("inf")


def huge_noise(ctx: Ctx, p: Proc, progress: bool = False) -> Check:
    """Noise 1e9 may wreck the model (a clean one-line divergence naming the noise) but the
    accountant must give every played round a finite epsilon (it raised a math domain error)."""
    eps = [r.get("dp_epsilon") for r in rounds_of(ctx, "n")]
    if not eps or not all(finite_epsilon(e) for e in eps):
        return False, f"exit {p.rc}; epsilon by round {eps}"
    if p.rc == 0:
        skipped = [r["round"] for r in rounds_of(ctx, "n") if r.get("skipped")]
        if skipped:  # the in-process engine stops this run as diverged
            return False, f"exit 0 with round(s) {skipped} skipped (every reply missing)"
        return True, f"finished; epsilon {eps[-1]:.3g}"
    ok, why = refused(p, "noise", progress=progress)
    return ok, (f"diverged in one line naming the noise; epsilon by round {eps}" if ok else why)


@case("dp-noise-1e9", "--dp-noise 1e9 ends in a math domain error traceback (in process), and "
      "every --resume repeats it", "a finite epsilon for every played round; the run finishes "
      "or stops in one line naming the noise; --resume is one line or finishes")  # fmt: skip
def _noise_1e9(ctx: Ctx) -> Check:
    first = ctx.fedskew("run", "--dp", "central", "--dp-noise", "1e9", *SMALL,
                        "-o", "runs", "--name", "n")  # fmt: skip
    ok, why = huge_noise(ctx, first)
    if not ok:
        return False, why
    folder = next(f for f in (ctx.work / "runs").iterdir() if f.name.startswith("n"))
    again = ctx.fedskew("run", "--resume", str(folder), "--quiet")
    if again.rc != 0 and not (len(again.err_lines) == 1 and again.last_err.startswith("fedskew:")):
        return False, f"--resume: exit {again.rc} with {len(again.err_lines)} lines"
    return True, f"{why}; --resume exit {again.rc}"


@case("dp-noise-1e9-flower", "--dp-noise 1e9 ends in a math domain error traceback on Flower",
      "as in process: a finite epsilon; finishes, or stops in one line naming the "
      "noise")  # fmt: skip
def _noise_1e9_flower(ctx: Ctx) -> Check:
    p = ctx.fedskew("run", "--engine", "flower-sim", "--dp", "central", "--dp-noise", "1e9",
                    *SMALL, "-o", "runs", "--name", "n", timeout=150)  # fmt: skip
    return huge_noise(ctx, p)


@case("dp-noise-1e9-flower-secagg", "--dp-noise 1e9 on Flower, with SecAgg+ (beside the "
      "issue's list: the same noise inside a secure sum)", "as in process: stops in one line "
      "naming the noise, or finishes with a finite epsilon")  # fmt: skip
def _noise_1e9_secagg(ctx: Ctx) -> Check:
    # No --quiet: Flower's log is where a client's traceback would show.
    p = ctx.fedskew("run", "--engine", "flower-sim", "--secure-aggregation", "--dp", "central",
                    "--dp-noise", "1e9", *SMALL[:-1], "-o", "runs", "--name", "n",
                    timeout=150)  # fmt: skip
    return huge_noise(ctx, p, progress=True)


@case("dp-noise-0", "--dp-noise 0 gives a null epsilon and no privacy column, without a word",
      "a warning that the run has no privacy (or a refusal)")  # fmt: skip
def _noise_0(ctx: Ctx) -> Check:
    p = ctx.fedskew("run", "--dp", "central", "--dp-noise", "0", *SMALL, "-o", "runs")
    if p.rc != 0:
        return refused(p)
    said = "no privacy" in p.stderr.lower() or "privacy" in p.stderr.lower() and "0" in p.stderr
    return said, ("warned: " + p.last_err) if said else "exit 0 without a word"


def _secagg(ctx: Ctx, clip: str) -> Check:
    p = ctx.fedskew("run", "--engine", "flower-sim", "--secure-aggregation",
                    "--secagg-clip-range", clip, *SMALL, "-o", "runs", timeout=150)  # fmt: skip
    if p.rc != 0:
        return refused(p, "clip")
    return False, "exit 0: check by hand that the model moved"


@case("secagg-clip-3e38", "a SecAgg+ clip range of 3e38 leaves the model unmoved",
      "refused in one line (or a run that learns)")  # fmt: skip
def _secagg_big(ctx: Ctx) -> Check:
    return _secagg(ctx, "3e38")


@case("secagg-clip-1e-30", "a SecAgg+ clip range of 1e-30 leaves the model unmoved",
      "refused in one line (or a run that learns)")  # fmt: skip
def _secagg_small(ctx: Ctx) -> Check:
    return _secagg(ctx, "1e-30")


@case("local-dp-absurd-flower", "local DP at absurd noise on Flower 'finishes' with every "
      "round skipped", "non-zero exit with one fedskew line, or a warning before the "
      "run")  # fmt: skip
def _local_dp(ctx: Ctx) -> Check:
    p = ctx.fedskew("run", "--engine", "flower-sim", "--dp", "local", "--dp-noise", "1e30",
                    *SMALL, "-o", "runs", "--name", "l", timeout=150)  # fmt: skip
    if p.rc == 0:
        s = summary(ctx, "l")
        acc = s.get("final_accuracy")
        warned = "noise" in p.stderr.lower()
        return warned, f"exit 0, accuracy {acc}, " + ("warned" if warned else "no word")
    if not p.last_err.startswith("fedskew:"):
        return False, f"exit {p.rc}, last line {p.last_err!r}"
    return True, f"exit {p.rc}: {p.last_err}"


@case("dp-adaptive-digits", "adaptive clipping on digits at noise 0.5 climbs from 1 to 155 and "
      "the run stops blaming 'client 11: NaN'", "the run finishes with finite numbers, or "
      "stops in one line that names the DP noise/clip")  # fmt: skip
def _adaptive(ctx: Ctx) -> Check:
    p = ctx.fedskew("run", "--dp", "central", "--dp-clipping", "adaptive", "--dp-noise", "0.5",
                    "-r", "30", "--quiet", "-o", "runs", "--name", "a", timeout=150)  # fmt: skip
    if p.rc == 0:
        s = summary(ctx, "a")
        acc = s.get("final_accuracy")
        ok = isinstance(acc, int | float) and acc == acc
        return ok, f"finished: accuracy {acc}, final clip {s.get('dp_clip_final')}"
    line = p.last_err.lower()
    ok = p.last_err.startswith("fedskew:") and ("noise" in line or "clip" in line)
    return ok, f"exit {p.rc}: {p.last_err}"


# --------------------------------------------------------------------------- executors


def grid(ctx: Ctx, threads: bool = True) -> str:
    text = GRID.format(out=ctx.work / "grid", threads="threads = 1\n" if threads else "")
    return str(ctx.file("grid.toml", text))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@case("ray-unreachable-compare", "an unreachable --ray-address hangs compare",
      "refused in one line within 60 s")  # fmt: skip
def _ray(ctx: Ctx) -> Check:
    address = f"127.0.0.1:{free_port()}"
    p = ctx.fedskew("compare", "-c", grid(ctx), "--executor", "ray", "--ray-address", address,
                    timeout=90)  # fmt: skip
    ok, why = refused(p, "ray")
    if ok and p.seconds > 60:
        return False, f"refused after {p.seconds} s"
    return ok, f"{why} after {p.seconds} s"


@case("cpus-per-run-local", "--cpus-per-run is silently ignored by the local executor",
      "the run's torch threads are the CPUs asked for (recorded in processes.jsonl)")  # fmt: skip
def _cpus(ctx: Ctx) -> Check:
    file = grid(ctx, threads=False)  # [compare] threads = 1 beside it is refused, rightly
    ok, why = finished(ctx.fedskew("compare", "-c", file, "--cpus-per-run", "2"))
    if not ok:
        return False, why
    found = ctx.work / "grid" / "fedavg-s0" / "processes.jsonl"
    threads = json.loads(found.read_text().splitlines()[0]).get("torch_threads")
    return threads == 2, f"torch_threads {threads} recorded"


def slurm_runs(ctx: Ctx) -> Path:
    p = ctx.fedskew("compare", "-c", grid(ctx), "--executor", "slurm", "--dry-run")
    runs = ctx.work / "grid" / "slurm" / "runs.json"
    if p.rc != 0 or not runs.exists():
        raise RuntimeError(f"compare --dry-run: exit {p.rc}: {p.last_err}")
    return runs


def tamper(runs: Path, change: Callable[[dict[str, Any]], None]) -> None:
    data = json.loads(runs.read_text())
    entries = data["runs"] if isinstance(data, dict) else data
    change(entries[0])
    runs.write_text(json.dumps(data))


@case("slurm-runs-missing-key", "a tampered Slurm runs.json gives a KeyError traceback",
      "refused in one line")  # fmt: skip
def _slurm_key(ctx: Ctx) -> Check:
    runs = slurm_runs(ctx)
    tamper(runs, lambda entry: entry.pop(next(iter(entry))))
    return refused(ctx.fedskew("grid-task", str(runs), "--index", "0"))


@case("slurm-runs-outside", "an entry with out_dir ../outside trains and writes outside the grid",
      "refused in one line (the run's out_dir, and its folder); nothing written "
      "outside")  # fmt: skip
def _slurm_outside(ctx: Ctx) -> Check:
    def out_dir(entry: dict[str, Any]) -> None:
        entry["values"]["out_dir"] = "../outside"

    def folder(entry: dict[str, Any]) -> None:
        entry["folder"] = "../outside"

    for what, change in (("out_dir", out_dir), ("folder", folder)):
        runs = slurm_runs(ctx)
        tamper(runs, change)
        ok, why = refused(ctx.fedskew("grid-task", str(runs), "--index", "0"))
        leaked = [str(p) for p in ctx.work.parent.rglob("outside")]
        if leaked:
            return False, f"{what}: {why}; but wrote {leaked}"
        if not ok:
            return False, f"{what}: {why}"
    return True, "out_dir and folder both refused in one line"


# --------------------------------------------------------------------------- deployment

DEPLOY = """
import os, sys
sys.path.insert(0, {tests!r})
from flower_grid import LocalGrid
from flower_log import flower_log
from flwr.app import Context, RecordDict
import fedskew.apps.flower.run_config as rc
os.environ[rc.OUTPUT_ROOT_VARIABLE] = os.getcwd()
from fedskew.apps.flower.server import _server_main
context = Context(run_id=1, node_id=0, node_config={{}}, state=RecordDict(),
                  run_config={{"rounds": -1}})
text, raised = flower_log(lambda: _server_main(LocalGrid(2), context))
sys.stderr.write(text)
sys.exit(1 if raised is not None else 0)
"""


@case("deploy-rounds-negative", "a refused run config (rounds=-1) reaches the user of fedskew "
      "deploy as a 20-line traceback from the ServerApp in Flower's log",
      "the ServerApp's streamed log is the one fedskew line")  # fmt: skip
def _deploy(ctx: Ctx) -> Check:
    p = ctx.script("serverapp.py", DEPLOY.format(tests=str(ROOT / "tests")))
    # Flower's handler writes its level first ("ERROR :"), in colour: the line is what counts.
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in p.err_lines]
    if p.rc == 0:
        return False, "the ServerApp accepted rounds=-1"
    if len(lines) != 1 or "fedskew: rounds" not in lines[0]:
        return False, f"{len(lines)} lines in the streamed log"
    return True, "the streamed log is one line: " + lines[0].strip()


# --------------------------------------------------------------------------- still open


@case("memory-1gib-config", "a 1 GiB config value ends in MemoryError",
      "refused in one line before the file is read")  # fmt: skip
def _big_config(ctx: Ctx) -> Check:
    path = ctx.work / "big.toml"
    with path.open("w") as fh:
        fh.write('name = "')
    os.truncate(path, 2**30)  # sparse: a 1 GiB value without writing 1 GiB
    return refused(ctx.fedskew("run", "-c", str(path)), "MiB")


@case("memory-100k-clients", "100,000 clients end in a MemoryError/allocator traceback",
      "refused in one line")  # fmt: skip
def _many_clients(ctx: Ctx) -> Check:
    return refused(ctx.fedskew("run", "-n", "100000", "-r", "1", "--quiet", "-o", "runs"))


class Skip(Exception):
    """A case this machine cannot replay without harm: reported as skipped, with why."""


def total_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


MODEL_BYTES = 79_000**2 * 4  # 2 hidden layers of 79,000: the middle weight is 25 GB of float32


@case("memory-25gb-model", "a 25 GB model ends in an allocator traceback",
      "refused in one line with what was asked and what is there")  # fmt: skip
def _big_model(ctx: Ctx) -> Check:
    total = total_memory_bytes()
    if total / 2 < MODEL_BYTES < total * 2 and not ctx.shared.get("risk_memory"):
        # Near this host's memory the kernel lets the allocation through and its OOM killer
        # ends the process (or another's): not tried on a shared machine without
        # --risk-memory.
        raise Skip(f"25 GB is close to this host's {total / 2**30:.0f} GiB: without "
                   "--risk-memory the OOM killer could end other users' processes")  # fmt: skip
    p = ctx.fedskew("run", "-m", "mlp", "--model-option", "hidden=79000", "-r", "1", "--quiet",
                    "-o", "runs", timeout=120)  # fmt: skip
    if p.rc is not None and p.rc < 0:
        return False, f"killed by signal {-p.rc} after {p.seconds} s, no line"
    return refused(p, "GiB")


@case("local-test-holds-nothing", "a --local-test-fraction that holds out nothing runs with null "
      "accuracies and no warning", "refused in one line naming the smallest usable "
      "fraction")  # fmt: skip
def _local_test(ctx: Ctx) -> Check:
    return refused(ctx.fedskew("run", "--local-test-fraction", "0.0001", *SMALL, "-o", "runs"),
                   "fraction")  # fmt: skip


@case("partition-fractional-offsets", "partition files with fractional offsets are truncated "
      "silently", "refused in one line")  # fmt: skip
def _partition(ctx: Ctx) -> Check:
    import numpy as np

    indices = np.arange(1797, dtype=np.int64)
    offsets = np.array([0.0, 449.5, 899.0, 1348.0, 1797.0])
    np.savez(ctx.work / "part.npz", indices=indices, offsets=offsets)
    p = ctx.fedskew("run", "--partition-file", str(ctx.work / "part.npz"), *SMALL, "-o", "runs")
    return refused(p, "offsets")


SCAFFOLD = """
import sys, torch
import fedskew.runs.loop as loop
from fedskew.apps.cli import main
from fedskew.runs.checkpoint import read_checkpoint

exchange = loop.FiniteReplies.exchange

def hostile(self, messages, expect=None):
    # clients whose control deltas are finite but extreme: each passes the NaN check,
    # their sum is Inf in the server's c
    replies = exchange(self, messages, expect)
    if self.round == 1:
        for reply in replies.values():
            for k, v in reply.arrays.items():
                if k.startswith("dc/"):
                    reply.arrays[k] = torch.full_like(v, 3e38)
    return replies

loop.FiniteReplies.exchange = hostile
code = main(["run", "-a", "scaffold", "-n", "4", "--clients-per-round", "2", "-r", "3",
             "--quiet", "-o", "runs", "--name", "sc"])
import glob
for path in glob.glob("runs/sc*/checkpoint.npz"):
    saved = read_checkpoint(path)
    bad = [k for k, t in saved.server["c"].items() if not bool(torch.isfinite(t).all())]
    if bad:
        print("non-finite c in the checkpoint:", bad[:3], file=sys.stderr)
        code = 0
sys.exit(code)
"""


@case("scaffold-poisoned-c", "SCAFFOLD with poisoned control variates ends normally with "
      "non-finite server state in its checkpoint", "a one-line divergence at that round; "
      "the checkpoint kept is finite")  # fmt: skip
def _scaffold(ctx: Ctx) -> Check:
    return refused(ctx.script("scaffold.py", SCAFFOLD), "server state")


# The examples a test of the suite already replays with the same commands.
CITED = [
    ("kill -9 of a tune trial, then resume, vs the uninterrupted study",
     "tests/test_tune_determinism.py::test_a_study_killed_at_random_moments_gives_the_"
     "uninterrupted_trials (3 SIGKILLs at seeded moments; same trials and tuned.json)"),
    ("two tune processes each run the whole budget",
     "tests/test_tune_determinism.py::test_jobs_give_the_trials_of_one_process_even_when_killed"),
    ("workers print BrokenPipe tracebacks when the parent is killed as they start",
     "tests/test_worker_parent_gone.py"),
    ("an unreachable --ray-address hangs tune",
     "tests/test_grid_executors.py::test_an_unreachable_ray_address_is_one_line_soon[tune]"),
]  # fmt: skip
SKIPPED = [
    ("a killed Ray tune leaves two Ray agents that ignore SIGTERM",
     "starts a Ray cluster (some 20 s) and kills it: over this replay's budget on 2 shared "
     "cores; tests/test_grid_executors.py::test_a_killed_compare_leaves_no_ray_process_behind "
     "(slow) covers compare, not tune"),
    ("the same grid gives other low bits on the local and the Ray executor",
     "needs a Ray cluster and two grids; tests/test_grid_threads.py checks the pinned threads"),
    ("every refused run config through a real SuperLink (fedskew deploy)",
     "a SuperLink and SuperNodes take minutes to start; replayed above through the ServerApp "
     "and Flower's own log handler, as tests/test_flower.py does"),
]  # fmt: skip


# --------------------------------------------------------------------------- runner


@dataclass
class Outcome:
    name: str
    example: str
    expect: str
    clean: bool
    verdict: str  # clean / not clean: traceback / timeout / wrong outcome / replay error
    why: str
    seconds: float
    commands: list[dict[str, Any]] = field(default_factory=list)


def replay(c: Case, root: Path, shared: dict[str, Any]) -> Outcome:
    work = root / c.name
    work.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(work, shared)
    started = time.monotonic()
    try:
        ok, why = c.body(ctx)
        error = skipped = False
    except Skip as exc:
        ok, why, error, skipped = False, str(exc), False, True
    except Exception as exc:  # noqa: BLE001 - the replay's own fault is reported, not raised
        ok, why, error, skipped = False, f"{type(exc).__name__}: {exc}", True, False
    if any(p.timed_out for p in ctx.procs):
        verdict, ok = "not clean: hang past its timeout", False
    elif any(p.traceback for p in ctx.procs):
        verdict, ok = "not clean: traceback", False
    elif skipped:
        verdict = "skipped"
    elif error:
        verdict = "replay error"
    else:
        verdict = "clean" if ok else "not clean: wrong outcome"
    commands = [{"command": p.shown(), "rc": p.rc, "seconds": p.seconds,
                 "last_stderr": p.last_err} for p in ctx.procs]  # fmt: skip
    return Outcome(c.name, c.example, c.expect, ok, verdict, why,
                   round(time.monotonic() - started, 1), commands)  # fmt: skip


def replay_all(names: list[str] | None, root: Path, risk_memory: bool = False) -> list[Outcome]:
    chosen = [c for c in CASES if not names or c.name in names]
    shared: dict[str, Any] = {"root": str(root), "risk_memory": risk_memory}
    results = []
    for c in chosen:
        outcome = replay(c, root, shared)
        print(f"{outcome.verdict:<36} {c.name} ({outcome.seconds} s): {outcome.why}", flush=True)
        results.append(outcome)
    return results


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def write(results: list[Outcome], total_seconds: float, flags: list[str]) -> None:
    from machine import load1, machine_facts

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                            capture_output=True).stdout.strip()  # fmt: skip
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "src"], cwd=ROOT, text=True,
                                capture_output=True).stdout.strip())  # fmt: skip
    ran = [r for r in results if r.verdict != "skipped"]
    clean = sum(r.clean for r in ran)
    facts = machine_facts()
    data = {"commit": commit, "flags": flags, "src_dirty": dirty,
            "machine": facts, "load1": load1(),
            "seconds": round(total_seconds, 1), "clean": clean, "total": len(ran),
            "skipped_here": len(results) - len(ran),
            "cases": [asdict(r) for r in results],
            "cited": [{"example": e, "test": t} for e, t in CITED],
            "skipped": [{"example": e, "why": w} for e, w in SKIPPED]}  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "reliability_replay.json").write_text(json.dumps(data, indent=1) + "\n")
    machine = ", ".join(f"{k} {facts[k]}" for k in ("cpu", "cores", "memory_gib", "torch")
                        if k in facts)  # fmt: skip
    lines = [
        "# Issue 50's examples replayed on today's code",
        "",
        f"Made by `python benchmarks/reliability_replay.py{''.join(' ' + f for f in flags)}` "
        "(digits, 2-3 rounds, seed 0) on "
        f"commit {commit}{' with src changes' if dirty else ''}; machine: {machine}; load "
        f"{data['load1']}; {data['seconds']} s in all.",
        "",
        f"**{clean} of {len(ran)} cases clean** ({len(results) - len(ran)} skipped on this "
        "machine, said below in their row). A case is clean when no command of it "
        "printed a traceback or ran past its timeout and its check held (a refusal: non-zero "
        "exit and one `fedskew:` line).",
        "",
        "| case | issue's example | expected | outcome | evidence (exit, last stderr line) |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        evidence = "; ".join(f"exit {c['rc']}: {c['last_stderr'][:160] or '(no stderr)'}"
                             for c in r.commands[-2:])  # fmt: skip
        lines.append(f"| {r.name} | {cell(r.example)} | {cell(r.expect)} | **{r.verdict}**: "
                     f"{cell(r.why)} | {cell(evidence)} |")  # fmt: skip
    lines += ["", "## Commands", ""]
    for r in results:
        lines.append(f"- **{r.name}**:")
        lines += [f"  `{c['command'].replace(sys.executable, 'python')}` ({c['seconds']} s)"
                  for c in r.commands]  # fmt: skip
    lines += ["", "## Covered by a test of the suite (not rerun)", ""]
    lines += [f"- {e}: `{t}`" for e, t in CITED]
    lines += ["", "## Skipped", ""]
    lines += [f"- {e}: {w}" for e, w in SKIPPED]
    (RESULTS / "reliability_replay.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these cases only")
    parser.add_argument("--work", type=Path, help="scratch folder (default: a temporary one)")
    parser.add_argument("--no-write", action="store_true", help="print only; write no results")
    parser.add_argument("--risk-memory", action="store_true",
                        help="run the 25 GB model even near this host's memory")  # fmt: skip
    args = parser.parse_args(argv)
    unknown = set(args.only or []) - {c.name for c in CASES}
    if unknown:
        parser.error(f"no such case: {sorted(unknown)}")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fedskew-replay-") as scratch:
        root = args.work or Path(scratch)
        results = replay_all(args.only, root, args.risk_memory)
    total = time.monotonic() - started
    ran = [r for r in results if r.verdict != "skipped"]
    print(f"{sum(r.clean for r in ran)} of {len(ran)} cases clean, "
          f"{len(results) - len(ran)} skipped ({total:.0f} s)")  # fmt: skip
    if not args.no_write and not args.only:
        write(results, total, ["--risk-memory"] if args.risk_memory else [])
    return 0


if __name__ == "__main__":
    sys.exit(main())
