"""The Python half of benchmarks/gpu_check.sh: CPU/CUDA equivalence per algorithm and the
throughput table, written to benchmarks/results/gpu_check.md with the device's name.

1. Equivalence: every registered algorithm, fp32, 3 rounds (digits, 6 clients, 3 per round,
   one local epoch, the golden cases' parameters), once on the CPU and once on the device,
   clients one after another on both. Per round: |accuracy difference| <= ACC_TOL and
   |loss difference| <= LOSS_TOL x the CPU loss. TF32 is off (fp32 means fp32).
2. Throughput: benchmarks/clients_together.py's table (one after another, together, bare
   loop, and Flower's simulation with --flower) on issue 12's experiment.

``--device cpu`` is the dry run for a machine without a GPU: the same code compares the CPU
with itself and measures a small throughput table (one local epoch, one measured round),
written to benchmarks/out/ (not a result).

    python benchmarks/gpu_check.py --device cuda --flower [--tests-log LOG --tests-rc RC]
    python benchmarks/gpu_check.py --device cpu            # dry run
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import clients_together  # noqa: E402

from fedskew.algorithms import ALGORITHMS  # noqa: E402
from fedskew.config import ExperimentConfig  # noqa: E402
from fedskew.device import device_facts, resolve_device  # noqa: E402
from fedskew.experiment import run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ACC_TOL = 0.02  # absolute, per evaluated round (7 of digits' 360 test images)
LOSS_TOL = 0.02  # relative to the CPU run's test loss
# The golden cases' parameters: the methods' own rounds, at a size that runs in seconds.
PARAMS: dict[str, dict[str, Any]] = {
    "fedfm": {"lam": 5, "start_round": 1},
    "fedfm-lite": {"lam": 5, "start_round": 1, "a": 2},
    "creff": {"match_epochs": 3, "crt_epochs": 5},
}


def curve(algorithm: str, device: str, out_dir: str) -> list[dict[str, Any]]:
    cfg = ExperimentConfig(
        algorithm=algorithm,
        params=PARAMS.get(algorithm, {}),
        rounds=3,
        num_clients=6,
        clients_per_round=3,
        local_epochs=1,
        workers=0,
        device=device,
        clients_together="off",
        tf32=False,
        out_dir=out_dir,
        name=f"{algorithm}-{device}-{time.monotonic_ns()}",
        quiet=True,
    )
    folder, _ = run(cfg)
    return [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]


def equivalence(device: str) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for algorithm in ALGORITHMS:
            t0 = time.perf_counter()
            try:
                cpu = curve(algorithm, "cpu", tmp)
                dev = curve(algorithm, device, tmp)
            except Exception as exc:  # a failure is a row of the report, not the end of it
                rows.append({"algorithm": algorithm, "error": f"{type(exc).__name__}: {exc}"})
                continue
            acc = max(abs(a["accuracy"] - b["accuracy"]) for a, b in zip(cpu, dev, strict=True))
            loss = max(
                abs(a["loss"] - b["loss"]) / max(abs(a["loss"]), 1e-12)
                for a, b in zip(cpu, dev, strict=True)
            )
            rows.append(
                {
                    "algorithm": algorithm,
                    "accuracy_cpu": [round(r["accuracy"], 4) for r in cpu],
                    "accuracy_device": [round(r["accuracy"], 4) for r in dev],
                    "max_accuracy_gap": round(acc, 5),
                    "max_relative_loss_gap": round(loss, 6),
                    "within_tolerance": acc <= ACC_TOL and loss <= LOSS_TOL,
                    "seconds": round(time.perf_counter() - t0, 1),
                }
            )
            print(f"equivalence {algorithm}: {rows[-1]}", flush=True)
    return rows


def tests_summary(log: str | None, rc: int | None) -> str:
    if log is None:
        return "not run (benchmarks/gpu_check.sh runs them and passes their log)"
    lines = [x for x in Path(log).read_text(errors="replace").splitlines() if x.strip()]
    last = lines[-1] if lines else "(empty log)"
    return f"exit code {rc}: {last.strip('= ')}"


def markdown(report: dict[str, Any]) -> str:
    facts = report["device"]
    rows = report["equivalence"]
    ok = [r for r in rows if r.get("within_tolerance")]
    lines = [
        f"# GPU check: {facts['device_name']}",
        "",
        f"Written by `{report['command']}` (from benchmarks/gpu_check.sh) on "
        f"{report['date']}; device {facts['device']}"
        + (f", {facts['device_memory_gib']} GiB, CUDA {facts['cuda']}" if "cuda" in facts else "")
        + f"; torch {torch.__version__}.",
        "",
    ]
    if report["dry_run"]:
        lines += [
            "**Dry run on the CPU**: the CPU compared with itself and a small throughput "
            "table; it checks this script, not a GPU.",
            "",
        ]
    lines += [
        "## CUDA tests",
        "",
        f"tests/test_device.py and tests/test_together.py, the cases on cuda: {report['tests']}",
        "",
        "## CPU and device curves, per algorithm",
        "",
        f"fp32, 3 rounds, digits, 6 clients (3 per round), one local epoch, TF32 off. "
        f"Tolerance per round: |accuracy gap| <= {ACC_TOL}, |loss gap| <= {LOSS_TOL:.0%} "
        f"of the CPU's. Within it: {len(ok)} of {len(rows)}.",
        "",
        "| algorithm | accuracy (CPU) | accuracy (device) | max accuracy gap | max loss gap | ok |",
        "|---|---|---|---:|---:|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['algorithm']} | | | | | failed: {r['error'][:120]} |")
            continue
        lines.append(
            f"| {r['algorithm']} | {r['accuracy_cpu']} | {r['accuracy_device']} | "
            f"{r['max_accuracy_gap']:.4f} | {r['max_relative_loss_gap']:.2%} | "
            f"{'yes' if r['within_tolerance'] else 'NO'} |"
        )
    lines += ["", "## Throughput", ""]
    if report["throughput"] is None:
        lines.append("not measured (--skip-throughput)")
    else:
        text = clients_together.markdown(report["throughput"], report["throughput_command"])
        lines += text.split("\n", 2)[2].splitlines()  # without its title
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu for the dry run")
    p.add_argument("--tests-log", default=None)
    p.add_argument("--tests-rc", type=int, default=None)
    p.add_argument("--flower", action="store_true", help="Flower's simulation in the table")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--data-dir", default=None, help="where Fashion-MNIST is (see the loader)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = resolve_device(args.device)
    dry_run = device.type == "cpu"
    out = (
        Path(args.out)
        if args.out
        else ROOT
        / ("benchmarks/out/gpu_check_dryrun.md" if dry_run else "benchmarks/results/gpu_check.md")
    )
    report: dict[str, Any] = {
        "command": "python benchmarks/gpu_check.py " + shlex.join(argv or sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "device": device_facts(device),
        "dry_run": dry_run,
        "tests": tests_summary(args.tests_log, args.tests_rc),
        "equivalence": equivalence(args.device),
        "throughput": None,
    }
    if not args.skip_throughput:
        tp = ["--device", args.device, "--flower"] if args.flower else ["--device", args.device]
        if dry_run:
            tp += ["--epochs", "1", "--rounds", "1", "--bare-steps", "20"]
        if args.data_dir:
            tp += ["--data-dir", args.data_dir]
        tp_args = clients_together.parser().parse_args(tp)
        report["throughput"] = clients_together.measure(tp_args)
        report["throughput_command"] = "python benchmarks/clients_together.py " + shlex.join(tp)
    text = markdown(report)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str))
    print(text)
    failed = [r for r in report["equivalence"] if not r.get("within_tolerance")]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
