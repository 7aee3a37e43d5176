"""What central DP (DP-FedAvg) costs in accuracy, at a few noise multipliers, with the
accountant's epsilon (issue 38).

Two settings, FedAvg with an MLP of 16 hidden units on IID partitions (DP needs many clients
per round: the noise on the mean is z*S/m per value):

* digits (embedded): 50 clients, all 50 every round, 20 rounds, 2 local epochs;
* Fashion-MNIST: 500 clients, 100 a round, 20 rounds, 1 local epoch.

Per setting and seed: no DP; clipping only (S = 1, no noise: what clipping alone costs);
central DP at z = 1, 4 and 16 (S = 1); and adaptive clipping at z = 4 (initial S = 1, target
quantile 0.5). The report gives the final accuracy and the mean of the last 5 rounds, the
epsilon at delta = 1e-5 (``dp_epsilon``, and ``dp_epsilon_known_sampling`` where clients are
sampled) and the difference to no DP. Runs are in-process, one torch thread, one after
another; finished runs are kept and skipped on a rerun, unfinished ones resumed. About 10
minutes of one core for the default two seeds.

    python benchmarks/dp_accuracy.py [--seeds 0 1] [--report-only]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import load1, machine_facts  # noqa: E402
from runinfo import data_summary, describe_facts, run_facts  # noqa: E402

HERE = Path(__file__).resolve().parent
COMMON: dict[str, Any] = dict(
    algorithm="fedavg", model="mlp", model_options={"hidden": 16}, partition="iid",
    rounds=20, batch_size=16, workers=0, quiet=True, checkpoint_every=5,
)  # fmt: skip
SETTINGS: dict[str, dict[str, Any]] = {
    "digits": dict(
        dataset="digits", num_clients=50, clients_per_round=50, local_epochs=2, lr=0.3
    ),  # fmt: skip
    "fmnist": dict(
        dataset="fmnist",
        num_clients=500,
        clients_per_round=100,
        local_epochs=1,
        batch_size=32,
        lr=0.1,
    ),  # fmt: skip
}
VARIANTS: dict[str, dict[str, Any]] = {
    "no-dp": {},
    "clip-only": dict(dp="central", dp_clip=1.0, dp_noise=0.0),
    "z1": dict(dp="central", dp_clip=1.0, dp_noise=1.0),
    "z4": dict(dp="central", dp_clip=1.0, dp_noise=4.0),
    "z16": dict(dp="central", dp_clip=1.0, dp_noise=16.0),
    "z4-adaptive": dict(dp="central", dp_clip=1.0, dp_noise=4.0, dp_clipping="adaptive"),
}
LAST = 5


def run_one(setting: str, variant: str, seed: int, out: Path) -> str:
    import torch

    from fedskew.config import build_config
    from fedskew.runs.loop import run

    name = f"{setting}-{variant}-s{seed}"
    if (out / name / "summary.json").exists():
        return f"{name}: done before"
    torch.set_num_threads(1)
    values = {**COMMON, **SETTINGS[setting], **VARIANTS[variant], "seed": seed}
    unfinished = out / f"{name}.incomplete"
    t0 = time.perf_counter()
    if unfinished.is_dir():
        run(build_config({}, {**values, "out_dir": str(out), "name": name}), resume=unfinished)
    else:
        run(build_config({}, {**values, "out_dir": str(out), "name": name}))
    return f"{name}: done in {time.perf_counter() - t0:.0f} s"


def rows_of(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]


def fmt_eps(value: float | None) -> str:
    return "∞" if value is None else f"{value:.3g}"


def report(seeds: list[int], out: Path, seconds: dict[str, float]) -> dict[str, Any]:
    results: dict[str, Any] = {"runs": {}}
    lines: list[str] = []
    folders: dict[str, Path] = {}
    for setting in SETTINGS:
        lines += [
            f"### {setting}",
            "",
            f"| variant | seeds | final (%) | last {LAST} (%) | final - no DP (points) | "
            "epsilon (delta 1e-5) | epsilon, sampling known | noise std on the mean |",
            "|---|---|---|---|---|---|---|---|",
        ]
        base: dict[int, float] = {}
        for variant in VARIANTS:
            finals, lasts, diffs, eps, eps_known, stds = [], [], [], [], [], []
            for seed in seeds:
                folder = out / f"{setting}-{variant}-s{seed}"
                if not (folder / "summary.json").exists():
                    continue
                folders[folder.name] = folder
                rows = rows_of(folder)
                acc = [r["accuracy"] for r in rows if "accuracy" in r]
                final, last = 100 * acc[-1], 100 * statistics.mean(acc[-LAST:])
                if variant == "no-dp":
                    base[seed] = final
                finals.append(final)
                lasts.append(last)
                if seed in base:
                    diffs.append(final - base[seed])
                eps.append(rows[-1].get("dp_epsilon"))
                eps_known.append(rows[-1].get("dp_epsilon_known_sampling"))
                stds.append(rows[-1].get("dp_noise_std"))
                results["runs"][folder.name] = {
                    "final_accuracy": acc[-1],
                    f"last{LAST}_accuracy": last / 100,
                    "dp_epsilon": rows[-1].get("dp_epsilon"),
                    "dp_epsilon_known_sampling": rows[-1].get("dp_epsilon_known_sampling"),
                    "dp_clip_last": rows[-1].get("dp_clip"),
                    "dp_noise_std_last": rows[-1].get("dp_noise_std"),
                }
            if not finals:
                continue

            def ms(v: list[float], sign: bool = False) -> str:
                f = "+.2f" if sign else ".2f"
                sd = f" ± {statistics.stdev(v):.2f}" if len(v) > 1 else ""
                return f"{statistics.mean(v):{f}}{sd}"

            eps_text = "-" if variant == "no-dp" else " / ".join(dict.fromkeys(map(fmt_eps, eps)))
            known = [e for e in eps_known if e is not None]
            known_text = " / ".join(dict.fromkeys(map(fmt_eps, known))) if known else "-"
            std_text = " / ".join(dict.fromkeys(f"{s:.3g}" for s in stds if s is not None)) or "-"
            lines.append(
                f"| {variant} | {len(finals)} | {ms(finals)} | {ms(lasts)} | "
                f"{ms(diffs, True) if variant != 'no-dp' and diffs else '-'} | {eps_text} | "
                f"{known_text} | {std_text} |"
            )
        lines.append("")
    facts = {name: run_facts(folder) for name, folder in folders.items()}
    data_line, differ = data_summary(facts)
    per_run = "".join(f"- {n}: {describe_facts(f)}\n" for n, f in facts.items()) if differ else ""
    machines = sorted(
        {f"{p['cpu']}, {p['cores']} cores" for f in facts.values() for p in f["processes"]}
    )
    m = machine_facts()
    results.update(
        command="python benchmarks/dp_accuracy.py --seeds " + " ".join(map(str, seeds)),
        machine=m,
        load1_at_report=load1(),
        computed_on=machines,
        seeds=seeds,
        settings={k: {**COMMON, **v} for k, v in SETTINGS.items()},
        variants=VARIANTS,
        seconds_this_invocation=seconds,
    )
    text = (
        "# What central DP costs in accuracy\n\n"
        f"Produced by `{results['command']}`; report made on {m['cpu']}, {m['cores']} cores, "
        f"torch {m['torch']} (1-minute load {results['load1_at_report']}). Runs computed on: "
        f"{', '.join(machines) or 'none'}; in-process, one torch thread, one run at a time.\n\n"
        f"Data: {data_line}.\n\n" + per_run + "Settings (FedAvg, `mlp` with 16 hidden units, IID "
        "partition, 20 rounds, batch 16, momentum 0.9): digits, 50 clients, all 50 a round, 2 "
        "local epochs, lr 0.3; Fashion-MNIST, 500 clients, 100 a round, 1 local epoch, batch "
        "32, lr 0.1. Variants: `no-dp`; `clip-only` (`--dp central --dp-clip 1 --dp-noise 0`: "
        "clipping and equal weights, no noise, no finite epsilon); `zN` (`--dp central "
        "--dp-clip 1 --dp-noise N`); `z4-adaptive` (the same at z = 4 with "
        "`--dp-clipping adaptive`, initial norm 1, target quantile 0.5).\n\n"
        "Epsilon: dp-accounting's RDP accountant at delta = 1e-5, client-level, replace-one "
        "adjacency (docs/privacy.md): `dp_epsilon` after the last round, and "
        "`dp_epsilon_known_sampling` (for a reader who knows which clients each round took: "
        "the most-sampled client's rounds, no amplification; digits samples every client, so "
        "it has none). Values differ by seed only where the sampling does. Accuracy: mean ± "
        "sample standard deviation over the seeds.\n\n" + "\n".join(lines)
    )
    (HERE / "results" / "dp_accuracy.md").write_text(text)
    (HERE / "results" / "dp_accuracy.json").write_text(json.dumps(results, indent=2) + "\n")
    return {"text": text}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--out", default=str(HERE / "results" / "runs" / "dp_accuracy"))
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    seconds: dict[str, float] = {}
    if not args.report_only:
        for setting in SETTINGS:
            for seed in args.seeds:
                for variant in VARIANTS:
                    t0 = time.perf_counter()
                    print(run_one(setting, variant, seed, out), flush=True)
                    seconds[f"{setting}-{variant}-s{seed}"] = round(time.perf_counter() - t0, 1)
    print(report(args.seeds, out, seconds)["text"])


if __name__ == "__main__":
    main()
