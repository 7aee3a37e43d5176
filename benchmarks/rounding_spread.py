"""How far fp32 rounding alone moves gpu_check's curves, per algorithm, and the tolerances
gpu_check derives from it (written to benchmarks/results/gpu_check_spread.json and .md).

A CUDA curve differs from the CPU's from the first kernel on (cuDNN against oneDNN, another
summation order), and training amplifies such differences. This script makes differences of
the same kind on the CPU: the CPU curve of gpu_check's experiment again, with the initial
weights scaled by 1 + s * 2**-23 (s a random sign per element, another draw per nudge: one
or two units in the last place, as the second GPU review nudged them). The base curve and
its nudged copies are then equally good answers, and the gaps between any two of them (every
pair) are what rounding alone produces. The largest gap per algorithm, times MARGIN, with a
floor, is that algorithm's tolerance:

* the round-1 train_loss gap, relative to the first curve of the pair;
* the gap of the last 3 rounds' mean accuracy.

Why MARGIN 2: if the gaps were normal with deviation sigma, the range of 8 curves is about
2.8 sigma, so a tolerance of twice the largest pairwise gap is about 5.5 sigma for a gap
whose deviation is sqrt(2) sigma: a rounding-only comparison turns red with probability
about 1e-4, and the 21 comparisons of a GPU check all stay green with about 99.8 %.
Training curves with dips are heavier-tailed than that, which the margin is for.

    python benchmarks/rounding_spread.py [--nudges 7] [--only fedavg,feddyn]

Run it after changing gpu_check's experiment (SETTING, ROUNDS, PARAMS) or an algorithm:
gpu_check refuses tolerances measured on another experiment.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator
from itertools import combinations
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check  # noqa: E402
from machine import load1, machine_facts  # noqa: E402

import fedskew.runs.loop as loop  # noqa: E402
from fedskew.algorithms import ALGORITHMS  # noqa: E402

MARGIN = 2.0
# Floors: an algorithm whose nudged curves happened to agree closely still gets room for a
# kernel that rounds differently: twice the largest gaps seen so far from other rounding
# (the second GPU review: nudges moved round 1's train_loss by up to 1.2 %, and the CPU's
# vmap path against one after another moved it by 1.5 % and the last 3 rounds by 0.026).
ROUND1_FLOOR = 0.03
LAST3_FLOOR = 0.05
ULP = 2.0**-23


def nudge(model: torch.nn.Module, seed: int) -> None:
    """Scale every floating parameter element by 1 +- 2**-23 (signs drawn from ``seed``),
    in place: a change in its last bits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                signs = torch.randint(0, 2, p.shape, generator=gen).to(p.dtype) * 2 - 1
                p.mul_(1 + ULP * signs.to(p.device))


@contextlib.contextmanager
def nudged(seed: int | None) -> Iterator[None]:
    """Runs in the block start from nudged initial weights (``seed`` None: as they are)."""
    if seed is None:
        yield
        return
    original = loop.new_model

    def made(prep: Any) -> torch.nn.Module:
        model = original(prep)
        nudge(model, seed)
        return model

    loop.new_model = made
    try:
        yield
    finally:
        loop.new_model = original


def derive(pair_gaps: list[dict[str, float]]) -> dict[str, float]:
    """The largest gaps over all pairs, and the tolerances derived from them."""
    round1 = max(g["round1_train_loss_gap"] for g in pair_gaps)
    last3 = max(g["last3_accuracy_gap"] for g in pair_gaps)
    return {
        "round1_train_loss_spread": round(round1, 5),
        "last3_accuracy_spread": round(last3, 4),
        "round1_train_loss_tol": round(max(ROUND1_FLOOR, MARGIN * round1), 4),
        "last3_accuracy_tol": round(max(LAST3_FLOOR, MARGIN * last3), 3),
    }


def rederived(row: dict[str, Any]) -> dict[str, Any]:
    """A measured row with its tolerances derived again from its spreads (after a change
    of MARGIN or the floors: the spreads are the largest pairwise gaps already)."""
    return {
        **row,
        **derive(
            [
                {
                    "round1_train_loss_gap": row["round1_train_loss_spread"],
                    "last3_accuracy_gap": row["last3_accuracy_spread"],
                }
            ]
        ),
    }


def measure(algorithm: str, nudges: int, tmp: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    curves = []
    for seed in [None, *range(1, nudges + 1)]:
        with nudged(seed):
            curves.append(gpu_check.curve(algorithm, "cpu", "off", tmp))
    pairs = [gpu_check.raw_gaps(a, b) for a, b in combinations(curves, 2)]
    return {
        "algorithm": algorithm,
        "accuracy": [[round(r["accuracy"], 4) for r in c] for c in curves],
        "round1_train_loss": [round(c[0]["train_loss"], 5) for c in curves],
        "lowest_last_accuracy": round(min(c[-1]["accuracy"] for c in curves), 4),
        **derive(pairs),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def markdown(data: dict[str, Any]) -> str:
    lines = [
        "# Rounding spread of gpu_check's curves, per algorithm",
        "",
        f"Written by `{data['command']}` on {data['date']} ({data['machine']['cpu']}, "
        f"torch {data['torch']}, {data['threads']} torch thread(s); 1-minute load "
        f"{data['load_before']} before, {data['load_after']} after).",
        "",
        f"Each algorithm's CPU curve of gpu_check's experiment, and {data['nudges']} more with "
        "the initial weights nudged in their last bits (scaled by 1 +- 2**-23, a random sign "
        "per element). "
        "Spread: the largest gap between any two of these curves. Tolerance (what "
        f"benchmarks/gpu_check.py allows a device curve): {MARGIN:g} x the spread, at least "
        f"{ROUND1_FLOOR:.0%} (round 1's train_loss) and {LAST3_FLOOR} (the last 3 rounds' mean "
        "accuracy). See benchmarks/rounding_spread.py for why.",
        "",
        "| algorithm | accuracy at the last round (base, nudges) | round 1 train_loss: spread "
        "/ tolerance | last 3 accuracy: spread / tolerance | seconds (8 curves) |",
        "|---|---|---|---|---:|",
    ]
    for row in data["rows"]:
        last = " ".join(f"{c[-1]:.2f}" for c in row["accuracy"])
        lines.append(
            f"| {row['algorithm']} | {last} | {row['round1_train_loss_spread']:.2%} / "
            f"{row['round1_train_loss_tol']:.1%} | {row['last3_accuracy_spread']:.3f} / "
            f"{row['last3_accuracy_tol']:.3f} | {row['seconds']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nudges", type=int, default=7, help="nudged curves per algorithm")
    p.add_argument("--only", default=None, help="comma-separated algorithms (default: all)")
    p.add_argument("--out", default=str(gpu_check.SPREAD_FILE), help="the .json to write")
    p.add_argument(
        "--derive-only",
        action="store_true",
        help="measure nothing: derive the tolerances of --out again from its spreads",
    )
    args = p.parse_args(argv)
    if args.derive_only:
        out = Path(args.out)
        data = json.loads(out.read_text())
        data["rows"] = [rederived(r) for r in data["rows"]]
        out.write_text(json.dumps(data, indent=1) + "\n")
        out.with_suffix(".md").write_text(markdown(data))
        return 0
    algorithms = [a.strip() for a in args.only.split(",")] if args.only else list(ALGORITHMS)
    out = Path(args.out)
    data: dict[str, Any] = {
        "command": "python benchmarks/rounding_spread.py " + shlex.join(argv or sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "experiment": gpu_check.experiment(),
        "nudges": args.nudges,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": machine_facts(),
        "load_before": load1(),
        "rows": [],
    }
    if out.exists() and args.only:  # measuring some algorithms again: keep the others
        kept = json.loads(out.read_text())
        if kept.get("experiment") == data["experiment"]:
            data["rows"] = [r for r in kept["rows"] if r["algorithm"] not in algorithms]
    with tempfile.TemporaryDirectory() as tmp:
        for algorithm in algorithms:
            row = measure(algorithm, args.nudges, tmp)
            data["rows"].append(row)
            data["rows"].sort(key=lambda r: r["algorithm"])
            data["load_after"] = load1()
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(data, indent=1) + "\n")
            out.with_suffix(".md").write_text(markdown(data))
            print(
                f"{algorithm}: round 1 {row['round1_train_loss_spread']:.2%}, last 3 "
                f"{row['last3_accuracy_spread']:.3f} ({row['seconds']} s)",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
