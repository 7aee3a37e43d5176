"""Assemble BENCHMARKS.md from the result files the benchmark scripts wrote.

Nothing is measured here and no figure or verdict is typed here: every number comes from a
file under benchmarks/results/. The JSON files are written by the scripts that measured
them (benchmarks/README.md says which script writes which file and how to rerun it);
external_figures.json holds figures reported to the project for other frameworks, measured
on another machine, and every row or sentence that uses them says so. Sentences that draw a
conclusion (goal reached or not, which configuration is fastest, faster or slower) are
computed from those numbers. Per-run command lists stay in the linked result files. The
file opens with the summary of benchmarks_summary.py (headline ratios, each linked to its
section); tests/test_benchmarks_md.py checks that BENCHMARKS.md is what this script writes.

    python benchmarks/make_benchmarks_md.py            # write BENCHMARKS.md
    python benchmarks/make_benchmarks_md.py --check    # exit 1 if BENCHMARKS.md differs
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import benchmarks_summary as summary

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
ROOT = HERE.parent
LINK = "benchmarks/results/"


def load(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def machine_text(m: dict[str, Any]) -> str:
    return f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}"


def workers_of(result: dict[str, Any]) -> int:
    """The --workers of a precision_throughput invocation (0: clients in one process)."""
    found = re.search(r"--workers\s+(\d+)", result.get("command", ""))
    return int(found.group(1)) if found else 0


def layout(workers: int, threads: int) -> str:
    if workers:
        return f"{workers} worker processes, 1 thread each"
    return f"1 process, {threads} threads"


def faster_or_slower(ratio: float) -> str:
    return "faster" if ratio > 1 else "slower" if ratio < 1 else "the same"


# ---------------------------------------------------------------------------- throughput


def throughput_section() -> list[str]:
    inproc, workers = load("precision_throughput.json"), load("precision_throughput_workers.json")
    external = load("external_figures.json")
    if inproc is None or external is None:
        return ["## Round throughput", "", "(run benchmarks/precision_throughput.py)", ""]
    frameworks = external["frameworks"]
    goal_of = external["goal"]["of"]
    goal = external["goal"]["factor"] * frameworks[goal_of]["round_throughput"]
    reported_bare = external["bare_loop"]["fp32 contiguous"]
    m = inproc["machine"]
    commands = " and ".join(f"`{r['command']}`" for r in (inproc, workers) if r is not None)
    lines = [
        f"## {summary.THROUGHPUT}",
        "",
        f"The experiment: {external['experiment']}. Round throughput = {external['unit']}.",
        "",
        "- Reported rows: other frameworks' figures "
        f"({external['source']}; that machine: {external['machine']}; "
        "[external_figures.json](benchmarks/results/external_figures.json)). The goal, "
        f"{external['goal']['factor']}x {goal_of}'s figure = {goal:,} samples/s, is a figure "
        "of that machine too.",
        f"- fedskew rows: measured on {machine_text(m)} by {commands} (one repeat per row; "
        "the repeated measurement below is the one to read); "
        f"{inproc['setting']['rounds_setting']}.",
        "- 'x own bare fp32 loop' divides by the bare fp32 loop of the row's own machine: "
        f"the reported {reported_bare:,} samples/s for the reported rows, the same "
        "invocation's for "
        "fedskew's.",
        "",
        "| source | framework / configuration | round throughput (samples/s) "
        f"| x own bare fp32 loop | x goal ({goal:,}) |",
        "|---|---|---|---|---|",
    ]
    for name, f in frameworks.items():
        value = f["round_throughput"]
        lines.append(
            f"| reported (another machine, not rerun) | {name} | {value:,} | "
            f"{value / reported_bare:.2f} | {value / goal:.2f} |"
        )
    for source, result in (
        ("precision_throughput.json", inproc),
        ("precision_throughput_workers.json", workers),
    ):
        if result is None:
            continue
        label = layout(workers_of(result), result["setting"]["threads"])
        own = bare_fp32(result)
        for r in result["rounds"]:
            lines.append(
                f"| {source} | fedskew {r['precision']} {r['memory_format']}, {label} | "
                f"{r['round_throughput']:,.0f} | {r['round_throughput'] / own:.2f} | "
                f"{r['round_throughput'] / goal:.2f} |"
            )
    bare = {(r["precision"], r["memory_format"]): r["samples_per_s"] for r in inproc["bare"]}
    base = bare[("fp32", "contiguous")]
    lines += [
        "",
        f"Bare PyTorch loop, {machine_text(m)} (same model, batch 64, pre-made tensors, "
        f"{inproc['setting']['threads']} threads; from precision_throughput.json):",
        "",
        "| precision | memory format | samples/s | x fp32 contiguous |",
        "|---|---|---|---|",
    ]
    for (precision, fmt), value in bare.items():
        lines.append(f"| {precision} | {fmt} | {value:,.0f} | {value / base:.2f} |")
    lines += [
        "",
        *repeats_section(load("throughput_repeats.json"), external, goal),
        "",
        *defaults_evidence(inproc, workers, load("throughput_repeats.json")),
        "",
        "Details, each run's command and the evaluation share: "
        "[precision_throughput.md](benchmarks/results/precision_throughput.md), "
        "[precision_throughput_workers.md](benchmarks/results/precision_throughput_workers.md), "
        "[throughput_repeats.md](benchmarks/results/throughput_repeats.md).",
        "",
    ]
    return lines


def bare_fp32(result: dict[str, Any]) -> float:
    return next(
        r["samples_per_s"]
        for r in result["bare"]
        if r["precision"] == "fp32" and r["memory_format"] == "contiguous"
    )


def repeats_section(result: dict | None, external: dict[str, Any], goal: int) -> list[str]:
    """The repeated, interleaved measurement, and the conclusions computed from it."""
    if result is None:
        return ["(run benchmarks/throughput_repeats.py)"]
    m, s = result["machine"], result["setting"]
    n = s["repeat"]
    goal_of = external["goal"]["of"]
    flower = external["frameworks"][goal_of]["round_throughput"]
    reported_bare = external["bare_loop"]["fp32 contiguous"]
    bare: dict[tuple[str, bool], list[float]] = {}
    for r in result["bare"]:
        bare.setdefault((r["precision"], r["compiled"]), []).append(r["samples_per_s"])
    own = statistics.median(bare[("fp32", False)])
    lines = [
        f"Repeated measurement: `{result['command']}` on {machine_text(m)}; {n} repeats, "
        "every variant once per repeat, order alternating; channels_last; median [min-max]. "
        f"The bare fp32 loop of the same invocation ran at {own:,.0f} samples/s (median).",
        "",
        "| fedskew configuration | round throughput (samples/s) | x own bare fp32 loop "
        f"| x goal ({goal:,}; reported) | x {goal_of}'s reported figure |",
        "|---|---|---|---|---|",
    ]
    rows: list[tuple[float, str, list[float]]] = []
    for precision in ("fp32", "bf16"):
        for workers in sorted({r["workers"] for r in result["rounds"]}):
            vals = [
                r["round_throughput"]
                for r in result["rounds"]
                if r["precision"] == precision and r["workers"] == workers
            ]
            if not vals:
                continue
            med = statistics.median(vals)
            label = f"{precision} channels_last, {layout(workers, s['threads'])}"
            rows.append((med, label, vals))
            lines.append(
                f"| {label} | {med:,.0f} [{min(vals):,.0f}-{max(vals):,.0f}] | "
                f"{med / own:.2f} | {med / goal:.2f} | {med / flower:.2f} |"
            )
    med, label, vals = max(rows)
    reached = med >= goal
    flower_own = flower / reported_bare
    lines += [
        "",
        f"Fastest configuration (median): {label}, {med:,.0f} samples/s (best of {n}: "
        f"{max(vals):,.0f}). Against the goal ({goal:,}, from the figures reported on another "
        f"machine): {med / goal:.2f}, goal **{'reached' if reached else 'not reached'}**"
        + ("" if reached else f" (it needs {goal / med:.2f}x more)")
        + f". Each against its own machine's bare fp32 loop: fedskew {med / own:.2f}x "
        f"(this invocation), {goal_of} {flower_own:.2f}x (reported: {flower:,} / "
        f"{reported_bare:,}); ratio {med / own / flower_own:.2f}.",
    ]
    gain = bf16_gain()
    reported_gain = external["bare_loop"]["bf16 channels_last"] / reported_bare
    if gain:
        lines += [
            "",
            f"Bare loop, bf16 channels_last / fp32 contiguous: {gain:.2f} here "
            f"(precision_throughput.json) and {reported_gain:.2f} as reported "
            f"({external['bare_loop']['bf16 channels_last']:,} / {reported_bare:,}, another "
            "machine).",
        ]
    compiled = {
        p: statistics.median(bare[(p, True)]) / statistics.median(bare[(p, False)])
        for p in ("fp32", "bf16")
        if (p, True) in bare and (p, False) in bare
    }
    if compiled:
        parts = ", ".join(
            f"{p}: {c:.2f} ({faster_or_slower(c)} compiled)" for p, c in compiled.items()
        )
        lines += ["", f"torch.compile (inductor), compiled / eager in the bare loop: {parts}."]
    return lines


def bf16_gain() -> float:
    result = load("precision_throughput.json")
    if result is None:
        return 0.0
    bare = {(r["precision"], r["memory_format"]): r["samples_per_s"] for r in result["bare"]}
    return bare[("bf16", "channels_last")] / bare[("fp32", "contiguous")]


def defaults_evidence(
    inproc: dict[str, Any], workers: dict | None, repeats: dict | None
) -> list[str]:
    """Counts behind the defaults (src/fedskew/assembly/prepare.py use_channels_last, config.py
    effective_workers), computed from the measurements above."""
    pairs = wins = 0
    for result in (inproc, workers):
        if result is None:
            continue
        by = {(r["repeat"], r["precision"], r["memory_format"]): r for r in result["rounds"]}
        for (rep, precision, fmt), r in by.items():
            if fmt == "channels_last" and (rep, precision, "contiguous") in by:
                pairs += 1
                wins += r["round_throughput"] > by[rep, precision, "contiguous"]["round_throughput"]
    lines = [
        "What the defaults rest on (`use_channels_last` in src/fedskew/assembly/prepare.py, "
        "`execution_choice` in src/fedskew/config.py): channels_last had the higher round "
        f"throughput in {wins} of {pairs} channels_last/contiguous pairs of the first "
        "measurement"
    ]
    if repeats is not None:
        by = {(r["repeat"], r["precision"], r["workers"]): r for r in repeats["rounds"]}
        counts = []
        for precision in ("fp32", "bf16"):
            keys = [k for k in by if k[1] == precision and k[2]]
            won = sum(
                by[k]["round_throughput"] > by[k[0], precision, 0]["round_throughput"]
                for k in keys
                if (k[0], precision, 0) in by
            )
            counts.append(f"{won} of {len(keys)} repeats in {precision}")
        lines[0] += (
            "; worker processes had the higher round throughput than one process with all "
            "threads in " + " and ".join(counts)
        )
    choice = load("auto_choice.json")
    if choice is not None:
        for v in choice["verdicts"]:
            cells = v["median"]
            threads = [k for k in cells if k.startswith("0x")]
            workers = [k for k in cells if not k.startswith("0x")]
            if threads and workers:
                ratio = cells[workers[0]] / cells[threads[0]]
                lines[0] += (
                    f"; {v['precision']}, {v['condition']} machine (auto_choice.json): "
                    f"{workers[0]} workers x threads / 1 process x {threads[0][2:]} threads = "
                    f"{ratio:.2f}"
                )
    lines[0] += (
        ". Metrics do not depend on the engine at equal threads per process "
        "(tests/test_workers.py)."
    )
    return lines


# ---------------------------------------------------------------------------- other sections


def round_time_reading() -> list[str]:
    """How far the per-algorithm ratios can be trusted, from the run's own FedAvg spread."""
    result = load("algorithm_round_time.json")
    if result is None:
        return []
    repeats = max(r["repeat"] for r in result["runs"])
    fedavg = next(r for r in result["summary"] if r["algorithm"] == "fedavg")
    return [
        "## Round time per algorithm: how to read it",
        "",
        f"{repeats} repeat(s), {result['threads']} thread(s) per run; FedAvg runs first, in "
        "the middle and last of every repeat, and its own ratios spread "
        f"{fedavg['ratio_min']:.2f}-{fedavg['ratio_max']:.2f}: ratios within that spread of 1 "
        "do not tell algorithms apart. The extra-passes column is counted from the code and "
        "does not depend on the run.",
        "",
    ]


COMMAND_COLUMNS = {"command", "commands", "call"}


def split_row(line: str) -> list[str]:
    """The cells of a Markdown table row; a '|' inside backticks stays in its cell."""
    cells, cell, code = [], "", False
    for ch in line.strip()[1:]:
        if ch == "`":
            code = not code
        if ch == "|" and not code:
            cells.append(cell)
            cell = ""
        else:
            cell += ch
    return cells


def without_commands(body: list[str]) -> list[str]:
    """A result file as BENCHMARKS.md shows it: without its 'Commands' sections and without
    table columns of per-run commands (they stay in the result file, which is linked)."""
    out: list[str] = []
    skip_level = 0
    drop: list[int] = []
    for i, line in enumerate(body):
        heading = re.match(r"(#+)\s+(.*)", line)
        if heading:
            level = len(heading.group(1))
            if skip_level and level > skip_level:
                continue
            skip_level = level if heading.group(2).strip().lower() == "commands" else 0
            if skip_level:
                continue
        elif skip_level:
            continue
        if line.startswith("|"):
            nxt = body[i + 1] if i + 1 < len(body) else ""
            if nxt.startswith("|---") or nxt.startswith("|:--") or nxt.startswith("|--:"):
                cells = split_row(line)
                drop = [j for j, c in enumerate(cells) if c.strip().lower() in COMMAND_COLUMNS]
            if drop:
                cells = split_row(line)
                line = "|" + "|".join(c for j, c in enumerate(cells) if j not in drop) + "|"
        else:
            drop = []
        out.append(line)
    return out


# Result files written before their scripts spoke only of the project: an issue number that is
# only a label becomes the project's words (the scripts now write these).
WORDING = [
    ("Issue 12's goals (computed from the rows above):", "Goals (computed from the rows above):"),
]


def include(title: str, name: str, script: str) -> list[str]:
    path = RESULTS / name
    if not path.exists():
        return [f"## {title}", "", f"(run `{script}`)", ""]
    text = path.read_text()
    for old, new in WORDING:
        text = text.replace(old, new)
    body = text.splitlines()
    if body and body[0].startswith("# "):
        body = body[1:]
    shown = without_commands(body)
    removed = len(shown) < len(body) or any(a != b for a, b in zip(shown, body, strict=False))
    body = shown
    suffix = ", with every run's command" if removed else ""
    # Nested under this file's sections: demote headings one level.
    body = ["#" + line if line.startswith("#") else line for line in body]
    body = [re.sub(r"\]\((?!https?:|#|benchmarks/)([^)]+)\)", rf"]({LINK}\1)", x) for x in body]
    while body and not body[-1].strip():
        body.pop()
    return [
        f"## {title}",
        *body,
        "",
        f"Full result{suffix}: [{name}]({LINK}{name}).",
        "",
    ]


def render() -> str:
    """BENCHMARKS.md's text."""
    lines = [
        "# Benchmarks",
        "",
        *summary.summary_lines(),
        "## How this file is made",
        "",
        "Assembled by `python benchmarks/make_benchmarks_md.py` from the result files under "
        "benchmarks/results/; [benchmarks/README.md](benchmarks/README.md) says which script "
        "makes which file and how to rerun it. Each section names its script, machine, data "
        "and seeds; figures measured elsewhere are marked as such. Speed figures compare "
        "rows of one invocation; absolute samples/s depend on the machine.",
        "",
        *throughput_section(),
        *include(
            summary.CPU_ACCURACY,
            "precision_accuracy.md",
            "python benchmarks/precision_accuracy.py",
        ),  # fmt: skip
        *round_time_reading(),
        *include(
            summary.ROUND_TIME,
            "algorithm_round_time.md",
            "python benchmarks/algorithm_round_time.py",
        ),  # fmt: skip
        *include("Scale", "scale.md", "python benchmarks/scale.py"),
        *include(
            "Flower's simulation against fedskew's engines",
            "flower_round_time.md",
            "python benchmarks/flower_round_time.py",
        ),  # fmt: skip
        *include(
            summary.SIDE_BY_SIDE,
            "flower_side_by_side.md",
            "python benchmarks/flower_side_by_side.py --repeat 2 --busy",
        ),  # fmt: skip
        *include(
            "`--workers auto`: one process against worker processes, idle and busy",
            "auto_choice.md",
            "python benchmarks/auto_choice.py",
        ),  # fmt: skip
        *include(
            "Engine against a bare loop (simple-cnn)",
            "engine_throughput.md",
            "python benchmarks/engine_throughput.py",
        ),  # fmt: skip
        *include(
            "Where the seconds of a round go",
            "round_profile.md",
            "python benchmarks/round_profile.py",
        ),  # fmt: skip
        *include(
            summary.GPU_TABLE,
            "gpu_table.md",
            "python benchmarks/gpu_table.py --device cuda",
        ),  # fmt: skip
        *include(
            summary.GPU_REPEAT,
            "gpu_table_resnet18_repeat.md",
            "python benchmarks/gpu_table.py --device cuda --models resnet18 --rounds 3",
        ),  # fmt: skip
        *include(
            summary.GPU_ACCURACY,
            "precision_accuracy_cuda.md",
            "python benchmarks/precision_accuracy.py --device cuda --modes fp32 tf32 bf16",
        ),  # fmt: skip
        *include(
            summary.GPU_CHECK,
            "gpu_check.md",
            "bash benchmarks/gpu_check.sh",
        ),  # fmt: skip
        *include(
            "Pooling before ReLU in the small CNNs",
            "pool_relu_order.md",
            "python benchmarks/pool_relu_order.py",
        ),  # fmt: skip
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="BENCHMARKS.md from benchmarks/results/")
    parser.add_argument("--check", action="store_true", help="exit 1 if BENCHMARKS.md differs")
    args = parser.parse_args(argv)
    text, target = render(), ROOT / "BENCHMARKS.md"
    if args.check:
        if target.read_text() != text:
            print("BENCHMARKS.md differs from what the result files give: run "
                  "python benchmarks/make_benchmarks_md.py", file=sys.stderr)
            return 1
        return 0
    target.write_text(text)
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
