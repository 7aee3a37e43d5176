"""The one-screen summary that opens BENCHMARKS.md: the headline ratios, each computed here from
a committed result file under benchmarks/results/ and linked to the section that holds its
setting and runs. No figure is typed here; machine, data and seeds are read from the results.

make_benchmarks_md.py puts these lines at the top of BENCHMARKS.md;
tests/test_benchmarks_md.py checks that BENCHMARKS.md is what the scripts produce.

    python benchmarks/benchmarks_summary.py       # print the summary alone
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import statistics
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
LAST = 5  # the accuracy of the last rounds, as precision_accuracy.py reports it

# The sections of BENCHMARKS.md the rows link to (make_benchmarks_md.py writes these headings).
THROUGHPUT = "Round throughput: FedAvg on Fashion-MNIST, and figures reported for other frameworks"
SIDE_BY_SIDE = "Flower and fedskew side by side, equal precision"
CPU_ACCURACY = "bf16 against fp32: accuracy"
ROUND_TIME = "Round time per algorithm, relative to FedAvg"
GPU_TABLE = "GPU: one after another against together, fp32/TF32/bf16"
GPU_REPEAT = "GPU: the ResNet-18 rows again, minutes later on the same machine"
GPU_ACCURACY = "GPU: TF32 and bf16 against fp32, accuracy"
GPU_CHECK = "GPU check"


def slug(heading: str) -> str:
    """The anchor both GitHub and MkDocs' toc give a plain heading (no code, no HTML)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return re.sub(r" ", "-", text)


def link(heading: str, text: str | None = None) -> str:
    return f"[{text or heading}](#{slug(heading)})"


def load(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / name).read_text(encoding="utf-8"))


def cpu_text(m: dict[str, Any]) -> str:
    return f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}"


def gpu_text(env: dict[str, Any], m: dict[str, Any]) -> str:
    return f"{env['device_name']}, torch {m['torch']}"


def seeds_text(seeds: list[int]) -> str:
    return ("seed " if len(seeds) == 1 else "seeds ") + ", ".join(map(str, sorted(seeds)))


# ------------------------------------------------------------------------------------ rows
# Each row: (what is compared, the ratio(s), where and on what it was measured, section link).
Row = tuple[str, str, str, str]


def data_name(source: str) -> str:
    """A data source as the results write it, shortened to the data set's name."""
    found = re.search(r"([\w-]+) idx files", source)
    return found.group(1) if found else source.split(" (")[0]


def flower_rows() -> list[Row]:
    result = load("flower_side_by_side.json")
    s, m = result["setting"], result["machine"]
    flwr = result["runs"][0]["details"]["flwr"]
    repeats = max(r["repeat"] for r in result["runs"])
    where = (
        f"{cpu_text(m)}, Flower {flwr}; "
        f"{data_name(result['checks']['dataset_sources'][0])}, {s['model']}; "
        f"{seeds_text([s['seed']])}, {repeats} repeat(s)"
    )

    def ratio(condition: str, denominator: str) -> str:
        for c in result["comparisons"].get(condition, []):
            if c["numerator"] == "fedskew-fp32" and c["denominator"] == denominator:
                return f"{c['ratio']:.2f}x {condition}"
        return f"not measured {condition}"

    parts = [
        f"Flower as its documentation writes the app: **{ratio('idle', 'flower-docs')}**, "
        f"{ratio('busy', 'flower-docs')}",
        f"Flower given fedskew's fp32 speed settings by hand: "
        f"**{ratio('idle', 'flower-tricks-fp32')}**, {ratio('busy', 'flower-tricks-fp32')}",
    ]
    return [(
        "CPU speed, fedskew's defaults against Flower's simulation, same FedAvg experiment, "
        "both fp32 (busy: beside a busy core)",
        "; ".join(parts),
        where,
        link(SIDE_BY_SIDE),
    )]


def bf16_speed_row() -> Row:
    result = load("throughput_repeats.json")
    medians: dict[tuple[str, int], float] = {}
    for precision in ("fp32", "bf16"):
        for workers in {r["workers"] for r in result["rounds"]}:
            values = [
                r["round_throughput"] for r in result["rounds"]
                if r["precision"] == precision and r["workers"] == workers
            ]  # fmt: skip
            if values:
                medians[precision, workers] = statistics.median(values)
    best = {p: max(v for (q, _), v in medians.items() if q == p) for p in ("fp32", "bf16")}
    seed = re.search(r"seed (\d+)", result["setting"]["rounds_setting"])
    where = (
        f"{cpu_text(result['machine'])}; {data_name(result['data_source'])}, fedavg-cnn; "
        f"{seeds_text([int(seed.group(1))]) if seed else 'seed not recorded'}, median of "
        f"{result['setting']['repeat']} repeats"
    )
    return (
        "CPU speed, bf16 autocast against fp32 (round throughput, the faster layout of each)",
        f"**{best['bf16'] / best['fp32']:.2f}x** ({best['bf16']:,.0f} / {best['fp32']:,.0f} "
        "samples/s)",
        where,
        link(THROUGHPUT),
    )


def round_time_row() -> Row:
    result = load("algorithm_round_time.json")
    others = [r for r in result["summary"] if r["algorithm"] != "fedavg"]
    low = min(others, key=lambda r: r["ratio"])
    high = max(others, key=lambda r: r["ratio"])
    fedavg = next(r for r in result["summary"] if r["algorithm"] == "fedavg")
    seed = re.search(r"seed (\d+)", result["setting"])
    return (
        f"CPU cost of each method, its round time against FedAvg's ({len(others)} methods; "
        "above 1: slower)",
        f"{low['ratio']:.2f}x ({low['algorithm']}) to **{high['ratio']:.2f}x** "
        f"({high['algorithm']}); FedAvg against itself: {fedavg['ratio_min']:.2f}-"
        f"{fedavg['ratio_max']:.2f}",
        f"{cpu_text(result['machine'])}; {result['setting'].split(',')[0]}, "
        f"{result['setting'].split(',')[1].strip()}; "
        f"{seeds_text([int(seed.group(1))]) if seed else 'seed not recorded'}",
        link(ROUND_TIME),
    )


def together_ratios(name: str) -> dict[str, dict[str, float]]:
    """Together / one after another, training samples/s, per model and precision."""
    cells: dict[tuple[str, str], dict[str, float]] = {}
    for c in load(name)["cells"]:
        cells.setdefault((c["model"], c["precision"]), {})[c["how"]] = c["samples_per_second"]
    out: dict[str, dict[str, float]] = {}
    for (model, precision), v in cells.items():
        if "off" in v and "vmap" in v:
            out.setdefault(model, {})[precision] = v["vmap"] / v["off"]
    return out


def gpu_rows() -> list[Row]:
    check = {s["step"]: s for s in load("gpu_check.json")["steps"]}
    env = check["environment"]["facts"]
    throughput = check["throughput"]
    result = throughput["result"]
    # The seed as the recorded command gave it, or the script's default: its own parser says.
    args = _clients_together().parser().parse_args(shlex.split(throughput["command"])[2:])
    paired = result["paired_training"]
    table = load("gpu_table.json")
    first = together_ratios("gpu_table.json")
    repeat = together_ratios("gpu_table_resnet18_repeat.json")
    table_seeds = sorted({int(x) for x in re.findall(r"seed (\d+)", _md("gpu_table.md"))})
    by_model = []
    for model, ratios in first.items():
        cells = ", ".join(f"{p} {r:.2f}x" for p, r in ratios.items())
        if model in repeat:
            again = ", ".join(f"{p} {r:.2f}x" for p, r in repeat[model].items())
            cells += f" ({link(GPU_REPEAT, 'rerun')}: {again})"
        data = data_name(table["datasets"][model])
        by_model.append(f"{model} on {data}: {cells}")
    rows: list[Row] = [
        (
            "GPU speed, a round's clients trained together (vmap) against one after another "
            "(samples/s)",
            "round throughput, fedavg-cnn: "
            f"**{result['ratios']['together_vs_one_after_another']:.2f}x** "
            f"(training alone {paired['ratio_median']:.2f}x, pairs "
            f"{paired['ratio_range'][0]:.2f}-{paired['ratio_range'][1]:.2f}x)",
            f"{gpu_text(env, result['machine'])}; {data_name(throughput['dataset'])}; "
            f"{seeds_text([args.seed])}, {result['repeat']} repeat(s)",
            link(GPU_CHECK),
        ),
        (
            "GPU speed, together against one after another by precision (training samples/s)",
            "; ".join(by_model),
            f"{gpu_text(table['environment'], table['machine'])}; {seeds_text(table_seeds)}, "
            "one measurement per cell",
            link(GPU_TABLE),
        ),
    ]
    equivalence = check["equivalence"]["rows"]
    within = sum(r["verdict"] == "ok" for r in equivalence)
    setting = _first_sentence(
        _section(_md("gpu_check.md"), "CPU and device curves, per algorithm")
    )
    seed = re.search(r"\bseed \d+", setting)
    data, model = re.match(r"([\w-]+), ([\w-]+)", setting).groups()
    rows.append((
        "GPU against CPU, each algorithm's accuracy curve (one after another and together)",
        f"**{within} of {len(equivalence)}** algorithms within their measured tolerance",
        f"{gpu_text(env, result['machine'])}; {data}, {model}; "
        f"{seed.group(0) if seed else 'seed not recorded'}",
        link(GPU_CHECK),
    ))
    return rows


def _clients_together() -> Any:
    spec = importlib.util.spec_from_file_location(
        "clients_together_for_summary", HERE / "clients_together.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _md(name: str) -> str:
    return (RESULTS / name).read_text(encoding="utf-8")


def _section(text: str, heading: str) -> str:
    return text.split(f"## {heading}\n", 1)[1].split("\n#", 1)[0].strip()


def _first_sentence(text: str) -> str:
    """The setting sentence a result file opens a section with (its own words)."""
    return text.split(". ", 1)[0].strip()


def accuracy_rows() -> list[Row]:
    rows: list[Row] = []
    for folder, where_link, device in (
        ("precision", CPU_ACCURACY, "CPU"),
        ("precision-cuda", GPU_ACCURACY, "GPU"),
    ):
        runs = RESULTS / "runs" / folder
        got: dict[str, dict[int, tuple[float, float]]] = {}
        configs: list[dict[str, Any]] = []
        processes: list[dict[str, Any]] = []
        for run in sorted(runs.iterdir()):
            if not (run / "summary.json").exists():
                continue
            mode, seed = run.name.rsplit("-s", 1)
            lines = (run / "metrics.jsonl").read_text().splitlines()
            acc = [json.loads(x)["accuracy"] for x in lines]
            got.setdefault(mode, {})[int(seed)] = (acc[-1], statistics.mean(acc[-LAST:]))
            configs.append(json.loads((run / "config.json").read_text()))
            if (run / "processes.jsonl").exists():
                processes.append(json.loads((run / "processes.jsonl").read_text().split("\n")[0]))
        cells = []
        for mode in (m for m in got if m != "fp32"):
            seeds = sorted(set(got[mode]) & set(got["fp32"]))
            final = [100 * (got[mode][s][0] - got["fp32"][s][0]) for s in seeds]
            last = [100 * (got[mode][s][1] - got["fp32"][s][1]) for s in seeds]
            cells.append(
                f"{mode} - fp32: final **{statistics.mean(final):+.2f} ± "
                f"{statistics.stdev(final):.2f}**, last {LAST} rounds "
                f"{statistics.mean(last):+.2f} ± {statistics.stdev(last):.2f} points"
            )
        c = configs[0]
        machines = sorted({
            f"{p.get('device_name') or p['cpu']}, torch {p['torch']}" for p in processes
        })  # fmt: skip
        machine = (
            "; ".join(machines) if len(processes) == len(configs)
            else "machine not recorded with these runs"
        )  # fmt: skip
        seeds = sorted({cfg["seed"] for cfg in configs})
        rows.append((
            f"{device} accuracy cost of lower precision (test accuracy, mean ± sd over seeds, "
            "percentage points)",
            "; ".join(cells),
            f"{machine}; {c['dataset']}, {c['model']}, {c['rounds']} rounds; "
            f"{seeds_text(seeds)} (runs/{folder}/)",
            link(where_link),
        ))
    return rows


def summary_lines() -> list[str]:
    cpu_accuracy, gpu_accuracy = accuracy_rows()
    gpu = gpu_rows()
    rows = [*flower_rows(), bf16_speed_row(), cpu_accuracy, round_time_row(), *gpu, gpu_accuracy]
    return [
        "## Summary",
        "",
        "The headline ratios, computed by `python benchmarks/benchmarks_summary.py` from the "
        "result files of the sections linked (make_benchmarks_md.py writes them here). Speed "
        "ratios above 1: the first-named side is faster. Each section has the full setting, "
        "the result file and every run; CPU and GPU rows come from different machines.",
        "",
        "| what | ratio | measured on (machine, data, seeds) | section |",
        "|---|---|---|---|",
        *(f"| {what} | {ratio} | {where} | {section} |" for what, ratio, where, section in rows),
        "",
    ]


if __name__ == "__main__":
    print("\n".join(summary_lines()))
