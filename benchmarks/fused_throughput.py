"""Samples/s and peak memory of a round's clients trained fused, by vmap, and one after
another (issue 47), for ResNet-18 and fedavg-cnn.

Each (model, path) runs in a fresh process (``--one``), so that its peak memory is its own:
on CUDA ``torch.cuda.max_memory_allocated`` over the timed call; on the CPU the growth of the
process's peak resident set (``ru_maxrss``) from just before training, which counts torch's
allocations and the allocator's reuse together (coarser than CUDA's number). A path trains
K clients of random data of the model's input shape for one epoch (one untimed call first:
cuDNN's and oneDNN's choices, allocator warm-up), then ``--repeats`` timed calls; samples/s is
the clients' samples over the fastest call. The paths:

* ``off``: ``local_train`` of each client after another (torch's SGD, as a run does);
* ``vmap``: ``train_together`` (stacked weights, ``torch.func.vmap``, BatchNorm by formula);
* ``fused``: ``train_together(fused=True)`` (engines/fused.py: grouped convolutions, native
  BatchNorm over K x C channels).

Ratios are within one invocation on one machine (loads change between invocations):

    python benchmarks/fused_throughput.py --device cpu --tiny      # a few minutes on 2 cores
    python benchmarks/fused_throughput.py --device cuda            # full size, for the GPU

writes ``results/fused_throughput[_tiny]_<device>.{json,md}``. The GPU session script can
call it with ``--device cuda --out DIR``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import load1, machine_facts  # noqa: E402

from fedskew.data.federated import ClientData  # noqa: E402
from fedskew.engines.together import train_together  # noqa: E402
from fedskew.models import build_model  # noqa: E402
from fedskew.training.interface import LocalTrainConfig  # noqa: E402
from fedskew.training.local import local_train  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PATHS = ("off", "vmap", "fused")
# model -> (options, input shape); the tiny mode's in TINY.
FULL = {"resnet18": ({}, (3, 32, 32)), "fedavg-cnn": ({}, (1, 28, 28))}
TINY = {"resnet18": ({"width": 8}, (3, 16, 16)), "fedavg-cnn": ({}, (1, 28, 28))}


def settings(args: argparse.Namespace) -> dict[str, Any]:
    models = TINY if args.tiny else FULL
    return {
        "models": {m: {"options": models[m][0], "shape": list(models[m][1])} for m in args.models},
        "clients": args.clients,
        "samples_per_client": args.samples,
        "batch_size": args.batch,
        "repeats": args.repeats,
        "device": args.device,
        "precision": "fp32",
    }


def run_one(model_name: str, path: str, config: dict[str, Any]) -> dict[str, Any]:
    """One path's timing and peak memory, in this process."""
    device = torch.device(config["device"])
    spec = config["models"][model_name]
    shape, k, n = tuple(spec["shape"]), config["clients"], config["samples_per_client"]
    torch.manual_seed(0)
    model = build_model(model_name, shape, 10, **spec["options"]).to(device)
    x = torch.randn(k * n, *shape, device=device)
    y = torch.randint(0, 10, (k * n,), device=device)
    rows = [torch.arange(i * n, (i + 1) * n, device=device) for i in range(k)]
    datas = [ClientData(x, y, r, 10) for r in rows]
    cfg = LocalTrainConfig(
        epochs=1, batch_size=config["batch_size"], lr=0.01, momentum=0.9, weight_decay=1e-4
    )
    start = {name: v.detach().clone() for name, v in model.state_dict().items()}

    def train() -> None:
        gens = [torch.Generator().manual_seed(i) for i in range(k)]
        if path == "off":
            for i in range(k):
                model.load_state_dict(start)
                local_train(model, datas[i], cfg, gens[i])
        else:
            train_together(model, datas, cfg, gens, [start] * k, [1] * k, fused=path == "fused")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    train()  # warm-up: kernel choices, allocator
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(config["repeats"]):
        began = time.perf_counter()
        train()
        sync()
        times.append(time.perf_counter() - began)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        peak_kind = "cuda max_memory_allocated"
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
        peak_kind = "growth of peak RSS"
    return {
        "model": model_name,
        "path": path,
        "seconds": times,
        "samples_per_s": k * n / min(times),
        "peak_bytes": peak,
        "peak_kind": peak_kind,
        "torch_threads": torch.get_num_threads(),
    }


def markdown(result: dict[str, Any]) -> str:
    cfg = result["settings"]
    lines = [
        "# Clients trained fused, by vmap, one after another (issue 47)",
        "",
        f"`benchmarks/fused_throughput.py {' '.join(result['argv'])}`: {cfg['clients']} clients "
        f"x {cfg['samples_per_client']} random samples, batch {cfg['batch_size']}, one epoch, "
        f"SGD with momentum and weight decay, fp32, on {result['device_name']} "
        f"({result['machine'].get('cpu', '?')}, {result['machine'].get('cores', '?')} cores, "
        f"torch {torch.__version__} with {result['rows'][0]['torch_threads']} threads, "
        f"load {result['load_before']} before and "
        f"{result['load_after']} after); each path in a fresh process, the fastest of "
        f"{cfg['repeats']} timed calls after one warm-up. Peak memory: "
        f"{result['rows'][0]['peak_kind'] if result['rows'] else ''}.",
        "",
        "| model | path | samples/s | peak MiB | samples/s vs off | vs vmap |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for model_name, spec in cfg["models"].items():
        rows = {r["path"]: r for r in result["rows"] if r["model"] == model_name}
        for path in PATHS:
            r = rows[path]
            lines.append(
                f"| {model_name} {spec['options'] or ''} {tuple(spec['shape'])} | {path} | "
                f"{r['samples_per_s']:.0f} | {r['peak_bytes'] / 2**20:.0f} | "
                f"{r['samples_per_s'] / rows['off']['samples_per_s']:.2f}x | "
                f"{r['samples_per_s'] / rows['vmap']['samples_per_s']:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--tiny", action="store_true", help="ResNet-18 at width 8, 16x16")
    parser.add_argument("--models", nargs="+", default=list(FULL), choices=list(FULL))
    parser.add_argument("--clients", type=int, default=None, help="default 8 (tiny: 4)")
    parser.add_argument("--samples", type=int, default=None, help="per client; 640 (tiny 64)")
    parser.add_argument("--batch", type=int, default=None, help="default 64 (tiny 16)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--one", nargs=3, metavar=("MODEL", "PATH", "SETTINGS_JSON"))
    args = parser.parse_args(argv)
    if args.one:
        model_name, path, config = args.one
        print(json.dumps(run_one(model_name, path, json.loads(config))))
        return 0
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("fused_throughput: no CUDA device here; use --device cpu", file=sys.stderr)
        return 2
    args.clients = args.clients or (4 if args.tiny else 8)
    args.samples = args.samples or (64 if args.tiny else 640)
    args.batch = args.batch or (16 if args.tiny else 64)
    config = settings(args)
    load_before = load1()
    rows = []
    for model_name in args.models:
        for path in PATHS:
            out = subprocess.run(
                [sys.executable, __file__, "--one", model_name, path, json.dumps(config)],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            row = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{model_name} {path}: {row['samples_per_s']:.0f} samples/s", flush=True)
            rows.append(row)
    device_name = (
        torch.cuda.get_device_name(torch.device(args.device))
        if args.device.startswith("cuda")
        else "the CPU"
    )
    result = {
        "argv": sys.argv[1:] if argv is None else argv,
        "settings": config,
        "machine": machine_facts(),
        "device_name": device_name,
        "load_before": load_before,
        "load_after": load1(),
        "rows": rows,
    }
    stem = f"fused_throughput{'_tiny' if args.tiny else ''}_{args.device.split(':')[0]}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
