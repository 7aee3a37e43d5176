"""Repeated, interleaved measurements of the two levers issue 6 left open.

1. Clients in one process with all threads against clients in one-thread worker processes
   (``--workers N``), on the issue-6 experiment (FedAvg, fmnist, fedavg-cnn, 20 clients,
   Dirichlet 0.1, 8 per round, E=5, batch 64, evaluation every round), per precision with
   channels_last. Each repeat runs every variant once, in an order that alternates between
   repeats; the paired ratio workers / in-process is taken inside each repeat.
2. ``torch.compile`` (inductor) of fedavg-cnn in the bare loop against the eager model, per
   precision with channels_last; compile time reported apart from the steady throughput.

Only ratios inside one run mean anything; the machine must be otherwise idle.

    python benchmarks/throughput_repeats.py [--threads 2] [--workers 2] [--repeat 3]
        [--rounds 3] [--bare-steps 300] [--out benchmarks/results/throughput_repeats.md]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_facts  # noqa: E402
from precision_throughput import (  # noqa: E402
    BATCH,
    LR,
    MOMENTUM,
    bare_loop,
    experiment_config,
    rounds_throughput,
)

from fedskew.data.sources import load_dataset  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PRECISIONS = ("fp32", "bf16")


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} [{min(values):,.0f}-{max(values):,.0f}]"


def ratio_summary(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def paired_rows(
    rows: list[dict[str, Any]], switch: str, figure: str, extra: dict[str, str] | None = None
) -> list[str]:
    """Per precision: the figure without and with ``switch`` (median [range] over repeats),
    their ratio paired inside each repeat, an ``extra`` cell if given, the number of pairs."""
    lines = []
    for precision in PRECISIONS:
        mine = [r for r in rows if r["precision"] == precision]
        off = {r["repeat"]: r[figure] for r in mine if not r[switch]}
        on = {r["repeat"]: r[figure] for r in mine if r[switch]}
        paired = [on[k] / off[k] for k in off if k in on]
        if paired:
            cell = f" {extra[precision]} |" if extra else ""
            lines.append(
                f"| {precision} | {summary(list(off.values()))} | {summary(list(on.values()))} "
                f"| {ratio_summary(paired)} |{cell} {len(paired)} |"
            )
    return lines


def markdown(result: dict[str, Any]) -> str:
    m, s = result["machine"], result["setting"]
    layout_rows = paired_rows(result["rounds"], "workers", "round_throughput")
    warmups: dict[str, list[float]] = {}
    for r in result["bare"]:
        if r["compiled"]:
            warmups.setdefault(r["precision"], []).append(r["warmup_seconds"])
    compile_seconds = {p: f"{statistics.median(w):.1f} s" for p, w in warmups.items()}
    bare_rows = paired_rows(result["bare"], "compiled", "samples_per_s", compile_seconds)
    every = "\n".join(
        f"| {r['repeat']} | {r['precision']} | {'workers' if r['workers'] else 'in-process'} | "
        f"{r['round_throughput']:,.0f} | {r['training_throughput']:,.0f} | "
        f"{100 * r['eval_share']:.1f} % |"
        for r in result["rounds"]
    )
    return (
        "# Repeated throughput measurements: worker processes and torch.compile\n\n"
        f"Produced by `{result['command']}`.\n\n"
        f"- Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; torch {m['torch']}; "
        f"Python {m['python']}\n"
        f"- Data: Fashion-MNIST ({result['data_source']})\n"
        f"- Rounds: {s['rounds_setting']}; in-process = one process with {s['threads']} threads, "
        f"workers = `--workers {s['workers']}` (one thread each). Round throughput = training "
        "samples per second of round wall time, evaluation included, first round left out.\n"
        f"- Bare loop: fedavg-cnn, channels_last, SGD lr {LR}, momentum {MOMENTUM}, batch "
        f"{BATCH}, {s['bare_steps']} timed steps after 10 warm-up steps, {s['threads']} threads.\n"
        f"- {s['repeat']} repeats; in each, every variant once, the order reversed in every "
        "other repeat. Cells: median [min-max] over repeats; ratios are paired inside a "
        "repeat.\n\n"
        "## Clients in worker processes against one process\n\n"
        "| precision | in-process (samples/s) | workers (samples/s) | workers / in-process "
        "| repeats |\n|---|---|---|---|---|\n" + "\n".join(layout_rows) + "\n\n"
        "## torch.compile in the bare loop\n\n"
        "| precision | eager (samples/s) | compiled (samples/s) | compiled / eager "
        "| warm-up incl. compile | repeats |\n|---|---|---|---|---|---|\n"
        + "\n".join(bare_rows)
        + "\n\n## Every round measurement\n\n"
        "| repeat | precision | layout | round throughput | training alone | evaluation share |\n"
        "|---|---|---|---|---|---|\n" + every + "\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="rounds per fedskew run (0: none)")
    ap.add_argument("--local-epochs", type=int, default=5)
    ap.add_argument("--bare-steps", type=int, default=300, help="timed steps (0: no bare loop)")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", default=str(RESULTS / "throughput_repeats.md"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    command = "python benchmarks/throughput_repeats.py " + " ".join(
        shlex.quote(a) for a in sys.argv[1:]
    )
    data = load_dataset("fmnist", args.data_dir)
    args.weight_decay = 0.0
    bare: list[dict[str, Any]] = []
    rounds: list[dict[str, Any]] = []
    for rep in range(1, args.repeat + 1):
        flip = rep % 2 == 0
        if args.bare_steps:
            variants = [(p, c) for p in PRECISIONS for c in (False, True)]
            for precision, compiled in variants[::-1] if flip else variants:
                torch._dynamo.reset()  # each compiled variant pays its own compilation
                speed, warm = bare_loop(
                    data.x_train, data.y_train, precision, "channels_last", args.bare_steps,
                    weight_decay=0.0, compiled=compiled,
                )  # fmt: skip
                bare.append({"repeat": rep, "precision": precision, "compiled": compiled,
                             "samples_per_s": round(speed, 1),
                             "warmup_seconds": round(warm, 2)})  # fmt: skip
                print(f"bare   {rep} {precision} compiled={compiled} {speed:,.0f}", flush=True)
        if args.rounds:
            variants = [(p, w) for p in PRECISIONS for w in (0, args.workers)]
            for precision, workers in variants[::-1] if flip else variants:
                cfg = experiment_config(
                    argparse.Namespace(**{**vars(args), "workers": workers}),
                    precision,
                    "channels_last",
                )
                figures = rounds_throughput(cfg)
                rounds.append({"repeat": rep, "precision": precision, "workers": workers,
                               **figures})  # fmt: skip
                print(
                    f"rounds {rep} {precision} workers={workers} "
                    f"{figures['round_throughput']:,.0f}",
                    flush=True,
                )
    result = {
        "machine": machine_facts(),
        "data_source": data.source,
        "command": command,
        "setting": {
            "threads": args.threads,
            "workers": args.workers,
            "repeat": args.repeat,
            "bare_steps": args.bare_steps,
            "rounds_setting": (
                "FedAvg, fmnist, fedavg-cnn, channels_last, 20 clients, dirichlet beta 0.1, "
                f"8 per round, E={args.local_epochs}, batch {BATCH}, lr {LR}, momentum "
                f"{MOMENTUM}, eval every round, seed 0, {args.rounds} rounds"
            ),
        },
        "bare": bare,
        "rounds": rounds,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(result))
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"written: {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
