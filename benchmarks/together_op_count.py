"""Operators dispatched per step of clients trained together (issue 39), on the CPU.

Trains one together round (``train_together``) of six clients with ragged data sizes for
two small models (``mlp`` and ``simple-cnn`` with BatchNorm) under a TorchDispatchMode that
counts every aten operator and the bytes of the new tensors they return, split by step.
A step runs from the end of the previous SGD step to the end of its own (so it holds the
previous step's loss bookkeeping); "setup" is everything before the first step
and "finish" everything after the last SGD step. Operator counts do not depend on timing,
so they compare across machines and loads: ``--label before|after`` keeps both labels in
``results/together_op_count.json`` and the .md shows them side by side.

    python benchmarks/together_op_count.py --label before
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_facts  # noqa: E402

from fedskew.data.federated import ClientData  # noqa: E402
from fedskew.engines import together  # noqa: E402
from fedskew.models import build_model  # noqa: E402
from fedskew.training.interface import LocalTrainConfig  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# 6, 6, 5, 5, 4, 3 steps of 8: steps 0-2 all clients, full batches; step 3 five clients, one
# batch of 4 (padded); steps 4-5 prefixes of the stack.
SIZES = [48, 48, 40, 40, 28, 24]
BATCH = 8
MODELS = {"mlp": {}, "simple-cnn": {"norm": "bn"}}
SHAPE = (1, 16, 16)
CLASSES = 10


class Counting(TorchDispatchMode):
    """Counts aten operators and the bytes of the tensors they newly return."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        self.ops[str(func.overloadpacket.__name__)] += 1
        # Returns that alias an input (views, in-place and out= ops) allocate nothing.
        if not any(r.alias_info is not None for r in func._schema.returns):
            flat, _ = tree_flatten(out)
            self.bytes += sum(t.nbytes for t in flat if isinstance(t, torch.Tensor))
        return out

    def take(self) -> tuple[dict[str, int], int]:
        ops, nbytes = dict(sorted(self.ops.items())), self.bytes
        self.ops, self.bytes = Counter(), 0
        return ops, nbytes


def one_round(model_name: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = build_model(model_name, SHAPE, CLASSES, **MODELS[model_name])
    total = sum(SIZES)
    x = torch.randn(total, *SHAPE)
    y = torch.randint(0, CLASSES, (total,))
    offsets = [sum(SIZES[:k]) for k in range(len(SIZES))]
    datas = [
        ClientData(x, y, torch.arange(o, o + n), CLASSES)
        for o, n in zip(offsets, SIZES, strict=True)
    ]
    gens = [torch.Generator().manual_seed(k) for k in range(len(SIZES))]
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cfg = LocalTrainConfig(
        epochs=1, batch_size=BATCH, lr=0.05, momentum=0.9, weight_decay=1e-3, grad_clip=5.0
    )
    mode = Counting()
    segments: list[dict[str, Any]] = []
    real_sgd, real_step = together._sgd_step, together._ChunkStep.step
    started = False

    def cut(name: str, active: int | None = None) -> None:
        ops, nbytes = mode.take()
        segments.append(
            {
                "segment": name,
                "active": active,
                "ops": sum(ops.values()),
                "bytes": nbytes,
                "by_op": ops,
            }  # fmt: skip
        )

    def step(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal started
        if not started:
            cut("setup")
            started = True
        return real_step(*args, **kwargs)

    def sgd(weights, *args, **kwargs):  # type: ignore[no-untyped-def]
        real_sgd(weights, *args, **kwargs)
        active = weights[0].shape[0]
        cut(f"step {sum(1 for s in segments if s['segment'].startswith('step'))}", active)

    together._sgd_step, together._ChunkStep.step = sgd, step  # type: ignore[method-assign]
    try:
        with mode:
            together.train_together(model, datas, cfg, gens, [start] * len(SIZES), [1] * len(SIZES))
            cut("finish")
    finally:
        together._sgd_step, together._ChunkStep.step = real_sgd, real_step  # type: ignore[method-assign]
    return {"model": model_name, "options": MODELS[model_name], "segments": segments}


def commit() -> str:
    folder = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=folder, capture_output=True, text=True
    )
    return out.stdout.strip() or "unknown"


def markdown(result: dict[str, Any]) -> str:
    labels = list(result["labels"])
    lines = [
        "# Operators per step of clients trained together (issue 39)",
        "",
        f"`benchmarks/together_op_count.py`: {len(SIZES)} clients of {SIZES} samples, batch "
        f"{BATCH}, one epoch, momentum, weight decay and clipping, on the CPU; aten operators "
        "counted by a TorchDispatchMode, bytes of the tensors they newly return. A step runs "
        "from the end of the previous SGD step to the end of its own; setup is the stacking "
        "and the drawing of every batch, which happens before the first step; finish the rest.",
        "",
    ]
    for label in labels:
        run = result["labels"][label]
        lines.append(f"- {label}: commit {run['commit']}, torch {run['torch']}")
    for model_name in MODELS:
        lines += ["", f"## {model_name}", ""]
        header = "| segment | active |" + "".join(f" ops {lb} | KiB {lb} |" for lb in labels)
        lines += [header, "|" + "---|" * (2 + 2 * len(labels))]
        runs = [
            next(m for m in result["labels"][lb]["models"] if m["model"] == model_name)
            for lb in labels
        ]
        for i, seg in enumerate(runs[0]["segments"]):
            cells = "".join(
                f" {r['segments'][i]['ops']} | {r['segments'][i]['bytes'] / 1024:.1f} |"
                for r in runs
            )
            lines.append(f"| {seg['segment']} | {seg['active'] or ''} |{cells}")
        if len(runs) > 1:
            lines += ["", f"Operators per step that changed, {labels[0]} -> {labels[-1]}:", ""]
            first, last = runs[0]["segments"], runs[-1]["segments"]
            for i, seg in enumerate(first):
                a, b = seg["by_op"], last[i]["by_op"]
                diff = {op: b.get(op, 0) - a.get(op, 0) for op in sorted({*a, *b})}
                shown = ", ".join(f"{op} {d:+d}" for op, d in diff.items() if d)
                lines.append(f"- {seg['segment']}: {shown or 'no change'}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--label", required=True, help="before, after, ...")
    args = parser.parse_args(argv)
    path = RESULTS / "together_op_count.json"
    result = json.loads(path.read_text()) if path.exists() else {"labels": {}}
    result["labels"][args.label] = {
        "commit": commit(),
        "torch": torch.__version__,
        "machine": machine_facts(),
        "models": [one_round(name) for name in MODELS],
    }
    RESULTS.mkdir(exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    (RESULTS / "together_op_count.md").write_text(markdown(result))
    print((RESULTS / "together_op_count.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
