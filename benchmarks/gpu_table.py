"""BENCHMARKS.md's GPU table: a round's clients one after another against trained together,
in fp32, TF32 and bf16, for fedavg-cnn and ResNet-18: round throughput and peak GPU memory.

Each cell is one fedskew run (FedAvg, 20 clients, Dirichlet 0.1, 8 clients per round, one
local epoch, batch 64, lr 0.01, momentum 0.9, seed 0, the default deterministic setting) of a
warm-up round and ``--rounds`` measured rounds; samples/s is training samples per second of a
measured round's training time (median), peak memory the largest ``gpu_peak_mib`` (PyTorch's
allocated bytes) and ``gpu_reserved_peak_mib`` of the measured rounds in metrics.jsonl.

fedavg-cnn runs on Fashion-MNIST where a copy is found (as gpu_check.py looks for it), else a
synthetic stand-in of its shape; ResNet-18 (BatchNorm, the CIFAR stem) on a synthetic stand-in
of CIFAR-10's shape (50,000 + 10,000 random 3x32x32 images: the timings hold, the accuracy
means nothing). What a cell really ran is read from the run's log: a configuration that the
together path hands to one after another (bf16 did before its casts were made explicitly
inside vmap) says so in its row, with the reason fedskew logged.

    python benchmarks/gpu_table.py --device cuda --out benchmarks/results/gpu_table.md

The .md and a .json beside it are rewritten after every cell, so a run cut short keeps the
cells it finished.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import clients_together  # noqa: E402
from gpu_check import data_dir_of, synthetic_images, throughput_dataset  # noqa: E402
from machine import machine_facts  # noqa: E402

from fedskew.core.device import device_facts, resolve_device  # noqa: E402
from fedskew.core.machine import git_commit  # noqa: E402
from fedskew.data.sources import register_dataset  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CIFAR_SHAPED = "cifar10-shaped-synthetic"
PRECISIONS = {  # name: (--precision, --tf32)
    "fp32": ("fp32", False),
    "TF32": ("fp32", True),
    "bf16": ("bf16", False),
}
HOWS = {"off": "one after another", "vmap": "together"}


class FallbackLog(logging.Handler):
    """Collects what fedskew logs about a round's clients not trained together."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "one after another" in text or "out of GPU memory" in text:
            self.messages.append(text)


def cell(
    model: str, dataset: str, data_dir: str | None, precision: str, how: str, args: Any, out: str
) -> dict[str, Any]:
    mode, tf32 = PRECISIONS[precision]
    # clients_together's experiment (issue 12's) with one local epoch, this model and mode.
    setting = argparse.Namespace(
        dataset=dataset, data_dir=data_dir, epochs=1, rounds=args.rounds, device=args.device,
        seed=0,
    )  # fmt: skip
    cfg = replace(
        clients_together.experiment_config(setting, how, out),
        model=model,
        precision=mode,
        tf32=tf32,
        name=f"{model}-{precision}-{how}-{time.monotonic_ns()}",
    )
    fallback = FallbackLog()
    logger = logging.getLogger("fedskew")
    logger.addHandler(fallback)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        measured = clients_together.rounds_throughput(cfg)
    finally:
        logger.removeHandler(fallback)
        logger.setLevel(level)
    return {
        "model": model,
        "precision": precision,
        "how": how,
        **measured,
        "deterministic": cfg.deterministic,
        "one_after_another_because": sorted(set(fallback.messages)),
    }


def markdown(data: dict[str, Any]) -> str:
    env = data["environment"]
    lines = [
        f"# GPU table: {env.get('device_name', data['device'])}",
        "",
        f"Written by `{data['command']}` on {data['date']} UTC.",
        "",
        f"- device: {data['device']} ({env.get('device_name', '?')}), "
        f"torch {data['machine'].get('torch', '?')}, CUDA {env.get('cuda', '-')}",
        f"- machine: {data['machine']['cpu']}, {data['machine']['cores']} cores",
        f"- code: commit {data['commit']}",
        "",
        "FedAvg, 20 clients, Dirichlet 0.1, 8 clients per round, E=1, batch 64, lr 0.01, "
        f"momentum 0.9, seed 0; {data['rounds']} measured round(s) after a warm-up round. "
        "samples/s: training samples per second of a round's training time (median); peak: "
        "allocated / reserved GPU MiB (largest over the measured rounds). Together / one after "
        "another is computed from the two cells beside it.",
        "",
    ]
    if not data.get("cache_emptied_between_cells"):
        lines += [
            "The cells ran one after another in one process without emptying PyTorch's "
            "cache between them: a reserved peak also holds memory an earlier cell left "
            "cached; the allocated peak is the cell's own.",
            "",
        ]
    lines += [f"Note: {n}" for n in data.get("notes", [])] + ([""] if data.get("notes") else [])
    for model, described in data["datasets"].items():
        lines += [f"## {model}", "", f"Data: {described}.", ""]
        lines += [
            "| precision | one after another: samples/s | peak MiB | together: samples/s "
            "| peak MiB | together / one after another | note |",
            "|---|---:|---:|---:|---:|---:|---|",
        ]
        for precision in PRECISIONS:
            cells = {
                c["how"]: c
                for c in data["cells"]
                if c["model"] == model and c["precision"] == precision
            }
            if not cells:
                continue

            def rate(c: dict[str, Any] | None) -> str:
                if c is None:
                    return "not run"
                if c.get("error"):
                    return f"failed: {c['error']}"
                v = c["samples_per_second"]
                return "-" if v is None else f"{v:,.0f}"

            def mem(c: dict[str, Any] | None) -> str:
                if c is None or c.get("error") or c.get("gpu_peak_mib") is None:
                    return "-"
                return f"{c['gpu_peak_mib']:,.0f} / {c['gpu_reserved_peak_mib']:,.0f}"

            off, vm = cells.get("off"), cells.get("vmap")
            ratio = "-"
            if off and vm and off.get("samples_per_second") and vm.get("samples_per_second"):
                ratio = f"{vm['samples_per_second'] / off['samples_per_second']:.2f}x"
            note = ""
            if vm and vm.get("one_after_another_because"):
                note = "together ran one after another: " + "; ".join(
                    vm["one_after_another_because"]
                )
            lines.append(
                f"| {precision} | {rate(off)} | {mem(off)} | {rate(vm)} | {mem(vm)} "
                f"| {ratio} | {note} |"
            )
        lines.append("")
    return "\n".join(lines)


def commit() -> str:
    facts = git_commit(ROOT)
    if facts["git_commit"] is None:
        return "unknown (not a git checkout)"
    dirty = " with uncommitted changes" if facts["git_dirty"] else ""
    return f"{str(facts['git_commit'])[:7]}{dirty}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--rounds", type=int, default=2, help="measured rounds after a warm-up")
    p.add_argument("--models", default="fedavg-cnn,resnet18")
    p.add_argument("--data-dir", default=None, help="where Fashion-MNIST is (default: data/)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "gpu_table.md"))
    p.add_argument("--note", action="append", default=[], help="a line the report adds")
    p.add_argument(
        "--from-json", default=None, help="write the .md of this .json again (no measuring)"
    )
    args = p.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        data["notes"] = [*data.get("notes", []), *args.note]
        out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
        out.write_text(markdown(data))
        return 0
    device = resolve_device(args.device)
    data_dir = data_dir_of(args.data_dir)
    register_dataset(
        CIFAR_SHAPED,
        lambda: synthetic_images(
            CIFAR_SHAPED,
            (3, 32, 32),
            "synthetic stand-in made by benchmarks/gpu_table.py",
            n_train=50000,
        ),
    )
    models = [m.strip() for m in args.models.split(",")]
    datasets: dict[str, tuple[str, str]] = {}
    for model in models:
        if model == "resnet18":
            datasets[model] = (
                CIFAR_SHAPED,
                "a synthetic stand-in of CIFAR-10's shape (50,000 + 10,000 random 3x32x32 "
                "images): the timings hold, the accuracy means nothing",
            )
        else:
            datasets[model] = throughput_dataset(data_dir)
    data: dict[str, Any] = {
        "command": "python benchmarks/gpu_table.py " + shlex.join(argv or sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "device": str(device),
        "environment": device_facts(device) if device.type == "cuda" else {"device_name": "cpu"},
        "machine": machine_facts(),
        "commit": commit(),
        "rounds": args.rounds,
        "datasets": {m: d[1] for m, d in datasets.items()},
        "cells": [],
        "cache_emptied_between_cells": True,
        "notes": list(args.note),
    }

    def write() -> None:
        out.write_text(markdown(data))
        out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            dataset = datasets[model][0]
            for precision in PRECISIONS:
                for how in HOWS:
                    if device.type == "cuda":
                        # The reserved peak then starts from this cell's own memory.
                        torch.cuda.empty_cache()
                    t0 = time.perf_counter()
                    try:
                        c = cell(model, dataset, data_dir, precision, how, args, tmp)
                    except Exception as exc:  # a failed cell is a row that says so
                        traceback.print_exc()
                        c = {
                            "model": model,
                            "precision": precision,
                            "how": how,
                            "error": f"{type(exc).__name__}: {str(exc)[:200]}",
                        }
                    c["wall_seconds"] = round(time.perf_counter() - t0, 1)
                    data["cells"].append(c)
                    write()
                    print(
                        f"gpu_table: {model} {precision} {HOWS[how]}: "
                        f"{c.get('samples_per_second', c.get('error'))} samples/s, "
                        f"{c['wall_seconds']} s",
                        flush=True,
                    )
    print(out.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
