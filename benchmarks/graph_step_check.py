"""Issue 47's device check of the local step as a CUDA graph (fedskew.training.graph_step).

For each model (ResNet-18 with the CIFAR stem on 3x32x32, fedavg-cnn on 1x28x28; random
images of those shapes: the timings hold, nothing is learnt) and precision (fp32, bf16):

1. **bit for bit**: one client's 20 steps (batch 64, the 20th a short batch, which runs
   eagerly), momentum 0.9, weight decay 1e-4, under PyTorch's deterministic algorithms:
   eager against eager (is the device deterministic at all?) and the CUDA graph against eager:
   every parameter and buffer compared with ``torch.equal``, the loss sums too.
2. **paths**, samples/s of the training steps and peak allocated memory, each from the same
   initial weights on the same batches: fedskew's step eager, fedskew's step replayed as a
   graph, a bare CUDA-graph loop of the same model, precision and batches (plain PyTorch:
   forward, cross-entropy, backward, ``torch.optim.SGD(foreach=True)`` captured whole),
   fedskew FedAvg rounds (4 clients x 20 steps: one after another with ``--cuda-graphs on``
   and ``off``, capture per client included; clients together by ``vmap`` and ``fused``,
   and ``fused`` with its chunk step replayed as CUDA graphs, each row saying what the run
   recorded it did), and the paths of concurrent_paths.py:
   4 replicas on 4 CUDA streams in one process (graphed steps), and N processes at once
   (2 and 4, and 4 under a private MPS daemon where one starts), each its own graphed step,
   as aggregate samples/s with each process's peak memory. The ratios (a path / bare loop)
   are computed from these numbers when the report is written. The N-process rows run at
   fp32 only by default (``--processes-precisions``): each starts N Python processes.

``PATHS`` maps a path's name to a function ``(Setting) -> dict`` returning at least
``samples_per_second`` (and ``peak_mib`` where measured); ``--paths`` picks which run,
``register_path`` adds one. ``FUTURE_PATHS`` are rows not built in this build, reported as
such, not skipped silently (none now).

    python benchmarks/graph_step_check.py --device cuda --out OUT/graph_step.md
    python benchmarks/graph_step_check.py --dry-run    # the same code, tiny, on the CPU

On the CPU no graph is captured: the "graph" runs are the same graph-safe step eagerly (the
report says so), so the dry run checks the code, not the speed. The .md and .json are
rewritten after every cell, so a run cut short keeps what it finished.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from concurrent_paths import processes_under_mps, run_processes, streams_path  # noqa: E402
from machine import machine_facts  # noqa: E402
from step_setting import (  # noqa: E402
    LR,
    MOMENTUM,
    WEIGHT_DECAY,
    Setting,
    client_data,
    fresh_model,
    peak_memory,
    sync,
    train_config,
)

from fedskew.config import ExperimentConfig  # noqa: E402
from fedskew.core.device import device_facts, resolve_device  # noqa: E402
from fedskew.core.gpu_memory import PEAK_KEYS  # noqa: E402
from fedskew.core.machine import git_commit  # noqa: E402
from fedskew.core.precision import autocast  # noqa: E402
from fedskew.data.datasets import Dataset  # noqa: E402
from fedskew.data.sources import register_dataset  # noqa: E402
from fedskew.runs.loop import run  # noqa: E402
from fedskew.training.graph_step import LocalStep, resolve_graphs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


FULL = {
    "resnet18": ((3, 32, 32), {}),
    "fedavg-cnn": ((1, 28, 28), {}),
}
# The dry run: the same code on the CPU at a size that takes seconds on two shared cores.
DRY = {
    "resnet18": ((3, 8, 8), {"width": 8}),
    "fedavg-cnn": ((1, 28, 28), {}),
}


# ---------------------------------------------------------------------------- building blocks


@contextmanager
def deterministic() -> Iterator[None]:
    """PyTorch's deterministic algorithms, cuDNN's benchmark off, for the block."""
    was = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was[0])
        torch.backends.cudnn.benchmark = was[1]


# ---------------------------------------------------------------------------- 1. bit for bit


def client_run(s: Setting, graphs: bool) -> tuple[dict[str, torch.Tensor], float, LocalStep]:
    """One client's ``s.steps`` steps (the last a short batch) from the fixed weights."""
    model = fresh_model(s)
    data = client_data(s, s.batch * (s.steps - 1) + s.batch // 2)
    step = LocalStep(model, data, train_config(s), graphs=graphs)
    result = step.train(torch.Generator().manual_seed(2))
    assert result.steps == s.steps, result
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return state, result.mean_loss, step


def difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(
        float((a[k].double() - b[k].double()).abs().max()) if a[k].numel() else 0.0 for k in a
    )


def bit_for_bit(s: Setting) -> dict[str, Any]:
    graphs, reason = resolve_graphs("on", s.device, fresh_model(s))
    with deterministic():
        first, loss1, _ = client_run(s, graphs=False)
        second, loss2, _ = client_run(s, graphs=False)
        graphed, loss3, step = client_run(s, graphs=graphs)
    return {
        "steps": s.steps,
        "graph_captured": bool(step._graph),
        "graph_reason": step.graph_reason or reason,
        "eager_equals_eager": all(torch.equal(first[k], second[k]) for k in first)
        and loss1 == loss2,
        "graph_equals_eager": all(torch.equal(first[k], graphed[k]) for k in first)
        and loss1 == loss3,
        "graph_max_difference": difference(first, graphed),
        "mean_loss": loss1,
    }


# ---------------------------------------------------------------------------- 2. paths


def timed_local_step(s: Setting, graphs: bool) -> dict[str, Any]:
    """fedskew's step over ``timed_steps`` full batches, timed on its second call (the first
    warms up and, with graphs, captures; the graph is kept for the second)."""
    out: dict[str, Any] = {}
    with peak_memory(s.device, out):
        model = fresh_model(s)
        data = client_data(s, s.batch * s.timed_steps)
        step = LocalStep(model, data, train_config(s), graphs=graphs)
        gen = torch.Generator().manual_seed(3)
        step.train(gen)
        sync(s.device)
        t0 = time.perf_counter()
        step.train(gen)
        sync(s.device)
        seconds = time.perf_counter() - t0
    out.update(
        samples_per_second=round(len(data) / seconds, 1),
        ms_per_step=round(1000 * seconds / s.timed_steps, 3),
        graph=bool(step._graph),
    )
    return out


def fedskew_eager(s: Setting) -> dict[str, Any]:
    return timed_local_step(s, graphs=False)


def fedskew_graph(s: Setting) -> dict[str, Any]:
    graphs, reason = resolve_graphs("on", s.device, fresh_model(s))
    out = timed_local_step(s, graphs=graphs)
    if reason:
        out["note"] = f"eager: {reason}"
    return out


def bare_loop(s: Setting) -> dict[str, Any]:
    """Plain PyTorch on the same weights, batches and precision: the batch gathered from
    device tensors by a static index, forward, cross-entropy, backward and foreach SGD,
    captured whole as one CUDA graph after three warm-up steps on a side stream (the
    pattern of PyTorch's CUDA-graphs documentation); eager on the CPU."""
    out: dict[str, Any] = {}
    with peak_memory(s.device, out):
        model = fresh_model(s)
        model.train()
        data = client_data(s, s.batch * s.timed_steps)
        opt = torch.optim.SGD(
            model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY,
            foreach=True,
        )  # fmt: skip
        perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(3))
        perm = perm.to(s.device)
        idx = torch.empty(s.batch, dtype=torch.int64, device=s.device)

        def step() -> None:
            x, y = data.x.index_select(0, idx), data.y.index_select(0, idx)
            with autocast(s.precision, s.device.type):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()

        def load(i: int) -> None:
            j = i % s.timed_steps
            idx.copy_(perm[j * s.batch : (j + 1) * s.batch])

        graph = None
        if s.device.type == "cuda":
            side = torch.cuda.Stream(device=s.device)
            side.wait_stream(torch.cuda.current_stream(s.device))
            with torch.cuda.stream(side):
                for i in range(3):
                    load(i)
                    opt.zero_grad(set_to_none=True)
                    step()
            torch.cuda.current_stream(s.device).wait_stream(side)
            opt.zero_grad(set_to_none=True)  # the captured backward allocates them anew
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()

        def one(i: int) -> None:
            load(i)
            if graph is not None:
                graph.replay()
            else:
                opt.zero_grad(set_to_none=True)
                step()

        for i in range(s.timed_steps):  # warm, as fedskew's paths get a first call
            one(i)
        sync(s.device)
        t0 = time.perf_counter()
        for i in range(s.timed_steps):
            one(i)
        sync(s.device)
        seconds = time.perf_counter() - t0
    out.update(
        samples_per_second=round(s.batch * s.timed_steps / seconds, 1),
        ms_per_step=round(1000 * seconds / s.timed_steps, 3),
        graph=graph is not None,
    )
    return out


def fedskew_round(s: Setting, graphs: str, together: str = "off") -> dict[str, Any]:
    """A fedskew FedAvg run, ``--cuda-graphs graphs --clients-together together``: training
    samples per second of each measured round (median), peak memory from metrics.jsonl."""
    name = f"graph-step-check-{s.model}-{'x'.join(map(str, s.shape))}"
    n = s.clients * s.client_steps * s.batch

    def synthetic() -> Dataset:
        gen = torch.Generator().manual_seed(0)
        return Dataset(
            name=name, x_train=torch.randn(n, *s.shape, generator=gen),
            y_train=torch.randint(0, 10, (n,), generator=gen),
            x_test=torch.randn(4 * s.batch, *s.shape, generator=gen),
            y_test=torch.randint(0, 10, (4 * s.batch,), generator=gen),
            num_classes=10, input_shape=s.shape, class_names=[str(i) for i in range(10)],
            source="random images made by benchmarks/graph_step_check.py",
        )  # fmt: skip

    register_dataset(name, synthetic)
    with tempfile.TemporaryDirectory() as out_dir:
        cfg = ExperimentConfig(
            algorithm="fedavg", dataset=name, model=s.model, model_options=dict(s.options),
            num_clients=s.clients, partition="iid", clients_per_round=s.clients,
            local_epochs=1, batch_size=s.batch, lr=LR, momentum=MOMENTUM,
            weight_decay=WEIGHT_DECAY, precision=s.precision, rounds=s.rounds + 1,
            eval_every=s.rounds + 1, checkpoint_every=0, workers=0, device=str(s.device),
            clients_together=together, cuda_graphs=graphs, seed=0, out_dir=out_dir,
            name=f"{graphs}-{time.monotonic_ns()}", quiet=True,
        )  # fmt: skip
        folder, _ = run(cfg)
        records = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
        process = json.loads((folder / "processes.jsonl").read_text().splitlines()[0])
    measured = records[1:]
    rates = [r["samples"] / r["seconds"] for r in measured if r["seconds"] > 0]
    peaks = {k: max((r[k] for r in measured if r.get(k) is not None), default=None)
             for k in PEAK_KEYS}  # fmt: skip
    return {
        "samples_per_second": round(statistics.median(rates), 1) if rates else None,
        "round_seconds": [round(r["seconds"], 4) for r in measured],
        "peak_mib": peaks.get("gpu_peak_mib"),
        "cuda_graphs": process.get("cuda_graphs"),
        "clients_together": process.get("clients_together"),
        # What the run says it did: a fused request that trained by vmap (or one after
        # another) would otherwise pass for the fused path.
        "note": "; ".join(
            x for x in (f"clients_together {process.get('clients_together')}",
                        process.get("cuda_graphs_reason", "")) if x
        ),  # fmt: skip
    }


PathFn = Callable[[Setting], dict[str, Any]]
FUSED = "fedskew round, clients together (fused)"
FUSED_GRAPH = "fedskew round, fused + CUDA graph"
STREAMS = "CUDA streams, one replica per client"
# The paths measured side by side, in report order (a Setting in, samples_per_second /
# peak_mib / note out). The N-process rows are added per run (process_paths: how many
# processes is an option).
PATHS: dict[str, PathFn] = {
    "fedskew step, eager": fedskew_eager,
    "fedskew step, CUDA graph": fedskew_graph,
    "bare CUDA-graph loop": bare_loop,
    "fedskew round, --cuda-graphs off": lambda s: fedskew_round(s, "off"),
    "fedskew round, --cuda-graphs on": lambda s: fedskew_round(s, "on"),
    "fedskew round, clients together (vmap)": lambda s: fedskew_round(s, "off", "vmap"),
    FUSED: lambda s: fedskew_round(s, "off", "fused"),
    FUSED_GRAPH: lambda s: fedskew_round(s, "on", "fused"),
    STREAMS: streams_path,
}
# Issue 47's paths not in this build, reported as rows that say so (register_path adds one).
FUTURE_PATHS: dict[str, str] = {}
BARE = "bare CUDA-graph loop"
MPS_ROW = ", MPS)"  # how an N-process row under MPS ends


def process_paths(counts: list[int], mps: bool = True) -> dict[str, PathFn]:
    """The rows of N processes at once, one per count, and with MPS for the largest."""
    paths: dict[str, PathFn] = {
        f"N processes ({n})": (lambda s, n=n: run_processes(s, n)) for n in counts
    }
    if mps and counts:
        n = max(counts)
        paths[f"N processes ({n}{MPS_ROW}"] = lambda s, n=n: processes_under_mps(s, n)
    return paths


def register_path(name: str, fn: PathFn) -> None:
    """Add a path to the side-by-side table (the fused model's, from its own module)."""
    PATHS[name] = fn


# ---------------------------------------------------------------------------- report


def ratios(cells: list[dict[str, Any]]) -> None:
    """Each path's samples/s over the bare loop's of its setting, computed in place."""
    for c in cells:
        if c.get("kind") != "path":
            continue
        bare = next(
            (
                b for b in cells
                if b.get("kind") == "path" and b["path"] == BARE
                and b["model"] == c["model"] and b["precision"] == c["precision"]
            ),
            None,
        )  # fmt: skip
        rate, base = c.get("samples_per_second"), bare and bare.get("samples_per_second")
        c["over_bare_loop"] = round(rate / base, 3) if rate and base else None


def markdown(data: dict[str, Any]) -> str:
    env = data["environment"]
    name = env.get("device_name") or data["device"]
    lines = [
        f"# The local step as a CUDA graph: {name}",
        "",
        f"Written by `{data['command']}` on {data['date']} UTC; code {data['commit']}; "
        f"torch {data['machine'].get('torch', '?')}, CUDA {env.get('cuda', '-')}; "
        f"{data['machine'].get('cpu', '?')}.",
        "",
        f"Random images, 10 classes; batch {data['batch']}, lr {LR}, momentum {MOMENTUM}, "
        f"weight decay {WEIGHT_DECAY}; seeds fixed (weights 0, data 1, batches 2/3).",
        "",
    ]
    if data.get("dry_run"):
        lines += [
            "**Dry run on the CPU**: tiny sizes, no graph is captured (the graph runs are the "
            "same graph-safe step eagerly); the numbers check the script, not the speed.",
            "",
        ]
    lines += [f"Note: {n}" for n in data.get("notes", [])]
    lines += [
        "## Graph against eager, bit for bit",
        "",
        "| model | precision | steps | graph captured | eager = eager | graph = eager "
        "| max difference | note |",
        "|---|---|---:|---|---|---|---:|---|",
    ]
    for c in data["cells"]:
        if c.get("kind") != "bits":
            continue
        if c.get("error"):
            lines.append(f"| {c['model']} | {c['precision']} | - | - | - | - | - | "
                         f"failed: {c['error']} |")  # fmt: skip
            continue
        lines.append(
            f"| {c['model']} | {c['precision']} | {c['steps']} | {c['graph_captured']} "
            f"| {c['eager_equals_eager']} | {c['graph_equals_eager']} "
            f"| {c['graph_max_difference']:.3g} | {c['graph_reason']} |"
        )
    lines += [
        "",
        "## Paths side by side",
        "",
        "samples/s of training steps (a fedskew round: its training time, median of the "
        "measured rounds); peak: allocated MiB; / bare loop: samples/s over the bare "
        "CUDA-graph loop's of the same model and precision, computed from the two cells. "
        "Streams and N processes: samples/s of all replicas or processes together over the "
        "wall time (first start to last end), ms/step that time per step of any of them, "
        "peak the largest process's (each one's in the note).",
        "",
        "| model | precision | path | samples/s | ms/step | peak MiB | / bare loop | note |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for c in data["cells"]:
        if c.get("kind") != "path":
            continue
        if c.get("error"):
            lines.append(f"| {c['model']} | {c['precision']} | {c['path']} | - | - | - | - "
                         f"| failed: {c['error']} |")  # fmt: skip
            continue

        def num(v: Any, fmt: str = ",.0f") -> str:
            return "-" if v is None else format(v, fmt)

        lines.append(
            f"| {c['model']} | {c['precision']} | {c['path']} "
            f"| {num(c.get('samples_per_second'))} | {num(c.get('ms_per_step'), '.2f')} "
            f"| {num(c.get('peak_mib'))} | {num(c.get('over_bare_loop'), '.2f')} "
            f"| {c.get('note', '')} |"
        )
    lines.append("")
    return "\n".join(lines)


def commit() -> str:
    facts = git_commit(ROOT)
    if facts["git_commit"] is None:
        return "unknown (not a git checkout)"
    return str(facts["git_commit"])[:7] + (
        " with uncommitted changes" if facts["git_dirty"] else ""
    )


def settings(args: argparse.Namespace, device: torch.device) -> list[Setting]:
    shapes = DRY if args.dry_run else FULL
    out = []
    for model in args.models:
        if model not in shapes:
            raise SystemExit(f"graph_step_check: unknown model {model!r} ({', '.join(shapes)})")
        shape, options = shapes[model]
        for precision in args.precisions:
            out.append(
                Setting(
                    model,
                    shape,
                    options,
                    precision,
                    device,
                    batch=4 if args.dry_run else 64,
                    steps=3 if args.dry_run else 20,
                    timed_steps=3 if args.dry_run else 40,
                    clients=2 if args.dry_run else 4,
                    client_steps=2 if args.dry_run else 20,
                    rounds=1 if args.dry_run else 2,
                )  # fmt: skip
            )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU")
    p.add_argument("--models", nargs="+", default=list(FULL))
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    p.add_argument("--paths", nargs="+", default=None, help="default: every registered one")
    p.add_argument("--budget", type=float, default=240.0, help="seconds; later cells skipped")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "graph_step.md"))
    p.add_argument("--note", action="append", default=[])
    p.add_argument("--processes", nargs="*", type=int, default=[2, 4],
                   help="the N of the N-process rows (none: no such rows)")
    p.add_argument("--processes-precisions", nargs="+", default=["fp32"],
                   help="precisions the N-process rows run at (each starts N processes)")
    p.add_argument("--no-mps", action="store_true", help="no N-process row under MPS")
    args = p.parse_args(argv)
    if any(n < 1 for n in args.processes):
        p.error("--processes: each count must be 1 or more")
    if args.dry_run:
        args.device = "cpu"
    device = resolve_device(args.device)
    started = time.monotonic()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    by_process = process_paths(args.processes, not args.no_mps)
    paths = {**PATHS, **by_process}
    wanted = list(paths) + list(FUTURE_PATHS) if args.paths is None else args.paths
    data: dict[str, Any] = {
        "command": "python benchmarks/graph_step_check.py " + " ".join(argv or sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "commit": commit(),
        "device": str(device),
        "environment": device_facts(device),
        "machine": machine_facts(),
        "dry_run": args.dry_run,
        "batch": 4 if args.dry_run else 64,
        "notes": list(args.note),
        "cells": [],
    }

    def save() -> None:
        ratios(data["cells"])
        out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
        out.write_text(markdown(data))

    failed = False
    # Every setting's in-process cells first, then every setting's N-process cells: those
    # start Python processes (seconds each) and are what the budget drops first, rather
    # than the last setting's bit check and paths (the worst case: gpu_session.sh's notes).
    planned: list[tuple[int, Setting, dict[str, Any], Callable[[], dict[str, Any]]]] = []
    for s in settings(args, device):
        planned.append((0, s, {"kind": "bits"}, lambda s=s: bit_for_bit(s)))
        for path in wanted:
            fn = paths.get(path)
            label = ""
            if fn is None:
                label = FUTURE_PATHS.get(path, "")
                if not label:
                    label = "unknown path"
                    failed = True
            elif path in by_process and s.precision not in args.processes_precisions:
                at = " ".join(args.processes_precisions)
                label = f"not measured at {s.precision}: --processes-precisions {at}"
            if label:
                data["cells"].append({"kind": "path", "path": path, "model": s.model,
                                      "precision": s.precision, "note": label})  # fmt: skip
                continue
            # MPS rows last of all: a server that does not answer costs its deadline.
            later = 2 if path.endswith(MPS_ROW) else int(path in by_process)
            planned.append((later, s, {"kind": "path", "path": path}, lambda fn=fn, s=s: fn(s)))
    planned.sort(key=lambda p: p[0])  # stable: in each pass, settings and paths in order
    for _, s, head, job in planned:
        cell = {**head, "model": s.model, "precision": s.precision}
        if time.monotonic() - started > args.budget:
            cell["error"] = f"skipped: the {args.budget:.0f} s budget was spent"
        else:
            try:
                cell.update(job())
            except Exception as exc:  # noqa: BLE001 - a failed cell is a row, the rest runs
                traceback.print_exc()
                cell["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
                failed = True
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        data["cells"].append(cell)
        print(f"graph_step_check: {json.dumps(cell)}", flush=True)
        save()
    # Order the rows: per setting, the bit check, then the paths as registered.
    order = {name: i for i, name in enumerate(wanted)}
    data["cells"].sort(key=lambda c: (c["model"], c["precision"], c["kind"] != "bits",
                                      order.get(c.get("path", ""), -1)))  # fmt: skip
    save()
    bits = [c for c in data["cells"] if c["kind"] == "bits" and not c.get("error")]
    if device.type == "cuda" and any(c["graph_captured"] and not c["graph_equals_eager"]
                                     and c["eager_equals_eager"] for c in bits):  # fmt: skip
        failed = True
    print(f"graph_step_check: {out} ({time.monotonic() - started:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
