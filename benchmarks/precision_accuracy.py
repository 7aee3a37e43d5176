"""Do bf16 autocast and TF32 keep fp32's accuracy? The issue-6 experiment over several seeds.

FedAvg, Fashion-MNIST, fedavg-cnn, 20 clients, Dirichlet 0.1, 8 per round, 5 local epochs,
batch 64, lr 0.01, momentum 0.9, channels_last, for R rounds, once per mode (fp32, bf16, and
on CUDA tf32: fp32 with TF32 products) per seed. Each run is a `fedskew run` subprocess;
finished runs are kept and skipped on a rerun. The report gives per seed the final accuracy
and the mean of the last rounds of each mode, and each mode's difference from fp32 per seed
(paired: same partition and clients).

    python benchmarks/precision_accuracy.py [--rounds 15] [--seeds 0 1 2] [--jobs 2]
    python benchmarks/precision_accuracy.py --device cuda --modes fp32 tf32 bf16 --rounds 10 \\
        --jobs 3 --threads 4 --out benchmarks/results/runs/precision-cuda \\
        --report benchmarks/results/precision_accuracy_cuda.md       # on a GPU machine
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
# NIID-Bench's loop (dirichlet-niidbench: dirichlet before partition_version 2): the
# committed runs under results/runs were made with it, so a rerun continues them.
SETTING = [
    "-d", "fmnist", "-m", "fedavg-cnn", "-n", "20", "--clients-per-round", "8",
    "--partition", "dirichlet-niidbench", "--beta", "0.1", "-e", "5", "-b", "64", "--lr", "0.01",
    "--momentum", "0.9", "--memory-format", "channels_last",
]  # fmt: skip
LAST = 5


MODES = {  # mode: its fedskew options
    "fp32": ["--precision", "fp32"],
    "bf16": ["--precision", "bf16"],
    "tf32": ["--precision", "fp32", "--tf32", "on"],
}


def run_one(mode: str, seed: int, rounds: int, out: Path, threads: int, device: str) -> str:
    name = f"{mode}-s{seed}"
    if (out / name / "summary.json").exists():
        return f"{name}: done before"
    unfinished = out / f"{name}.incomplete"
    if unfinished.is_dir():
        cmd = [sys.executable, "-m", "fedskew", "run", "--resume", str(unfinished), "-q"]
    else:
        # --workers 0: the runs share the machine --jobs at a time, one thread each.
        cmd = [sys.executable, "-m", "fedskew", "run", *SETTING, *MODES[mode],
               "--device", device, "--seed", str(seed), "-r", str(rounds), "-o", str(out),
               "--name", name, "--workers", "0", "-q"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return f"{name}: FAILED {proc.stderr.strip()[-500:]}"
    return f"{name}: done"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--modes", nargs="+", default=["fp32", "bf16"], choices=list(MODES))
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(HERE / "results" / "runs" / "precision"))
    ap.add_argument("--report", default=str(HERE / "results" / "precision_accuracy.md"))
    args = ap.parse_args()
    if "tf32" in args.modes and not args.device.startswith("cuda"):
        ap.error("tf32 is a CUDA mode: give --device cuda")
    modes = ["fp32", *[m for m in args.modes if m != "fp32"]]  # fp32: the reference
    out = Path(args.out)
    failed = False
    with ThreadPoolExecutor(args.jobs) as pool:
        jobs = [(m, s) for s in args.seeds for m in modes]
        for line in pool.map(
            lambda j: run_one(*j, args.rounds, out, args.threads, args.device), jobs
        ):
            print(line, flush=True)
            failed = failed or "FAILED" in line

    others = modes[1:]
    rows, swings = [], []
    diffs: dict[str, tuple[list[float], list[float]]] = {m: ([], []) for m in others}
    for seed in args.seeds:
        got = {}
        for mode in modes:
            folder = out / f"{mode}-s{seed}"
            if not (folder / "summary.json").exists():
                continue
            lines = (folder / "metrics.jsonl").read_text().splitlines()
            acc = [json.loads(x)["accuracy"] for x in lines]
            summary = json.loads((folder / "summary.json").read_text())
            got[mode] = (acc[-1], statistics.mean(acc[-LAST:]),
                         summary["train_samples_per_second"])  # fmt: skip
            if mode == "fp32":
                swings.append(100 * statistics.stdev(acc[-LAST:]))
        if "fp32" not in got or len(got) < 2:
            continue
        f32, l32, s32 = got["fp32"]
        cells = [f"{100 * f32:.2f}", f"{100 * l32:.2f}", f"{s32:,.0f}"]
        for mode in others:
            if mode not in got:
                cells += ["-"] * 5
                continue
            fin, last, speed = got[mode]
            diffs[mode][0].append(100 * (fin - f32))
            diffs[mode][1].append(100 * (last - l32))
            cells += [f"{100 * fin:.2f}", f"{100 * (fin - f32):+.2f}", f"{100 * last:.2f}",
                      f"{100 * (last - l32):+.2f}", f"{speed:,.0f}"]  # fmt: skip
        rows.append(f"| {seed} | " + " | ".join(cells) + " |")

    def mean_sd(v: list[float]) -> str:
        sd = f" ± {statistics.stdev(v):.2f}" if len(v) > 1 else ""
        return f"{statistics.mean(v):+.2f}{sd}" if v else "n/a"

    finished = {
        f"{m}-s{s}": out / f"{m}-s{s}"
        for s in args.seeds
        for m in modes
        if (out / f"{m}-s{s}" / "summary.json").exists()
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
    header = ["seed", "fp32 final (%)", f"fp32 last {LAST} (%)", "fp32 training samples/s"]
    for mode in others:
        header += [f"{mode} final (%)", "difference", f"{mode} last {LAST} (%)", "difference",
                   f"{mode} training samples/s"]  # fmt: skip
    summary_lines = "".join(
        f"{mode} - fp32, mean ± sd over seeds: final {mean_sd(diffs[mode][0])} points, "
        f"last {LAST} rounds {mean_sd(diffs[mode][1])} points.\n"
        for mode in others
    )
    title = " and ".join(f"{x} autocast" if x == "bf16" else x.upper() for x in others)
    command = (
        f"python benchmarks/precision_accuracy.py --rounds {args.rounds} "
        f"--seeds {' '.join(map(str, args.seeds))}"
        + (f" --modes {' '.join(args.modes)}" if args.modes != ["fp32", "bf16"] else "")
        + (f" --device {args.device}" if args.device != "cpu" else "")
    )
    options = "|".join(" ".join(MODES[x]) for x in modes)
    text = (
        f"# {title} against fp32: accuracy\n\n"
        f"Produced by `{command}`; report made on {m['cpu']}, "
        f"{m['cores']} cores, torch {m['torch']}. Runs computed on: {machines}; "
        f"{args.jobs} runs at a time, {args.threads} thread each.\n\n"
        f"Data: Fashion-MNIST; {data_line}. Setting: `fedskew run {' '.join(SETTING)} "
        f"-r {args.rounds} {{{options}}} --seed S`.\n\n"
        + per_run
        + "| "
        + " | ".join(header)
        + " |\n|"
        + "---|" * len(header)
        + "\n"
        + "\n".join(rows)
        + "\n\n"
        + summary_lines
        + f"For scale: within one fp32 run the accuracy of the last {LAST} rounds has a "
        f"standard deviation of {statistics.mean(swings) if swings else float('nan'):.2f} "
        "points (mean over seeds).\n"
    )
    Path(args.report).write_text(text)
    print(text)
    if failed:
        raise SystemExit("precision_accuracy: some runs failed (their lines above)")


if __name__ == "__main__":
    main()
