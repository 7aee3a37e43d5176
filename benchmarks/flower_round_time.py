"""Per-round time of the Flower simulation engine against the in-process engine.

Both run the same experiment (same seed, partition and clients) as `fedskew run`
subprocesses; the round time is the run loop's `seconds` per round (training plus message
transport, evaluation excluded), and the startup is the process's wall time minus the
rounds. The two curves are also checked to be identical.

    python benchmarks/flower_round_time.py            # ~5 min
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402

HERE = Path(__file__).resolve().parent
ENGINES = [
    ("inprocess", ["--engine", "inprocess"]),
    ("inprocess-workers2", ["--engine", "inprocess", "--workers", "2"]),
    ("flower-sim", ["--engine", "flower-sim"]),
]


def run_engine(label: str, args: list[str], setting: list[str], out: Path, threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "fedskew", "run", *setting, *args,
           "-o", str(out), "--name", label, "-q"]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{label} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (out / label / "metrics.jsonl").read_text().splitlines()]
    seconds = [r["seconds"] for r in rows]
    return {
        "engine": label,
        "command": " ".join(["fedskew", *cmd[3:]]),
        "round_seconds": seconds,
        "median_round_seconds": statistics.median(seconds[1:] or seconds),
        "wall_seconds": round(wall, 2),
        "startup_seconds": round(
            wall - sum(seconds) - sum(r.get("eval_seconds", 0) for r in rows), 2
        ),
        "accuracy": [r["accuracy"] for r in rows],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = ap.parse_args()
    setting = ["-d", "fmnist", "-m", "simple-cnn", "-n", "20", "--clients-per-round", "8",
               "--beta", "0.1", "-e", "1", "-b", "64", "--lr", "0.01", "-r", str(args.rounds),
               "--seed", "0"]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        results = [
            run_engine(label, engine_args, setting, Path(tmp), args.threads)
            for label, engine_args in ENGINES
        ]
    inproc, workers, sim = results
    same = inproc["accuracy"] == sim["accuracy"] == workers["accuracy"]
    ratio = sim["median_round_seconds"] / inproc["median_round_seconds"]
    ratio_workers = sim["median_round_seconds"] / workers["median_round_seconds"]
    report = {"machine": describe(), "threads": args.threads, "results": results,
              "identical_accuracy": same, "round_time_ratio": ratio,
              "round_time_ratio_to_workers": ratio_workers}  # fmt: skip
    m = report["machine"]
    (HERE / "results" / "flower_round_time.json").write_text(json.dumps(report, indent=1))
    lines = [
        "# Flower simulation vs in-process: time per round",
        "",
        f"Produced by `python benchmarks/flower_round_time.py --rounds {args.rounds} "
        f"--threads {args.threads}` on {m['cpu']}, {m['cores']} cores, torch {m['torch']}. "
        "Data: Fashion-MNIST (the official files); FedAvg, simple-cnn, 20 clients, "
        "Dirichlet 0.1, 8 per round, 1 local epoch, seed 0. Each process has "
        f"{args.threads} torch thread(s); the Flower simulation runs one Ray worker per core "
        "(clients two at a time on 2 cores), so the fair in-process comparison is "
        "`--workers 2` (two worker processes of one thread each).",
        "",
        "| engine | median round (s) | rounds (s) | startup (s) | total wall (s) |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        rounds = ", ".join(f"{s:.2f}" for s in r["round_seconds"])
        lines.append(
            f"| {r['engine']} | {r['median_round_seconds']:.2f} | {rounds} | "
            f"{r['startup_seconds']:.1f} | {r['wall_seconds']:.1f} |"
        )
    lines += [
        "",
        f"Flower simulation round time / in-process with 2 workers: {ratio_workers:.2f}x; "
        f"/ in-process in one process: {ratio:.2f}x (medians of rounds 2-{args.rounds}). "
        f"Accuracy curves identical across the three: {same}.",
        "",
    ]
    (HERE / "results" / "flower_round_time.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
