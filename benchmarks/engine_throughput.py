"""Engine training throughput against a bare PyTorch loop of the same model.

FedAvg on Fashion-MNIST, 20 clients, Dirichlet beta 0.1, 8 clients per round,
5 local epochs, batch 64, simple-cnn. The engine's figure is training samples per
second over whole rounds (client sampling, messages, weight loading, aggregation
included; evaluation excluded). The bare loop trains the same model with the same
optimiser on pre-made tensors in batches of 64. Both run in this process, so the
ratio is independent of the machine's speed.

    python benchmarks/engine_throughput.py [--rounds 3] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_facts  # noqa: E402

from fedskew.config import ExperimentConfig  # noqa: E402
from fedskew.data.sources import load_dataset  # noqa: E402
from fedskew.models import build_model  # noqa: E402
from fedskew.runs.loop import run  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def bare_loop(
    x: torch.Tensor, y: torch.Tensor, samples: int, channels_last: bool, batch: int = 64
) -> float:
    """Samples per second of plain SGD steps on pre-made tensors."""
    model = build_model("simple-cnn", tuple(x.shape[1:]), 10)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-5)
    model.train()
    steps = samples // batch
    for i in range(10):  # warm-up
        xb, yb = x[i * batch : (i + 1) * batch], y[i * batch : (i + 1) * batch]
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
    n = len(y) // batch
    t0 = time.perf_counter()
    for s in range(steps):
        i = s % n
        xb, yb = x[i * batch : (i + 1) * batch], y[i * batch : (i + 1) * batch]
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
    return steps * batch / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--repeat", type=int, default=2, help="repeat the whole measurement")
    ap.add_argument("--out", default=str(RESULTS / "engine_throughput.md"))
    args = ap.parse_args()

    data = load_dataset("fmnist", args.data_dir)
    rows = []
    for rep, fmt in [(r, f) for r in range(args.repeat) for f in ("contiguous", "channels_last")]:
        cfg = ExperimentConfig(
            algorithm="fedavg", dataset="fmnist", data_dir=args.data_dir, model="simple-cnn",
            num_clients=20, clients_per_round=8, partition="dirichlet",
            partition_params={"beta": 0.1}, rounds=args.rounds, local_epochs=5, batch_size=64,
            lr=0.01, momentum=0.9, weight_decay=1e-5, eval_every=args.rounds, seed=0,
            memory_format=fmt, checkpoint_every=0,
            out_dir=str(Path(tempfile.gettempdir()) / "fedskew-bench"), quiet=True,
        )  # fmt: skip
        cl = fmt == "channels_last"
        before = bare_loop(data.x_train, data.y_train, 60_000, cl)
        _, summary = run(cfg)
        after = bare_loop(data.x_train, data.y_train, 60_000, cl)
        engine = summary["train_samples_per_second"]
        rows.append(
            {
                "repeat": rep + 1,
                "memory_format": fmt,
                "bare_before": round(before, 1),
                "bare_after": round(after, 1),
                "engine": engine,
                "ratio": round(engine / ((before + after) / 2), 3),
            }
        )
    result = {
        "machine": machine_facts(),
        "setting": "FedAvg, fmnist, simple-cnn, 20 clients, dirichlet beta 0.1, 8/round, "
        f"E=5, batch 64, lr 0.01, momentum 0.9, seed 0, {args.rounds} rounds, fp32",
        "rows": rows,
    }
    print(json.dumps(result, indent=2))
    m = result["machine"]
    table = "\n".join(
        f"| {r['repeat']} | {r['memory_format']} | {r['bare_before']:,.0f} / "
        f"{r['bare_after']:,.0f} | {r['engine']:,.0f} | **{r['ratio']:.3f}** |"
        for r in rows
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        "# Engine throughput against a bare PyTorch loop\n\n"
        f"Produced by `python benchmarks/engine_throughput.py --rounds {args.rounds} "
        f"--repeat {args.repeat}`.\n\n"
        f"- Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; torch {m['torch']}, "
        f"{m['torch_threads']} threads; Python {m['python']}\n"
        f"- Data: Fashion-MNIST ({data.source})\n"
        f"- Setting: {result['setting']}\n"
        "- Engine: training samples per second over whole rounds (sampling, messages, weight "
        "loading, aggregation included; evaluation excluded). Bare loop: the same model and "
        "optimiser on pre-made tensors, batch 64, in the same process, before and after the "
        "engine run.\n\n"
        "| repeat | memory format | bare loop before / after (samples/s) | engine (samples/s) "
        "| engine / bare |\n|---|---|---|---|---|\n" + table + "\n\n"
        "Target: engine / bare >= 0.9. The spread between repeats is the machine's noise "
        "(a shared 2-core VM): compare rows of one repeat.\n"
    )
    (out.with_suffix(".json")).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
