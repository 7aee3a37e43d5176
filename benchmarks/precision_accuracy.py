"""Does bf16 autocast keep fp32's accuracy? The issue-6 experiment over several seeds.

FedAvg, Fashion-MNIST, fedavg-cnn, 20 clients, Dirichlet 0.1, 8 per round, 5 local epochs,
batch 64, lr 0.01, momentum 0.9, channels_last, for R rounds, once in fp32 and once in bf16 per
seed. Each run is a `fedskew run` subprocess; finished runs are kept and skipped on a rerun.
The report gives per seed the final accuracy and the mean of the last rounds, and the
bf16 - fp32 difference per seed (paired: same partition and clients).

    python benchmarks/precision_accuracy.py [--rounds 15] [--seeds 0 1 2] [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_facts  # noqa: E402
from runinfo import data_summary, describe_facts, run_facts  # noqa: E402

HERE = Path(__file__).resolve().parent
SETTING = [
    "-d", "fmnist", "-m", "fedavg-cnn", "-n", "20", "--clients-per-round", "8",
    "--partition", "dirichlet", "--beta", "0.1", "-e", "5", "-b", "64", "--lr", "0.01",
    "--momentum", "0.9", "--memory-format", "channels_last",
]  # fmt: skip
LAST = 5


def run_one(precision: str, seed: int, rounds: int, out: Path, threads: int) -> str:
    name = f"{precision}-s{seed}"
    if (out / name / "summary.json").exists():
        return f"{name}: done before"
    unfinished = out / f"{name}.incomplete"
    if unfinished.is_dir():
        cmd = [sys.executable, "-m", "fedskew", "run", "--resume", str(unfinished), "-q"]
    else:
        # --workers 0: the runs share the machine --jobs at a time, one thread each.
        cmd = [sys.executable, "-m", "fedskew", "run", *SETTING, "--precision", precision,
               "--seed", str(seed), "-r", str(rounds), "-o", str(out), "--name", name,
               "--workers", "0", "-q"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return f"{name}: FAILED {proc.stderr.strip()[-500:]}"
    return f"{name}: done"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(HERE / "results" / "runs" / "precision"))
    args = ap.parse_args()
    out = Path(args.out)
    with ThreadPoolExecutor(args.jobs) as pool:
        jobs = [(p, s) for s in args.seeds for p in ("fp32", "bf16")]
        for line in pool.map(lambda j: run_one(*j, args.rounds, out, args.threads), jobs):
            print(line, flush=True)

    rows, diffs_final, diffs_last, swings = [], [], [], []
    for seed in args.seeds:
        got = {}
        for precision in ("fp32", "bf16"):
            folder = out / f"{precision}-s{seed}"
            if not (folder / "summary.json").exists():
                continue
            lines = (folder / "metrics.jsonl").read_text().splitlines()
            acc = [json.loads(x)["accuracy"] for x in lines]
            summary = json.loads((folder / "summary.json").read_text())
            got[precision] = (acc[-1], statistics.mean(acc[-LAST:]),
                              summary["train_samples_per_second"])  # fmt: skip
            if precision == "fp32":
                swings.append(100 * statistics.stdev(acc[-LAST:]))
        if len(got) < 2:
            continue
        (f32, l32, s32), (b16, l16, s16) = got["fp32"], got["bf16"]
        diffs_final.append(100 * (b16 - f32))
        diffs_last.append(100 * (l16 - l32))
        rows.append(
            f"| {seed} | {100 * f32:.2f} | {100 * b16:.2f} | {100 * (b16 - f32):+.2f} | "
            f"{100 * l32:.2f} | {100 * l16:.2f} | {100 * (l16 - l32):+.2f} | "
            f"{s32:,.0f} | {s16:,.0f} |"
        )

    def mean_sd(v: list[float]) -> str:
        sd = f" ± {statistics.stdev(v):.2f}" if len(v) > 1 else ""
        return f"{statistics.mean(v):+.2f}{sd}" if v else "n/a"

    finished = {
        f"{p}-s{s}": out / f"{p}-s{s}"
        for s in args.seeds
        for p in ("fp32", "bf16")
        if (out / f"{p}-s{s}" / "summary.json").exists()
    }
    facts = {name: run_facts(folder) for name, folder in finished.items()}
    data_line, differ = data_summary(facts)
    per_run = (
        "".join(f"- {name}: {describe_facts(f)}\n" for name, f in facts.items()) + "\n"
        if differ
        else ""
    )
    machines = (
        ", ".join(
            sorted(
                {f"{p['cpu']}, {p['cores']} cores" for f in facts.values() for p in f["processes"]}
            )
        )
        or "not recorded (the runs predate processes.jsonl)"
    )
    m = machine_facts()
    text = (
        "# bf16 autocast against fp32: accuracy\n\n"
        f"Produced by `python benchmarks/precision_accuracy.py --rounds {args.rounds} "
        f"--seeds {' '.join(map(str, args.seeds))}`; report made on {m['cpu']}, "
        f"{m['cores']} cores, torch {m['torch']}. Runs computed on: {machines}; "
        f"{args.jobs} runs at a time, {args.threads} thread each.\n\n"
        f"Data: Fashion-MNIST; {data_line}. Setting: `fedskew run {' '.join(SETTING)} "
        f"-r {args.rounds} --precision fp32|bf16 --seed S`.\n\n"
        + per_run
        + f"| seed | fp32 final (%) | bf16 final (%) | difference | fp32 last {LAST} (%) "
        f"| bf16 last {LAST} (%) | difference | fp32 training samples/s | bf16 training "
        "samples/s |\n|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
        f"bf16 - fp32, mean ± sd over seeds: final {mean_sd(diffs_final)} points, "
        f"last {LAST} rounds {mean_sd(diffs_last)} points. For scale: within one fp32 run the "
        f"accuracy of the last {LAST} rounds has a standard deviation of "
        f"{statistics.mean(swings) if swings else float('nan'):.2f} points (mean over seeds).\n"
    )
    (HERE / "results" / "precision_accuracy.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
