"""Operators per local step of every algorithm that trains together, one client alone and
fused (issue 47), on ResNet-18.

Each algorithm runs for real (``fedskew.run``: its server, its client logic's ``plain_<kind>``
plans, its own loss), two rounds on a tiny dataset of random CIFAR-shaped images (3x8x8, 10
classes, an equal IID split: 12 samples a client, batch 4, two local epochs, momentum and
weight decay), ResNet-18 of width 8, on the CPU, three times:

* one client alone: ``--clients-together off`` with 2 clients, which trains each client with
  ``graph_step.LocalStep``; a step is cut at the end of ``LocalStep.sgd``;
* fused with K = 2 and K = 5 clients (``--clients-together fused``, all clients every round);
  a step is cut at the end of ``together._sgd_step``.

A step runs from the end of the previous SGD step to the end of its own (the loss sum and the
carried state's update of the previous step, the batch's loading, forward, loss, backward and
SGD). Counted are the steps of the last round's training exchanges, only steady ones: not an
epoch's first step (it holds the epoch's drawing on the one-client path, and the first holds
momentum's start); every steady step of a setting must issue the same operators, which the
script checks. MOON's previous model, FedProto's and FedCME's global class features, FedFM's
anchors (from ``start_round`` 1) are there in the second round; FedCME's two training
exchanges a round are counted separately. Non-view operators are aten operators minus those
in ``VIEWS`` (no kernel on a GPU). Operator counts do not depend on timing, so they compare
across machines and loads.

    python benchmarks/fused_op_count.py                 # every algorithm, a few minutes
    python benchmarks/fused_op_count.py fedprox moon    # some

writes ``results/fused_op_count.{json,md}`` (all algorithms only).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_facts  # noqa: E402

import fedskew  # noqa: E402
from fedskew.data.datasets import Dataset  # noqa: E402
from fedskew.engines import together  # noqa: E402
from fedskew.engines.inprocess import InProcessEngine  # noqa: E402
from fedskew.training.graph_step import LocalStep  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SHAPE, CLASSES = (3, 8, 8), 10
PER_CLIENT, BATCH, EPOCHS, ROUNDS = 12, 4, 2, 2
BATCHES = PER_CLIENT // BATCH  # per epoch: steps 0 and BATCHES start an epoch
KS = (2, 5)
BOUND = 1.1  # issue 47: a fused step costs at most 1.1x one client's step
# Operators that allocate nothing and launch no kernel on a GPU (views and aliases), as the
# third GPU review counts "non-view device ops".
VIEWS = frozenset({
    "view", "_unsafe_view", "reshape", "expand", "slice", "select", "t", "permute",
    "as_strided", "unsqueeze", "squeeze", "detach", "alias", "transpose", "unbind", "split",
    "lift_fresh", "_reshape_alias", "narrow", "unflatten", "flatten",
})  # fmt: skip
FM = {"start_round": 1}
# Every algorithm that trains together (engines/together.py's docstring), with parameters
# that keep the run small; "<inner>+fm" is the feature-matching plug-in around it.
ALGORITHMS: dict[str, dict[str, Any]] = {
    "fedavg": {},
    "fedprox": {"mu": 0.1},
    "fedlc": {},
    "fedrs": {},
    "feddecorr": {},
    "fedntd": {},
    "feddyn": {},
    "fedproto": {},
    "fedcme": {},
    "fedfm": FM,
    "fedfm-lite": {"a": 2, **FM},
    "fedrod": {},
    "moon": {"out_dim": 16},
    "fedacd": {},
    "scaffold": {},
    "fednova": {},
    "creff": {"match_epochs": 1, "crt_epochs": 1},
    "fednh": {},
    "fedavg+fm": FM,
    "fedprox+fm": {"mu": 0.1, **FM},
    "moon+fm": {"out_dim": 16, **FM},
    "fedacd+fm": FM,
}


def non_view(ops: Counter[str]) -> int:
    """The operators of ``ops`` that launch a kernel (not in VIEWS)."""
    return sum(n for op, n in ops.items() if op not in VIEWS)


class StepOps(TorchDispatchMode):
    """aten operators by name, cut into steps by ``cut()``."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.steps: list[Counter[str]] = []
        self.active: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def cut(self, active: int = 1) -> None:
        self.steps.append(self.ops)
        self.active.append(active)
        self.ops = Counter()


@dataclass
class Training:
    """One training call (one client alone, or a fused stack) and its steps' operators."""

    kind: str
    clients: int
    steps: list[Counter[str]] = field(default_factory=list)
    active: list[int] = field(default_factory=list)  # the clients each step trained


@contextlib.contextmanager
def counted_steps(path: str) -> Iterator[list[Training]]:
    """Every training call of the block with its steps' operators: ``path`` "off" counts
    ``LocalStep.train`` (one client), "fused" ``together.train_together``; each exchange's
    message kind is recorded with its calls."""
    calls: list[Training] = []
    kind = [""]
    real_exchange = InProcessEngine._exchange

    def exchange(self, messages):  # type: ignore[no-untyped-def]
        kind[0] = next(iter(messages.values())).kind if messages else ""
        return real_exchange(self, messages)

    patches: list[tuple[Any, str, Any]] = [(InProcessEngine, "_exchange", exchange)]
    mode: list[StepOps] = []

    def counting(real, clients_of):  # type: ignore[no-untyped-def]
        def train(*args, **kwargs):  # type: ignore[no-untyped-def]
            mode.append(StepOps())
            try:
                with mode[-1]:
                    out = real(*args, **kwargs)
            finally:
                ops = mode.pop()
            calls.append(Training(kind[0], clients_of(args), ops.steps, ops.active))
            return out

        return train

    def cutting(real, active_of):  # type: ignore[no-untyped-def]
        def sgd(*args, **kwargs):  # type: ignore[no-untyped-def]
            real(*args, **kwargs)
            if mode:
                mode[-1].cut(active_of(args))

        return sgd

    if path == "off":
        patches += [
            (LocalStep, "train", counting(LocalStep.train, lambda args: 1)),
            (LocalStep, "sgd", cutting(LocalStep.sgd, lambda args: 1)),
        ]
    else:
        patches += [
            (together, "train_together",
             counting(together.train_together, lambda args: len(args[1]))),
            (together, "_sgd_step", cutting(together._sgd_step, lambda args: len(args[0][0]))),
        ]  # fmt: skip
    # client_runtime imported train_together by name: patch its name too.
    from fedskew.engines import client_runtime

    if path != "off":
        patches.append((client_runtime, "train_together", patches[-2][2]))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, new in patches:
        setattr(owner, name, new)
    try:
        yield calls
    finally:
        for owner, name, old in reversed(saved):
            setattr(owner, name, old)


def images(num_clients: int, seed: int) -> Dataset:
    """Random CIFAR-shaped images, PER_CLIENT per client and 8 to test on."""
    gen = torch.Generator().manual_seed(seed)
    n = PER_CLIENT * num_clients
    x, y = (
        torch.randn(n + 8, *SHAPE, generator=gen),
        torch.randint(0, CLASSES, (n + 8,), generator=gen),
    )
    return Dataset(
        "op-count-images", x[:n], y[:n], x[n:], y[n:], CLASSES, SHAPE,
        [str(c) for c in range(CLASSES)], "random",
    )  # fmt: skip


def algorithm_run(name: str, path: str, clients: int, folder: Path) -> list[Training]:
    """Two rounds of ``name`` (``"<inner>+fm"``: the plug-in) with ``clients`` clients, all
    of them every round, trained as ``path`` says: the training calls, counted."""
    inner, fm = name.removesuffix("+fm"), name.endswith("+fm")
    with counted_steps(path) as calls:
        fedskew.run(
            algorithm=inner, feature_matching=fm, params=ALGORITHMS[name],
            dataset=lambda num_clients, seed: images(num_clients, seed),
            model="resnet18", model_options={"width": 8}, partition="iid",
            num_clients=clients, clients_per_round=clients, rounds=ROUNDS,
            local_epochs=EPOCHS, batch_size=BATCH, lr=0.01, momentum=0.9, weight_decay=1e-5,
            clients_together=path, workers=0, device="cpu", quiet=True,
            out_dir=str(folder), name=f"{name}-{path}-{clients}",
        )  # fmt: skip
    return calls


def steady(calls: list[Training], path: str, clients: int) -> dict[str, Counter[str]]:
    """Per training exchange kind of the last round, the operators of its steady steps
    (each call's steps but an epoch's first), which must all be the same."""
    per_round = {}
    for call in calls:  # the last round's calls of each kind come last
        per_round.setdefault(call.kind, []).append(call)
    out: dict[str, Counter[str]] = {}
    for kind, kind_calls in per_round.items():
        # One call a client alone; one a fused stack (of every client but FedCME's odd one
        # out in its train_rest).
        last = kind_calls[-clients:] if path == "off" else kind_calls[-1:]
        # Full stacks only: FedCME's odd client out trains all epochs where the others
        # train part of them, so the stack's last steps hold it alone.
        counts = [
            s
            for c in last
            for i, (s, active) in enumerate(zip(c.steps, c.active, strict=True))
            if i % BATCHES and active == c.clients
        ]
        assert counts and all(len(c.steps) % BATCHES == 0 for c in last), kind
        different = {non_view(s) for s in counts}
        if len({tuple(sorted(s.items())) for s in counts}) != 1:
            raise AssertionError(f"{kind}: steady steps differ: {sorted(different)} non-view ops")
        out[kind] = counts[-1]
    return out


def measure(name: str) -> dict[str, dict[str, Counter[str]]]:
    """Per setting ("one", "K=2", "K=5") the steady step's operators, by training kind."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        out["one"] = steady(algorithm_run(name, "off", 2, Path(tmp)), "off", 2)
        for k in KS:
            out[f"K={k}"] = steady(algorithm_run(name, "fused", k, Path(tmp)), "fused", k)
    return out


def row(name: str, kind: str, settings: dict[str, Counter[str]]) -> dict[str, Any]:
    """The numbers of one training exchange: non-view operators per step, the ratios and
    the verdicts computed from them, and the operators that differ."""
    one = non_view(settings["one"])
    fused = {key: non_view(settings[key]) for key in settings if key != "one"}
    largest = f"K={max(KS)}"
    independent = all(settings[f"K={k}"] == settings[largest] for k in KS)
    ratio = fused[largest] / one
    diff = Counter(settings[largest])
    diff.subtract(settings["one"])
    return {
        "algorithm": name,
        "exchange": kind,
        "one_client": one,
        **{f"fused_K{k}": fused[f"K={k}"] for k in KS},
        "ratio": round(ratio, 4),
        "independent_of_K": independent,
        "within_bound": ratio <= BOUND,
        "fused_minus_one": {op: n for op, n in sorted(diff.items()) if n and op not in VIEWS},
        "K_differences": {
            f"K={k}": {
                op: n for op, n in sorted((Counter(settings[largest]) - settings[f"K={k}"]).items())
            }
            for k in KS
            if settings[f"K={k}"] != settings[largest]
        },
    }


def commit() -> str:
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
        capture_output=True, text=True,
    )  # fmt: skip
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=Path(__file__).resolve().parent, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    return (out.stdout.strip() or "unknown") + ("+changes" if dirty else "")


def markdown(result: dict[str, Any]) -> str:
    machine = result["machine"]
    lines = [
        "# Operators per local step, one client and fused (issue 47)",
        "",
        f"`benchmarks/fused_op_count.py` at commit {result['commit']}, torch {result['torch']}, "
        f"{machine['cpu']}, {machine['cores']} cores, {machine['memory_gib']} GiB "
        f"({result['seconds']:.0f} s). Every algorithm that "
        f"trains together, run for real (`fedskew.run`, {ROUNDS} rounds, the last counted): "
        f"ResNet-18 of width 8 on random {'x'.join(map(str, SHAPE))} images, {PER_CLIENT} a "
        f"client (equal IID split), batch {BATCH}, {EPOCHS} local epochs, momentum 0.9, weight "
        "decay 1e-5, on the CPU. Non-view aten operators per steady step (not an epoch's first): "
        "one client with `--clients-together off` (graph_step.LocalStep), fused with K clients "
        "(`--clients-together fused`). Ratio: fused K=5 over one client; "
        f"`<= {BOUND}x` and `K-independent` (every operator the same for K=2 and K=5) are "
        "computed from the counts. A fused step is counted only where every client of its "
        "stack trains (FedCME's odd client out of K=5 trains all epochs in train_first and is "
        "not in train_rest's stack of 4).",
        "",
        "| algorithm | exchange | one client | fused K=2 | fused K=5 | ratio | K-independent "
        f"| <= {BOUND}x |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['algorithm']} | {r['exchange']} | {r['one_client']} | {r['fused_K2']} | "
            f"{r['fused_K5']} | {r['ratio']:.3f} | {'yes' if r['independent_of_K'] else 'NO'} | "
            f"{'yes' if r['within_bound'] else 'NO'} |"
        )
    over = [r for r in result["rows"] if not r["within_bound"] or not r["independent_of_K"]]
    lines += ["", f"{len(result['rows']) - len(over)} of {len(result['rows'])} training exchanges "
              f"are K-independent and within {BOUND}x."]  # fmt: skip
    lines += ["", "Non-view operators of the fused K=5 step minus one client's (by operator):", ""]
    for r in result["rows"]:
        shown = ", ".join(f"{op} {n:+d}" for op, n in r["fused_minus_one"].items())
        lines.append(f"- {r['algorithm']} ({r['exchange']}): {shown or 'none'}")
        for k, d in r["K_differences"].items():
            lines.append(f"  - K=5 minus {k}: {d}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("algorithms", nargs="*", help="a subset (default: all; only all writes)")
    args = parser.parse_args(argv)
    names = args.algorithms or list(ALGORITHMS)
    unknown = [n for n in names if n not in ALGORITHMS]
    if unknown:
        parser.error(
            f"unknown algorithm(s) {', '.join(unknown)}; choose from {', '.join(ALGORITHMS)}"
        )
    started = time.perf_counter()
    rows = []
    for name in names:
        began = time.perf_counter()
        settings = measure(name)
        print(f"{name}: {time.perf_counter() - began:.0f} s", flush=True)
        for kind in settings["one"]:
            rows.append(row(name, kind, {key: by_kind[kind] for key, by_kind in settings.items()}))
            r = rows[-1]
            print(f"{name} {kind}: one {r['one_client']}, fused {r['fused_K2']} / {r['fused_K5']}, "
                  f"ratio {r['ratio']:.3f}", flush=True)  # fmt: skip
    result = {
        "commit": commit(),
        "torch": torch.__version__,
        "machine": machine_facts(),
        "seconds": time.perf_counter() - started,
        "settings": {
            "shape": list(SHAPE),
            "per_client": PER_CLIENT,
            "batch": BATCH,
            "epochs": EPOCHS,
            "rounds": ROUNDS,
            "model": "resnet18",
            "width": 8,
            "ks": list(KS),
            "bound": BOUND,
            "algorithms": ALGORITHMS,
        },  # fmt: skip
        "rows": rows,
    }
    text = markdown(result)
    print(text)
    if not args.algorithms:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "fused_op_count.json").write_text(json.dumps(result, indent=1) + "\n")
        (RESULTS / "fused_op_count.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
