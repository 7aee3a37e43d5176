"""Assemble BENCHMARKS.md from the result files the benchmark scripts wrote.

Nothing is measured here: every number comes from a JSON file under benchmarks/results/,
written by the script named next to it. Run the scripts first, then this:

    python benchmarks/precision_throughput.py --threads 2 --rounds 3 --repeat 1 --bare-steps 200
    python benchmarks/precision_throughput.py --threads 2 --rounds 3 --repeat 1 --bare-steps 200 \\
        --workers 2 --out benchmarks/results/precision_throughput_workers.md
    python benchmarks/precision_accuracy.py --rounds 15
    python benchmarks/scale.py --threads 2
    python benchmarks/algorithm_round_time.py -r 4 -e 2 --repeat 1 --threads 2
    python benchmarks/flower_round_time.py --threads 1
    python benchmarks/make_benchmarks_md.py
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
ROOT = HERE.parent


def load(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def throughput_section() -> list[str]:
    inproc, workers = load("precision_throughput.json"), load("precision_throughput_workers.json")
    if inproc is None:
        return ["(run benchmarks/precision_throughput.py)"]
    figures, goal = inproc["issue_figures"], inproc["goal"]
    bare = {(r["precision"], r["memory_format"]): r["samples_per_s"] for r in inproc["bare"]}
    base = bare[("fp32", "contiguous")]
    m = inproc["machine"]
    lines = [
        "## Round throughput: the issue-6 experiment",
        "",
        "FedAvg, Fashion-MNIST, 20 clients, Dirichlet 0.1, 8 clients per round, 5 local epochs, "
        "batch 64, SGD lr 0.01, momentum 0.9, McMahan's FedAvg CNN (`fedavg-cnn`, 582,026 "
        "parameters), the global model tested every round. Round throughput = training samples "
        "per second of round wall time, evaluation included.",
        "",
        f"fedskew rows: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, measured by "
        "`benchmarks/precision_throughput.py` (one repeat; 3 rounds, the first left out). "
        "Framework rows: the figures issue 6 gives for the frameworks on its 2-core machine "
        "kind (not rerun here). The issue's machine had AMX; this one (AMD EPYC) has AVX-512 "
        "BF16 but no AMX, and its bare fp32 loop runs at "
        f"{base:,.0f} samples/s where the issue measured 3,600, so the column 'x own bare fp32 "
        "loop' is the fairer comparison across the two machines.",
        "",
        "| framework / configuration | round throughput (samples/s) | x own bare fp32 loop "
        f"| x goal ({goal:,}) |",
        "|---|---|---|---|",
    ]
    for name, value in figures.items():
        lines.append(f"| {name} (issue 6) | {value:,} | {value / 3600:.2f} | {value / goal:.2f} |")
    for label, result in (("1 process, 2 threads", inproc), ("2 worker processes", workers)):
        if result is None:
            continue
        own = {(r["precision"], r["memory_format"]): r["samples_per_s"] for r in result["bare"]}[
            ("fp32", "contiguous")
        ]
        for r in result["rounds"]:
            lines.append(
                f"| fedskew {r['precision']} {r['memory_format']}, {label} | "
                f"{r['round_throughput']:,.0f} | {r['round_throughput'] / own:.2f} | "
                f"{r['round_throughput'] / goal:.2f} |"
            )
    lines += [
        "",
        "Bare PyTorch loop on this machine (same model, batch 64, pre-made tensors, 2 threads):",
        "",
        "| precision | memory format | samples/s | x fp32 contiguous |",
        "|---|---|---|---|",
    ]
    for (precision, fmt), value in bare.items():
        lines.append(f"| {precision} | {fmt} | {value:,.0f} | {value / base:.2f} |")
    best, best_bare = max(
        (
            (r, {(b["precision"], b["memory_format"]): b["samples_per_s"] for b in res["bare"]})
            for res in (inproc, workers)
            if res
            for r in res["rounds"]
        ),
        key=lambda pair: pair[0]["round_throughput"],
    )
    flower_ratio = figures["Flower 1.42 simulation (Ray)"] / 3600
    own_best = best["round_throughput"] / best_bare[("fp32", "contiguous")]
    other_bare = (
        f"{workers['bare'][0]['samples_per_s']:,.0f}" if workers and workers["bare"] else "n/a"
    )
    lines += [
        "",
        "**Goal not reached on this machine.** The fastest configuration, "
        f"{best['precision']} {best['memory_format']}, runs at "
        f"{best['round_throughput']:,.0f} samples/s: {best['round_throughput'] / goal:.2f} of "
        "the 3x-Flower goal in absolute terms. Measured against each machine's own bare fp32 "
        f"loop it is {own_best:.2f}x where Flower's figure is {flower_ratio:.2f}x, about "
        f"{own_best / flower_ratio:.1f}x Flower. Why not 3x: bf16 with channels_last speeds "
        f"the bare loop up {bare[('bf16', 'channels_last')] / base:.1f}x here (no AMX) against "
        "2.6x (3,600 -> 9,300) on the issue's machine; and two one-thread worker processes "
        "add little over one process with two threads here (the rows above), where the "
        "issue's figures promised 18 % (2 x 5,700 one-thread against 9,300 two-thread "
        "samples/s; the one-thread bare loop was not measured here). Both runs are single "
        "repeats; "
        f"the bare fp32 loop measured {base:,.0f} and {other_bare} samples/s in the two "
        "invocations, so differences under about 15 % between rows of different invocations "
        "are noise.",
        "",
        "Defaults chosen from these rows: `channels_last` for convolutional models (faster in "
        "every pair); `--precision fp32` stays the default for exactness (bf16 is opt-in; its "
        "accuracy is checked below); clients stay in one process by default (`--workers 2` was "
        "faster by 3-22 % per row but within this noise, and costs a few seconds of start-up "
        "and one copy of the dataset per worker).",
    ]
    lines += [
        "",
        "Details, per-run commands and the evaluation share: "
        "[precision_throughput.md](benchmarks/results/precision_throughput.md), "
        "[precision_throughput_workers.md](benchmarks/results/precision_throughput_workers.md).",
        "",
    ]
    return lines


def include(title: str, name: str, script: str) -> list[str]:
    path = RESULTS / name
    if not path.exists():
        return [f"## {title}", "", f"(run `{script}`)", ""]
    body = path.read_text().splitlines()
    if body and body[0].startswith("# "):
        body = body[1:]
    # Nested under this file's sections: demote headings one level.
    body = ["#" + line if line.startswith("#") else line for line in body]
    body = [line.replace("](compare_", "](benchmarks/results/compare_") for line in body]
    return [f"## {title}", *body, ""]


def main() -> None:
    lines = [
        "# Benchmarks",
        "",
        "Produced by `python benchmarks/make_benchmarks_md.py` from the result files of the "
        "scripts it names; each section says which script, machine, data and seeds. Speed "
        "figures are ratios inside one run of one script; absolute samples/s depend on the "
        "machine.",
        "",
        *throughput_section(),
        *include(
            "bf16 against fp32: accuracy",
            "precision_accuracy.md",
            "python benchmarks/precision_accuracy.py",
        ),  # fmt: skip
        "## Round time per algorithm: how to read it",
        "",
        "A single repeat with one thread per run, so FedAvg's own three runs in it (start, "
        "middle, end) spread as shown in its range; ratios within that spread of 1 do not "
        "tell algorithms apart. The extra-passes column is counted from the code and does not "
        "depend on the run. (An earlier repeat taken while other processes shared the machine "
        "gave FedProx 7.3x; this one, on a machine running one other single-thread job, gives "
        "1.2x.)",
        "",
        *include(
            "Round time per algorithm, relative to FedAvg",
            "algorithm_round_time.md",
            "python benchmarks/algorithm_round_time.py",
        ),  # fmt: skip
        *include("Scale", "scale.md", "python benchmarks/scale.py"),
        *include(
            "Flower simulation against the in-process engine",
            "flower_round_time.md",
            "python benchmarks/flower_round_time.py",
        ),  # fmt: skip
        *include(
            "Engine against a bare loop (simple-cnn)",
            "engine_throughput.md",
            "python benchmarks/engine_throughput.py",
        ),  # fmt: skip
    ]
    (ROOT / "BENCHMARKS.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {ROOT / 'BENCHMARKS.md'}")


if __name__ == "__main__":
    main()
