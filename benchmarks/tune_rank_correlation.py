"""How well a tuning trial's accuracy at an early round ranks the trials' final objective:
the measurement behind ``fedskew tune``'s default pruner warm-up (docs/tuning.md).

Reads a tuning study's folder (``<study>/trials/<method>-t<N>-s<seed>[.incomplete]``, each
with config.json and metrics.jsonl) and writes, per method, Spearman's rank correlation of the
evaluated accuracy at each round against the objective (mean accuracy of the last ``last``
evaluated rounds, as ``fedskew tune`` computes it), over the trials that ran to the end. Two
clocks: the round itself, and the rounds since the trial's last mechanism first acted (from
the method's declared inactive mechanisms, ``fedskew.assembly.prepare.all_acted_round``:
FedFM launched at 0-based round s acts from round s + 1 on; FedAvg from round 1).

A pruned trial has no objective, so it enters no correlation; the table counts how many
trials (pruned ones included) reached each round. No machine is involved: it reads results.

    python benchmarks/tune_rank_correlation.py reproduction/runs/fedfm-tuned \\
        --out benchmarks/results/tune_rank_correlation
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np

from fedskew.assembly.prepare import all_acted_round
from fedskew.config import build_config
from fedskew.grid.tune import objective, read_rows

TRIAL = re.compile(r"^(?P<method>[a-z0-9_]+)-t(?P<number>\d+)-s(?P<seed>\d+)(\.incomplete)?$")


def ranks(values: np.ndarray) -> np.ndarray:
    """Ranks 1..n, ties given their mean rank."""
    order = np.argsort(values, kind="stable")
    r = np.empty(len(values))
    r[order] = np.arange(1, len(values) + 1)
    for v in np.unique(values):
        tied = values == v
        r[tied] = r[tied].mean()
    return r


def spearman(x: list[float], y: list[float]) -> float | None:
    """Spearman's rho; None below 3 pairs or with a constant side."""
    if len(x) < 3:
        return None
    rx, ry = ranks(np.asarray(x, float)), ranks(np.asarray(y, float))
    if rx.std() == 0 or ry.std() == 0:
        return None
    return float(np.corrcoef(rx, ry)[0, 1])


def read_trials(folder: Path, last: int) -> list[dict]:
    trials = []
    for path in sorted((folder / "trials").iterdir()):
        m = TRIAL.match(path.name)
        if m is None or not (path / "config.json").is_file():
            continue
        saved = json.loads((path / "config.json").read_text(encoding="utf-8"))
        values = {k: v for k, v in saved.items() if k != "resolved"}
        cfg = build_config(values, {})
        rows = read_rows(path)
        acc = {int(r["round"]): 100 * float(r["accuracy"]) for r in rows
               if r.get("accuracy") is not None}  # fmt: skip
        finished = (path / "summary.json").is_file()
        trials.append({
            "method": m["method"], "number": int(m["number"]), "finished": finished,
            "rounds": cfg.rounds, "acted": all_acted_round(cfg), "accuracy": acc,
            "objective": objective(rows, last) if finished else None,
        })  # fmt: skip
    return trials


def correlations(trials: list[dict]) -> dict:
    out: dict = {}
    for method in sorted({t["method"] for t in trials}):
        mine = [t for t in trials if t["method"] == method]
        done = [t for t in mine if t["finished"]]
        rounds = max(t["rounds"] for t in mine)
        by_round = []
        for r in range(1, rounds + 1):
            pairs = [(t["accuracy"][r], t["objective"]) for t in done if r in t["accuracy"]]
            by_round.append({
                "round": r, "completed": len(pairs),
                "reached": sum(r in t["accuracy"] for t in mine),
                "spearman": spearman([a for a, _ in pairs], [o for _, o in pairs]),
            })  # fmt: skip
        by_since = []
        for k in range(0, rounds):
            # k rounds after the round in which the last mechanism first acted
            pairs = [(t["accuracy"][t["acted"] + k], t["objective"]) for t in done
                     if t["acted"] + k in t["accuracy"]]  # fmt: skip
            by_since.append({
                "after_acted": k, "completed": len(pairs),
                "reached": sum(t["acted"] + k in t["accuracy"] for t in mine),
                "spearman": spearman([a for a, _ in pairs], [o for _, o in pairs]),
            })  # fmt: skip
        out[method] = {
            "trials": len(mine), "completed": len(done),
            "acted_rounds": {str(t["number"]): t["acted"] for t in mine},
            "by_round": by_round, "by_rounds_after_acted": by_since,
        }  # fmt: skip
    return out


def warmup_from(result: dict, threshold: float) -> int | None:
    """The fewest rounds after the last mechanism acted at which, for every method, the rank
    correlation is at least ``threshold`` and so is its mean over that round and every later
    one with a value. The mean, not every later value: with five or six completed trials one
    swap of neighbours moves rho by 0.1 to 0.3, and a rule on the minimum follows that noise."""
    found_all = []
    for data in result.values():
        series = [(e["after_acted"], e["spearman"]) for e in data["by_rounds_after_acted"]
                  if e["spearman"] is not None]  # fmt: skip
        found = None
        for k, rho in series:
            later = [r for kk, r in series if kk >= k]
            if rho >= threshold and float(np.mean(later)) >= threshold:
                found = k
                break
        if found is None:
            return None
        found_all.append(found)
    return max(found_all) if found_all else None


def markdown(folder: Path, last: int, threshold: float, result: dict, warmup: int | None) -> str:
    def cell(v: float | None) -> str:
        return "" if v is None else f"{v:+.2f}"

    lines = [
        "# Early-round accuracy against the tuning objective",
        "",
        f"Made by `python benchmarks/tune_rank_correlation.py {folder} --last {last} "
        f"--threshold {threshold}` from the committed study's run folders (CIFAR-10, "
        "tuning seed 100; see the study's tune.json). Objective: mean accuracy of the last "
        f"{last} evaluated rounds. Spearman's rho over the trials that ran to the end; a "
        "pruned trial has no objective and enters no correlation (`reached` counts the "
        "trials, pruned ones included, with an accuracy at that round). No machine: it "
        "reads results.",
        "",
    ]
    for method, data in result.items():
        lines += [f"## {method}: {data['completed']} of {data['trials']} trials completed", ""]
        lines += ["| round | rho (completed) | reached |", "|---|---|---|"]
        lines += [f"| {e['round']} | {cell(e['spearman'])} ({e['completed']}) | {e['reached']} |"
                  for e in data["by_round"]]  # fmt: skip
        lines += ["", "| rounds after the last mechanism acted | rho (completed) | reached |",
                  "|---|---|---|"]  # fmt: skip
        lines += [f"| {e['after_acted']} | {cell(e['spearman'])} ({e['completed']}) | "
                  f"{e['reached']} |" for e in data["by_rounds_after_acted"]]  # fmt: skip
        lines.append("")
    chosen = "none (no round qualifies for every method)" if warmup is None else str(warmup)
    lines += [
        f"Warm-up (rounds after the last mechanism acted) at which rho >= {threshold} for "
        "every method, and so is its mean over that round and the later ones: "
        f"**{chosen}**.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("study", type=Path, help="the tuning study's folder")
    p.add_argument("--last", type=int, default=3, help="the objective's window (default 3)")
    p.add_argument(
        "--threshold",
        type=float,
        default=0.8,
        help="least rank correlation a judged round must keep (default 0.8)",
    )
    p.add_argument("--out", type=Path, help="write OUT.json and OUT.md (default: print)")
    args = p.parse_args(argv)
    if not (args.study / "trials").is_dir():
        print(f"error: {args.study} has no trials/ folder", file=sys.stderr)
        return 2
    result = correlations(read_trials(args.study, args.last))
    warmup = warmup_from(result, args.threshold)
    text = markdown(args.study, args.last, args.threshold, result, warmup)
    if args.out is None:
        print(text)
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    data = {"study": str(args.study), "last": args.last, "threshold": args.threshold,
            "warmup": warmup, "methods": result}  # fmt: skip
    args.out.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    args.out.with_suffix(".md").write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
