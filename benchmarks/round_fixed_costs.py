"""Issue 47's fixed per-round costs: what a round spends outside local training.

FedAvg and FedFM (for its anchor pass) on ResNet-18 (CIFAR stem, about 11 M parameters) with
random images of CIFAR-10's shape (3x32x32, 10 classes), 10 clients per round (all of them,
IID, ``--samples`` each, 5,000 by default), one local epoch (the goal round's 10 x 5,000
images), clients in this process (``workers`` 0). Everything else is fedskew's default: the
global model evaluated on the whole test set and a checkpoint written every round
(``eval_every`` 1, ``checkpoint_every`` 1), batch 32, lr 0.05, momentum 0.9, fp32,
``clients_together`` auto (vmap on CUDA, one after another on the CPU),
FedFM's parameters (the anchors are computed and aggregated every round; the matching term
starts at round 20). The test set has ``--test-size`` images: 10,000 by default, CIFAR-10's
test split, which fedskew scores whole.

Timers (round_timers.py, the mechanism of round_profile.py) are installed around fedskew's
functions and book each stretch of time to one category, exclusively, so the categories of
a round add up to its wall time (end of one round to the end of the next; round 1 warms up
and is not reported). On CUDA every clock reading is preceded by ``torch.cuda.synchronize``:
the device's work is booked to the category that queued it.

Each category is reported as a fraction (a) of the measured round and (b) of the issue's goal
round, a ResNet-18 FedAvg round of 10 x 5,000 images in 8 s, against the issue's bound of 5 %
of a round for the fixed costs. On the CPU the training is far from the goal speed and there
is no device boundary (nothing is copied to or from a device): (b) then says what the host
side costs, not what a GPU round costs.

    python benchmarks/round_fixed_costs.py --device cuda --out OUT/round_fixed_costs.md
    python benchmarks/round_fixed_costs.py --dry-run     # tiny, seconds on the CPU
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import load1, machine_facts  # noqa: E402
from round_timers import Ledger, Patches, timed  # noqa: E402

import fedskew.algorithms.fedavg as fedavg_mod  # noqa: E402
import fedskew.algorithms.fedfm as fedfm_mod  # noqa: E402
import fedskew.engines.client_runtime as runtime_mod  # noqa: E402
import fedskew.runs.folder as folder_mod  # noqa: E402
import fedskew.runs.loop as loop_mod  # noqa: E402
import fedskew.runs.measurements as measurements_mod  # noqa: E402
import fedskew.runs.tracking.session as session_mod  # noqa: E402
import fedskew.training.graph_step as graph_step_mod  # noqa: E402
import fedskew.training.local as local_mod  # noqa: E402
from fedskew.config import ExperimentConfig  # noqa: E402
from fedskew.core.device import device_facts, resolve_device  # noqa: E402
from fedskew.core.machine import git_commit  # noqa: E402
from fedskew.data.datasets import Dataset  # noqa: E402
from fedskew.data.sources import register_dataset  # noqa: E402
from fedskew.models import build_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "round_fixed_costs.md"

# The goal: a ResNet-18 FedAvg round of 10 x 5,000 images in about 8 s, with the
# fixed per-round costs under 5 % of it.
GOAL_ROUND_S = 8.0
GOAL_SHARE = 0.05
CLIENTS = 10
SHAPE = (3, 32, 32)
CLASSES = 10

TRAINING = "training"
OTHER = "other"
# (category, what it times, where). Report order; "other" is the ledger's bottom: time no
# wrapper claims.
CATEGORIES: list[tuple[str, str, str]] = [
    (TRAINING, "local training: the graph-safe step, local_train, or clients trained together",
     "training/graph_step.py train_plain, training/local.py local_train, "
     "engines/together.py train_together"),
    ("aggregation", "the server's weighted average of the replies and its server-lr step",
     "training/aggregation.py weighted_average, apply_server_lr"),
    ("host<->device copies", "messages' arrays and client states moved to the run's device and "
     "back at the runtime's boundary (nothing on the CPU)",
     "core/device.py to_device, to_cpu (from engines/client_runtime.py)"),
    ("model state copies", "a message's weights loaded into the scratch model, the reply's "
     "clone of the trained state, FedFM's copy of the received model",
     "training/local.py set_arrays, get_arrays; algorithms/fedfm.py keep_received"),
    ("checkpoint", "save_checkpoint (npz, fsync, rename)", "runs/checkpoint.py"),
    ("evaluation", "the global model on the test set", "runs/loop.py evaluate_global_model"),
    ("anchor pass", "FedFM's step 1: the clients' class means of features over all their "
     "samples and the server's anchor aggregation (its copies are in the copy rows)",
     "algorithms/fedfm.py anchor_exchange, local_anchor_arrays, aggregate_anchors"),
    ("NaN/Inf checks", "every reply's arrays and the new global model checked for NaN/Inf",
     "runs/loop.py non_finite_value, non_finite_array"),
    ("metrics line", "the round's measurements, metrics.jsonl line (fsync) and trackers",
     "runs/measurements.py, runs/folder.py append_metrics, runs/tracking"),
    (OTHER, "the rest: engine dispatch, client contexts and generators, traffic count, run "
     "loop", "engines/, runs/loop.py"),
]  # fmt: skip
NAMES = [c for c, _, _ in CATEGORIES]


@dataclass(frozen=True)
class Sizes:
    shape: tuple[int, int, int]
    samples: int  # per client
    test: int
    rounds: int  # measured, after one warm-up round
    model_options: dict[str, Any]
    local_epochs: int


FULL = Sizes(shape=SHAPE, samples=5000, test=10_000, rounds=2, model_options={}, local_epochs=1)
# The same code at a size that takes seconds on two shared CPU cores.
# (Width 8: at width 4 fedskew's CPU step ran for minutes here; not looked into.)
DRY = Sizes(
    shape=(3, 8, 8), samples=8, test=32, rounds=1, model_options={"width": 8}, local_epochs=1
)


# ----------------------------------------------------------------------------- timers


class BoundaryBytes:
    """Bytes that really cross the device boundary in to_device / to_cpu."""

    def __init__(self) -> None:
        self.down = 0  # host -> device
        self.up = 0  # device -> host

    def count(self, arrays: Mapping[str, torch.Tensor], target: torch.device | None) -> int:
        """Bytes of ``arrays`` not on ``target`` (None: the host)."""
        kind = "cpu" if target is None else target.type
        return sum(t.nbytes for t in arrays.values() if t.device.type != kind)


@contextmanager
def instrumented(
    ledger: Ledger, crossing: BoundaryBytes, inclusive: dict[str, float]
) -> Iterator[None]:
    """Install the timers on fedskew's functions; put every one back afterwards."""
    patches = Patches(ledger)
    t = patches.time
    t(graph_step_mod, "train_plain", TRAINING)
    t(local_mod, "local_train", TRAINING)
    t(runtime_mod, "train_together", TRAINING)
    for mod in (fedavg_mod, fedfm_mod):
        t(mod, "weighted_average", "aggregation")
        t(mod, "apply_server_lr", "aggregation")
        t(mod, "set_arrays", "model state copies")
    t(runtime_mod, "set_arrays", "model state copies")
    t(local_mod, "get_arrays", "model state copies")
    t(fedfm_mod, "keep_received", "model state copies")
    t(loop_mod, "non_finite_value", "NaN/Inf checks")
    t(loop_mod, "non_finite_array", "NaN/Inf checks")
    t(measurements_mod.Measurements, "measure", "metrics line")
    t(folder_mod.RunFolder, "append_metrics", "metrics line")
    t(session_mod.TrackingSession, "log_round", "metrics line")
    t(loop_mod, "save_checkpoint", "checkpoint")
    t(loop_mod, "evaluate_global_model", "evaluation")
    t(fedfm_mod, "local_anchor_arrays", "anchor pass")
    t(fedfm_mod, "aggregate_anchors", "anchor pass")

    to_device, to_cpu = runtime_mod.to_device, runtime_mod.to_cpu

    def counted_to_device(arrays: Mapping[str, torch.Tensor], device: torch.device) -> Any:
        crossing.down += crossing.count(arrays, device)
        return to_device(arrays, device)

    def counted_to_cpu(arrays: Mapping[str, torch.Tensor]) -> Any:
        crossing.up += crossing.count(arrays, None)
        return to_cpu(arrays)

    patches.replace(
        runtime_mod, "to_device", timed(ledger, counted_to_device, "host<->device copies")
    )
    patches.replace(runtime_mod, "to_cpu", timed(ledger, counted_to_cpu, "host<->device copies"))

    # The anchor pass also whole, its copies and model loads included (inclusive time).
    anchor_exchange = timed(ledger, fedfm_mod.anchor_exchange, "anchor pass")

    def whole_anchor_exchange(*args: Any, **kwargs: Any) -> Any:
        start = ledger._now()
        try:
            return anchor_exchange(*args, **kwargs)
        finally:
            inclusive["anchor pass"] = inclusive.get("anchor pass", 0.0) + ledger._now() - start

    patches.replace(fedfm_mod, "anchor_exchange", whole_anchor_exchange)
    try:
        yield
    finally:
        patches.restore()


# ----------------------------------------------------------------------------- one run


def synthetic(
    name: str, shape: tuple[int, ...], n_train: int, n_test: int
) -> Callable[[], Dataset]:
    def load() -> Dataset:
        gen = torch.Generator().manual_seed(0)
        return Dataset(
            name=name, x_train=torch.randn(n_train, *shape, generator=gen),
            y_train=torch.randint(0, CLASSES, (n_train,), generator=gen),
            x_test=torch.randn(n_test, *shape, generator=gen),
            y_test=torch.randint(0, CLASSES, (n_test,), generator=gen),
            num_classes=CLASSES, input_shape=shape, class_names=[str(i) for i in range(CLASSES)],
            source="random images made by benchmarks/round_fixed_costs.py",
        )  # fmt: skip

    return load


# FedAvg as it ran before its round averaged on the device: every reply's arrays brought to
# the host and averaged there (ServerLogic.takes_device_replies off). The same on the CPU.
HOST_REPLIES = "fedavg@host"
ALGORITHMS = {"fedavg": "fedavg", "fedfm": "fedfm", HOST_REPLIES: "fedavg"}


def measure(variant: str, device: torch.device, sizes: Sizes) -> dict[str, Any]:
    """One run of ``variant`` (an algorithm, or HOST_REPLIES): per measured round its wall
    time, the seconds of every category, the bytes across the device boundary; the run's own
    facts beside them."""
    algorithm = ALGORITHMS[variant]
    name = f"fixed-costs-{'x'.join(map(str, sizes.shape))}-{sizes.samples}-{sizes.test}"
    register_dataset(name, synthetic(name, sizes.shape, CLIENTS * sizes.samples, sizes.test))
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    ledger = Ledger(base=OTHER, sync=sync)
    crossing = BoundaryBytes()
    inclusive: dict[str, float] = {}
    rounds: list[dict[str, Any]] = []
    last: dict[str, Any] = {}

    def mark() -> None:
        wall, totals, _ = ledger.snapshot()
        last.update(wall=wall, totals=totals, down=crossing.down, up=crossing.up,
                    anchor=inclusive.get("anchor pass", 0.0))  # fmt: skip

    def on_round(record: dict[str, Any]) -> None:
        before = dict(last)
        mark()
        seconds = {c: last["totals"].get(c, 0.0) - before["totals"].get(c, 0.0) for c in NAMES}
        rounds.append({
            "round": record["round"],
            "wall_s": last["wall"] - before["wall"],
            "seconds": seconds,
            "anchor_pass_inclusive_s": last["anchor"] - before["anchor"],
            "bytes_to_device": last["down"] - before["down"],
            "bytes_to_host": last["up"] - before["up"],
            "samples": record["samples"],
        })  # fmt: skip

    with tempfile.TemporaryDirectory() as out_dir:
        cfg = ExperimentConfig(
            algorithm=algorithm, dataset=name, model="resnet18",
            model_options=dict(sizes.model_options), num_clients=CLIENTS, partition="iid",
            clients_per_round=CLIENTS, rounds=sizes.rounds + 1, workers=0, device=str(device),
            seed=0, out_dir=out_dir, name=f"{algorithm}-{time.monotonic_ns()}", quiet=True,
            local_epochs=sizes.local_epochs,
        )  # fmt: skip
        with instrumented(ledger, crossing, inclusive):
            host = Patches(ledger)
            if variant == HOST_REPLIES:
                host.replace(fedavg_mod.FedAvgServer, "takes_device_replies", lambda self: False)
            try:
                mark()
                folder, _ = loop_mod.run(cfg, on_round=on_round)
            finally:
                host.restore()
        process = json.loads((folder / "processes.jsonl").read_text().splitlines()[0])
        config = json.loads((folder / "config.json").read_text())
    params = sum(
        p.numel()
        for p in build_model("resnet18", sizes.shape, CLASSES, **sizes.model_options).parameters()
    )
    return {
        "algorithm": variant,
        "parameters": params,
        "clients_together": process.get("clients_together"),
        "cuda_graphs": process.get("cuda_graphs"),
        "settings": {k: config.get(k) for k in (
            "local_epochs", "batch_size", "lr", "momentum", "eval_every", "checkpoint_every",
            "clients_together", "precision", "algorithm_params")},
        "warm_up": rounds[0],
        "rounds": rounds[1:],
    }  # fmt: skip


def per_tensor_check(arrays: Mapping[str, torch.Tensor]) -> str | None:
    """fedskew's NaN/Inf check as it was before (commit 0384df6): isfinite of every element,
    read back tensor by tensor. Kept here only to time it beside the present one."""
    for name, t in arrays.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


def nan_check_before_after(device: torch.device, sizes: Sizes, repeats: int = 5) -> dict[str, Any]:
    """Seconds of the NaN/Inf checks of one round (10 replies and the new global model) done
    the old way and by fedskew's non_finite_array, on one model's state on ``device``, the
    faster of ``repeats`` tries each, alternating."""
    torch.manual_seed(0)
    state = build_model("resnet18", sizes.shape, CLASSES, **sizes.model_options).to(device)
    arrays = {k: v.detach().clone() for k, v in state.state_dict().items()}
    checks = {"before": per_tensor_check, "now": loop_mod.non_finite_array}
    best = {name: float("inf") for name in checks}
    for _ in range(repeats):
        for name, fn in checks.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            assert fn(arrays) is None
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best[name] = min(best[name], time.perf_counter() - t0)
    per_round = CLIENTS + 1
    return {"models_per_round": per_round, **{f"{k}_s": v * per_round for k, v in best.items()}}


# ----------------------------------------------------------------------------- summary


def typical_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The measured round of least wall time: other processes on a shared machine only add
    time (on 2 shared cores here rounds of 11 s took 60 s beside a neighbour's work), and its
    categories still add up to its wall time, as a mean's or median's per category would not."""
    return min(rounds, key=lambda r: r["wall_s"])


def summarise(run: dict[str, Any]) -> dict[str, Any]:
    """The typical measured round's seconds per category, and each one's fractions of that
    round and of the goal round, computed here from the measurements."""
    rnd = typical_round(run["rounds"])
    wall = rnd["wall_s"]
    rows = []
    for c in NAMES:
        s = rnd["seconds"][c]
        rows.append(
            {"category": c, "seconds": s, "of_round": s / wall, "of_goal": s / GOAL_ROUND_S}
        )
    fixed = sum(r["seconds"] for r in rows if r["category"] != TRAINING)
    return {
        "round": rnd["round"],
        "walls_s": [r["wall_s"] for r in run["rounds"]],
        "wall_s": wall,
        "rows": rows,
        "fixed_s": fixed,
        "fixed_of_round": fixed / wall,
        "fixed_of_goal": fixed / GOAL_ROUND_S,
        "fixed_within_goal": fixed / GOAL_ROUND_S < GOAL_SHARE,
        "anchor_pass_inclusive_s": rnd["anchor_pass_inclusive_s"],
        "bytes_to_device": rnd["bytes_to_device"],
        "bytes_to_host": rnd["bytes_to_host"],
        "samples": rnd["samples"],
    }


def before_after(runs: list[dict[str, Any]], device: str) -> list[str]:
    """FedAvg averaging on the device against FedAvg with the replies brought to the host,
    where both ran: the fixed costs of each and their difference."""
    by = {r["algorithm"]: r["summary"] for r in runs}
    if "fedavg" not in by or HOST_REPLIES not in by:
        return []
    now, before = by["fedavg"], by[HOST_REPLIES]
    lines = [
        "## FedAvg: replies averaged where they are against brought to the host (before)",
        "",
    ]
    if device == "cpu":
        lines += [
            "On the CPU both runs take the same code path (there is no device boundary): "
            "their difference is this machine's noise.",
            "",
        ]
    lines += [
        "| category | host (before) s/round | device s/round | difference |",
        "|---|---:|---:|---:|",
    ]
    for a, b in zip(before["rows"], now["rows"], strict=True):
        if a["category"] != TRAINING:
            lines.append(f"| {a['category']} | {a['seconds']:.4f} | {b['seconds']:.4f} | "
                         f"{b['seconds'] - a['seconds']:+.4f} |")  # fmt: skip
    saved = before["fixed_s"] - now["fixed_s"]
    lines += [
        f"| **fixed costs** | **{before['fixed_s']:.4f}** | **{now['fixed_s']:.4f}** | "
        f"**{-saved:+.4f}** |",
        "",
        f"Fixed costs {pct(before['fixed_of_goal'])} of the goal round before, "
        f"{pct(now['fixed_of_goal'])} now; bytes the runtime brought back to the host per "
        f"round {before['bytes_to_host'] / 2**20:,.1f} MiB before, "
        f"{now['bytes_to_host'] / 2**20:,.1f} MiB now (plus, now, the average's one copy to "
        "the host, inside the aggregation row).",
        "",
    ]
    return lines


def pct(x: float) -> str:
    return f"{100 * x:.2f} %"


def markdown(data: dict[str, Any]) -> str:
    env = data["environment"]
    where = env.get("device_name") or data["device"]
    label = "CPU" if data["device"] == "cpu" else where
    sizes = data["sizes"]
    lines = [
        f"# Fixed per-round costs (issue 47): {label}",
        "",
        f"Written by `{data['command']}` on {data['date']} UTC; code {data['commit']}; "
        f"torch {data['machine'].get('torch', '?')}; {data['machine'].get('cpu', '?')}, "
        f"{data['threads']} torch threads; load average {data['load_before']} before, "
        f"{data['load_after']} after."
        + (
            f" Tables summarised again (--report-only) by code {data['summarised_by']}."
            if data.get("summarised_by")
            else ""
        ),
        "",
        f"ResNet-18 (CIFAR stem), random images of shape {'x'.join(map(str, sizes['shape']))}, "
        f"{CLASSES} classes, {CLIENTS} clients per round (IID, all sampled) of "
        f"{sizes['samples']:,} images each, a test set of {sizes['test']:,} images, seed 0; "
        f"round 1 warms up, rounds 2..{sizes['rounds'] + 1} are measured; the tables show "
        "the measured round of least wall time (the least disturbed), whose rows add up to "
        "it. "
        "fedskew's defaults otherwise (listed per run): evaluation every round on the whole "
        "test set, a checkpoint every round. Clients in this process (workers 0).",
        "",
        f"Goal round: {GOAL_ROUND_S:g} s (issue 47: a ResNet-18 FedAvg round of 10 x 5,000 "
        f"images); bound on the fixed costs: {100 * GOAL_SHARE:g} % of it "
        f"({GOAL_SHARE * GOAL_ROUND_S:g} s).",
        "",
    ]
    if data["dry_run"]:
        lines += ["**Dry run**: tiny model and sizes; the numbers check the script, not the "
                  "costs.", ""]  # fmt: skip
    if data["device"] == "cpu":
        lines += [
            "**CPU**: training is far from the goal speed, and nothing crosses a device "
            "boundary (the copy rows hold no host<->device transfer): the goal column says "
            "what the host-side work would weigh in an 8 s round, not what a GPU round costs.",
            "",
        ]
    for run in data["runs"]:
        s = run["summary"]
        st = run["settings"]
        lines += [
            f"## {run['algorithm']}",
            "",
            f"{run['parameters']:,} parameters; clients_together {run['clients_together']}, "
            f"cuda_graphs {run['cuda_graphs']}; local epochs {st['local_epochs']}, batch "
            f"{st['batch_size']}, lr {st['lr']}, momentum {st['momentum']}, precision "
            f"{st['precision']}, eval_every {st['eval_every']}, checkpoint_every "
            f"{st['checkpoint_every']}; {s['samples']:,.0f} training samples per round. "
            f"Measured rounds' wall times: {', '.join(f'{w:.2f}' for w in s['walls_s'])} s; "
            f"the table is round {s['round']}'s.",
            "",
            "| category | s/round | of the measured round | of the 8 s goal round |",
            "|---|---:|---:|---:|",
        ]
        for r in s["rows"]:
            lines.append(f"| {r['category']} | {r['seconds']:.4f} | {pct(r['of_round'])} | "
                         f"{pct(r['of_goal'])} |")  # fmt: skip
        lines += [
            f"| **fixed costs (all but training)** | **{s['fixed_s']:.4f}** | "
            f"**{pct(s['fixed_of_round'])}** | **{pct(s['fixed_of_goal'])}** |",
            f"| round wall time | {s['wall_s']:.4f} | 100 % | {pct(s['wall_s'] / GOAL_ROUND_S)} |",
            "",
            f"Fixed costs {'within' if s['fixed_within_goal'] else '**over**'} "
            f"{100 * GOAL_SHARE:g} % of the goal round ({pct(s['fixed_of_goal'])}). Bytes "
            f"across the device boundary per round: {s['bytes_to_device'] / 2**20:,.1f} MiB "
            f"to the device, {s['bytes_to_host'] / 2**20:,.1f} MiB back to the host.",
            "",
        ]
        if run["algorithm"] == "fedfm":
            a = s["anchor_pass_inclusive_s"]
            lines += [f"Anchor pass whole (its copies and model loads included): {a:.4f} s "
                      f"per round, {pct(a / s['wall_s'])} of the round, {pct(a / GOAL_ROUND_S)} "
                      "of the goal round.", ""]  # fmt: skip
    lines += before_after(data["runs"], data["device"])
    nan = data.get("nan_check")
    if nan:
        lines += [
            "## NaN/Inf checks before and now",
            "",
            f"The checks of one round ({nan['models_per_round']} models: the replies and the new "
            f"global model), timed apart in this invocation: {nan['before_s']:.4f} s the way "
            f"fedskew checked before (isfinite of every element, read back per tensor), "
            f"{nan['now_s']:.4f} s now (each tensor's extremes, one read back): "
            f"{pct(nan['before_s'] / GOAL_ROUND_S)} and {pct(nan['now_s'] / GOAL_ROUND_S)} of "
            "the goal round.",
            "",
        ]
    lines += ["## What each category times", ""]
    lines += [f"- `{c}`: {what} ({where})" for c, what, where in CATEGORIES]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU (seconds)")
    ap.add_argument(
        "--algorithms", nargs="+", choices=list(ALGORITHMS), default=None,
        help=f"default: fedavg {HOST_REPLIES} fedfm on CUDA ({HOST_REPLIES}: FedAvg with the "
        "replies brought to the host, as before), fedavg fedfm on the CPU (no boundary)",
    )  # fmt: skip
    ap.add_argument("--samples", type=int, help=f"images per client (default {FULL.samples})")
    ap.add_argument("--test-size", type=int, help=f"test images (default {FULL.test:,})")
    ap.add_argument("--rounds", type=int, help=f"measured rounds (default {FULL.rounds})")
    ap.add_argument("--local-epochs", type=int, help="default 1 (the goal round's)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument(
        "--report-only", action="store_true", help="summarise the --out .json again, no run"
    )
    args = ap.parse_args(argv)
    if args.report_only:
        out = Path(args.out)
        data = json.loads(out.with_suffix(".json").read_text())
        for run in data["runs"]:
            run["summary"] = summarise(run)
        data["summarised_by"] = git_commit(ROOT)
        out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
        out.write_text(markdown(data))
        print(f"written: {out} and {out.with_suffix('.json')}")
        return 0
    base = DRY if args.dry_run else FULL
    if args.dry_run and args.device != "cpu":
        ap.error("--dry-run runs on the CPU")
    sizes = Sizes(
        shape=base.shape, samples=args.samples or base.samples, test=args.test_size or base.test,
        rounds=args.rounds or base.rounds, model_options=base.model_options,
        local_epochs=args.local_epochs or base.local_epochs,
    )  # fmt: skip
    if min(sizes.samples, sizes.test, sizes.rounds) < 1:
        ap.error("--samples, --test-size and --rounds must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {
        "command": "python benchmarks/round_fixed_costs.py "
        + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)),
        "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "commit": git_commit(ROOT),
        "machine": machine_facts(),
        "environment": device_facts(device),
        "device": device.type,
        "threads": torch.get_num_threads(),
        "dry_run": args.dry_run,
        "sizes": {"shape": list(sizes.shape), "samples": sizes.samples, "test": sizes.test,
                  "rounds": sizes.rounds, "model_options": sizes.model_options,
                  "local_epochs": sizes.local_epochs},
        "goal_round_s": GOAL_ROUND_S,
        "goal_share": GOAL_SHARE,
        "load_before": load1(),
        "runs": [],
    }  # fmt: skip
    data["nan_check"] = nan_check_before_after(device, sizes)
    if args.algorithms is None:
        on_cpu = device.type == "cpu" and not args.dry_run  # the dry run runs every variant
        args.algorithms = ["fedavg", "fedfm"] if on_cpu else ["fedavg", HOST_REPLIES, "fedfm"]
    for algorithm in args.algorithms:
        run = measure(algorithm, device, sizes)
        run["summary"] = summarise(run)
        data["runs"].append(run)
        data["load_after"] = load1()
        # Written after every run: a session cut short keeps what it finished.
        out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
        out.write_text(markdown(data))
        print(f"{algorithm}: round {run['summary']['wall_s']:.3f} s, fixed "
              f"{run['summary']['fixed_s']:.3f} s", flush=True)  # fmt: skip
    print(f"written: {out} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
