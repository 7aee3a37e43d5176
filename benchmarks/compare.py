"""Multi-seed comparison of algorithms in one setting: runs, then a table and a curve plot.

Each (algorithm, seed) is one `fedskew run` in its own process, so a killed comparison
resumes where it stopped: finished run folders are kept and skipped. Their config,
metrics and summary are committed under results/runs/ (checkpoints and partitions are
not), so the table can be rebuilt and checked from them with --report-only. The report is made
from whatever runs have finished and says how many seeds each row has.

    python benchmarks/compare.py --preset methods            # FedAvg, FedCME, FedFM, FedACD
    python benchmarks/compare.py --preset methods --report-only
    python benchmarks/compare.py --preset baselines          # the 14 baselines

Presets fix the setting of the project's comparison issues: Fashion-MNIST, simple-cnn,
20 clients, Dirichlet beta 0.1, 8 clients per round, 5 local epochs, batch 64, lr 0.01.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402

HERE = Path(__file__).resolve().parent
SETTING = [
    "-d", "fmnist", "-m", "simple-cnn", "-n", "20", "--clients-per-round", "8",
    "--partition", "dirichlet", "--beta", "0.1", "-e", "5", "-b", "64", "--lr", "0.01",
    "--momentum", "0.9", "--weight-decay", "1e-5",
]  # fmt: skip
PRESETS: dict[str, dict[str, list[str]]] = {
    "methods": {
        "fedavg": ["-a", "fedavg"],
        "fedcme": ["-a", "fedcme"],
        "fedfm": ["-a", "fedfm"],
        "fedacd": ["-a", "fedacd"],
    },
    # The baselines the three papers compare against, each with its defaults.
    "baselines": {
        name: ["-a", name]
        for name in (
            "fedavg",
            "fedprox",
            "scaffold",
            "feddyn",
            "fednova",
            "moon",
            "fedrs",
            "fedlc",
            "fedrod",
            "fedntd",
            "feddecorr",
            "fednh",
            "creff",
            "fedproto",
        )
    },  # fmt: skip
}


def run_one(label: str, args: list[str], seed: int, rounds: int, out: Path, threads: int) -> str:
    name = f"{label}-s{seed}"
    if (out / name / "summary.json").exists():
        return f"{name}: done before"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    unfinished = out / f"{name}.incomplete"
    if unfinished.is_dir():  # killed earlier: continue from its last checkpoint
        cmd = [sys.executable, "-m", "fedskew", "run", "--resume", str(unfinished), "-q"]
    else:
        cmd = [sys.executable, "-m", "fedskew", "run", *SETTING, *args, "--seed", str(seed),
               "-r", str(rounds), "-o", str(out), "--name", name, "-q"]  # fmt: skip
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return f"{name}: FAILED ({proc.stderr.strip().splitlines()[-1:]})"
    return f"{name}: {time.time() - t0:.0f} s"


def fmt_std(a) -> str:
    return f"{float(a.std(ddof=1)):.2f}" if len(a) > 1 else "n/a (1 seed)"


def report(preset: str, out: Path, seeds: list[int], rounds: int, results: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = []
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    # Means only over the seeds every algorithm has finished, so that rows compare like with
    # like; every finished run is listed per seed below the table.
    finished = {
        label: [s for s in seeds if (out / f"{label}-s{s}" / "summary.json").exists()]
        for label in PRESETS[preset]
    }
    common = [s for s in seeds if all(s in f for f in finished.values())]
    per_seed = []
    for label, done in finished.items():
        for seed in done:
            summary = json.loads((out / f"{label}-s{seed}" / "summary.json").read_text())
            per_seed.append(
                f"| {label} | {seed} | {100 * summary['final_accuracy']:.2f} | "
                f"{100 * summary['best_accuracy']:.2f} |"
            )
    for label in PRESETS[preset]:
        finals, bests, curves, mib = [], [], [], []
        for seed in common:
            folder = out / f"{label}-s{seed}"
            if not (folder / "summary.json").exists():
                continue
            summary = json.loads((folder / "summary.json").read_text())
            lines = (folder / "metrics.jsonl").read_text().splitlines()
            metrics = [json.loads(line) for line in lines]
            finals.append(summary["final_accuracy"])
            bests.append(summary["best_accuracy"])
            mib.append((summary["total_bytes_down"] + summary["total_bytes_up"]) / 2**20)
            curves.append([m["accuracy"] for m in metrics if "accuracy" in m])
        if not finals:
            rows.append(f"| {label} | 0 | not run | | |")
            continue
        f, b = np.array(finals) * 100, np.array(bests) * 100
        rows.append(
            f"| {label} | {len(finals)} | {f.mean():.2f} ± {fmt_std(f)} | "
            f"{b.mean():.2f} ± {fmt_std(b)} | {np.mean(mib) / len(curves[0]):.2f} |"
        )
        n = min(len(c) for c in curves)
        arr = np.array([c[:n] for c in curves]) * 100
        x = np.arange(1, n + 1)
        ax.plot(x, arr.mean(0), label=label)
        if len(curves) > 1:
            ax.fill_between(x, arr.min(0), arr.max(0), alpha=0.2)
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"{preset}: Fashion-MNIST, simple-cnn, 20 clients, Dir(0.1), 8/round, E=5")
    ax.grid(alpha=0.3)
    ax.legend()
    results.mkdir(parents=True, exist_ok=True)
    fig.savefig(results / f"compare_{preset}.png", bbox_inches="tight")
    m = describe()
    (results / f"compare_{preset}.md").write_text(
        f"# Comparison: {preset}\n\n"
        f"Produced by `python benchmarks/compare.py --preset {preset} --rounds {rounds} "
        f"--seeds {' '.join(map(str, seeds))}`; the seeds column says how many of those "
        "runs count in the means.\n\n"
        f"- Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; torch {m['torch']}\n"
        f"- Data: Fashion-MNIST (Debian's dataset-fashion-mnist copy of the official files)\n"
        f"- Setting: `fedskew run {' '.join(SETTING)} -r {rounds}`, seeds {seeds}; "
        "each algorithm with its defaults\n\n"
        f"Mean ± sample standard deviation over the seeds every algorithm finished: {common}.\n\n"
        "| algorithm | seeds | final accuracy (%) | best accuracy (%) | MiB per round |\n"
        "|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
        "Every finished run:\n\n| algorithm | seed | final (%) | best (%) |\n|---|---|---|---|\n"
        + "\n".join(per_seed)
        + "\n\n"
        f"![accuracy curves](compare_{preset}.png)\n\n"
        "Curves: mean over the common seeds; the shaded band is the min-max range.\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="methods")
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--out", default=str(HERE / "results" / "runs"))
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    out = Path(args.out) / args.preset
    if not args.report_only:
        jobs = [
            (label, a, seed) for seed in args.seeds for label, a in PRESETS[args.preset].items()
        ]
        with ThreadPoolExecutor(args.jobs) as pool:
            futures = [
                pool.submit(run_one, label, a, seed, args.rounds, out, args.threads)
                for label, a, seed in jobs
            ]
            for fut in futures:
                print(fut.result(), flush=True)
    report(args.preset, out, args.seeds, args.rounds, HERE / "results")


if __name__ == "__main__":
    main()
