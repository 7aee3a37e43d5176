"""What `--workers auto` rests on: clients in one process with every thread against clients in
one-thread worker processes, on an idle machine and on a busy one.

The issue-6 experiment (FedAvg, Fashion-MNIST, fedavg-cnn, 20 clients, Dirichlet 0.1, 8 per
round, batch 64, SGD lr 0.01 momentum 0.9; E = 2 here by default to keep the invocation
short: the choice is about how a round's client work spreads over the cores, which E scales
alike), each layout a `fedskew run` child process, per precision (fp32, bf16), each run once
on the idle machine and once while another CPU-bound process runs (a one-thread Python busy
loop started before the run and stopped after it: a colleague's job, a second experiment).
Every repeat runs every variant once, the order reversed in every other repeat.

Throughput = training samples / training seconds (metrics.jsonl `samples`, `seconds`: the
evaluation is timed apart and left out) summed over rounds 2..R: every measured round
counts, slow ones included. The per-round spread (fastest / slowest round's samples/s) shows
rounds slowed by something other than the layout (denormals, a busy spell).

    python benchmarks/auto_choice.py [--rounds 3] [--repeat 2] [--layouts 0x2 2x1]
    python benchmarks/auto_choice.py --report-only

A layout ``WxT``: W worker processes (0: clients in the run's own process) with T torch
threads each (the run's process gets T with W = 0).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from child import REPO, command_text, read_metrics, run_child  # noqa: E402
from machine import load1, machine_facts  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PRECISIONS = ("fp32", "bf16")
CONDITIONS = ("idle", "busy")
BUSY_LOOP = "while True: pass"
RUN_TIMEOUT_S = 1800


def parse_layout(text: str) -> tuple[int, int]:
    try:
        workers, threads = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"a layout is WxT (workers x threads), got {text!r}") from None
    if workers < 0 or threads < 1 or workers == 1:
        raise SystemExit(f"layout {text!r}: W is 0 or >= 2, T >= 1")
    return workers, threads


def layout_name(workers: int, threads: int) -> str:
    if workers == 0:
        return f"1 process x {threads} thread(s)"
    return f"{workers} worker processes x {threads} thread(s)"


def experiment_args(args: argparse.Namespace, precision: str, workers: int) -> list[str]:
    return [
        "run", "-a", "fedavg", "-d", "fmnist", "-m", "fedavg-cnn", "-n", "20",
        "--clients-per-round", "8", "--partition", "dirichlet", "--beta", "0.1",
        "-e", str(args.local_epochs), "-b", "64", "--lr", "0.01", "--momentum", "0.9",
        "--weight-decay", "0", "-r", str(args.rounds), "--seed", "0",
        "--precision", precision, "--workers", str(workers), "--checkpoint-every", "0", "-q",
        *(["--data-dir", args.data_dir] if args.data_dir else []),
    ]  # fmt: skip


def aggregate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Samples/s over rounds 2..R (sum of samples / sum of seconds) and the per-round
    spread (fastest / slowest round)."""
    measured = [r for r in rows if r["round"] >= 2 and r.get("seconds")]
    if not measured:
        return {"samples_per_s": None, "per_round": [], "spread": None}
    per_round = [r["samples"] / r["seconds"] for r in measured]
    total = sum(r["samples"] for r in measured) / sum(r["seconds"] for r in measured)
    return {
        "samples_per_s": round(total, 1),
        "per_round": [round(x, 1) for x in per_round],
        "spread": round(max(per_round) / min(per_round), 3),
    }


def run_once(
    args: argparse.Namespace, precision: str, layout: tuple[int, int], condition: str, tmp: Path
) -> dict[str, Any]:
    workers, threads = layout
    out = tmp / f"{precision}-{workers}x{threads}-{condition}-{time.monotonic_ns()}"
    argv = [sys.executable, "-m", "fedskew", *experiment_args(args, precision, workers),
            "-o", str(out)]  # fmt: skip
    busy = None
    if condition == "busy":
        busy = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
        time.sleep(1.0)  # let it take its core
    before = load1()
    try:
        code, wall, _, _ = run_child(argv, threads, out / "child.log", poll_s=0)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    after = load1()
    if code != 0:
        text = (out / "child.log").read_text(errors="replace")[-2000:]
        raise SystemExit(f"{command_text(argv, threads)} failed ({code}):\n{text}")
    rows = read_metrics(out)
    folder = next(out.glob("*/processes.jsonl")).parent
    process = json.loads((folder / "processes.jsonl").read_text().splitlines()[0])
    return {
        "precision": precision,
        "workers": workers,
        "threads": threads,
        "condition": condition,
        "command": command_text(argv, threads),
        "wall_s": round(wall, 1),
        "load1_before": before,
        "load1_after": after,
        "denormals": process.get("denormals"),
        "workers_recorded": process.get("workers"),
        "data_source": process.get("data_source"),
        **aggregate(rows),
    }


def verdicts(runs: list[dict[str, Any]], layouts: list[tuple[int, int]]) -> list[dict]:
    """Per precision and condition: each layout's median samples/s over repeats, and the
    fastest, computed from the runs."""
    out = []
    for precision in PRECISIONS:
        for condition in CONDITIONS:
            cells = {}
            for workers, threads in layouts:
                values = [
                    r["samples_per_s"]
                    for r in runs
                    if (r["precision"], r["condition"], r["workers"], r["threads"])
                    == (precision, condition, workers, threads)
                    and r["samples_per_s"]
                ]
                if values:
                    cells[f"{workers}x{threads}"] = statistics.median(values)
            if cells:
                best = max(cells, key=cells.__getitem__)
                out.append({"precision": precision, "condition": condition, "median": cells,
                            "fastest": best})  # fmt: skip
    return out


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    layouts = [tuple(x) for x in result["layouts"]]
    keys = [f"{w}x{t}" for w, t in layouts]
    head = " | ".join(layout_name(w, t) for w, t in layouts)
    first = keys[0]
    lines = [
        "# `--workers auto`: one process against worker processes, idle and busy\n",
        f"Produced by `{result['command']}` on {m['cpu']}, {m['cores']} cores, "
        f"{m['memory_gib']} GiB; torch {m['torch']}; Python {m['python']}.\n",
        f"- Setting: {result['setting']}",
        f"- Data: {result['data_source']}",
        "- Busy: another process runs `python -c '" + BUSY_LOOP + "'` (one core) during the run.",
        "- Throughput: training samples / training seconds over rounds 2.."
        f"{result['rounds']} (evaluation left out, every round counted); median over "
        f"{result['repeat']} repeat(s).\n",
        f"| precision | machine | {head} | ratios to {layout_name(*layouts[0])} | fastest |",
        "|---|---|" + "---|" * len(keys) + "---|---|",
    ]
    for v in result["verdicts"]:
        cells = " | ".join(f"{v['median'][k]:,.0f}" if k in v["median"] else "-" for k in keys)
        ratios = ", ".join(
            f"{k}: {v['median'][k] / v['median'][first]:.2f}"
            for k in keys[1:]
            if k in v["median"] and first in v["median"]
        )
        fastest = layout_name(*(int(x) for x in v["fastest"].split("x")))
        lines.append(f"| {v['precision']} | {v['condition']} | {cells} | {ratios} | {fastest} |")
    lines += [
        "\n## Every run\n",
        "| precision | layout | machine | samples/s | per round | spread | denormals | load "
        "before / after | wall (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        per_round = ", ".join(f"{x:,.0f}" for x in r["per_round"])
        value = f"{r['samples_per_s']:,.0f}" if r["samples_per_s"] else "-"
        lines.append(
            f"| {r['precision']} | {layout_name(r['workers'], r['threads'])} | "
            f"{r['condition']} | {value} | {per_round} | {r['spread']} | {r['denormals']} | "
            f"{r['load1_before']} / {r['load1_after']} | {r['wall_s']} |"
        )
    lines += ["\nCommands:\n"] + [f"- `{r['command']}`" for r in result["runs"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--local-epochs", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--layouts", nargs="+", default=None,
                    help="WxT items; default: 0xC and Cx1 for C usable cores")  # fmt: skip
    ap.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    ap.add_argument("--conditions", nargs="+", default=list(CONDITIONS), choices=CONDITIONS)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", default=str(RESULTS / "auto_choice.md"))
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    if args.report_only:
        out.write_text(markdown(json.loads(out.with_suffix(".json").read_text())))
        return
    cores = len(os.sched_getaffinity(0))
    layouts = [parse_layout(x) for x in args.layouts] if args.layouts else [(0, cores), (cores, 1)]
    command = "python benchmarks/auto_choice.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="auto-choice-", dir=REPO / "benchmarks") as tmp:
        for rep in range(1, args.repeat + 1):
            variants = [
                (p, lay, c) for c in args.conditions for p in args.precisions for lay in layouts
            ]
            for precision, layout, condition in variants[::-1] if rep % 2 == 0 else variants:
                row = run_once(args, precision, layout, condition, Path(tmp))
                row["repeat"] = rep
                runs.append(row)
                print(
                    f"{rep} {precision} {layout[0]}x{layout[1]} {condition}: "
                    f"{row['samples_per_s']} samples/s, spread {row['spread']}",
                    flush=True,
                )
    result = {
        "machine": machine_facts(),
        "command": command,
        "rounds": args.rounds,
        "repeat": args.repeat,
        "layouts": [list(x) for x in layouts],
        "data_source": runs[0]["data_source"] if runs else None,
        "setting": (
            "FedAvg, fmnist, fedavg-cnn (channels_last), 20 clients, dirichlet beta 0.1, 8 per "
            f"round, E={args.local_epochs}, batch 64, lr 0.01, momentum 0.9, weight decay 0, "
            f"seed 0, {args.rounds} rounds, fedskew's defaults otherwise (denormals flushed)"
        ),
        "runs": runs,
        "verdicts": verdicts(runs, layouts),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.write_text(markdown(result))
    print(f"written: {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
