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

The same presets are compare files for `fedskew compare`, with the same run names and
settings, so either continues the other's runs: configs/compare/methods.toml and
configs/compare/baselines.toml (`fedskew compare -c configs/compare/methods.toml
--report-only` writes results/runs/methods/comparison.md and .csv; `fedskew report
benchmarks/results/runs/methods` the full report). This script stays for its
results/compare_*.md reports, which the findings files quote.
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
from machine import machine_facts  # noqa: E402
from runinfo import data_summary, describe_facts, run_facts  # noqa: E402

HERE = Path(__file__).resolve().parent
# NIID-Bench's loop (dirichlet-niidbench: dirichlet before partition_version 2): the
# committed runs under results/runs were made with it, so a rerun continues them.
SETTING = [
    "-d", "fmnist", "-m", "simple-cnn", "-n", "20", "--clients-per-round", "8",
    "--partition", "dirichlet-niidbench", "--beta", "0.1", "-e", "5", "-b", "64", "--lr", "0.01",
    "--momentum", "0.9", "--weight-decay", "1e-5",
]  # fmt: skip
PRESETS: dict[str, dict[str, list[str]]] = {
    "methods": {
        "fedavg": ["-a", "fedavg"],
        "fedcme": ["-a", "fedcme"],
        "fedfm": ["-a", "fedfm"],
        # lam 50 (the paper's default) diverges with this BatchNorm-free CNN; 10 is the low
        # end of the paper's best range (see compare_methods.md).
        "fedfm-lam10": ["-a", "fedfm", "-p", "lam=10"],
        "fedacd": ["-a", "fedacd"],
        # FedCME ablations, to see which part costs accuracy in this setting.
        "fedcme-noexchange": ["-a", "fedcme", "-p", "exchange=none"],
        "fedcme-mu0": ["-a", "fedcme", "-p", "mu=0"],
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
    }
    | {
        # SCAFFOLD's remedy for its local step budget (see scaffold.py): the paper's plain SGD.
        "scaffold-momentum0": ["-a", "scaffold", "--momentum", "0"],
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


LAST = 10  # rounds averaged for the "last rounds" column: final accuracy swings at beta 0.1


def load_run(folder: Path) -> tuple[dict, list[float]]:
    summary = json.loads((folder / "summary.json").read_text())
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return summary, [m["accuracy"] for m in metrics if "accuracy" in m]


def ran_on(summary: dict, rounds: int) -> str:
    """Which machine computed which rounds of a run (a resumed run may span machines)."""
    unrecorded = "not recorded (the run predates processes.jsonl)"
    spans: list[list] = []  # [first round, last round, machine]
    for p in summary.get("processes", []):
        machine = f"{p['cpu']}, {p['cores']} cores, torch {p['torch']}"
        if spans:
            spans[-1][1] = p["from_round"] - 1
        elif p["from_round"] > 1:
            spans.append([1, p["from_round"] - 1, unrecorded])
        if spans and spans[-1][2] == machine:
            continue  # same machine resumed: one span
        spans.append([p["from_round"], rounds, machine])
    if not spans:
        return unrecorded
    spans[-1][1] = rounds
    return "; ".join(f"r{a}-{b}: {m}" for a, b, m in spans if b >= a)


def report(preset: str, out: Path, seeds: list[int], rounds: int, results: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    runs: dict[str, dict[int, tuple[dict, list[float]]]] = {
        label: {
            s: load_run(out / f"{label}-s{s}")
            for s in seeds
            if (out / f"{label}-s{s}" / "summary.json").exists()
        }
        for label in PRESETS[preset]
    }
    reference = runs.get("fedavg", {})
    facts = {
        (label, s): run_facts(out / f"{label}-s{s}") for label, done in runs.items() for s in done
    }
    data_line, differ = data_summary(facts)
    rows, per_seed = [], []
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for label, done in runs.items():
        if not done:
            rows.append(f"| {label} | 0 | not run | | | | |")
            continue
        finals = np.array([100 * sm["final_accuracy"] for sm, _ in done.values()])
        bests = np.array([100 * sm["best_accuracy"] for sm, _ in done.values()])
        lasts = np.array([100 * np.mean(c[-LAST:]) for _, c in done.values()])
        mib = np.mean(
            [(sm["total_bytes_down"] + sm["total_bytes_up"]) / 2**20 / len(c)
             for sm, c in done.values()]
        )  # fmt: skip
        paired = [
            100 * (np.mean(c[-LAST:]) - np.mean(reference[s][1][-LAST:]))
            for s, (_, c) in done.items()
            if s in reference
        ]
        if label == "fedavg" or not paired:
            delta = "" if label == "fedavg" else "n/a"
        else:
            d = np.array(paired)
            delta = f"{d.mean():+.2f} ± {fmt_std(d)} ({int((d > 0).sum())}/{len(d)} seeds up)"
        rows.append(
            f"| {label} | {len(done)} | {finals.mean():.2f} ± {fmt_std(finals)} | "
            f"{lasts.mean():.2f} ± {fmt_std(lasts)} | {bests.mean():.2f} ± {fmt_std(bests)} | "
            f"{delta} | {mib:.2f} |"
        )
        for s, (sm, c) in done.items():
            per_seed.append(
                f"| {label} | {s} | {100 * sm['final_accuracy']:.2f} | "
                f"{100 * np.mean(c[-LAST:]):.2f} | {100 * sm['best_accuracy']:.2f} | "
                f"{ran_on(sm, len(c))} |"
                + (f" {describe_facts(facts[label, s])} |" if differ else "")
            )
        n = min(len(c) for _, c in done.values())
        arr = np.array([c[:n] for _, c in done.values()]) * 100
        x = np.arange(1, n + 1)
        ax.plot(x, arr.mean(0), label=f"{label} ({len(done)} seeds)")
        if len(done) > 1:
            ax.fill_between(x, arr.min(0), arr.max(0), alpha=0.15)
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"{preset}: Fashion-MNIST, simple-cnn, 20 clients, Dir(0.1), 8/round, E=5")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    results.mkdir(parents=True, exist_ok=True)
    fig.savefig(results / f"compare_{preset}.png", bbox_inches="tight")
    m = machine_facts()
    (results / f"compare_{preset}.md").write_text(
        f"# Comparison: {preset}\n\n"
        f"Produced by `python benchmarks/compare.py --preset {preset} --rounds {rounds} "
        f"--seeds {' '.join(map(str, seeds))}`; the seeds column says how many of those "
        "runs have finished and count in the row.\n\n"
        f"- Report made on: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; torch "
        f"{m['torch']}. Each run says below which machine computed which of its rounds "
        "(one thread per run; a killed run resumes from its checkpoint, on any machine)\n"
        f"- Data: Fashion-MNIST; {data_line}\n"
        f"- Setting: `fedskew run {' '.join(SETTING)} -r {rounds}`, seeds {seeds}; "
        "each algorithm with its defaults unless its label says otherwise\n\n"
        "Mean ± sample standard deviation over each row's seeds. At beta 0.1 the accuracy "
        f"swings by several points from round to round, so the mean over the last {LAST} "
        "rounds is the steadier measure. The same seed gives every algorithm the same "
        "partition and the same clients each round, so the difference to FedAvg is taken "
        "per seed (paired) and then averaged.\n\n"
        f"| algorithm | seeds | final accuracy (%) | mean of last {LAST} rounds (%) "
        f"| best accuracy (%) | last-{LAST} vs FedAvg, paired (points) | MiB per round |\n"
        "|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
        f"Every finished run:\n\n| algorithm | seed | final (%) | last {LAST} (%) | best (%) "
        "| rounds computed on |"
        + (" data read from; torch |" if differ else "")
        + "\n|---|---|---|---|---|---|"
        + ("---|" if differ else "")
        + "\n"
        + "\n".join(per_seed)
        + "\n\n"
        f"![accuracy curves](compare_{preset}.png)\n\n"
        "Curves: mean over each algorithm's finished seeds; the shaded band is the min-max "
        "range.\n"
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
    ap.add_argument("--only", nargs="+", metavar="LABEL", help="run only these rows")
    ap.add_argument(
        "--runs", nargs="+", metavar="LABEL-sSEED",
        help="run exactly these runs, in this order (e.g. fedprox-s1 moon-s2)",
    )  # fmt: skip
    args = ap.parse_args()
    out = Path(args.out) / args.preset
    if not args.report_only:
        jobs = [
            (label, a, seed)
            for seed in args.seeds
            for label, a in PRESETS[args.preset].items()
            if not args.only or label in args.only
        ]
        if args.runs:
            by_name = {f"{label}-s{seed}": (label, a, seed) for label, a, seed in jobs}
            unknown = [r for r in args.runs if r not in by_name]
            if unknown:
                ap.error(f"not runs of this preset and these seeds: {' '.join(unknown)}")
            jobs = [by_name[r] for r in args.runs]
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
