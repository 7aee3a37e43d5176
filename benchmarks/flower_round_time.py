"""Round time of Flower's simulation engine against fedskew's own engines, side by side.

One invocation runs the same experiment (same config and seed: the same partition, the same
clients every round, the same test set) as `fedskew run` child processes, one after another
on this machine:

1. ``flower-sim``: Flower's simulation engine (Ray), one virtual SuperNode per client. A probe
   in the child (benchmarks/flower_probe.py) records the client resources fedskew passes to
   Flower and the Ray actor pool Flower builds from them: A actors train A clients at a time.
   While it runs, the OMP_NUM_THREADS of Flower's actor processes is read from /proc.
2. fedskew with Flower's thread budget (A actors x T threads): in A one-thread worker
   processes (``--workers A``), and in one process with A x T torch threads.
3. fedskew in one process with T threads (a smaller budget than Flower's when A > 1).

Every process gets OMP_NUM_THREADS=T (``--threads``), except step 2's single process (A x T).
Round time is the run loop's ``seconds`` per round (training and message transport; the
evaluation is timed apart and left out); startup = wall time - rounds - evaluation. After
the runs, each run folder's config.json, processes.jsonl and metrics.jsonl are read back
for the engine, workers, precision, threads, data copy and test set of each side, and to
check that the clients and the accuracy curves are identical. Other processes may share the
machine: the 1-minute load average is recorded before and after every run.

    python benchmarks/flower_round_time.py [--rounds 5] [--threads 1]     # a few minutes
    python benchmarks/flower_round_time.py --report-only    # the .md again from the .json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from child import REPO, _descendants  # noqa: E402
from machine import load1, machine_facts  # noqa: E402
from runinfo import run_facts  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
# Config keys that say how and where a run executes, not what it computes.
EXECUTION_KEYS = ("engine", "workers", "out_dir", "name", "quiet")
RESOLVED_EXECUTION_KEYS = ("torch_threads",)
RUN_TIMEOUT_S = 900


def code_state() -> dict[str, Any]:
    """The commit, whether src/ has uncommitted changes, and a digest of src/'s files: taken
    before and after the runs, so that the result says whether the code changed between."""

    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True).stdout

    digest = hashlib.sha256()
    for path in sorted((REPO / "src").rglob("*.py")):
        digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return {
        "commit": git("rev-parse", "--short", "HEAD").strip() or "unknown",
        "src_dirty": bool(git("status", "--porcelain", "--", "src").strip()),
        "src_digest": digest.hexdigest(),
    }


def code_record(start: dict[str, Any], end: dict[str, Any]) -> dict[str, Any]:
    """What a result says of the code it ran, from :func:`code_state` before and after."""
    return {
        "commit": start["commit"],
        "src_changes_uncommitted": start["src_dirty"],
        "src_unchanged_during_runs": start == end,
    }


def code_sentence(code: dict[str, Any]) -> str:
    """The report's line on a :func:`code_record`."""
    return (
        f"- fedskew's code: commit {code['commit']}"
        + (", with uncommitted changes under src/" if code["src_changes_uncommitted"] else "")
        + (
            "; src/ did not change during the invocation."
            if code["src_unchanged_during_runs"]
            else "; **src/ changed during the invocation: the runs may have run different code**."
        )
    )


def actor_environment(pid: int, seen: dict[int, str]) -> None:
    """OMP_NUM_THREADS of every Flower actor process below ``pid`` (from /proc)."""
    for child in _descendants(pid):
        if child in seen:
            continue
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"ClientAppActor" not in cmdline:
                continue
            env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        values = [e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"OMP_NUM_THREADS=")]
        seen[child] = values[0] if values else "unset"


def run_engine(
    label: str, engine_args: list[str], setting: list[str], out: Path, threads: int
) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    fedskew_args = ["run", *setting, *engine_args, "-o", str(out), "--name", label, "-q"]
    flower = "flower-sim" in engine_args
    probe = out / f"{label}.flower.json"
    if flower:
        argv = [sys.executable, str(HERE / "flower_probe.py"), str(probe), *fedskew_args]
    else:
        argv = [sys.executable, "-m", "fedskew", *fedskew_args]
    load_before = load1()
    actors: dict[int, str] = {}
    log = out / f"{label}.log"
    t0 = time.perf_counter()
    # Output to a file, not a pipe: a pipe nobody reads while the run goes on can fill up.
    with open(log, "w") as sink:
        proc = subprocess.Popen(
            argv, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
        polls = 0
        while proc.poll() is None:
            if flower and polls % 4 == 0:  # every 2 s: a /proc scan costs CPU time too
                actor_environment(proc.pid, actors)
            if time.perf_counter() - t0 > RUN_TIMEOUT_S:
                os.killpg(proc.pid, signal.SIGKILL)  # the run and the Ray processes it started
                proc.wait()
                raise SystemExit(f"{label}: no result after {RUN_TIMEOUT_S} s (log: {log})")
            time.sleep(0.5)
            polls += 1
    wall = time.perf_counter() - t0
    load_after = load1()
    if proc.returncode != 0:
        raise SystemExit(f"{label} failed:\n{log.read_text()[-3000:]}")
    folder = out / label
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    facts = run_facts(folder)
    config = facts["config"]
    seconds = [r["seconds"] for r in rows]
    result: dict[str, Any] = {
        "engine": label,
        "command": f"OMP_NUM_THREADS={threads} fedskew "
        + " ".join(shlex.quote(a) for a in fedskew_args),
        "omp_num_threads": threads,
        "precision": config["precision"],
        "channels_last": config["resolved"]["channels_last"],
        "torch_threads_main_process": config["resolved"]["torch_threads"],
        "workers": [p["workers"] for p in facts["processes"]],
        "dataset_source": facts["dataset_source"],
        "train_samples": config["resolved"]["train_samples"],
        "test_samples": facts["test_samples"],
        "config_compared": {
            **{k: v for k, v in config.items() if k not in EXECUTION_KEYS},
            "resolved": {
                k: v for k, v in config["resolved"].items() if k not in RESOLVED_EXECUTION_KEYS
            },
        },
        "round_seconds": seconds,
        "median_round_seconds": statistics.median(seconds[1:] or seconds),
        "wall_seconds": round(wall, 2),
        "startup_seconds": round(
            wall - sum(seconds) - sum(r.get("eval_seconds", 0) for r in rows), 2
        ),
        "load1_before": load_before,
        "load1_after": load_after,
        "clients": [r["clients"] for r in rows],
        "accuracy": [r["accuracy"] for r in rows],
    }
    if flower:
        result["flower"] = json.loads(probe.read_text()) if probe.exists() else None
        result["flower_actor_omp_num_threads"] = sorted(set(actors.values()))
        result["flower_actor_processes_seen"] = len(actors)
    return result


def describe(r: dict[str, Any]) -> str:
    """The configuration of one side, from what its run recorded."""
    fmt = "channels_last" if r["channels_last"] else "contiguous"
    if "flower" in r:
        f = r["flower"]
        omp = ", ".join(r["flower_actor_omp_num_threads"]) or "not seen"
        return (
            f"Flower {f['flwr']} simulation, Ray {f['ray']}: client resources "
            f"num_cpus={f['client_resources'].get('num_cpus')}, "
            f"num_gpus={f['client_resources'].get('num_gpus')} per virtual client; Ray sees "
            f"{f['ray_cpus']:g} CPUs, so {f['actors']} actor(s) train {f['actors']} client(s) "
            f"at a time; actors' OMP_NUM_THREADS={omp}; {r['precision']}, {fmt}"
        )
    workers = max(r["workers"])
    if workers:
        return (
            f"fedskew in-process engine with {workers} worker processes (one torch thread "
            f"each), main process {r['torch_threads_main_process']} thread(s); "
            f"{r['precision']}, {fmt}"
        )
    return (
        f"fedskew in-process engine, clients in the main process with "
        f"{r['torch_threads_main_process']} torch thread(s); {r['precision']}, {fmt}"
    )


def speed_word(ratio: float) -> str:
    return "faster" if ratio > 1 else "slower" if ratio < 1 else "as fast"


def report_md(report: dict[str, Any]) -> str:
    m, s = report["machine"], report["setting"]
    results = report["results"]
    flower = next(r for r in results if "flower" in r)
    budget = report["thread_budget"]
    code = report["code"]
    lines = [
        "# Flower simulation against fedskew's engines: time per round, side by side",
        "",
        f"Produced by `{report['invocation']}` on {m['cpu']}, {m['cores']} cores, "
        f"{m['memory_gib']} GiB, torch {m['torch']}, Python {m['python']}: every run in this "
        "one invocation, one after another. 1-minute load average "
        f"{report['load1_start']} at the start and {report['load1_end']} at the end (other "
        "processes may share the machine; each run's is in the table).",
        "",
        f"Like with like, the same thread budget ({budget} threads as Flower's): Flower's "
        "median round time divided by fedskew's (above 1: fedskew faster).",
        "",
    ]
    runs = {r["engine"]: r for r in results}
    # Files written before "run_of" existed: main() runs them in this order.
    run_of = report.get("run_of") or {
        "workers": results[1]["engine"],
        "one_process": results[2]["engine"],
        "reference": results[-1]["engine"],
    }
    for key in ("workers", "one_process", "reference"):
        if key not in report["ratios"]:
            continue
        r = runs[run_of[key]]
        ratio = report["ratios"][key]
        lines.append(
            ("- " if key != "reference" else "- not like with like: ")
            + f"fedskew with {r['threads_in_use']} thread(s) ({r['engine']}): "
            + (f"{ratio:.2f}" if key == "reference" else f"**{ratio:.2f}**")
            + f" (fedskew {speed_word(ratio)} in this run)"
        )
    loads = [report["load1_start"], report["load1_end"]] + [
        x for r in results for x in (r["load1_before"], r["load1_after"])
    ]
    if max(loads) > m["cores"]:
        lines += [
            "",
            f"The 1-minute load average reached {max(loads)} on these {m['cores']} cores "
            "during the runs: other processes competed for the CPU, so these round times "
            "are not those of an idle machine, and a run's time depends on when it ran.",
        ]
    lines += ["", "Configurations, from what each run recorded:", ""]
    lines += [f"- {r['engine']}: {describe(r)}" for r in results]
    lines += [
        "",
        "| run | threads in use | median round (s) | rounds (s) | startup (s) | wall (s) "
        "| load (1 min) before / after |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rounds = ", ".join(f"{x:.2f}" for x in r["round_seconds"])
        lines.append(
            f"| {r['engine']} | {r['threads_in_use']} | {r['median_round_seconds']:.2f} | "
            f"{rounds} | {r['startup_seconds']:.1f} | {r['wall_seconds']:.1f} | "
            f"{r['load1_before']} / {r['load1_after']} |"
        )
    differences = "; ".join(
        f"{r['engine']}: " + ("identical" if d == 0 else f"differs by up to {100 * d:.2f} points")
        for r, d in zip(results, report["accuracy_difference_to_flower"], strict=True)
        if r is not flower
    )
    lines += [
        "",
        f"- Experiment: `fedskew run {' '.join(s)}` (FedAvg), the same for every run; only "
        "the engine, workers and threads differ.",
        f"- Data: {flower['dataset_source']}; {flower['train_samples']:,} training and "
        f"{flower['test_samples']:,} test samples.",
        f"- Same clients every round in every run: {report['identical_clients']}; same "
        f"config apart from engine, workers and threads: {report['identical_config']}; same "
        f"data copy and test set: {report['identical_data']}.",
        f"- Accuracy curve against Flower's: {differences}.",
        code_sentence(code),
        "- Round time: the run loop's seconds per round (training and message transport; "
        "evaluation left out), median of rounds 2 and later. Startup: wall time minus rounds "
        "and evaluation.",
        "",
        "## Commands",
        "",
    ]
    lines += [f"- {r['engine']}: `{r['command']}`" for r in results]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (T)")
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="rewrite flower_round_time.md from flower_round_time.json; run nothing",
    )
    args = ap.parse_args()
    if args.report_only:
        report = json.loads((RESULTS / "flower_round_time.json").read_text())
        (RESULTS / "flower_round_time.md").write_text(report_md(report))
        return
    invocation = "python benchmarks/flower_round_time.py " + " ".join(
        shlex.quote(a) for a in sys.argv[1:]
    )
    setting = ["-d", "fmnist", "-m", "simple-cnn", "-n", "20", "--clients-per-round", "8",
               "--beta", "0.1", "-e", "1", "-b", "64", "--lr", "0.01", "-r", str(args.rounds),
               "--seed", "0"]  # fmt: skip
    T = args.threads
    code_start = code_state()
    load_start = load1()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        flower = run_engine("flower-sim", ["--engine", "flower-sim"], setting, out, T)
        if flower["flower"] is None:
            raise SystemExit("the Flower probe recorded nothing: the run did not build Ray actors")
        actors = int(flower["flower"]["actors"])
        budget = actors * T
        flower["threads_in_use"] = f"{actors} actors x {T}"
        workers = run_engine(
            f"fedskew-workers{actors}",
            ["--engine", "inprocess", "--workers", str(actors)],
            setting,
            out,
            T,
        )
        workers["threads_in_use"] = f"{actors} workers x 1"
        results = [flower, workers]
        one_process = run_engine(
            f"fedskew-1process-{budget}threads",
            ["--engine", "inprocess", "--workers", "0"],
            setting,
            out,
            budget,
        )
        one_process["threads_in_use"] = f"1 process x {budget}"
        results.append(one_process)
        if budget != T:
            reference = run_engine(
                f"fedskew-1process-{T}threads",
                ["--engine", "inprocess", "--workers", "0"],
                setting,
                out,
                T,
            )
            reference["threads_in_use"] = f"1 process x {T}"
            results.append(reference)
    load_end = load1()
    code_end = code_state()

    def ratio(r: dict[str, Any]) -> float:
        return flower["median_round_seconds"] / r["median_round_seconds"]

    headline = {
        "workers": f"fedskew's with {actors} one-thread worker processes",
        "one_process": f"fedskew's in one process with {budget} torch threads",
    }
    ratios = {"workers": ratio(workers), "one_process": ratio(one_process)}
    report: dict[str, Any] = {
        "machine": machine_facts(),
        "invocation": invocation,
        "setting": setting,
        "threads": T,
        "thread_budget": budget,
        "load1_start": load_start,
        "load1_end": load_end,
        "results": results,
        "identical_clients": all(r["clients"] == flower["clients"] for r in results),
        "accuracy_difference_to_flower": [
            max(abs(a - b) for a, b in zip(r["accuracy"], flower["accuracy"], strict=True))
            for r in results
        ],
        "code": code_record(code_start, code_end),
        "identical_config": all(r["config_compared"] == flower["config_compared"] for r in results),
        "identical_data": all(
            (r["dataset_source"], r["train_samples"], r["test_samples"])
            == (flower["dataset_source"], flower["train_samples"], flower["test_samples"])
            for r in results
        ),
        "headline": headline,
        "ratios": ratios,
        "run_of": {"workers": workers["engine"], "one_process": one_process["engine"]},
    }
    if budget != T:
        report["reference"] = f"fedskew's in one process with {T} torch thread(s)"
        report["ratios"]["reference"] = ratio(results[-1])
        report["run_of"]["reference"] = results[-1]["engine"]
    (RESULTS / "flower_round_time.json").write_text(json.dumps(report, indent=1) + "\n")
    text = report_md(report)
    (RESULTS / "flower_round_time.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
