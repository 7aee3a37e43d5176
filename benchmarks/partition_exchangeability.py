"""Does the Dirichlet partition depend on the class index? dirichlet (a fresh random class
order per draw) against dirichlet-niidbench (NIID-Bench's loop: classes in index order), on
CIFAR-10-shaped labels (10 classes x 5,000 samples), beta 0.1 / 0.5, 10 / 100 clients, over
seeds 0..S-1 (50 by default), min_size 10 (the schemes' default).

Per scheme and setting, from the partitions make_partition returns:

* per class index, the mean over seeds of the clients holding >= 1 % of the class
  (``holders``) and of the largest client's share of it (``largest``);
* the seeds in which class 9 has fewer holders than class 0;
* p-values of the within-seed permutation test (fedskew.data.exchangeability) of the slope
  on the class index and of the spread of the per-class means, for both statistics;
* the balancing statistic: the coefficient of variation of the client sizes (std / mean),
  and the largest client over N/K, mean over seeds;
* holders by the position at which a draw visits the class (first .. last), from count-level
  draws of the same loop before the min_size repair: where the cap's effect falls in a draw.

A reference row, ``no cap``, draws the same per-class Dirichlet proportions without closing
full clients (then the same min_size repair): what the balancing rule buys.

    python benchmarks/partition_exchangeability.py [--seeds 50] [--permutations 9999]
    python benchmarks/partition_exchangeability.py --report-only   # .md and docs from .json

Writes benchmarks/results/partition_exchangeability.{json,md} and the measured block of
docs/partitions.md. About 30 s on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_facts  # noqa: E402

from fedskew.core.rng import numpy_rng  # noqa: E402
from fedskew.data.exchangeability import PATTERNS, class_index_pvalues, trend  # noqa: E402
from fedskew.data.partition import (  # noqa: E402
    HOLDER_SHARE,
    PARTITIONS,
    _dirichlet,
    _dirichlet_counts,
    _repair_min_size,
    class_holders,
    largest_share,
    make_partition,
    partition_stats,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "partition_exchangeability.json"
DOC = ROOT / "docs" / "partitions.md"
BEGIN = "<!-- measured by benchmarks/partition_exchangeability.py: begin -->"
END = "<!-- measured by benchmarks/partition_exchangeability.py: end -->"
CLASSES, PER_CLASS = 10, 5000
SETTINGS = [(0.5, 10), (0.1, 10), (0.5, 100), (0.1, 100)]  # (beta, clients)
SCHEMES = ("dirichlet", "dirichlet-niidbench")
NO_CAP = "no cap (reference)"
MIN_SIZE = int(PARTITIONS["dirichlet"].params["min_size"])  # type: ignore[call-overload]
# A p-value below this is read as "tied to the class index" in the conclusions.
ALPHA = 0.01


def labels() -> np.ndarray:
    return np.random.default_rng(0).permutation(np.repeat(np.arange(CLASSES), PER_CLASS))


def no_cap_counts(num_clients: int, beta: float, seed: int) -> np.ndarray:
    """Per class, client proportions ~ Dir(beta) split as the schemes split them, but no
    client is ever closed; then the schemes' min_size repair."""
    rng = numpy_rng(seed, -1, -1, "benchmark:no-cap")
    counts = np.zeros((num_clients, CLASSES), dtype=np.int64)
    for c in range(CLASSES):
        bounds = np.floor(np.cumsum(_dirichlet(rng, beta, num_clients)) * PER_CLASS)
        bounds = np.clip(bounds.astype(np.int64), 0, PER_CLASS)
        bounds[-1] = PER_CLASS
        counts[:, c] = np.diff(bounds, prepend=0)
    _repair_min_size(counts, MIN_SIZE)
    return counts


def holders_by_position(scheme: str, num_clients: int, beta: float, seeds: int) -> list[float]:
    """Mean holders of the class a draw visits first, second, ..., last (count level, one
    draw of the loop per seed, before the min_size repair)."""
    sizes = np.full(CLASSES, PER_CLASS)
    out = np.zeros(CLASSES)
    for seed in range(seeds):
        rng = numpy_rng(seed, -1, -1, "benchmark:positions")
        order = rng.permutation(CLASSES) if scheme == "dirichlet" else np.arange(CLASSES)
        counts = _dirichlet_counts(sizes, num_clients, beta, rng, order)
        out += class_holders(counts)[order]
    return (out / seeds).round(3).tolist()


def measure(name: str, counts: list[np.ndarray], permutations: int) -> dict[str, Any]:
    holders = np.array([class_holders(c) for c in counts])
    largest = np.array([largest_share(c) for c in counts])
    sizes = np.array([c.sum(axis=1) for c in counts], dtype=np.float64)
    cap = sizes.sum(axis=1, keepdims=True) / sizes.shape[1]
    return {
        "scheme": name,
        "holders": holders.mean(axis=0).round(3).tolist(),
        "largest": largest.mean(axis=0).round(4).tolist(),
        "class9_fewer_holders_than_class0": int((holders[:, 9] < holders[:, 0]).sum()),
        "holders_slope": round(trend(holders), 4),
        "largest_slope": round(trend(largest), 5),
        "p": {
            f"{stat} {pattern}": p
            for stat, values in (("holders", holders), ("largest", largest))
            for pattern, p in class_index_pvalues(values, permutations, seed=1).items()
        },
        "size_cv": round(float((sizes.std(axis=1) / sizes.mean(axis=1)).mean()), 4),
        "largest_client_over_cap": round(float((sizes.max(axis=1) / cap[:, 0]).mean()), 3),
    }


def run(seeds: int, permutations: int) -> dict[str, Any]:
    y = labels()
    started = time.time()
    settings = []
    for beta, clients in SETTINGS:
        rows = []
        for scheme in SCHEMES:
            counts = [
                partition_stats(make_partition(y, clients, scheme, s, beta=beta), y, CLASSES)
                for s in range(seeds)
            ]
            row = measure(scheme, counts, permutations)
            row["holders_by_position"] = holders_by_position(scheme, clients, beta, seeds)
            rows.append(row)
        counts = [no_cap_counts(clients, beta, s) for s in range(seeds)]
        rows.append(measure(NO_CAP, counts, permutations))
        settings.append({"beta": beta, "clients": clients, "rows": rows})
        print(f"beta {beta}, {clients} clients: done ({time.time() - started:.0f} s)", flush=True)
    return {
        "command": "python benchmarks/partition_exchangeability.py " + shlex.join(sys.argv[1:]),
        "machine": machine_facts(),
        "labels": f"CIFAR-10-shaped: {CLASSES} classes x {PER_CLASS} samples (synthetic labels)",
        "seeds": f"0..{seeds - 1}",
        "permutations": permutations,
        "min_size": MIN_SIZE,
        "holder_share": HOLDER_SHARE,
        "alpha": ALPHA,
        "seconds": round(time.time() - started, 1),
        "settings": settings,
    }


# ---------------------------------------------------------------------------- the report


def _min_p(row: dict[str, Any]) -> float:
    return min(row["p"].values())


def conclusions(data: dict[str, Any]) -> list[str]:
    """Computed from the numbers: which scheme ties which statistic to the class index, and
    what the cap does to the client sizes."""
    alpha, out = data["alpha"], []
    for s in data["settings"]:
        rows = {r["scheme"]: r for r in s["rows"]}
        old, new, free = rows["dirichlet-niidbench"], rows["dirichlet"], rows[NO_CAP]
        where = f"beta {s['beta']}, {s['clients']} clients"
        tied = [r["scheme"] for r in (old, new) if _min_p(r) < alpha]
        text = (
            f"{where}: dirichlet-niidbench's holders go from {old['holders'][0]:.2f} (class 0) "
            f"to {old['holders'][-1]:.2f} (class 9) and the largest share from "
            f"{old['largest'][0]:.3f} to {old['largest'][-1]:.3f} (smallest p {_min_p(old):.4f}"
            f"); dirichlet's from {new['holders'][0]:.2f} to {new['holders'][-1]:.2f} and "
            f"{new['largest'][0]:.3f} to {new['largest'][-1]:.3f} (smallest p "
            f"{_min_p(new):.4f}). "
        )
        if tied == ["dirichlet-niidbench"]:
            text += f"Only dirichlet-niidbench ties the classes to their index (p < {alpha}). "
        elif not tied:
            text += "Neither scheme shows a class-index pattern at this alpha. "
        else:
            text += f"Tied to the class index at this alpha: {', '.join(tied)}. "
        text += (
            f"Client sizes (CV): dirichlet {new['size_cv']:.3f}, dirichlet-niidbench "
            f"{old['size_cv']:.3f}, no cap {free['size_cv']:.3f}; the largest client is "
            f"{new['largest_client_over_cap']:.2f} / {old['largest_client_over_cap']:.2f} / "
            f"{free['largest_client_over_cap']:.2f} x N/K."
        )
        out.append(text)
    same = all(
        _min_p(next(r for r in s["rows"] if r["scheme"] == "dirichlet")) >= alpha
        for s in data["settings"]
    )
    old_tied = all(
        _min_p(next(r for r in s["rows"] if r["scheme"] == "dirichlet-niidbench")) < alpha
        for s in data["settings"]
    )
    out.append(
        f"In every setting: dirichlet shows no class-index pattern: {'yes' if same else 'no'}; "
        f"dirichlet-niidbench does: {'yes' if old_tied else 'no'} (alpha {alpha})."
    )
    return out


def _nums(values: list[float], form: str) -> str:
    return " ".join(f"{v:{form}}" for v in values)


def tables(data: dict[str, Any]) -> list[str]:
    lines = []
    for s in data["settings"]:
        lines += [
            f"**beta {s['beta']}, {s['clients']} clients**",
            "",
            "| scheme | holders, class 0..9 | largest share, class 0..9 | class 9 < class 0 "
            "(seeds) | p: holders slope / spread, largest slope / spread | size CV | "
            "largest / (N/K) |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in s["rows"]:
            p = " / ".join(f"{r['p'][f'{stat} {pat}']:.4f}" for stat in ("holders", "largest")
                           for pat in PATTERNS)  # fmt: skip
            lines.append(
                f"| {r['scheme']} | {_nums(r['holders'], '.1f')} | {_nums(r['largest'], '.2f')} "
                f"| {r['class9_fewer_holders_than_class0']} | {p} | {r['size_cv']:.3f} "
                f"| {r['largest_client_over_cap']:.2f} |"
            )
        lines.append("")
        lines.append("Holders by the position at which a draw visits the class (first .. last):")
        lines.append("")
        for r in s["rows"]:
            if "holders_by_position" in r:
                lines.append(f"- {r['scheme']}: {_nums(r['holders_by_position'], '.1f')}")
        lines.append("")
    return lines


def provenance(data: dict[str, Any]) -> str:
    m = data["machine"]
    return (
        f"Made by `{data['command'].strip()}` on {m.get('cpu', '?')}, {m.get('cores', '?')} "
        f"cores, in {data['seconds']} s; labels {data['labels']}; seeds {data['seeds']}; "
        f"min_size {data['min_size']}; holders = clients with >= {data['holder_share']:.0%} "
        f"of the class; {data['permutations']} permutations per test."
    )


def markdown(data: dict[str, Any]) -> str:
    lines = [
        "# Does the Dirichlet partition depend on the class index?",
        "",
        provenance(data),
        "",
        "dirichlet: classes visited in a fresh random order per draw; dirichlet-niidbench: "
        "NIID-Bench's loop, classes in index order; both close clients that hold N/K samples. "
        "no cap: the same proportions, no client closed (a reference for the balance). "
        "p: within-seed permutation test (fedskew.data.exchangeability) of the slope on the "
        "class index and of the spread of the per-class means. Size CV: std / mean of the "
        "client sizes.",
        "",
        "## Conclusions (computed from the numbers below)",
        "",
        *[f"- {c}" for c in conclusions(data)],
        "",
        "## Numbers (means over seeds)",
        "",
        *tables(data),
    ]
    return "\n".join(lines).rstrip() + "\n"


def doc_block(data: dict[str, Any]) -> str:
    return "\n".join(
        [
            BEGIN,
            "",
            provenance(data) + " Full tables: "
            "[benchmarks/results/partition_exchangeability.md]"
            "(../benchmarks/results/partition_exchangeability.md).",
            "",
            *[f"- {c}" for c in conclusions(data)],
            "",
            END,
        ]
    )


def write(data: dict[str, Any]) -> None:
    RESULTS.with_suffix(".md").write_text(markdown(data), encoding="utf-8")
    text = DOC.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{DOC} has no block between {BEGIN!r} and {END!r}")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(head + doc_block(data) + tail, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=50, help="seeds 0..S-1 (default 50)")
    parser.add_argument("--permutations", type=int, default=9999)
    parser.add_argument("--report-only", action="store_true", help="rewrite from the .json")
    args = parser.parse_args(argv)
    if args.report_only:
        data = json.loads(RESULTS.read_text(encoding="utf-8"))
    else:
        if args.seeds < 2 or args.permutations < 1:
            parser.error("--seeds must be >= 2 and --permutations >= 1")
        data = run(args.seeds, args.permutations)
        RESULTS.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    write(data)
    print(f"wrote {RESULTS.with_suffix('.md')} and the block of {DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
