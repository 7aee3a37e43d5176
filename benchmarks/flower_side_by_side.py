"""Flower 1.42's simulation and fedskew side by side, at equal precision (issue 35).

One invocation runs issue 6's experiment (FedAvg, Fashion-MNIST, 20 clients, Dirichlet beta
0.1, 8 clients per round, E=5, batch 64, SGD lr 0.01 momentum 0.9, fedavg-cnn, the global
model tested every round, seed 0) in up to five configurations, each a child process, one
after another:

1. ``flower-docs``: a plain Flower app written as Flower's PyTorch documentation writes one
   (benchmarks/flower_side_by_side_app.py: Message API, ``run_simulation`` on Ray, a
   DataLoader and a per-batch loop), fp32; num_cpus=1 per client, so Ray runs 2 actors on
   2 cores; OMP_NUM_THREADS=1 in the simulation's environment (driver and actors).
2. ``flower-tricks-fp32``: the same app with fedskew's fp32 speed tricks added by hand in its
   client: flush-to-zero for denormals on the training thread (with OMP_NUM_THREADS=1 the
   only thread that trains; a probe at the end of every train call checks it there, and on
   any torch pool thread), channels_last model and batches; fp32, no autocast.
3. ``flower-tricks``: the same with bf16 autocast as well (forward and loss).
4. ``fedskew-fp32``: ``fedskew run`` with its defaults (no --workers: auto; no thread
   setting), fp32.
5. ``fedskew-bf16``: the same with ``--precision bf16``.

The default set depends on the CPU: all five where /proc/cpuinfo shows bf16 instructions
(avx512_bf16 or amx_bf16); where it shows neither, torch emulates bf16 (a bf16 row would
measure the emulation), so only the fp32 ones run (flower-docs, flower-tricks-fp32,
fedskew-fp32) and the report says why, with the flags. ``--only`` picks any set. A ratio
whose configurations did not run, or did not finish, is reported as not measured.

Both sides train the same partition (made once by ``fedskew partition`` and fed to both:
``--partition-file`` on fedskew's side, the client index lists on Flower's) and the same
clients every round (fedskew's sampler; the Flower strategy sends to exactly those nodes),
from the same initial weights. Per run: each round's wall seconds (fedskew: metrics.jsonl
``seconds``; Flower: timed in the ServerApp over the same span: send, train, reply,
average; evaluation apart), the samples it trained (E x the sampled clients' sizes), the
test accuracy, startup and wall time, and the 1-minute load average before and after.
Throughput of a run = its samples over its seconds in rounds 2..R, every round counted
(slow rounds too); configurations are compared by the same sum over all their runs.

``--repeat N`` runs every configuration N times, the order alternating between repeats.
``--busy`` adds, in each repeat, a run of every configuration while a pure-Python busy loop
(one process, one core: ``while True: pass``) started just before it runs, and is stopped
just after. Goals (issue 35), computed from the numbers, at equal precision:
fedskew-fp32 / flower-docs >= 1.5 (fedskew's default against Flower as users write it),
fedskew-fp32 / flower-tricks-fp32 >= 1.0 and fedskew-bf16 / flower-tricks >= 1.0 (against
Flower with every trick fedskew uses added by hand).

    python benchmarks/flower_side_by_side.py --repeat 2 --busy   # the full run (time: below)
    python benchmarks/flower_side_by_side.py --rounds 2 --epochs 1 --clients-per-round 2 \\
        --repeat 1 --out /tmp/sbs/flower_side_by_side.md          # the whole path, minutes
    python benchmarks/flower_side_by_side.py --report-only        # the .md again from the .json

Time of the full run (5 rounds, 555,570 samples a run; rounds 2..5 measured): on 2 cores
with bf16 instructions, 20 runs, about 1.5 h from the rates in BENCHMARKS.md. On an
AVX2-only 2-core machine (the AMD EPYC this script was written on: Flower fp32 about
1,000-1,300 samples/s on 2 cores idle, fedskew fp32 about 3,000; a Flower run also spends
about 30-50 s starting Ray and about 3-6 s testing per round), the default 12 fp32 runs
take about 1.5-2 h: an idle Flower run about 8-10 min, an idle fedskew run about 3.5 min,
about 1.5x that beside the busy loop. With ``--only``, the bf16 ones, emulated at about 150
samples/s per core, take about half an hour each idle. A run gets --timeout seconds
(default 7200) before it is killed and reported as not finished.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from child import REPO  # noqa: E402

from fedskew.core.machine import BF16_FLAGS, cpu_features  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "flower_side_by_side.md"
CONFIGS = ("flower-docs", "flower-tricks-fp32", "flower-tricks", "fedskew-fp32", "fedskew-bf16")
PRECISION = {"flower-docs": "fp32", "flower-tricks-fp32": "fp32", "flower-tricks": "bf16",
             "fedskew-fp32": "fp32", "fedskew-bf16": "bf16"}  # fmt: skip
VARIANT = {"flower-docs": "docs", "flower-tricks-fp32": "tricks", "flower-tricks": "tricks"}
# (numerator, denominator, goal or None, what the ratio says)
COMPARISONS = (
    ("fedskew-fp32", "flower-docs", 1.5,
     "fedskew's default (fp32) against Flower as its documentation writes it, both fp32"),
    ("fedskew-fp32", "flower-tricks-fp32", 1.0,
     "fedskew's default (fp32) against Flower with every fp32 trick added by hand "
     "(channels_last, flushed denormals), both fp32"),
    ("fedskew-bf16", "flower-tricks", 1.0,
     "fedskew bf16 against Flower with every trick added by hand, both bf16"),
    ("fedskew-bf16", "flower-docs", None,
     "fedskew bf16 against Flower as documented (not equal precision: no goal)"),
)  # fmt: skip
TAG_VARIABLE = "FEDSKEW_SIDE_BY_SIDE_TAG"  # in the environment of every process a run starts
BUSY_CODE = "while True: pass"
BUSY_KIND = f"one pure-Python busy loop (`python -c '{BUSY_CODE}'`: one process, one core)"
FIRST_MEASURED_ROUND = 2


# ----------------------------------------------------------------------------- numbers


def throughput(rounds: list[dict[str, Any]], first: int = FIRST_MEASURED_ROUND) -> dict[str, Any]:
    """Samples per second of one run over rounds ``first``..R: the sum of the rounds' samples
    over the sum of their seconds (a slow round weighs by its length), the per-round figures
    and their spread (max / min)."""
    measured = [r for r in rounds if r["round"] >= first]
    if not measured:
        raise ValueError(f"no round from round {first} on to measure")
    if any(r["seconds"] <= 0 for r in measured):
        raise ValueError("a measured round took no time")
    per_round = [r["samples"] / r["seconds"] for r in measured]
    samples = sum(r["samples"] for r in measured)
    seconds = sum(r["seconds"] for r in measured)
    return {
        "rounds": [r["round"] for r in measured],
        "samples": samples,
        "seconds": seconds,
        "samples_per_s": samples / seconds,
        "per_round_samples_per_s": per_round,
        "spread": max(per_round) / min(per_round),
    }


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The runs of one configuration together: all their measured samples over all their
    measured seconds, and each run's own figure. None when there is no finished run."""
    done = [r for r in runs if "throughput" in r]
    if not done:
        return None
    samples = sum(r["throughput"]["samples"] for r in done)
    seconds = sum(r["throughput"]["seconds"] for r in done)
    return {
        "runs": len(done),
        "samples_per_s": samples / seconds,
        "per_run": [r["throughput"]["samples_per_s"] for r in done],
    }


def compare(runs: list[dict[str, Any]], condition: str) -> list[dict[str, Any]]:
    """The ratios of COMPARISONS among the runs of ``condition`` (idle or busy): pooled over
    repeats, and per repeat; with a goal, whether the pooled ratio reaches it."""
    of = {c: [r for r in runs if r["config"] == c and r["condition"] == condition] for c in CONFIGS}
    rows = []
    for num, den, goal, what in COMPARISONS:
        a, b = pooled(of[num]), pooled(of[den])
        row: dict[str, Any] = {"numerator": num, "denominator": den, "goal": goal, "what": what}
        if a is None or b is None:
            row["ratio"] = None
            row["missing"] = [c for c, p in ((num, a), (den, b)) if p is None]
            row["not_run"] = [c for c in row["missing"] if not of[c]]
        else:
            row["ratio"] = a["samples_per_s"] / b["samples_per_s"]
            by_repeat = {
                (r["repeat"], r["config"]): r["throughput"]["samples_per_s"]
                for r in of[num] + of[den]
                if "throughput" in r
            }
            repeats = sorted({rep for rep, _ in by_repeat})
            row["per_repeat"] = [
                by_repeat[rep, num] / by_repeat[rep, den]
                for rep in repeats
                if (rep, num) in by_repeat and (rep, den) in by_repeat
            ]
        row["reached"] = None if goal is None or row["ratio"] is None else row["ratio"] >= goal
        rows.append(row)
    return rows


def accuracy_gaps(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per comparison and condition, the largest accuracy difference in any round between the
    two configurations' runs of the same repeat (points)."""
    rows = []
    for num, den, _goal, _what in COMPARISONS:
        for condition in ("idle", "busy"):
            gaps = []
            for a in runs:
                if a["config"] != num or a["condition"] != condition or "rounds" not in a:
                    continue
                for b in runs:
                    if (b["config"], b["condition"], b["repeat"]) != (den, condition, a["repeat"]):
                        continue
                    if "rounds" not in b:
                        continue
                    acc_b = {r["round"]: r.get("accuracy") for r in b["rounds"]}
                    gaps += [
                        abs(r["accuracy"] - acc_b[r["round"]]) * 100
                        for r in a["rounds"]
                        if r.get("accuracy") is not None and acc_b.get(r["round"]) is not None
                    ]
            if gaps:
                rows.append(
                    {
                        "pair": f"{num} - {den}",
                        "condition": condition,
                        "max": max(gaps),
                        "mean": statistics.fmean(gaps),
                    }
                )
    return rows


def run_order(repeat: int, busy: bool, configs: tuple[str, ...] = CONFIGS) -> list[tuple[str, str]]:
    """(configuration, condition) in the order repeat ``repeat`` (0-based) runs them: the
    configurations forward in even repeats and backward in odd ones; with ``busy``, the busy
    runs follow the idle ones in the opposite order."""
    order = list(configs) if repeat % 2 == 0 else list(reversed(configs))
    plan = [(c, "idle") for c in order]
    if busy:
        plan += [(c, "busy") for c in reversed(order)]
    return plan


# ----------------------------------------------------------------------------- processes


def last_line(log: Path) -> str:
    try:
        lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return "no log"
    return lines[-1][:300] if lines else "no output"


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a live process (from /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def end_tagged(tag: str) -> list[int]:
    """End what a run left running (Ray may leave an actor exiting): the processes whose
    environment carries this run's tag, and nothing else."""
    from fedskew.apps.flower.processes import end_processes, tagged_processes

    return end_processes(tagged_processes(TAG_VARIABLE, tag))


class Busy:
    """The competing CPU-bound process of a busy run: started before, stopped after it."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", BUSY_CODE],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.started = time.perf_counter()

    def stop(self) -> dict[str, Any]:
        used = cpu_seconds(self.proc.pid)
        wall = time.perf_counter() - self.started
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return {
            "kind": BUSY_KIND,
            "cpu_seconds": None if used is None else round(used, 1),
            "wall_seconds": round(wall, 1),
        }


def run_child(
    argv: list[str], env: dict[str, str], log: Path, timeout: float
) -> tuple[str | None, float]:
    """Run one child to the end; (one-line error or None, wall seconds). A child past
    ``timeout`` is killed with everything it started (its process group, then whatever
    still carries its tag)."""
    tag = uuid.uuid4().hex
    env = {**env, TAG_VARIABLE: tag}
    t0 = time.perf_counter()
    error = None
    with open(log, "w") as sink:  # a file, not a pipe nobody reads during the run
        proc = subprocess.Popen(
            argv, env=env, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            error = f"no result after {timeout:.0f} s (killed)"
        except BaseException:  # Ctrl-C: take the child and what it started along
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            end_tagged(tag)
            raise
    wall = time.perf_counter() - t0
    end_tagged(tag)
    if error is None and proc.returncode != 0:
        error = f"exit code {proc.returncode}: {last_line(log)}"
    return error, wall


def launch(
    argv: list[str],
    env: dict[str, str],
    log: Path,
    timeout: float,
    *,
    command: str,
    environment: str,
) -> dict[str, Any]:
    """Run one side's child (:func:`run_child`); the run's record so far: its command,
    environment, log, wall seconds, and "error" when it failed."""
    record: dict[str, Any] = {"command": command, "environment": environment, "log": log.name}
    error, wall = run_child(argv, env, log, timeout)
    record["wall_seconds"] = round(wall, 2)
    if error:
        record["error"] = error
    return record


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    src = str(REPO / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def shown(argv: list[str], work: Path) -> str:
    """The command as typed from the repository root; WORK stands for the invocation's
    scratch folder (partition file, run folders, specs)."""
    out = []
    for a in argv:
        if a == sys.executable:
            a = "python"
        a = a.replace(str(work), "WORK")
        if a.startswith(str(REPO) + os.sep):
            a = os.path.relpath(a, REPO)
        out.append(shlex.quote(a) if "WORK" not in a else a)
    return " ".join(out)


# ----------------------------------------------------------------------------- sides


def fedskew_argv(s: dict[str, Any], precision: str, out: Path, name: str) -> list[str]:
    argv = [sys.executable, "-m", "fedskew", "run", "-a", "fedavg", "-d", "fmnist",
            "-m", "fedavg-cnn", "-n", str(s["num_clients"]),
            "--partition-file", s["partition_file"],
            "--clients-per-round", str(s["clients_per_round"]), "-e", str(s["epochs"]),
            "-b", str(s["batch_size"]), "--lr", str(s["lr"]), "--momentum", str(s["momentum"]),
            "--weight-decay", "0", "-r", str(s["rounds"]), "--seed", str(s["seed"]),
            "--eval-every", "1"]  # fmt: skip
    if s["data_dir"]:
        argv += ["--data-dir", s["data_dir"]]
    if precision == "bf16":
        argv += ["--precision", "bf16"]
    return argv + ["-o", str(out), "--name", name, "-q"]


def run_fedskew(
    config: str, s: dict[str, Any], work: Path, name: str, timeout: float
) -> dict[str, Any]:
    from runinfo import run_facts

    from fedskew.data.partition import load_partition

    argv = fedskew_argv(s, PRECISION[config], work, name)
    env = base_env()
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # fedskew's defaults, not ours
        env.pop(var, None)
    record = launch(
        argv, env, work / f"{name}.log", timeout,
        command=shown(argv, work).replace("python -m fedskew", "fedskew", 1),
        environment="OMP_NUM_THREADS and MKL_NUM_THREADS unset (fedskew's defaults)",
    )  # fmt: skip
    if "error" in record:
        return record
    folder = work / name
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if x]
    facts = run_facts(folder)
    config_json = facts["config"]
    resolved = config_json.get("resolved", {})
    saved, _ = load_partition(folder / "partition.npz")
    ours = s["partition"]
    record["rounds"] = [
        {
            k: r.get(k)
            for k in ("round", "clients", "samples", "seconds", "accuracy", "loss", "eval_seconds")
        }
        for r in rows
    ]
    record["details"] = {
        "precision": config_json.get("precision"),
        "channels_last": resolved.get("channels_last"),
        "torch_threads": resolved.get("torch_threads"),
        "workers_setting": config_json.get("workers"),
        "workers": sorted({p.get("workers") for p in facts["processes"]} - {None}),
        "denormals": config_json.get("denormals", "not in config.json"),
        "dataset_source": facts["dataset_source"],
        "train_samples": resolved.get("train_samples"),
        "test_samples": facts["test_samples"],
        "torch": facts["torch"],
        "same_partition": len(saved) == len(ours)
        and all(list(a) == list(b) for a, b in zip(saved, ours, strict=True)),
    }
    return record


def run_flower(
    config: str, s: dict[str, Any], work: Path, name: str, timeout: float
) -> dict[str, Any]:
    spec = {
        "variant": VARIANT[config],
        "precision": PRECISION[config],
        **{k: s[k] for k in ("rounds", "epochs", "batch_size", "lr", "momentum", "seed",
                             "partition_file", "data_dir", "clients", "num_clients")},
        "num_cpus": 1,
        "setup_timeout": 600,
        "round_timeout": timeout,
    }  # fmt: skip
    spec_file, result_file = work / f"{name}.spec.json", work / f"{name}.result.json"
    spec_file.write_text(json.dumps(spec, indent=1) + "\n")
    argv = [sys.executable, str(HERE / "flower_side_by_side_app.py"), str(spec_file),
            str(result_file)]  # fmt: skip
    env = base_env()
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = "1"
    record = launch(
        argv, env, work / f"{name}.log", timeout,
        command="OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 " + shown(argv, work),
        environment="OMP_NUM_THREADS=1, MKL_NUM_THREADS=1 (driver and Ray actors)",
    )  # fmt: skip
    if "error" in record:
        return record
    result = json.loads(result_file.read_text())
    sizes = [len(p) for p in s["partition"]]
    rounds = []
    for r in result["rounds"]:
        examples = {int(k): v for k, v in r["num_examples"].items()}
        rounds.append(
            {
                "round": r["round"],
                "clients": r["clients"],
                "samples": s["epochs"] * sum(examples.values()),
                "seconds": r["seconds"],
                "accuracy": r.get("accuracy"),
                "loss": r.get("loss"),
                "eval_seconds": r.get("eval_seconds"),
                "sizes_match_partition": all(sizes[c] == n for c, n in examples.items()),
            }
        )
    probes = [p for r in result["rounds"] for p in r["probes"]]
    facts = result.get("ray_facts") or {}
    record["rounds"] = rounds
    record["details"] = {
        "flwr": result["flwr"],
        "ray": result["ray"],
        "torch": [result["torch"]],
        "client_resources": facts.get("client_resources"),
        "actors": facts.get("actors"),
        "ray_cpus": facts.get("ray_cpus"),
        "actor_processes_seen": len({p["pid"] for p in probes}),
        "client_torch_threads": sorted({int(p["torch_threads"]) for p in probes}),
        "denormals_flushed": sorted({bool(p["denormals_flushed"]) for p in probes}),
        "server_torch_threads": result.get("server_torch_threads"),
        "query_seconds": result.get("query_seconds"),
        "dataset_source": result.get("dataset_source"),
        "train_samples": result.get("train_samples"),
        "test_samples": result.get("test_samples"),
        "same_partition": all(r["sizes_match_partition"] for r in rounds),
    }
    return record


def one_run(
    config: str, condition: str, repeat: int, s: dict[str, Any], work: Path, timeout: float
) -> dict[str, Any]:
    from machine import load1

    name = f"{config}-{condition}-r{repeat + 1}"
    side = run_flower if config.startswith("flower") else run_fedskew
    busy = Busy() if condition == "busy" else None
    if busy:
        time.sleep(0.5)  # running before the run starts
    before = load1()
    try:
        record = side(config, s, work, name, timeout)
    except (OSError, ValueError, KeyError, TypeError) as exc:  # reading what the run wrote
        record = {"error": f"{type(exc).__name__}: {exc}"[:300], "log": f"{name}.log",
                  "command": "", "environment": "", "wall_seconds": 0.0}  # fmt: skip
    finally:
        after = load1()
        busy_facts = busy.stop() if busy else None
    record = {
        "config": config,
        "condition": condition,
        "repeat": repeat + 1,
        "precision": PRECISION[config],
        **record,
        "load1_before": before,
        "load1_after": after,
    }
    if busy_facts:
        record["busy"] = busy_facts
    if "rounds" in record:
        rounds = record["rounds"]
        record["clients_as_planned"] = [r["clients"] for r in rounds] == s["clients"]
        record["samples_as_planned"] = [r["samples"] for r in rounds] == s["planned_samples"]
        try:
            record["throughput"] = throughput(rounds)
        except ValueError as exc:
            record["error"] = str(exc)
        evaluation = sum(r.get("eval_seconds") or 0 for r in rounds)
        record["eval_seconds"] = round(evaluation, 2)
        record["startup_seconds"] = round(
            record["wall_seconds"] - sum(r["seconds"] for r in rounds) - evaluation, 2
        )
    return record


def make_partition(s: dict[str, Any], work: Path) -> tuple[str, list[list[int]]]:
    """``fedskew partition`` as a child: the command, and the partition it saved."""
    from fedskew.data.partition import load_partition

    path = work / "partition.npz"
    argv = [sys.executable, "-m", "fedskew", "partition", "-d", "fmnist",
            "-n", str(s["num_clients"]), "--partition", "dirichlet", "--beta", str(s["beta"]),
            "--seed", str(s["seed"]), "--save", str(path)]  # fmt: skip
    if s["data_dir"]:
        argv += ["--data-dir", s["data_dir"]]
    error, _ = run_child(argv, base_env(), work / "partition.log", 900)
    if error:
        raise SystemExit(f"fedskew partition failed: {error} (log: {work / 'partition.log'})")
    parts, _ = load_partition(path)
    command = shown(argv, work).replace("python -m fedskew", "fedskew", 1)
    return command, [p.tolist() for p in parts]


def has_bf16(cpu: dict[str, Any]) -> bool:
    """Whether the CPU has bf16 instructions (AVX-512 BF16 or AMX), from cpu_features()."""
    return any(cpu["flags"].get(f) for f in BF16_FLAGS)


def flag_list(cpu: dict[str, Any], names: tuple[str, ...] | None = None) -> str:
    names = names or tuple(cpu["flags"])
    return ", ".join(f"{f} {'yes' if cpu['flags'].get(f) else 'no'}" for f in names)


def selection(cpu: dict[str, Any], only: list[str] | None) -> dict[str, Any]:
    """The configurations to run: those ``--only`` names, else the default for this CPU (all
    of them where it has bf16 instructions, the fp32 ones where it has none); and, where the
    default leaves some out, why (a sentence for the report)."""
    if only:
        configs = tuple(c for c in CONFIGS if c in only)
        return {"configs": list(configs), "by": "--only", "left_out": [], "reason": None}
    if has_bf16(cpu):
        return {"configs": list(CONFIGS), "by": "default", "left_out": [], "reason": None}
    left = [c for c in CONFIGS if PRECISION[c] == "bf16"]
    reason = (
        f"The bf16 configurations ({', '.join(left)}) were left out, the default where the "
        f"CPU has no bf16 instructions: this one's /proc/cpuinfo flags show "
        f"{flag_list(cpu, BF16_FLAGS)} (and {flag_list(cpu, ('avx2', 'avx512f'))}; torch's "
        f"CPU kernels: {cpu['torch_cpu_capability']}), so torch would emulate bf16 and a bf16 "
        "row would measure that emulation, not bf16 on a CPU that has it (on the AVX2-only "
        "2-core AMD EPYC this script was written on: about 150 samples/s per core in bf16 "
        "against about 1,000 in fp32). The bf16 ratios are therefore not measured here; "
        "`--only` runs these configurations all the same."
    )
    configs = [c for c in CONFIGS if c not in left]
    return {"configs": configs, "by": "default", "left_out": left, "reason": reason}


# ----------------------------------------------------------------------------- report


def fmt_rate(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def describe(config: str, runs: list[dict[str, Any]]) -> str:
    """One configuration, from what its finished runs recorded."""
    done = [r for r in runs if r["config"] == config and "details" in r]
    if not done:
        return "no finished run"

    def values(key: str) -> str:
        seen: list[str] = []
        for r in done:
            v = r["details"].get(key)
            text = ", ".join(map(str, v)) if isinstance(v, list) else str(v)
            if text not in seen:
                seen.append(text)
        return " / ".join(seen)

    d = done[0]["details"]
    if config.startswith("flower"):
        tricks = VARIANT[config] == "tricks"
        bf16 = PRECISION[config] == "bf16"
        return (
            f"Flower {d['flwr']} simulation on Ray {d['ray']}; client resources "
            f"{values('client_resources')}; Ray saw {values('ray_cpus')} CPUs and built "
            f"{values('actors')} actors (actor processes that answered: "
            f"{values('actor_processes_seen')}); torch threads in the client "
            f"{values('client_torch_threads')}, in the ServerApp "
            f"{values('server_torch_threads')}; denormals flushed (probe at the end of the "
            "train call, on the thread that trained, and any torch pool thread it uses): "
            f"{values('denormals_flushed')}; "
            + (
                "channels_last model and batches, torch.set_flush_denormal(True) at the top "
                "of every train call, "
                if tricks
                else "contiguous, "
            )
            + ("bf16 autocast (forward and loss)" if bf16 else "fp32 (no autocast)")
            + "; DataLoader(TensorDataset, batch 64, shuffle) and a per-batch loop"
        )
    return (
        f"fedskew in-process engine, workers setting {values('workers_setting')} -> "
        f"{values('workers')} worker process(es); torch threads in the main process "
        f"{values('torch_threads')}; {values('precision')}, "
        f"{'channels_last' if d.get('channels_last') else 'contiguous'}; denormals: "
        f"{values('denormals')}"
    )


def verdict(row: dict[str, Any]) -> str:
    if row["ratio"] is None:
        not_run = row.get("not_run", [])
        failed = [c for c in row["missing"] if c not in not_run]
        why = ([f"{' and '.join(not_run)} not run"] if not_run else []) + (
            [f"no finished run of {' and '.join(failed)}"] if failed else []
        )
        return f"not measured ({'; '.join(why)})"
    text = f"**{row['ratio']:.2f}**"
    if row.get("per_repeat"):
        text += f" (per repeat: {', '.join(f'{x:.2f}' for x in row['per_repeat'])})"
    if row["goal"] is not None:
        text += f"; goal >= {row['goal']:g}: **{'reached' if row['reached'] else 'not reached'}**"
    return text


def report_md(report: dict[str, Any]) -> str:
    from flower_round_time import code_sentence

    m, s, cpu = report["machine"], report["setting"], report["cpu_features"]
    runs = report["runs"]
    conditions = [c for c in ("idle", "busy") if any(r["condition"] == c for r in runs)]
    flags = flag_list(cpu)
    chosen = report.get("selection") or {"configs": list(CONFIGS), "reason": None}
    shown_configs = [
        c for c in CONFIGS if c in chosen["configs"] or any(r["config"] == c for r in runs)
    ]
    versions = {
        k: v for r in runs for k, v in (r.get("details") or {}).items() if k in ("flwr", "ray")
    }
    code = report["code"]
    lines = [
        "# Flower and fedskew side by side, equal precision",
        "",
        f"Produced by `{report['invocation']}` on {m['cpu']}, {m['cores']} cores, "
        f"{m['memory_gib']} GiB, Python {m['python']}, torch {m['torch']} (CPU kernels: "
        f"{cpu['torch_cpu_capability']}; {flags}), flwr {versions.get('flwr', '-')}, Ray "
        f"{versions.get('ray', '-')}. Every run is a child process, one after another; "
        f"1-minute load average {report['load1_start']} at the start and "
        f"{report['load1_end']} at the end (each run's is in its row).",
        "",
    ]
    if chosen["reason"]:
        lines += [chosen["reason"], ""]
    if not has_bf16(cpu) and any(PRECISION[c] == "bf16" for c in shown_configs):
        lines += [
            "This CPU has no bf16 instructions (no AVX-512 BF16, no AMX): torch emulates "
            "bf16 here, so the bf16 rows measure that emulation, not what bf16 does on a "
            "CPU that has them (issue 6's machine has AMX and AVX-512 BF16).",
            "",
        ]
    lines += [
        "Throughput = samples trained in rounds "
        f"{FIRST_MEASURED_ROUND}..{s['rounds']} / their wall seconds (every round counts, "
        "slow ones too); a configuration's figure pools all its runs of a condition the same "
        "way. Ratios (above 1: fedskew faster), computed from those figures:",
        "",
    ]
    for condition in conditions:
        for row in report["comparisons"][condition]:
            lines.append(
                f"- {condition}: {row['numerator']} / {row['denominator']} = {verdict(row)} "
                f"({row['what']})"
            )
    loads = [report["load1_start"], report["load1_end"]] + [
        x for r in runs for x in (r["load1_before"], r["load1_after"])
    ]
    if max(loads) > m["cores"] + (1 if "busy" in conditions else 0):
        lines += [
            "",
            f"The 1-minute load average reached {max(loads)} on these {m['cores']} cores: "
            "other processes competed for the CPU, so these figures are not those of an idle "
            "machine, and a run's figure depends on when it ran.",
        ]
    failed = [r for r in runs if "error" in r]
    if failed:
        lines += ["", "Runs that did not finish (left out of the figures):", ""]
        lines += [
            f"- {r['config']} ({r['condition']}, repeat {r['repeat']}): {r['error']}"
            for r in failed
        ]
    lines += [
        "",
        "| configuration | precision | "
        + " | ".join(f"{c}: samples/s (runs)" for c in conditions)
        + " |",
        "|---|---|" + "---|" * len(conditions),
    ]
    for config in shown_configs:
        cells = []
        for condition in conditions:
            p = report["pooled"][condition].get(config)
            cells.append(
                "-"
                if p is None
                else f"{p['samples_per_s']:,.0f} ({', '.join(fmt_rate(x) for x in p['per_run'])})"
            )
        lines.append(f"| {config} | {PRECISION[config]} | " + " | ".join(cells) + " |")
    lines += ["", "Configurations, from what each run recorded:", ""]
    lines += [f"- {c}: {describe(c, runs)}" for c in shown_configs]
    lines += [
        "",
        "## Runs",
        "",
        "In the order they ran. Spread: the largest per-round samples/s over the smallest "
        f"(rounds {FIRST_MEASURED_ROUND}..{s['rounds']}): a round slowed by denormals, or by "
        "the machine, shows here.",
        "",
        "| # | repeat | condition | configuration | samples/s | per round (samples/s) | "
        "spread | rounds (s) | startup (s) | wall (s) | final accuracy (%) | load before / "
        "after | busy loop CPU s / wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(runs, 1):
        busy = r.get("busy")
        busy_text = f"{busy['cpu_seconds']} / {busy['wall_seconds']}" if busy else "-"
        if "throughput" not in r:
            lines.append(
                f"| {i} | {r['repeat']} | {r['condition']} | {r['config']} | failed | | | | | "
                f"{r['wall_seconds']:.0f} | | {r['load1_before']} / {r['load1_after']} | "
                f"{busy_text} |"
            )
            continue
        t = r["throughput"]
        final = r["rounds"][-1].get("accuracy")
        lines.append(
            f"| {i} | {r['repeat']} | {r['condition']} | {r['config']} | "
            f"{t['samples_per_s']:,.0f} | "
            + ", ".join(f"{x:,.0f}" for x in t["per_round_samples_per_s"])
            + f" | {t['spread']:.2f} | "
            + ", ".join(f"{x['seconds']:.1f}" for x in r["rounds"])
            + f" | {r['startup_seconds']:.1f} | {r['wall_seconds']:.1f} | "
            + ("-" if final is None else f"{100 * final:.2f}")
            + f" | {r['load1_before']} / {r['load1_after']} | {busy_text} |"
        )
    lines += [
        "",
        "Test accuracy per round (%), every run:",
        "",
        "| # | configuration | condition | repeat | " + " | ".join(
            f"r{k}" for k in range(1, s["rounds"] + 1)
        ) + " |",
        "|---|---|---|---|" + "---|" * s["rounds"],
    ]  # fmt: skip
    for i, r in enumerate(runs, 1):
        if "rounds" not in r:
            continue
        accs = [
            "-" if x.get("accuracy") is None else f"{100 * x['accuracy']:.2f}" for x in r["rounds"]
        ]
        lines.append(
            f"| {i} | {r['config']} | {r['condition']} | {r['repeat']} | " + " | ".join(accs) + " |"
        )
    gaps = report["accuracy_gaps"]
    if gaps:
        lines += [
            "",
            "Accuracy differences between the two sides of a ratio, same repeat, any round "
            "(points; close, not identical: the sides shuffle their batches differently and "
            "evaluate with their own code): "
            + "; ".join(
                f"{g['pair']} ({g['condition']}): max {g['max']:.2f}, mean {g['mean']:.2f}"
                for g in gaps
            )
            + ".",
        ]
    checks = report["checks"]
    lines += [
        "",
        "## Setting",
        "",
        f"- Experiment: FedAvg, Fashion-MNIST, {s['num_clients']} clients, Dirichlet beta "
        f"{s['beta']} (seed {s['seed']}), {s['clients_per_round']} clients per round, "
        f"E={s['epochs']}, batch {s['batch_size']}, SGD lr {s['lr']} momentum {s['momentum']} "
        f"weight decay 0, {s['model']}, {s['rounds']} rounds, the global model tested on the "
        "test set after every round (not timed in the round), experiment seed "
        f"{s['seed']}.",
        f"- Data: {'; '.join(checks['dataset_sources']) or '-'} "
        f"({s['train_samples']:,} training, {s['test_samples']:,} test samples"
        + (f"; --data-dir {s['data_dir']}" if s["data_dir"] else "")
        + ").",
        f"- Partition: made once by `{s['partition_command']}`; client sizes "
        f"{min(s['sizes'])}..{max(s['sizes'])} (total {sum(s['sizes']):,}). fedskew reads it "
        "with --partition-file; the Flower clients read the same file's index lists.",
        "- Clients per round (fedskew's sampler, `fedskew.data.federated.sample_clients`): "
        + "; ".join(f"r{k + 1}: {c}" for k, c in enumerate(s["clients"]))
        + ". Samples per round (E x their sizes): "
        + ", ".join(f"{x:,}" for x in s["planned_samples"])
        + ".",
        f"- Checks over every finished run: clients as planned: {checks['clients']}; samples "
        f"as planned: {checks['samples']}; same partition: {checks['partition']}; one data "
        f"copy and test set: {checks['data']}.",
        "- Initial weights: fedskew's for the seed on both sides (the Flower server builds "
        "them the way fedskew.assembly.prepare.new_model does). Batch order: fedskew draws "
        "its addressed permutation per (seed, round, client); the Flower client's "
        "DataLoader shuffles with a generator seeded from (seed, round, partition id).",
        "- Round time: fedskew, metrics.jsonl `seconds` (the server's round: send, train, "
        "reply, average); Flower, timed in the ServerApp from `configure_train` to the end "
        "of `aggregate_train`, the same span. Startup = wall - rounds - evaluation (process "
        "start, data, Ray, Flower's node query, shutdown).",
        f"- Busy runs: {BUSY_KIND}, started 0.5 s before the run's child and stopped after "
        "it; its CPU seconds show the share it took.",
        code_sentence(code),
        "",
        "## Commands",
        "",
        "Each Flower run's spec file holds the setting above, its variant (docs or tricks), "
        "its precision (fp32 or bf16) and num_cpus=1 per client.",
        "",
    ]
    first = {}
    for r in runs:
        first.setdefault(r["config"], r)
    lines += [
        f"- {c}: `{first[c]['command']}` ({first[c]['environment']})" for c in CONFIGS if c in first
    ]
    return "\n".join(lines) + "\n"


def summarize(report: dict[str, Any]) -> None:
    """The figures computed from the runs: pooled throughput, ratios, accuracy gaps, checks."""
    runs = report["runs"]
    conditions = [c for c in ("idle", "busy") if any(r["condition"] == c for r in runs)]
    report["pooled"] = {
        c: {
            config: pooled([r for r in runs if r["config"] == config and r["condition"] == c])
            for config in CONFIGS
        }
        for c in conditions
    }
    report["comparisons"] = {c: compare(runs, c) for c in conditions}
    report["accuracy_gaps"] = accuracy_gaps(runs)
    done = [r for r in runs if "details" in r]
    sources = list(dict.fromkeys(str(r["details"].get("dataset_source")) for r in done))
    report["checks"] = {
        "clients": all(r.get("clients_as_planned") for r in done),
        "samples": all(r.get("samples_as_planned") for r in done),
        "partition": all(r["details"].get("same_partition") for r in done),
        "data": len(sources) <= 1
        and len(
            {(r["details"].get("train_samples"), r["details"].get("test_samples")) for r in done}
        )
        <= 1,
        "dataset_sources": sources,
    }


# ----------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=5, help="local epochs E (issue 6: 5)")
    ap.add_argument("--clients-per-round", type=int, default=8, help="issue 6: 8 (shrink to test)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--busy", action="store_true", help="also run everything beside a busy loop")
    ap.add_argument(
        "--only",
        nargs="+",
        choices=CONFIGS,
        help="run only these configurations (default: all where the CPU has bf16 "
        "instructions, the fp32 ones where it has none)",
    )
    ap.add_argument("--data-dir", default="", help="passed to fedskew's loader on both sides")
    ap.add_argument("--timeout", type=float, default=7200, help="seconds per run (then killed)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=".md; the .json goes beside it")
    ap.add_argument("--keep", type=Path, help="keep run folders and logs here")
    ap.add_argument("--report-only", action="store_true", help="rewrite the .md from the .json")
    args = ap.parse_args()
    out_json = args.out.with_suffix(".json")
    if args.report_only:
        report = json.loads(out_json.read_text())
        args.out.write_text(report_md(report))
        print(f"wrote {args.out}")
        return 0
    if args.rounds < FIRST_MEASURED_ROUND:
        ap.error(f"--rounds must be at least {FIRST_MEASURED_ROUND} (round 1 is not measured)")
    if args.repeat < 1 or args.epochs < 1 or not 1 <= args.clients_per_round <= 20:
        ap.error("--repeat and --epochs at least 1; --clients-per-round 1..20")

    from flower_round_time import code_record, code_state
    from machine import load1, machine_facts

    from fedskew.data.federated import sample_clients

    invocation = "python benchmarks/flower_side_by_side.py " + " ".join(
        shlex.quote(a) for a in sys.argv[1:]
    )
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="flower-side-by-side-", dir=args.keep))
    else:
        work = Path(tempfile.mkdtemp(prefix="flower-side-by-side-"))
    s: dict[str, Any] = {
        "num_clients": 20, "beta": 0.1, "clients_per_round": args.clients_per_round,
        "epochs": args.epochs, "batch_size": 64, "lr": 0.01, "momentum": 0.9,
        "rounds": args.rounds, "seed": 0, "model": "fedavg-cnn",
        "data_dir": str(Path(args.data_dir).resolve()) if args.data_dir else "",
    }  # fmt: skip
    cpu = cpu_features()
    chosen = selection(cpu, args.only)
    if chosen["reason"]:
        print(chosen["reason"], flush=True)
    code_start, load_start = code_state(), load1()
    s["partition_command"], s["partition"] = make_partition(s, work)
    s["partition_file"] = str(work / "partition.npz")
    s["sizes"] = [len(p) for p in s["partition"]]
    s["clients"] = [
        sample_clients(s["seed"], rnd, s["num_clients"], s["clients_per_round"])
        for rnd in range(s["rounds"])
    ]
    s["planned_samples"] = [s["epochs"] * sum(s["sizes"][c] for c in cs) for cs in s["clients"]]
    plan = [
        (config, condition, rep)
        for rep in range(args.repeat)
        for config, condition in run_order(rep, args.busy, tuple(chosen["configs"]))
    ]
    runs = []
    for i, (config, condition, rep) in enumerate(plan, 1):
        print(f"[{i}/{len(plan)}] {config} ({condition}, repeat {rep + 1})", flush=True)
        record = one_run(config, condition, rep, s, work, args.timeout)
        if "error" in record:
            print(f"  failed: {record['error']} (log: {work / record['log']})", flush=True)
        else:
            print(f"  {record['throughput']['samples_per_s']:,.0f} samples/s", flush=True)
        runs.append(record)
    code_end = code_state()
    finished = [r for r in runs if "details" in r]
    s["train_samples"] = finished[0]["details"]["train_samples"] if finished else 0
    s["test_samples"] = finished[0]["details"]["test_samples"] if finished else 0
    s["partition_file"] = "partition.npz (in the invocation's scratch folder)"
    del s["partition"]
    report: dict[str, Any] = {
        "machine": machine_facts(),
        "cpu_features": cpu,
        "selection": chosen,
        "invocation": invocation,
        "setting": s,
        "load1_start": load_start,
        "load1_end": load1(),
        "code": code_record(code_start, code_end),
        "runs": runs,
    }
    summarize(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(report, indent=1) + "\n")
    text = report_md(report)
    args.out.write_text(text)
    print(text)
    failed = [r for r in runs if "error" in r]
    if failed or args.keep:
        print(f"run folders and logs kept in {work}")
        return 1 if failed else 0
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
