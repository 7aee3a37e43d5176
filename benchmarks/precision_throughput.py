"""Throughput of fedavg-cnn per precision (fp32, bf16) and memory format, bare and in rounds.

Two measurements for each of {fp32, bf16} x {contiguous, channels_last}, in one process at a
fixed thread count, interleaved so that the machine's drift hits every variant alike:

- bare loop: McMahan's FedAvg CNN trained by plain SGD (lr 0.01, momentum 0.9) on pre-made
  Fashion-MNIST tensors in batches of 64; bf16 is autocast around forward and loss, backward
  outside, exactly as in fedskew's local loop. Samples per second.
- rounds: fedskew's FedAvg on the issue-6 experiment (fmnist, 20 clients, Dirichlet 0.1,
  8 clients per round, 5 local epochs, batch 64, lr 0.01, momentum 0.9, fedavg-cnn, the
  global model tested every round). Round throughput is training samples per second of
  round wall time (from the end of one round to the end of the next: sampling, training,
  messages, aggregation, evaluation and metrics writing); training alone and the
  evaluation's share of the round are given as well.

Only ratios inside one run mean anything; compare rows of one repeat.

    python benchmarks/precision_throughput.py [--threads 2] [--rounds 3] [--repeat 2]
        [--bare-steps 300] [--data-dir DIR] [--out benchmarks/results/precision_throughput.md]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_facts  # noqa: E402

from fedskew.config import ExperimentConfig  # noqa: E402
from fedskew.data.sources import load_dataset  # noqa: E402
from fedskew.models import build_model  # noqa: E402
from fedskew.runs.loop import run  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PRECISIONS = ("fp32", "bf16")
FORMATS = ("contiguous", "channels_last")
BATCH = 64
LR = 0.01
MOMENTUM = 0.9
# The frameworks' round throughput and the goal, from issue 6 (another machine, not rerun
# here): read from the data file that states their source.
EXTERNAL = json.loads((RESULTS / "external_figures.json").read_text())
ISSUE_FIGURES = {k: v["round_throughput"] for k, v in EXTERNAL["frameworks"].items()}
GOAL = EXTERNAL["goal"]["factor"] * ISSUE_FIGURES[EXTERNAL["goal"]["of"]]


def forward_context(precision: str) -> contextlib.AbstractContextManager[object]:
    if precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def bare_loop(
    x: torch.Tensor,
    y: torch.Tensor,
    precision: str,
    memory_format: str,
    steps: int,
    weight_decay: float,
    warmup: int = 10,
    compiled: bool = False,
) -> tuple[float, float]:
    """(samples per second of plain SGD steps of fedavg-cnn on pre-made tensors, seconds of
    the warm-up steps, which include the compilation when ``compiled``)."""
    torch.manual_seed(0)
    model = build_model("fedavg-cnn", tuple(x.shape[1:]), 10)
    if memory_format == "channels_last":
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=weight_decay)
    forward = torch.compile(model) if compiled else model
    model.train()
    n = len(y) // BATCH

    def step(i: int) -> None:
        xb, yb = x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]
        with forward_context(precision):
            loss = F.cross_entropy(forward(xb), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    t0 = time.perf_counter()
    for i in range(warmup):
        step(i % n)
    warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    for s in range(steps):
        step(s % n)
    return steps * BATCH / (time.perf_counter() - t0), warm


def experiment_config(args: argparse.Namespace, precision: str, memory_format: str) -> Any:
    return ExperimentConfig(
        algorithm="fedavg", dataset="fmnist", data_dir=args.data_dir, model="fedavg-cnn",
        num_clients=20, clients_per_round=8, partition="dirichlet",
        partition_params={"beta": 0.1}, rounds=args.rounds, local_epochs=args.local_epochs,
        batch_size=BATCH, lr=LR, momentum=MOMENTUM, weight_decay=args.weight_decay,
        eval_every=1, seed=0, memory_format=memory_format, precision=precision,
        checkpoint_every=0, out_dir=str(Path(tempfile.gettempdir()) / "fedskew-bench"),
        quiet=True, workers=args.workers,
    )  # fmt: skip


def cli_command(args: argparse.Namespace, precision: str, memory_format: str) -> str:
    """The `fedskew run` command line of the same experiment."""
    data = f" --data-dir {shlex.quote(args.data_dir)}" if args.data_dir else ""
    return (
        f"OMP_NUM_THREADS={args.threads} fedskew run -a fedavg -d fmnist{data} -m fedavg-cnn "
        f"-n 20 --clients-per-round 8 --partition dirichlet --beta 0.1 -e {args.local_epochs} "
        f"-b {BATCH} --lr {LR} --momentum {MOMENTUM} --weight-decay {args.weight_decay} "
        f"-r {args.rounds} --eval-every 1 --memory-format {memory_format} "
        f"--precision {precision} --checkpoint-every 0 --seed 0 --workers {args.workers}"
    )


def rounds_throughput(cfg: ExperimentConfig) -> dict[str, Any]:
    """Round throughput of one run, from the wall time between round ends.

    The first round is measured from the start of the loop and left out of the figures
    when there are more: it also pays for the first oneDNN kernel selections."""
    marks: list[float] = []
    records: list[dict[str, Any]] = []

    def on_start(_: int) -> None:
        marks.append(time.perf_counter())

    def on_round(record: dict[str, Any]) -> None:
        marks.append(time.perf_counter())
        records.append(record)

    _, summary = run(cfg, on_round=on_round, on_start=on_start)
    walls = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    skip = 1 if len(records) > 1 else 0
    samples = sum(r["samples"] for r in records[skip:])
    wall = sum(walls[skip:])
    train = sum(r["seconds"] for r in records[skip:])
    evaluation = sum(r.get("eval_seconds", 0.0) for r in records[skip:])
    return {
        "rounds_measured": len(records) - skip,
        "round_throughput": round(samples / wall, 1),
        "training_throughput": round(samples / train, 1),
        "eval_share": round(evaluation / wall, 4),
        "round_seconds": [round(w, 3) for w in walls],
        "final_accuracy": summary["final_accuracy"],
    }


def markdown(result: dict[str, Any], command: str) -> str:
    m, s = result["machine"], result["setting"]
    bare_rows = []
    for row in result["bare"]:
        base = next(
            r["samples_per_s"]
            for r in result["bare"]
            if r["repeat"] == row["repeat"] and r["precision"] == "fp32"
            and r["memory_format"] == "contiguous"
        )  # fmt: skip
        bare_rows.append(
            f"| {row['repeat']} | {row['precision']} | {row['memory_format']} | "
            f"{row['samples_per_s']:,.0f} | {row['samples_per_s'] / base:.2f} |"
        )
    round_rows = [
        f"| {r['repeat']} | {r['precision']} | {r['memory_format']} | "
        f"{r['round_throughput']:,.0f} | {r['training_throughput']:,.0f} | "
        f"{100 * r['eval_share']:.1f} % | {r['round_throughput'] / GOAL:.2f} | "
        f"{r['final_accuracy']:.4f} |"
        for r in result["rounds"]
    ]
    commands = "\n".join(f"    {c}" for c in result["commands"])
    figures = ", ".join(f"{k} {v:,}" for k, v in ISSUE_FIGURES.items())
    return (
        "# fedavg-cnn throughput per precision and memory format\n\n"
        f"Produced by `{command}`.\n\n"
        f"- Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; torch {m['torch']}, "
        f"{m['torch_threads']} threads; Python {m['python']}\n"
        f"- Data: Fashion-MNIST ({result['data_source']})\n"
        f"- Bare loop: fedavg-cnn, SGD lr {LR}, momentum {MOMENTUM}, weight decay "
        f"{s['weight_decay']}, batch {BATCH}, {s['bare_steps']} timed steps after 10 warm-up "
        "steps, on pre-made tensors; bf16 = autocast around forward and loss.\n"
        f"- Rounds: {s['rounds_setting']}. Round throughput = training samples per second of "
        "round wall time (evaluation included); the first round is left out when there are "
        "more.\n\n"
        "## Bare PyTorch loop\n\n"
        "| repeat | precision | memory format | samples/s | x fp32 contiguous |\n"
        "|---|---|---|---|---|\n" + "\n".join(bare_rows) + "\n\n"
        "## fedskew rounds\n\n"
        "| repeat | precision | memory format | round throughput (samples/s) | training alone "
        f"| evaluation share | x goal ({GOAL:,}) | final accuracy |\n"
        "|---|---|---|---|---|---|---|---|\n" + "\n".join(round_rows) + "\n\n"
        f"The goal is {EXTERNAL['goal']['factor']}x the round throughput of "
        f"{EXTERNAL['goal']['of']} in issue 6 ({figures} samples/s; "
        f"{EXTERNAL['source']}: benchmarks/results/external_figures.json).\n\n"
        "Each rounds row is the same experiment as:\n\n" + commands + "\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=3, help="rounds per fedskew run (0: none)")
    ap.add_argument("--local-epochs", type=int, default=5, help="5 in the issue's experiment")
    ap.add_argument("--bare-steps", type=int, default=300, help="timed steps per bare loop")
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--repeat", type=int, default=2, help="repeat the whole measurement")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument(
        "--workers",
        type=int,
        default=0,
        help="clients in N worker processes of one thread each (0: in this process)",
    )
    ap.add_argument("--out", default=str(RESULTS / "precision_throughput.md"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    command = "python benchmarks/precision_throughput.py " + " ".join(
        shlex.quote(a) for a in sys.argv[1:]
    )

    data = load_dataset("fmnist", args.data_dir)
    variants = [(p, f) for p in PRECISIONS for f in FORMATS]
    bare: list[dict[str, Any]] = []
    rounds: list[dict[str, Any]] = []
    for rep in range(args.repeat):
        # Alternate the order between repeats so that drift does not favour one variant.
        order = variants if rep % 2 == 0 else variants[::-1]
        for precision, fmt in order:
            speed, _ = bare_loop(
                data.x_train, data.y_train, precision, fmt, args.bare_steps, args.weight_decay
            )
            bare.append(
                {
                    "repeat": rep + 1,
                    "precision": precision,
                    "memory_format": fmt,
                    "samples_per_s": round(speed, 1),
                }
            )
            print(f"bare    {rep + 1} {precision} {fmt:<13} {speed:10,.0f} samples/s", flush=True)
        if args.rounds < 1:
            continue
        for precision, fmt in order:
            figures = rounds_throughput(experiment_config(args, precision, fmt))
            rounds.append({"repeat": rep + 1, "precision": precision, "memory_format": fmt,
                           **figures})  # fmt: skip
            print(
                f"rounds  {rep + 1} {precision} {fmt:<13} "
                f"{figures['round_throughput']:10,.0f} samples/s "
                f"(training {figures['training_throughput']:,.0f}, "
                f"eval {100 * figures['eval_share']:.1f} %)",
                flush=True,
            )
    bare.sort(key=lambda r: (r["repeat"], variants.index((r["precision"], r["memory_format"]))))
    rounds.sort(key=lambda r: (r["repeat"], variants.index((r["precision"], r["memory_format"]))))
    result = {
        "machine": machine_facts(),
        "data_source": data.source,
        "setting": {
            "threads": args.threads,
            "bare_steps": args.bare_steps,
            "weight_decay": args.weight_decay,
            "rounds_setting": (
                "FedAvg, fmnist, fedavg-cnn, 20 clients, dirichlet beta 0.1, 8 per round, "
                f"E={args.local_epochs}, batch {BATCH}, lr {LR}, momentum {MOMENTUM}, "
                f"weight decay {args.weight_decay}, eval every round, seed 0, "
                f"{args.rounds} rounds, "
                + (
                    f"clients in {args.workers} worker processes of 1 thread each"
                    if args.workers > 1
                    else f"clients in this process, {args.threads} threads"
                )
            ),
        },
        "issue_figures": ISSUE_FIGURES,
        "goal": GOAL,
        "command": command,
        "commands": [cli_command(args, p, f) for p, f in variants] if args.rounds else [],
        "bare": bare,
        "rounds": rounds,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(result, command))
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"written: {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
