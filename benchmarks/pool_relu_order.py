"""Pooling before ReLU in the small CNNs: same numbers, less time (issue 35).

fedskew's two-convolution CNNs (simple-cnn, fedavg-cnn, cnn-cifar) run each block as
conv - max-pool 2x2 - ReLU. The textbook order is conv - ReLU - max-pool; the two commute
exactly, and pooling first leaves the ReLU and its backward a quarter of the elements. This
script trains both orders of the same model from the same weights on the same real batches
(Fashion-MNIST or CIFAR-10 images, SGD with momentum, fp32 and optionally bf16 autocast,
channels_last as fedskew's default), interleaving the orders in every repeat, and reports:

- whether the losses and the trained weights of the two orders are bit-identical;
- milliseconds per training step of each order, and the ratio pool-first / ReLU-first,
  per repeat and over all repeats (one process, so the ratio does not depend on the
  machine's speed).

    python benchmarks/pool_relu_order.py [--threads 1] [--steps 60] [--repeats 9]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import OrderedDict
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import load1, machine_facts  # noqa: E402

from fedskew.core.denormals import denormals_applied  # noqa: E402
from fedskew.data.sources import load_dataset  # noqa: E402
from fedskew.models import build_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = {"fedavg-cnn": "fmnist", "simple-cnn": "cifar10", "cnn-cifar": "cifar10"}


def relu_first(model: nn.Module) -> nn.Module:
    """The same modules (shared, so the same weights) in conv - ReLU - pool order."""
    names = list(model.body._modules)
    order: OrderedDict[str, nn.Module] = OrderedDict()
    i = 0
    while i < len(names):
        name = names[i]
        if name.startswith("pool") and i + 1 < len(names) and names[i + 1].startswith("relu"):
            order[names[i + 1]] = model.body._modules[names[i + 1]]
            order[name] = model.body._modules[name]
            i += 2
        else:
            order[name] = model.body._modules[name]
            i += 1
    if list(order) == names:
        raise SystemExit("the model has no pool-then-ReLU pair: nothing to compare")
    model.body = nn.Sequential(order)
    return model


def make(model_name: str, shape: tuple[int, ...], classes: int, order: str) -> nn.Module:
    torch.manual_seed(0)
    model = build_model(model_name, shape, classes)
    if order == "relu-pool":
        model = relu_first(model)
    return model.to(memory_format=torch.channels_last)


def train(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, batch: int, bf16: bool
) -> tuple[float, list[float]]:
    """Seconds per step after 5 warm-up steps, and every step's loss."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    losses: list[float] = []
    start = 0.0
    for step in range(steps):
        if step == 5:
            start = time.perf_counter()
        lo = (step * batch) % (len(x) - batch)
        xb, yb = x[lo : lo + batch], y[lo : lo + batch]
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
        with autocast:
            loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return (time.perf_counter() - start) / (steps - 5), losses


def measure(args: argparse.Namespace, model_name: str, bf16: bool) -> dict:
    data = load_dataset(MODELS[model_name], data_dir=args.data_dir)
    x = data.x_train[: args.steps * args.batch + args.batch].contiguous(
        memory_format=torch.channels_last
    )
    y = data.y_train[: len(x)]
    shape, classes = tuple(data.input_shape), data.num_classes
    times: dict[str, list[float]] = {"pool-relu": [], "relu-pool": []}
    identical = True
    for repeat in range(args.repeats):
        orders = ("pool-relu", "relu-pool") if repeat % 2 == 0 else ("relu-pool", "pool-relu")
        trained = {}
        for order in orders:
            model = make(model_name, shape, classes, order)
            seconds, losses = train(model, x, y, args.steps, args.batch, bf16)
            times[order].append(seconds * 1000)
            trained[order] = (losses, model.state_dict())
        (la, sa), (lb, sb) = trained["pool-relu"], trained["relu-pool"]
        identical &= la == lb and all(torch.equal(sa[k], sb[k]) for k in sa)
    ratios = [p / r for p, r in zip(times["pool-relu"], times["relu-pool"], strict=True)]
    return {
        "model": model_name,
        "dataset": data.name,
        "precision": "bf16" if bf16 else "fp32",
        "bit_identical": identical,
        "ms_per_step": times,
        "ratio_per_repeat": ratios,
        "ratio_of_means": statistics.mean(times["pool-relu"]) / statistics.mean(times["relu-pool"]),
        "ratio_median": statistics.median(ratios),
    }


def report(result: dict) -> str:
    m = result["machine"]
    lines = [
        "# Pooling before ReLU in the small CNNs",
        "",
        f"Produced by `{result['command']}` on {m['cpu']}, {m['cores']} cores, "
        f"torch {m['torch']}, {result['threads']} torch thread(s), denormals flushed; "
        f"1-minute load average {result['load_before']} before, {result['load_after']} after.",
        "",
        f"Each model trains {result['steps']} SGD steps (lr 0.01, momentum 0.9, batch "
        f"{result['batch']}, channels_last; the first 5 not timed) on the first training images "
        "of its dataset, from the same initial weights (seed 0), once in each order per repeat, "
        "the orders alternating which goes first. Ratio = pool-first / ReLU-first ms per step "
        "(below 1: pooling first is faster).",
        "",
        "| model | data | precision | bit-identical losses and weights | ms/step pool-first "
        "| ms/step ReLU-first | ratio of means | median ratio | ratio per repeat |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        lines.append(
            f"| {r['model']} | {r['dataset']} | {r['precision']} | "
            f"{'yes' if r['bit_identical'] else '**no**'} | "
            f"{statistics.mean(r['ms_per_step']['pool-relu']):.2f} | "
            f"{statistics.mean(r['ms_per_step']['relu-pool']):.2f} | "
            f"**{r['ratio_of_means']:.2f}** | {r['ratio_median']:.2f} | "
            + ", ".join(f"{v:.2f}" for v in r["ratio_per_repeat"])
            + " |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--bf16", action="store_true", help="also under bf16 autocast")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--out", default=str(RESULTS / "pool_relu_order"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    before = load1()
    runs = []
    with denormals_applied("flush"):
        for model_name in args.models:
            for bf16 in (False, True) if args.bf16 else (False,):
                runs.append(measure(args, model_name, bf16))
                print(json.dumps({k: v for k, v in runs[-1].items() if k != "ms_per_step"}))
    result = {
        "command": "python benchmarks/pool_relu_order.py " + " ".join(sys.argv[1:]),
        "machine": machine_facts(),
        "threads": args.threads,
        "steps": args.steps,
        "batch": args.batch,
        "load_before": before,
        "load_after": load1(),
        "runs": runs,
    }
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(report(result))
    print(f"wrote {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
