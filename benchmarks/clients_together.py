"""Round throughput of a round's clients one after another against trained together (vmap),
beside a bare PyTorch loop and, optionally, Flower's simulation, on one device.

The experiment is issue 12's: FedAvg, fedavg-cnn, Fashion-MNIST, 20 clients, Dirichlet 0.1,
8 clients per round, E=5 local epochs, batch 64 (lr 0.01, momentum 0.9). Round throughput is
training samples per second of a round's training time (the server's round: messages, local
training, aggregation; evaluation excluded), median over the measured rounds; the first
round of every run is a warm-up (kernel selection, vmap's first trace) and is left out. The
bare loop is plain SGD steps of one fedavg-cnn on device tensors, batch 64: the ceiling of
one client at a time.

Modes run interleaved (--repeat), so that drift hits them alike: only ratios inside one run
mean anything. On a shared machine whole runs last long enough for the load to change between
them, so a second table times the training alone, in one process: the clients of round 1,
trained one after another and then together from the same weights, back to back (--pairs
times); its ratio is the median of the pairs' ratios.

    python benchmarks/clients_together.py --device cpu --epochs 1 --rounds 2 --threads 2 \\
        --out benchmarks/results/clients_together_cpu.md
    python benchmarks/clients_together.py --device cuda --flower          # on a GPU machine

Writes the .md and a .json beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_facts  # noqa: E402

from fedskew.assembly.prepare import new_model, prepare  # noqa: E402
from fedskew.config import ExperimentConfig  # noqa: E402
from fedskew.core.device import device_name, resolve_device  # noqa: E402
from fedskew.core.gpu_memory import PEAK_KEYS  # noqa: E402
from fedskew.core.rng import torch_rng  # noqa: E402
from fedskew.data.federated import sample_clients  # noqa: E402
from fedskew.data.sources import load_dataset  # noqa: E402
from fedskew.engines.together import train_together  # noqa: E402
from fedskew.models import build_model  # noqa: E402
from fedskew.runs.loop import run  # noqa: E402
from fedskew.training.local import local_train, set_arrays  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BATCH = 64
LR = 0.01
MOMENTUM = 0.9
MODES = {"off": "one after another", "vmap": "together (vmap)"}
# Issue 12's goals for this experiment (benchmarks, not tests).
GOAL_TOGETHER = 5.0  # together / one after another, same GPU
GOAL_FLOWER = 10.0  # together / Flower's simulation, same GPU


def experiment_config(args: argparse.Namespace, mode: str, out_dir: str) -> ExperimentConfig:
    return ExperimentConfig(
        algorithm="fedavg",
        dataset=args.dataset,
        data_dir=args.data_dir,
        download=False,
        model="fedavg-cnn",
        num_clients=20,
        partition="dirichlet",
        partition_params={"beta": 0.1},
        clients_per_round=8,
        local_epochs=args.epochs,
        batch_size=BATCH,
        lr=LR,
        momentum=MOMENTUM,
        rounds=args.rounds + 1,
        eval_every=args.rounds + 1,  # evaluated once, after the last round
        checkpoint_every=0,
        workers=0,
        device=args.device,
        clients_together=mode if mode in MODES else "off",
        engine="flower-sim" if mode == "flower" else "inprocess",
        seed=args.seed,
        out_dir=out_dir,
        name=f"{mode}-{time.monotonic_ns()}",
        quiet=True,
    )


def rounds_throughput(cfg: ExperimentConfig) -> dict[str, Any]:
    """Training samples per second of each round after the first, their peak GPU memory
    (None on the CPU), and the final accuracy."""
    if cfg.engine == "flower-sim":
        from fedskew.apps.flower import run_simulation

        folder, summary = run_simulation(cfg)
    else:
        folder, summary = run(cfg)
    records = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    measured = records[1:]
    rates = [r["samples"] / r["seconds"] for r in measured if r["seconds"] > 0]

    def peak(key: str) -> float | None:
        values = [r[key] for r in measured if r.get(key) is not None]
        return max(values) if values else None

    return {
        "samples_per_second": round(statistics.median(rates), 1) if rates else None,
        "round_seconds": [round(r["seconds"], 4) for r in measured],
        "samples_per_round": [r["samples"] for r in measured],
        "final_accuracy": summary["final_accuracy"],
        **{key: peak(key) for key in PEAK_KEYS},
    }


def bare_loop(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Samples per second of plain SGD steps of one fedavg-cnn on device tensors."""
    data = load_dataset(args.dataset, args.data_dir, download=False)
    x = data.x_train[: 64 * BATCH].to(device)
    y = data.y_train[: 64 * BATCH].to(device)
    torch.manual_seed(0)
    model = build_model("fedavg-cnn", data.input_shape, data.num_classes).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=1e-5)
    batches = len(y) // BATCH

    def step(i: int) -> None:
        b = i % batches
        xb, yb = x[b * BATCH : (b + 1) * BATCH], y[b * BATCH : (b + 1) * BATCH]
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for i in range(10):  # warm-up
        step(i)
    sync(device)
    t0 = time.perf_counter()
    for i in range(args.bare_steps):
        step(i)
    sync(device)
    seconds = time.perf_counter() - t0
    return {"samples_per_second": round(args.bare_steps * BATCH / seconds, 1)}


def paired_training(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Round 1's clients trained one after another, then together, from the same weights,
    ``args.pairs`` times back to back (after one untimed pair): samples per second of each
    and the median of the pairs' ratios."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = experiment_config(args, "off", tmp)
    prep = prepare(cfg)
    model = new_model(prep)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    clients = sample_clients(cfg.seed, 0, cfg.num_clients, cfg.per_round())
    datas = [prep.fed.client(c) for c in clients]
    samples = cfg.local_epochs * sum(len(d) for d in datas)

    def alone() -> float:
        t0 = time.perf_counter()
        for c, data in zip(clients, datas, strict=True):
            set_arrays(model, start)
            local_train(model, data, prep.train, torch_rng(cfg.seed, 0, c, "train"))
        sync(device)
        return time.perf_counter() - t0

    def together() -> float:
        t0 = time.perf_counter()
        gens = [torch_rng(cfg.seed, 0, c, "train") for c in clients]
        epochs = [cfg.local_epochs] * len(clients)
        train_together(model, datas, prep.train, gens, [start] * len(clients), epochs)
        sync(device)
        return time.perf_counter() - t0

    alone(), together()  # warm-up
    pairs = [(alone(), together()) for _ in range(args.pairs)]
    ratios = sorted(a / t for a, t in pairs)
    return {
        "clients": clients,
        "samples": samples,
        "seconds": [[round(a, 3), round(t, 3)] for a, t in pairs],
        "one_after_another": round(samples / statistics.median(a for a, _ in pairs), 1),
        "together": round(samples / statistics.median(t for _, t in pairs), 1),
        "ratio_median": round(statistics.median(ratios), 3),
        "ratio_range": [round(ratios[0], 3), round(ratios[-1], 3)],
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    device = resolve_device(args.device)
    load_before = os.getloadavg()[0]
    modes = [*MODES, *(["flower"] if args.flower else [])]
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeat):
            for mode in modes:
                runs[mode].append(rounds_throughput(experiment_config(args, mode, tmp)))
    bare = bare_loop(args, device)
    paired = paired_training(args, device) if args.pairs else None
    rate = {m: statistics.median(r["samples_per_second"] for r in runs[m]) for m in modes}
    ratios = {"together_vs_one_after_another": rate["vmap"] / rate["off"]}
    ratios["one_after_another_vs_bare"] = rate["off"] / bare["samples_per_second"]
    if "flower" in rate:
        ratios["together_vs_flower"] = rate["vmap"] / rate["flower"]
    return {
        "dataset": args.dataset,
        "device": str(device),
        "device_name": device_name(device),
        "machine": machine_facts(),
        "torch_threads": torch.get_num_threads(),
        "epochs": args.epochs,
        "rounds_measured": args.rounds,
        "repeat": args.repeat,
        "runs": runs,
        "samples_per_second": {**{m: round(v, 1) for m, v in rate.items()}, "bare": bare},
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "paired_training": paired,
        # Other processes' load (1-minute average) when the measurement started and ended:
        # above the core count, timings mean little.
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def markdown(result: dict[str, Any], command: str) -> str:
    rate = result["samples_per_second"]
    ratios = result["ratios"]
    lines = [
        f"# Clients trained together: {result['device_name']} ({result['device']})",
        "",
        f"Command: `{command}`",
        "",
        f"FedAvg, fedavg-cnn, {result.get('dataset', 'fmnist')}, 20 clients, Dirichlet 0.1, "
        "8 clients per round, "
        f"E={result['epochs']}, batch {BATCH}, lr {LR}, momentum {MOMENTUM}; round throughput "
        "is training samples per second of the round's training time (evaluation excluded), "
        f"median of {result['rounds_measured']} measured round(s) after a warm-up round, "
        f"{result['repeat']} interleaved repeat(s). torch threads: {result['torch_threads']}; "
        f"machine: {result['machine']['cpu']}, {result['machine']['cores']} cores, "
        f"torch {result['machine']['torch']}. 1-minute load average (all processes) at the "
        f"start and end: {result['load_average'][0]} and {result['load_average'][1]}"
        + (
            f", above the {result['machine']['cores']} cores: other work shared the machine"
            if max(result["load_average"]) > result["machine"]["cores"]
            else ""
        )
        + ".",
        "",
        "| how | samples/s | vs one after another |",
        "|---|---:|---:|",
    ]
    names = {**MODES, "flower": "Flower simulation (flower-sim)"}
    for mode in [m for m in names if m in rate]:
        lines.append(f"| {names[mode]} | {rate[mode]:,.0f} | {rate[mode] / rate['off']:.2f}x |")
    bare = rate["bare"]["samples_per_second"]
    name = "bare loop (one model, plain SGD steps)"
    lines.append(f"| {name} | {bare:,.0f} | {bare / rate['off']:.2f}x |")
    paired = result.get("paired_training")
    if paired:
        low, high = paired["ratio_range"]
        lines += [
            "",
            f"Training alone, in one process: round 1's {len(paired['clients'])} clients "
            f"({paired['samples']:,} samples), one after another then together from the same "
            f"weights, {len(paired['seconds'])} pairs back to back:",
            "",
            "| how | samples/s (median) |",
            "|---|---:|",
            f"| one after another | {paired['one_after_another']:,.0f} |",
            f"| together (vmap) | {paired['together']:,.0f} |",
            "",
            f"Together / one after another, median of the pairs: {paired['ratio_median']:.2f}x "
            f"(pairs from {low:.2f}x to {high:.2f}x).",
        ]
    lines += ["", "Goals (computed from the rows above):", ""]
    together = ratios["together_vs_one_after_another"]
    verdict = "reached" if together >= GOAL_TOGETHER else "not reached"
    lines.append(
        f"- together >= {GOAL_TOGETHER:g}x one after another: {together:.2f}x, {verdict}"
        + ("" if result["device"].startswith("cuda") else " (the goal is about a GPU)")
    )
    if "together_vs_flower" in ratios:
        flower = ratios["together_vs_flower"]
        verdict = "reached" if flower >= GOAL_FLOWER else "not reached"
        goal = f"together >= {GOAL_FLOWER:g}x Flower's simulation"
        lines.append(f"- {goal}: {flower:.2f}x, {verdict}")
    else:
        lines.append("- together against Flower's simulation: not measured in this run (--flower)")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dataset", default="fmnist")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--epochs", type=int, default=5, help="local epochs (issue 12: 5)")
    p.add_argument("--rounds", type=int, default=2, help="measured rounds (after a warm-up)")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--bare-steps", type=int, default=300)
    p.add_argument("--pairs", type=int, default=3, help="paired training timings (0: none)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--flower", action="store_true", help="also Flower's simulation engine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="the .md to write (a .json goes beside it)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = measure(args)
    command = "python benchmarks/clients_together.py " + shlex.join(argv or sys.argv[1:])
    text = markdown(result, command)
    print(text)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        out.with_suffix(".json").write_text(json.dumps({"command": command, **result}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
