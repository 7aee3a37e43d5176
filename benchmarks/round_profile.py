"""Where the seconds of a round go: the issue-6 experiment, profiled, in fp32 and bf16.

FedAvg, Fashion-MNIST, fedavg-cnn, 20 clients, Dirichlet beta 0.1, 8 clients per round,
5 local epochs, batch 64, SGD lr 0.01 momentum 0.9 (weight decay 0), seed 0, the global
model evaluated and a checkpoint written every round (fedskew's defaults), the defaults'
memory format (channels_last for this convolutional model) and denormal policy (flush).
Clients run in this process (``workers`` 0): the same per-client work a worker process
does for its share of the clients, without the worker's message passing.

Timers are installed around fedskew's functions by this script (monkeypatching; the
library is not changed): every wrapped call pushes a category on a stack, and the time
between two clock readings goes to the category on top, so the categories of a round add
up to its wall time exactly (exclusive time; a category's nested wrapped calls count in
their own). Round wall time runs from the end of one round to the end of the next. Rounds
2..R are measured (round 1 pays for oneDNN's first kernel selections). One more round,
R+1, runs under ``torch.profiler`` with a ``record_function`` region per category: the
self CPU time of each operator, grouped into convolutions, matrix products (linear),
pooling, activations, loss, autocast casts and other operators, inside the region that
called it (forward+loss, backward, optimizer step, evaluation ...). Its wall time is not
used (the profiler slows it).

A bare loop gives the reference: the same model and optimiser on pre-made tensors
(consecutive slices of the training set, no gathering), with the same sequence of batch
sizes as the measured rounds' local training (the last, smaller batch of every client
epoch included), timed by the same clock in the same phases. It runs interleaved with the
engine, beside each client of the measured rounds (alternately just before and just after
its handler, its time kept out of the round's), so that both meet the same load.
"Engine beyond the bare loop" = round wall time without evaluation - bare-loop time for
the same batches, broken down per category (engine - bare for the phases both have).

Before that, a short check trains a small version of the experiment (2 clients per round,
1 local epoch, 2 rounds) with and without the timers, the bare loop and the profiler, and
compares the metrics lines: the wrappers must not change results.

Only ratios inside one run mean anything (the machine may be shared); the load average
before and after is recorded.

    python benchmarks/round_profile.py [--threads 2] [--rounds 3] [--precisions fp32 bf16]
        [--local-epochs 5] [--data-dir DIR] [--check-precisions ...] [--report-only]

Takes about 5 minutes on a 2-core machine with native bf16 (AVX-512 BF16) with the
defaults. Without native bf16 instructions (an AVX2-only CPU) bf16 runs several times
slower than fp32; there `--local-epochs 5 bf16=1 --rounds 3 bf16=2` keeps it to minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gzip
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_facts  # noqa: E402
from round_timers import Ledger as _Ledger  # noqa: E402
from round_timers import Patches, timed  # noqa: E402

import fedskew.algorithms.fedavg as fedavg_mod  # noqa: E402
import fedskew.engines.client_runtime as runtime_mod  # noqa: E402
import fedskew.engines.inprocess as inprocess_mod  # noqa: E402
import fedskew.runs.folder as folder_mod  # noqa: E402
import fedskew.runs.loop as loop_mod  # noqa: E402
import fedskew.runs.measurements as measurements_mod  # noqa: E402
import fedskew.runs.tracking.session as session_mod  # noqa: E402
import fedskew.training.interface as interface_mod  # noqa: E402
import fedskew.training.local as local_mod  # noqa: E402
import fedskew.training.protocol as protocol_mod  # noqa: E402
from fedskew.assembly.prepare import new_model, prepare  # noqa: E402
from fedskew.config import ExperimentConfig  # noqa: E402
from fedskew.core.denormals import apply_denormals, denormals_state  # noqa: E402
from fedskew.core.errors import DataError  # noqa: E402
from fedskew.core.machine import cpu_features, git_commit, software_facts  # noqa: E402
from fedskew.core.precision import autocast  # noqa: E402
from fedskew.data.federated import ClientData  # noqa: E402
from fedskew.data.sources import load_dataset  # noqa: E402
from fedskew.training.local import batch_bounds  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
OUT = RESULTS / "round_profile.md"
BATCH = 64
LR = 0.01
MOMENTUM = 0.9
CLIENTS = 20
PER_ROUND = 8
BETA = 0.1
SEED = 0
TIME_KEYS = ("seconds", "eval_seconds")

# ----------------------------------------------------------------------------- categories

# (category, group, what it times, where in fedskew). The order is the report's.
CATEGORIES: list[tuple[str, str, str, str]] = [
    ("train/forward+loss", "local training", "the loss function: forward pass and "
     "cross-entropy (under autocast in bf16)", "training/local.py cross_entropy_loss"),
    ("train/backward", "local training", "loss.backward()", "training/local.py local_train"),
    ("train/optimizer step", "local training", "opt.step()", "training/local.py local_train"),
    ("train/zero_grad", "local training", "opt.zero_grad(set_to_none=True)",
     "training/local.py local_train"),
    ("train/data: gather batch", "local training", "ClientData.batch (index_select of the "
     "client's rows, advanced indexing of the images)", "data/federated.py ClientData.batch"),
    ("train/data: randperm", "local training", "torch.randperm once per epoch",
     "training/local.py local_train"),
    ("train/optimizer creation", "local training", "make_optimizer once per client",
     "training/local.py make_optimizer"),
    ("train/other Python in the loop", "local training", "the rest of local_train: loop, "
     "autocast context, LossOutput checks, loss accumulation (loss_sum += loss.detach()), "
     "permutation slices, the final float(loss_sum)", "training/local.py local_train"),
    ("client/load weights", "client handler outside training", "set_arrays of the "
     "message's weights into the scratch model", "algorithms/fedavg.py plain_train"),
    ("client/reply state copy", "client handler outside training", "get_arrays: a detached "
     "clone of the trained state for the reply", "training/local.py trained_reply"),
    ("client/generator", "client handler outside training", "torch_rng: the client's "
     "addressed generator", "training/interface.py ClientContext.rng"),
    ("client/other", "client handler outside training", "the rest of the handler: "
     "denormal check, context, dispatch, run_plain/train_client, the reply Message",
     "engines/client_runtime.py ClientRuntime.handle"),
    ("engine/message carrying", "engine and server outside clients", "InProcessEngine."
     "exchange and the run loop's FiniteReplies.exchange: client states, refuse_unmet",
     "engines/inprocess.py, runs/loop.py"),
    ("engine/traffic count", "engine and server outside clients", "Message.nbytes of every "
     "message and reply", "training/protocol.py Message.nbytes"),
    ("engine/NaN-Inf checks", "engine and server outside clients", "non_finite_value of "
     "every reply, non_finite_array of the new global model", "runs/loop.py"),
    ("server/sampling", "engine and server outside clients", "sample_clients",
     "data/federated.py sample_clients"),
    ("server/aggregation", "engine and server outside clients", "weighted_average "
     "(float64 accumulation)", "training/aggregation.py weighted_average"),
    ("server/round other", "engine and server outside clients", "the rest of "
     "FedAvgServer.round: message, expected(), weights, mean train loss, server lr",
     "algorithms/fedavg.py FedAvgServer.round"),
    ("run/play_round other", "engine and server outside clients", "the rest of "
     "play_round: begin_round, the metrics record", "runs/loop.py play_round"),
    ("run/checkpoint", "engine and server outside clients", "save_checkpoint (npz, "
     "fsync, rename)", "runs/checkpoint.py save_checkpoint"),
    ("run/metrics", "engine and server outside clients", "metrics.jsonl line (fsync), "
     "trackers, Measurements.measure", "runs/folder.py append_metrics"),
    ("run/loop other", "engine and server outside clients", "the rest of the round loop "
     "(keep_round, record updates, the callback)", "runs/loop.py _run"),
    ("eval/global model", "evaluation", "evaluate_global_model: load weights, test-set "
     "forward, per-class counts", "runs/loop.py evaluate_global_model"),
]  # fmt: skip
GROUPS = [
    "local training",
    "client handler outside training",
    "engine and server outside clients",
    "evaluation",
]
GROUP_OF = {c: g for c, g, _, _ in CATEGORIES}
BASE = "run/loop other"  # the bottom of the stack: time no wrapper claims

# Bare-loop phases and the engine categories they correspond to.
BARE_PHASES = {
    "bare/batch slice": "train/data: gather batch",
    "bare/forward+loss": "train/forward+loss",
    "bare/zero_grad": "train/zero_grad",
    "bare/backward": "train/backward",
    "bare/optimizer step": "train/optimizer step",
    "bare/loop other": "train/other Python in the loop",
}


# ----------------------------------------------------------------------------- the ledger


class Ledger(_Ledger):
    """round_timers.Ledger with this profile's bottom category (no CUDA: nothing to sync)."""

    def __init__(self) -> None:
        super().__init__(base=BASE)


@contextlib.contextmanager
def instrumented(ledger: Ledger) -> Iterator[None]:
    """Install the timers; put every patched attribute back afterwards."""
    patches = Patches(ledger)
    patch = patches.time
    original_local_train = local_mod.local_train
    original_make_optimizer = local_mod.make_optimizer

    def local_train(*args: Any, loss_fn: Any = local_mod.cross_entropy_loss, **kwargs: Any) -> Any:
        return original_local_train(
            *args, loss_fn=timed(ledger, loss_fn, "train/forward+loss"), **kwargs
        )

    def make_optimizer(*args: Any, **kwargs: Any) -> torch.optim.Optimizer:
        opt = original_make_optimizer(*args, **kwargs)
        opt.step = timed(ledger, opt.step, "train/optimizer step")  # type: ignore[method-assign]
        opt.zero_grad = timed(ledger, opt.zero_grad, "train/zero_grad")  # type: ignore[method-assign]
        return opt

    patches.replace(
        local_mod, "local_train", timed(ledger, local_train, "train/other Python in the loop")
    )
    patches.replace(
        local_mod, "make_optimizer", timed(ledger, make_optimizer, "train/optimizer creation")
    )
    patch(torch.Tensor, "backward", "train/backward")
    patch(torch, "randperm", "train/data: randperm")
    patch(ClientData, "batch", "train/data: gather batch")
    patch(fedavg_mod, "set_arrays", "client/load weights")
    patch(local_mod, "get_arrays", "client/reply state copy")
    patch(interface_mod, "torch_rng", "client/generator")
    patch(runtime_mod.ClientRuntime, "handle", "client/other")
    patch(inprocess_mod.InProcessEngine, "exchange", "engine/message carrying")
    patch(loop_mod.FiniteReplies, "exchange", "engine/message carrying")
    patch(protocol_mod.Message, "nbytes", "engine/traffic count")
    patch(loop_mod, "non_finite_value", "engine/NaN-Inf checks")
    patch(loop_mod, "non_finite_array", "engine/NaN-Inf checks")
    patch(loop_mod, "sample_clients", "server/sampling")
    patch(fedavg_mod, "weighted_average", "server/aggregation")
    patch(fedavg_mod.FedAvgServer, "round", "server/round other")
    patch(loop_mod, "play_round", "run/play_round other")
    patch(loop_mod, "save_checkpoint", "run/checkpoint")
    patch(folder_mod.RunFolder, "append_metrics", "run/metrics")
    patch(session_mod.TrackingSession, "log_round", "run/metrics")
    patch(measurements_mod.Measurements, "measure", "run/metrics")
    patch(loop_mod, "keep_round", "run/loop other")
    patch(loop_mod, "evaluate_global_model", "eval/global model")
    try:
        yield
    finally:
        patches.restore()


def wrapper_cost(ledger_cls: type[Ledger] = Ledger, calls: int = 20_000) -> float:
    """Seconds one wrapped call adds (no profiler): a wrapped no-op against the no-op."""

    def noop() -> None:
        return None

    wrapped = timed(ledger_cls(), noop, "x")
    best = []
    for fn in (noop, wrapped):
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            runs.append(time.perf_counter() - t0)
        best.append(min(runs))
    return max(0.0, (best[1] - best[0]) / calls)


# ----------------------------------------------------------------------------- op categories

OP_CATEGORIES = [
    "convolution",
    "matrix product (linear)",
    "pooling",
    "activation (ReLU)",
    "loss (log-softmax, NLL)",
    "zero fills",
    "casts and copies",
    "optimizer arithmetic",
    "optimizer's own time (Optimizer.step)",
    "indexing and gathering",
    "autograd bookkeeping",
    "other operators",
]
# Operator names (lower case) of the categories that are not found by a substring.
LINEAR = {"aten::addmm", "aten::mm", "aten::bmm", "aten::matmul", "aten::linear", "aten::t"}
ACTIVATION = {"aten::relu", "aten::relu_", "aten::clamp_min", "aten::clamp_min_",
              "aten::threshold", "aten::threshold_backward"}  # fmt: skip
FILLS = {"aten::fill_", "aten::zero_", "aten::zeros", "aten::zeros_like"}
CASTS = {"aten::to", "aten::_to_copy", "aten::copy_", "aten::clone", "aten::contiguous",
         "aten::empty_strided", "aten::reshape"}  # fmt: skip
OPTIMIZER = ("aten::_foreach", "aten::add", "aten::mul", "aten::lerp")
INDEXING = {"aten::index", "aten::index_select", "aten::gather", "aten::randperm",
            "aten::slice", "aten::select", "aten::_index_put_impl_"}  # fmt: skip


def op_category(name: str, region: str) -> str:
    """The category of a profiler event named ``name`` inside ``region``. Autograd's node
    events (``ConvolutionBackward0``, ``autograd::engine::evaluate_function: ...``) are
    bookkeeping: the operators they call carry the arithmetic."""
    n = name.lower()
    if n.startswith("autograd::") or n.endswith("backward0") or "accumulategrad" in n:
        return "autograd bookkeeping"
    if n.startswith("optimizer."):
        return "optimizer's own time (Optimizer.step)"
    if "conv" in n:
        return "convolution"
    if n in LINEAR:
        return "matrix product (linear)"
    if "pool" in n:
        return "pooling"
    if n in ACTIVATION:
        return "activation (ReLU)"
    if any(k in n for k in ("softmax", "nll_loss", "cross_entropy")):
        return "loss (log-softmax, NLL)"
    if n in FILLS:
        return "zero fills"
    if n in CASTS:
        return "casts and copies"
    if region == "train/optimizer step" and n.startswith(OPTIMIZER):
        return "optimizer arithmetic"
    if n in INDEXING:
        return "indexing and gathering"
    return "other operators"


def categorised(ops: dict[str, float], region: str) -> dict[str, float]:
    """Seconds per operator category from seconds per operator name."""
    out: dict[str, float] = defaultdict(float)
    for name, sec in ops.items():
        out[op_category(name, region)] += sec
    return dict(out)


def profile_breakdown(prof: torch.profiler.profile) -> dict[str, Any]:
    """Self CPU time (seconds) per (region, operator category), where a region is the
    innermost fs:: record_function around the operator; plus each region's total time
    (inclusive, summed over calls) and the time of nested regions inside it."""
    events = prof.events()
    top_ops: dict[str, Counter[str]] = defaultdict(Counter)
    region_total: dict[str, float] = defaultdict(float)
    nested: dict[str, float] = defaultdict(float)
    cache: dict[int, str] = {}

    def region_of(ev: Any) -> str:
        chain = []
        node = ev.cpu_parent
        found = "outside regions"
        while node is not None:
            key = id(node)
            if key in cache:
                found = cache[key]
                break
            chain.append(key)
            if node.name.startswith("fs::"):
                found = node.name[4:]
                break
            node = node.cpu_parent
        for key in chain:
            cache[key] = found
        return found

    for ev in events:
        if ev.name.startswith("fs::"):
            region = ev.name[4:]
            region_total[region] += ev.cpu_time_total / 1e6
            parent = region_of(ev)
            if parent != "outside regions":
                nested[parent] += ev.cpu_time_total / 1e6
            continue
        region = region_of(ev)
        self_s = ev.self_cpu_time_total / 1e6
        if self_s <= 0:
            continue
        top_ops[region][ev.name] += self_s
    out: dict[str, Any] = {}
    for region in sorted(set(top_ops) | set(region_total)):
        total = region_total.get(region, 0.0)
        gaps = total - nested.get(region, 0.0) - sum(top_ops[region].values())
        out[region] = {
            "region_seconds": round(total, 5),
            "nested_region_seconds": round(nested.get(region, 0.0), 5),
            "gaps_seconds": round(gaps, 5) if total else None,
            # Every operator's self seconds: the report categorises them (op_category).
            "ops": {k: round(v, 6) for k, v in top_ops[region].most_common()},
        }
    return out


# ----------------------------------------------------------------------------- data


def data_source(data_dir: str | None, workdir: Path) -> tuple[str | None, str, bool]:
    """(data_dir to use, its description, whether it is a random stand-in). Fashion-MNIST
    from fedskew's loader without downloading; random pixels of the official shapes and
    sizes when no copy is found."""
    try:
        data = load_dataset("fmnist", data_dir, download=False)
        return data_dir, data.source, False
    except DataError as exc:
        print(f"no Fashion-MNIST copy ({exc}); random pixels in its format", flush=True)
    folder = workdir / "fmnist-random"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for split, n in (("train", 60_000), ("t10k", 10_000)):
        for kind, array in (
            ("images-idx3", rng.integers(0, 256, (n, 28, 28))),
            ("labels-idx1", rng.integers(0, 10, n)),
        ):
            magic = 0x0803 if array.ndim == 3 else 0x0801
            header = np.array([magic, *array.shape], dtype=">i4").tobytes()
            raw = header + array.astype(np.uint8).tobytes()
            (folder / f"{split}-{kind}-ubyte.gz").write_bytes(gzip.compress(raw, 1))
    data = load_dataset("fmnist", str(folder), download=False)
    return str(folder), f"RANDOM PIXELS in Fashion-MNIST's format ({data.source})", True


# ----------------------------------------------------------------------------- the runs


def experiment_config(
    args: argparse.Namespace,
    precision: str,
    rounds: int,
    epochs: int,
    out_dir: Path,
    per_round: int = PER_ROUND,
) -> ExperimentConfig:
    return ExperimentConfig(
        algorithm="fedavg", dataset="fmnist", data_dir=args.data_dir, model="fedavg-cnn",
        num_clients=CLIENTS, clients_per_round=per_round, partition="dirichlet",
        partition_params={"beta": BETA}, rounds=rounds, local_epochs=epochs,
        batch_size=BATCH, lr=LR, momentum=MOMENTUM, weight_decay=args.weight_decay,
        eval_every=1, checkpoint_every=args.checkpoint_every, seed=SEED, precision=precision,
        workers=0, out_dir=str(out_dir), quiet=True,
    )  # fmt: skip


def cli_command(args: argparse.Namespace, precision: str, rounds: int, epochs: int) -> str:
    data = f" --data-dir {shlex.quote(args.data_dir)}" if args.data_dir else ""
    return (
        f"OMP_NUM_THREADS={args.threads} fedskew run -a fedavg -d fmnist{data} -m fedavg-cnn "
        f"-n {CLIENTS} --clients-per-round {PER_ROUND} --partition dirichlet --beta {BETA} "
        f"-e {epochs} -b {BATCH} --lr {LR} --momentum {MOMENTUM} "
        f"--weight-decay {args.weight_decay} "
        f"-r {rounds} --eval-every 1 --checkpoint-every {args.checkpoint_every} "
        f"--precision {precision} --seed {SEED} --workers 0"
    )


class BareLoop:
    """Plain SGD steps of the run's model (same initial weights, memory format, precision
    and optimiser) on consecutive slices of the prepared training tensors: no gathering,
    no handler, no engine. Seconds per phase, by the same clock as the ledger.

    It runs interleaved with the engine: right before or right after each client's local
    training (alternately), the same sequence of batch sizes as that client's, so that
    both meet the same load on a shared machine. Its time is kept out of the round's."""

    def __init__(self, prep: Any, precision: str, warmup: int = 10) -> None:
        self.x, self.y = prep.dataset.x_train, prep.dataset.y_train
        self.precision = precision
        self.model = new_model(prep)
        self.model.train()
        self.opt = torch.optim.SGD(
            self.model.parameters(), lr=LR, momentum=MOMENTUM,
            weight_decay=prep.train.weight_decay,
        )  # fmt: skip
        self.partition = prep.partition
        self.epochs = prep.cfg.local_epochs
        self.offset = 0
        self.phases = dict.fromkeys(BARE_PHASES, 0.0)
        self.seconds = 0.0
        self.steps = 0
        self.samples = 0
        self.chunks = 0
        for _ in range(warmup):
            self._step(BATCH, None)

    def client_sizes(self, cid: int) -> list[int]:
        """The batch sizes of client ``cid``'s local training, in order."""
        bounds = batch_bounds(len(self.partition[cid]), BATCH)
        return [stop - start for start, stop in bounds] * self.epochs

    def _step(self, size: int, phases: dict[str, float] | None) -> None:
        if self.offset + size > len(self.y):
            self.offset = 0
        t0 = time.perf_counter()
        xb = self.x[self.offset : self.offset + size]
        yb = self.y[self.offset : self.offset + size]
        self.offset += size
        t1 = time.perf_counter()
        with autocast(self.precision, "cpu"):
            loss = F.cross_entropy(self.model(xb), yb)
        t2 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        loss.backward()
        t4 = time.perf_counter()
        self.opt.step()
        t5 = time.perf_counter()
        if phases is not None:
            phases["bare/batch slice"] += t1 - t0
            phases["bare/forward+loss"] += t2 - t1
            phases["bare/zero_grad"] += t3 - t2
            phases["bare/backward"] += t4 - t3
            phases["bare/optimizer step"] += t5 - t4

    def run_client(self, cid: int) -> float:
        """The bare loop over client ``cid``'s batch sizes; its seconds."""
        sizes = self.client_sizes(cid)
        booked = dict.fromkeys(BARE_PHASES, 0.0)
        t0 = time.perf_counter()
        for size in sizes:
            self._step(size, booked)
        total = time.perf_counter() - t0
        booked["bare/loop other"] = total - sum(booked.values())
        for k, v in booked.items():
            self.phases[k] += v
        self.seconds += total
        self.steps += len(sizes)
        self.samples += sum(sizes)
        self.chunks += 1
        return total


def profiled_run(
    cfg: ExperimentConfig,
    timed_rounds: int,
    with_profiler: bool,
    bare: BareLoop | None,
    bare_rounds: range,
) -> tuple[list[dict[str, Any]], dict[str, Any] | None, dict[str, Any]]:
    """Run ``cfg`` under the timers. Returns one entry per round (its wall time, the
    ledger's categories and call counts, its metrics record), the profiler's breakdown of
    round ``timed_rounds + 1`` (when ``with_profiler``), and the summary. ``bare`` runs
    beside every client of the (0-based) ``bare_rounds``, alternately before and after
    its handler, outside the round's time."""
    ledger = Ledger()
    rounds: list[dict[str, Any]] = []
    marks: list[tuple[float, dict[str, float], dict[str, int]]] = []
    bare_per_round: dict[int, float] = defaultdict(float)
    prof: torch.profiler.profile | None = None

    def on_start(_: int) -> None:
        marks.append(ledger.snapshot())

    def on_round(record: dict[str, Any]) -> None:
        nonlocal prof
        mark = ledger.snapshot()
        (t0, before, calls0), (t1, after, calls1) = marks[-1], mark
        rounds.append(
            {
                "round": record["round"],
                "wall": t1 - t0,
                "categories": {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after},
                "calls": {k: calls1.get(k, 0) - calls0.get(k, 0) for k in calls1},
                "record": record,
                "bare_seconds": bare_per_round.get(record["round"] - 1),
            }
        )
        if with_profiler and len(rounds) == timed_rounds:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            prof.start()
            ledger.regions = True
        elif prof is not None and len(rounds) == timed_rounds + 1:
            ledger.regions = False
            prof.stop()
        # The callback's own work belongs to no round: the next one starts here.
        marks.append(ledger.snapshot())

    handled = 0

    def with_bare(handle: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(handle)
        def wrapper(self: Any, cid: int, rnd: int, *args: Any, **kwargs: Any) -> Any:
            nonlocal handled
            beside = bare is not None and rnd in bare_rounds
            first = beside and handled % 2 == 0
            handled += beside

            def chunk() -> None:
                assert bare is not None
                bare_per_round[rnd] += bare.run_client(cid)

            if first:
                ledger.aside(chunk)
            reply = handle(self, cid, rnd, *args, **kwargs)
            if beside and not first:
                ledger.aside(chunk)
            return reply

        return wrapper

    with instrumented(ledger):
        timed_handle = runtime_mod.ClientRuntime.handle
        runtime_mod.ClientRuntime.handle = with_bare(timed_handle)  # type: ignore[method-assign]
        try:
            _, summary = loop_mod.run(cfg, on_round=on_round, on_start=on_start)
        finally:
            runtime_mod.ClientRuntime.handle = timed_handle  # type: ignore[method-assign]
    breakdown = None
    if prof is not None:
        t0 = time.perf_counter()
        breakdown = profile_breakdown(prof)
        print(f"  profiler events analysed in {time.perf_counter() - t0:.1f} s", flush=True)
    return rounds, breakdown, summary


def plain_metrics(out_dir: Path) -> list[dict[str, Any]]:
    """The metrics lines of the one run folder in ``out_dir``, without their timings."""
    (folder,) = [p for p in out_dir.iterdir() if p.is_dir()]
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIME_KEYS} for r in rows]


CHECK = "2 clients per round, 1 local epoch, 2 rounds: round 1 with the bare loop beside its clients, round 2 under the profiler"  # noqa: E501


def check_identical(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """A small version of the experiment (see CHECK) with and without the timers, the bare
    loop and the profiler: the metrics lines must be identical."""
    out: dict[str, Any] = {}
    for precision in args.check_precisions:
        plain_dir, timed_dir = workdir / f"check-{precision}-plain", workdir / f"check-{precision}"
        loop_mod.run(experiment_config(args, precision, 2, 1, plain_dir, per_round=2))
        cfg = experiment_config(args, precision, 2, 1, timed_dir, per_round=2)
        profiled_run(cfg, 1, True, BareLoop(prepare(cfg), precision), range(0, 1))
        plain, timed_rows = plain_metrics(plain_dir), plain_metrics(timed_dir)
        same = plain == timed_rows
        out[precision] = {"identical": same, "rounds": len(plain)}
        print(f"check {precision}: metrics lines identical with and without the wrappers: "
              f"{same}", flush=True)  # fmt: skip
        if not same:
            raise SystemExit(f"the wrappers changed the results ({precision}): {plain} != "
                             f"{timed_rows}")  # fmt: skip
    return out


def wait_for_quiet(max_load: float, timeout: float) -> float:
    """Wait until the 1-minute load average is below ``max_load`` (the machine is shared),
    at most ``timeout`` seconds; the load average when the wait ended."""
    deadline = time.monotonic() + timeout
    while os.getloadavg()[0] >= max_load and time.monotonic() < deadline:
        time.sleep(15)
    return os.getloadavg()[0]


def measure_precision(
    args: argparse.Namespace, precision: str, workdir: Path, cost_per_call: float
) -> dict[str, Any]:
    if args.wait > 0:
        load = wait_for_quiet(args.max_load, args.wait)
        print(f"{precision}: 1-minute load average {load:.2f}", flush=True)
    rounds_asked, epochs = args.rounds[precision], args.local_epochs[precision]
    total_rounds = rounds_asked + (1 if args.profiler else 0)
    cfg = experiment_config(args, precision, total_rounds, epochs, workdir / precision)
    prep = prepare(cfg)
    # The bare loop runs in the run's process after the run has set its denormal policy
    # (before the first client); it is checked below.
    bare = BareLoop(prep, precision)
    print(f"{precision}: {total_rounds} rounds, the bare loop beside the clients of rounds "
          f"2..{rounds_asked}", flush=True)  # fmt: skip
    load_run = os.getloadavg()
    rounds, breakdown, summary = profiled_run(
        cfg, rounds_asked, args.profiler, bare, range(1, rounds_asked)
    )
    measured = rounds[1:rounds_asked]
    engine_steps = sum(r["calls"].get("train/backward", 0) for r in measured)
    samples = sum(r["record"]["samples"] for r in measured)
    if engine_steps != bare.steps or samples != bare.samples:
        raise SystemExit(
            f"bare loop and rounds differ: {bare.steps} steps / {bare.samples} samples "
            f"against {engine_steps} / {samples}"
        )
    return {
        "precision": precision,
        "command": cli_command(args, precision, rounds_asked, epochs),
        "rounds_asked": rounds_asked,
        "local_epochs": epochs,
        "memory_format": "channels_last" if prep.channels_last else "contiguous",
        "denormals": cfg.denormals,
        "denormals_measured": denormals_state(),
        "load_during_run": [round(v, 2) for v in load_run],
        "rounds": [
            {
                "round": r["round"],
                "measured": 2 <= r["round"] <= rounds_asked,
                "profiled": r["round"] > rounds_asked,
                "wall": round(r["wall"], 4),
                "bare_seconds": None if r["bare_seconds"] is None else round(r["bare_seconds"], 4),
                "categories": {k: round(v, 5) for k, v in r["categories"].items()},
                "wrapped_calls": sum(r["calls"].values()),
                "steps": r["calls"].get("train/backward", 0),
                "samples": r["record"]["samples"],
                "clients": r["record"]["clients"],
                "accuracy": r["record"].get("accuracy"),
                "train_loss": r["record"].get("train_loss"),
            }
            for r in rounds
        ],
        "bare": {
            "seconds": round(bare.seconds, 5),
            "phases": {k: round(v, 5) for k, v in bare.phases.items()},
            "steps": bare.steps,
            "samples": bare.samples,
            "chunks": bare.chunks,
        },
        "profile": breakdown,
        "wrapper_cost_seconds": cost_per_call,
        "final_accuracy": summary["final_accuracy"],
    }


# ----------------------------------------------------------------------------- micro-costs


def rows_by_index_select(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x[idx]`` (same values, shape and strides) by ``index_select`` over rows that are
    contiguous in memory: x itself, or its NHWC view when x is channels_last."""
    if x.is_contiguous():
        return x.index_select(0, idx)
    return x.permute(0, 2, 3, 1).index_select(0, idx).permute(0, 3, 1, 2)


def micro_costs(args: argparse.Namespace, workdir: Path, reps: int = 500) -> dict[str, Any]:
    """Per-call costs of what the engine's loop does and the bare loop does not, and of
    alternatives, on the experiment's prepared data: 64-row batches of client 0, a new batch
    of its permuted rows at every call (cycling through one epoch), as in local training.
    The operations take turns (5 turns of ``reps`` calls each, median), so that a change in
    the machine's load hits all of them alike."""
    cfg = experiment_config(args, "fp32", 1, 1, workdir / "micro")
    prep = prepare(cfg)
    apply_denormals(cfg.denormals)
    data = prep.fed.client(0)
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
    batches = [perm[s : s + BATCH] for s in range(0, len(data) - BATCH + 1, BATCH)]
    indices = [data.indices.index_select(0, rows) for rows in batches]
    x, y = data.x, data.y
    loss = torch.tensor(0.5)
    acc = torch.zeros(())
    model = new_model(prep)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    turn = iter(range(10**9))

    def nxt() -> int:
        return next(turn) % len(batches)

    def autocast_enter_exit() -> None:
        with autocast("bf16", "cpu"):
            pass

    ops: dict[str, Callable[[], Any]] = {
        "ClientData.batch (64 rows: positions to rows, images, labels)":
            lambda: data.batch(batches[nxt()]),
        "x[idx]: the images by advanced indexing": lambda: x[indices[nxt()]],
        "x.index_select(0, idx) on rows contiguous in memory (same strides as x[idx])":
            lambda: rows_by_index_select(x, indices[nxt()]),
        "x[start:stop], y[start:stop] (the bare loop's slices)": lambda: (x[:BATCH], y[:BATCH]),
        "loss_sum += loss.detach()": lambda: acc.add_(loss.detach()),
        "bf16 autocast context enter+exit": autocast_enter_exit,
        "get_arrays (clone of the 582k-parameter state)": lambda: local_mod.get_arrays(model),
        "set_arrays (copy into the scratch model)": lambda: local_mod.set_arrays(model, state),
    }  # fmt: skip
    # The alternative gathers the same tensor as x[idx]: values and strides.
    for ix in indices[:3]:
        a, b = x[ix], rows_by_index_select(x, ix)
        assert torch.equal(a, b) and a.stride() == b.stride(), "alternative gather differs"
    runs: dict[str, list[float]] = defaultdict(list)
    for _ in range(5):
        for name, fn in ops.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            runs[name].append((time.perf_counter() - t0) / reps)
    return {
        "seconds_per_call": {k: round(statistics.median(v), 9) for k, v in runs.items()},
        "spread": {k: [round(min(v), 9), round(max(v), 9)] for k, v in runs.items()},
        "reps": reps,
        "client_rows": len(data),
    }


# ----------------------------------------------------------------------------- summaries


def summarise(p: dict[str, Any]) -> dict[str, Any]:
    """Mean seconds per measured round, per category and group, and the bare-loop
    comparison (per round: the bare loop ran the measured rounds' batches)."""
    measured = [r for r in p["rounds"] if r["measured"]]
    k = len(measured)
    cats = [c for c, _, _, _ in CATEGORIES]
    seconds = {c: sum(r["categories"].get(c, 0.0) for r in measured) / k for c in cats}
    wall = sum(r["wall"] for r in measured) / k
    groups = {g: sum(seconds[c] for c in cats if GROUP_OF[c] == g) for g in GROUPS}
    bare_phase = {BARE_PHASES[ph]: v / k for ph, v in p["bare"]["phases"].items()}
    bare = p["bare"]["seconds"] / k
    without_eval = wall - seconds["eval/global model"]
    beyond = {}
    for c in cats:
        if c == "eval/global model":
            continue
        beyond[c] = seconds[c] - bare_phase.get(c, 0.0)
    wrapped = sum(r["wrapped_calls"] for r in measured) / k
    return {
        "rounds_measured": k,
        "wall": wall,
        "seconds": seconds,
        "groups": groups,
        "samples": sum(r["samples"] for r in measured) / k,
        "steps": sum(r["steps"] for r in measured) / k,
        "bare_seconds": bare,
        "bare_phase_seconds": bare_phase,
        "without_eval": without_eval,
        "beyond": beyond,
        "beyond_total": without_eval - bare,
        "instrumentation_seconds": wrapped * p["wrapper_cost_seconds"],
        "wrapped_calls": wrapped,
    }


def pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f} %" if whole else "-"


def markdown(result: dict[str, Any]) -> str:
    m, s = result["machine"], result["setting"]
    precisions = [p["precision"] for p in result["precisions"]]
    sums = {p["precision"]: summarise(p) for p in result["precisions"]}
    by = {p["precision"]: p for p in result["precisions"]}
    lines = [
        "# Where the seconds of a round go (issue-6 experiment)",
        "",
        f"Produced by `{result['command']}`.",
        "",
        f"- Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; torch "
        f"{result['torch']}, {result['threads']} threads; Python {m['python']}; "
        + cpu_text(result.get("cpu")),
        f"- Load average (1, 5, 15 min): {fmt_load(result['load_before'])} before, "
        f"{fmt_load(result['load_after'])} after"
        + "".join(
            f"; {p}: {fmt_load(by[p]['load_during_run'])} at its run's start"
            + (f" (finished {by[p]['measured_at']})" if "measured_at" in by[p] else "")
            for p in precisions
        )
        + ". The machine may be shared: only the shares within one run mean much.",
        f"- Data: Fashion-MNIST ({result['data_source']})"
        + (
            " - **random pixels: no Fashion-MNIST copy was found**" if result["random_data"] else ""
        ),
        f"- Setting: {s['text']}",
        "- Per precision: "
        + "; ".join(
            f"{p}: E={by[p]['local_epochs']}, {by[p]['rounds_asked']} rounds (rounds 2.."
            f"{by[p]['rounds_asked']} measured, round 1 is warm-up)"
            + (f", round {by[p]['rounds_asked'] + 1} under torch.profiler" if s["profiler"] else "")
            for p in precisions
        )
        + ". Figures are mean seconds per measured round."
        + (
            " **The precisions ran with different local epochs: per-client and per-round "
            "costs weigh more at fewer epochs, so compare their shares with care.**"
            if len({by[p]["local_epochs"] for p in precisions}) > 1
            else ""
        ),
        f"- Seeds: experiment seed {SEED} (partition, client sampling, initial model, "
        "batch order); the bare loop starts from the same initial model.",
        "- Clients run in this process (`workers` 0): the per-client work here is what each "
        "worker process does for its clients; worker processes add their message passing.",
        "- Wrappers (timers, record_function regions, the interleaved bare loop): "
        + ", ".join(
            f"{p}: metrics lines identical with and without them "
            f"({'yes' if result['check'][p]['identical'] else 'NO'})"
            for p in precisions
            if p in result.get("check", {})
        )
        + (
            f" ({result['check_setting']})."
            if result.get("check")
            else "not checked in this invocation (--check-precisions with none)."
        )
        + " Their own cost: "
        + ", ".join(
            f"{p} {sums[p]['wrapped_calls']:,.0f} wrapped calls per round, about "
            f"{sums[p]['instrumentation_seconds'] * 1e3:.1f} ms "
            f"({pct(sums[p]['instrumentation_seconds'], sums[p]['wall'])} of the round)"
            for p in precisions
        )
        + ".",
        "",
        "## Seconds per round, by category",
        "",
        "Exclusive time: each category is the time spent in it outside the categories "
        "nested in it, so a round's rows add up to its wall time.",
        "",
        "| category | " + " | ".join(f"{p} s/round | {p} share" for p in precisions) + " |",
        "|---|" + "---|---|" * len(precisions),
    ]
    for group in GROUPS:
        cells = " | ".join(
            f"**{g:.3f}** | **{pct(g, sums[p]['wall'])}**"
            for p, g in ((p, sums[p]["groups"][group]) for p in precisions)
        )
        lines.append(f"| **{group}** | {cells} |")
        for c, g, _, _ in CATEGORIES:
            if g != group:
                continue
            cells = " | ".join(
                f"{sums[p]['seconds'][c]:.4f} | {pct(sums[p]['seconds'][c], sums[p]['wall'])}"
                for p in precisions
            )
            lines.append(f"| &nbsp;&nbsp;{c} | {cells} |")
    lines.append(
        "| **round wall time** | "
        + " | ".join(f"**{sums[p]['wall']:.3f}** | 100 %" for p in precisions)
        + " |"
    )
    lines.append(
        "| training samples / steps per round | "
        + " | ".join(f"{sums[p]['samples']:,.0f} / {sums[p]['steps']:,.0f} | " for p in precisions)
        + " |"
    )
    lines += ["", "What each category times:", ""]
    lines += [f"- `{c}`: {what} ({where})" for c, _, what, where in CATEGORIES]

    # ------------------------------------------------------------------ beyond the bare loop
    lines += [
        "",
        "## The engine beyond the bare loop",
        "",
        "Bare loop: the same model, initial weights, memory format, precision and optimiser "
        "on consecutive slices of the prepared training tensors, through the same batch sizes "
        "as the measured rounds' clients, run beside each client (alternately just before "
        "and just after its handler; its time is not in the round's), per round. Beyond = "
        "round wall time without evaluation - bare loop; per phase, engine - bare.",
        "",
        "| | " + " | ".join(f"{p} s/round | {p} share of round" for p in precisions) + " |",
        "|---|" + "---|---|" * len(precisions),
    ]
    for label, key in (
        ("round wall time", "wall"),
        ("round without evaluation", "without_eval"),
        ("bare loop, same batches", "bare_seconds"),
        ("**engine beyond the bare loop**", "beyond_total"),
    ):
        lines.append(
            f"| {label} | "
            + " | ".join(
                f"{sums[p][key]:.3f} | {pct(sums[p][key], sums[p]['wall'])}" for p in precisions
            )
            + " |"
        )
    lines.append(
        "| bare loop samples/s; round without evaluation samples/s | "
        + " | ".join(
            f"{sums[p]['samples'] / sums[p]['bare_seconds']:,.0f}; "
            f"{sums[p]['samples'] / sums[p]['without_eval']:,.0f} | "
            for p in precisions
        )
        + " |"
    )
    lines += [
        "",
        "Breakdown of the difference (engine - bare per phase; categories the bare loop does "
        "not have count whole). A negative row: the engine's phase was faster than the bare "
        "loop's (noise, or a cache effect of its freshly gathered batches).",
        "",
        "| category | "
        + " | ".join(
            f"{p} s/round | {p} share of round | {p} share of the difference" for p in precisions
        )
        + " |",
        "|---|" + "---|---|---|" * len(precisions),
    ]
    order = sorted(
        sums[precisions[0]]["beyond"],
        key=lambda c: -sum(sums[p]["beyond"][c] for p in precisions),
    )
    for c in order:
        bare_note = " (engine - bare)" if c in BARE_PHASES.values() else ""
        lines.append(
            f"| {c}{bare_note} | "
            + " | ".join(
                f"{sums[p]['beyond'][c]:+.4f} | {pct(sums[p]['beyond'][c], sums[p]['wall'])} | "
                f"{pct(sums[p]['beyond'][c], sums[p]['beyond_total'])}"
                for p in precisions
            )
            + " |"
        )
    if "fp32" in sums and "bf16" in sums:
        ratio = (sums["bf16"]["samples"] / sums["bf16"]["bare_seconds"]) / (
            sums["fp32"]["samples"] / sums["fp32"]["bare_seconds"]
        )
        slow = sorted(
            {
                name
                for info in (by["bf16"]["profile"] or {}).values()
                for name in info["ops"]
                if "slow_conv" in name
            }
        )
        lines += [
            "",
            f"Bare loop, bf16 / fp32 samples per second: {ratio:.2f} ("
            + ("bf16 faster" if ratio > 1 else "bf16 slower")
            + " on this CPU"
            + (
                f"; its bf16 convolutions ran in {', '.join(f'`{n}`' for n in slow)}, "
                "torch's fallback without oneDNN"
                if slow
                else ""
            )
            + ").",
        ]
    lines += [
        "",
        "Bare loop per phase (s/round): "
        + "; ".join(
            f"{p}: "
            + ", ".join(
                f"{ph.removeprefix('bare/')} {sums[p]['bare_phase_seconds'][c]:.3f}"
                for ph, c in BARE_PHASES.items()
            )
            for p in precisions
        )
        + ".",
    ]

    # ------------------------------------------------------------------ operators
    if all(by[p]["profile"] for p in precisions):
        lines += [
            "",
            "## Inside the regions: operators (torch.profiler, one round)",
            "",
            "The round after the measured ones, under torch.profiler: each operator's self CPU "
            "time, "
            "booked to the innermost category region around it, as a share of that region's "
            "profiled time. 'Between operators' is the region's time outside operators "
            "(Python, dispatch, and the profiler's own overhead, so it is an upper bound and "
            "the operator shares are lower bounds). Estimated s/round = share x the region's "
            "seconds per round measured without the profiler (table above).",
            "",
        ]
        for region in ("train/forward+loss", "train/backward", "train/optimizer step",
                       "eval/global model"):  # fmt: skip
            lines += operator_table(region, precisions, by, sums)
    else:
        lines += ["", "(operator breakdown not measured in this invocation)"]

    # ------------------------------------------------------------------ micro costs
    micro = result.get("micro")
    if micro:
        lines += [
            "",
            "## Single operations, measured alone",
            "",
            f"5 turns of {micro['reps']:,} calls each, the operations taking turns; fp32, "
            f"on the experiment's prepared data: 64-row batches of client 0's "
            f"{micro.get('client_rows', 0):,} rows, a new batch of its permutation at every "
            "call, as in local training.",
            "",
            "| operation | microseconds per call (median) | min-max of the turns |",
            "|---|---|---|",
        ]
        for name, sec in micro["seconds_per_call"].items():
            lo, hi = micro["spread"][name]
            lines.append(f"| {name} | {sec * 1e6:,.1f} | {lo * 1e6:,.1f}-{hi * 1e6:,.1f} |")

    # ------------------------------------------------------------------ candidates
    lines += ["", "## Candidates for a fix, by measured share", ""]
    lines += candidates(precisions, sums, micro)
    if all(by[p]["profile"] for p in precisions):
        lines += [
            "",
            "Inside the model (the bare loop pays these too): the largest operator categories "
            "of forward+loss, backward and evaluation, as estimated shares of the round "
            "(operator table above):",
            "",
            *model_costs(precisions, by, sums),
        ]
    lines += ["", "## Commands", "", "Each run is the same experiment as:", ""]
    lines += [f"    {by[p]['command']}" for p in precisions]
    return "\n".join(lines) + "\n"


def category_shares(
    info: dict[str, Any], region: str, timed_s: float
) -> dict[str, tuple[float, float]]:
    """Each operator category's (share of the region's profiled time, estimated seconds per
    round): the share times the region's seconds measured without the profiler."""
    total = info["region_seconds"] - info["nested_region_seconds"]
    return {
        cat: (v / total, v / total * timed_s) for cat, v in categorised(info["ops"], region).items()
    }


def operator_table(
    region: str, precisions: list[str], by: dict[str, Any], sums: dict[str, Any]
) -> list[str]:
    lines = [
        f"**{region}**",
        "",
        "| operators | " + " | ".join(f"{p} share | {p} est. s/round" for p in precisions) + " |",
        "|---|" + "---|---|" * len(precisions),
    ]
    rows: dict[str, dict[str, tuple[float, float]]] = defaultdict(dict)
    tops = {}
    for p in precisions:
        info = by[p]["profile"].get(region)
        if not info:
            continue
        total = info["region_seconds"] - info["nested_region_seconds"]
        timed_s = sums[p]["seconds"][region]
        for cat, shares in category_shares(info, region, timed_s).items():
            rows[cat][p] = shares
        gaps = info["gaps_seconds"] or 0.0
        rows["between operators"][p] = (gaps / total, gaps / total * timed_s)
        tops[p] = list(info["ops"].items())[:4]
    for cat in [*OP_CATEGORIES, "between operators"]:
        if cat not in rows:
            continue
        cells = " | ".join(
            f"{100 * rows[cat][p][0]:.1f} % | {rows[cat][p][1]:.3f}" if p in rows[cat] else "- | -"
            for p in precisions
        )
        lines.append(f"| {cat} | {cells} |")
    lines += [
        "",
        "Largest operators: "
        + "; ".join(
            f"{p}: " + ", ".join(f"`{name}` {sec:.2f} s" for name, sec in tops[p])
            for p in precisions
            if p in tops
        ),
        "",
    ]
    return lines


# Phases both loops run alike: an engine - bare difference there is not work to cut.
SAME_WORK = ("train/forward+loss", "train/backward", "train/optimizer step", "train/zero_grad")

# Where a fix would go, per category of the engine beyond the bare loop.
FIX_HINTS = {
    "train/data: gather batch": "the images of a batch are gathered by advanced indexing "
    "(`self.x[idx]`, aten::index); index_select over rows contiguous in memory gives the same "
    "tensor, values and strides (single operations above) (data/federated.py ClientData.batch)",
    "train/other Python in the loop": "per-step Python in training/local.py local_train: "
    "the autocast context, LossOutput checks, `loss_sum += loss.detach()`",
    "client/reply state copy": "get_arrays clones the whole state per client "
    "(training/local.py get_arrays via trained_reply)",
    "client/load weights": "set_arrays copies the global weights per client "
    "(training/local.py set_arrays)",
    "server/aggregation": "weighted_average accumulates every tensor in float64, one add_ "
    "per client per tensor (training/aggregation.py)",
    "run/checkpoint": "a checkpoint every round (fsync; runs/checkpoint.py save_checkpoint); "
    "--checkpoint-every N",
    "run/metrics": "one fsync'd metrics line per round (runs/folder.py append_metrics)",
    "train/zero_grad": "zero_grad(set_to_none=True) per step",
    "train/optimizer step": "SGD step (foreach) per step",
    "train/backward": "autograd backward",
    "train/forward+loss": "the loss function's forward pass",
    "train/optimizer creation": "a new SGD per client (training/local.py make_optimizer)",
    "engine/NaN-Inf checks": "isfinite over every reply (runs/loop.py non_finite_value)",
}


def candidates(precisions: list[str], sums: dict[str, Any], micro: dict | None) -> list[str]:
    """The categories of the engine beyond the bare loop, largest first, with their share
    of the round in each precision; evaluation as the one cost the bare loop leaves out."""
    order = sorted(
        sums[precisions[0]]["beyond"],
        key=lambda c: -min(sums[p]["beyond"][c] / sums[p]["wall"] for p in precisions),
    )
    lines = []
    for c in order:
        shares = [sums[p]["beyond"][c] / sums[p]["wall"] for p in precisions]
        if max(shares) < 0.002 or c in SAME_WORK:
            continue
        where = FIX_HINTS.get(c, "")
        lines.append(
            f"- `{c}`: "
            + ", ".join(f"{p} {100 * s:.1f} %" for p, s in zip(precisions, shares, strict=True))
            + f" of the round beyond the bare loop. {where}"
        )
    ev = [sums[p]["seconds"]["eval/global model"] / sums[p]["wall"] for p in precisions]
    lines.append(
        "- `eval/global model` (not in the bare loop): "
        + ", ".join(f"{p} {100 * s:.1f} %" for p, s in zip(precisions, ev, strict=True))
        + " of the round (10,000 test images every round; --eval-every N divides it)."
    )
    lines.append(
        "- Shares under 0.2 % of the round in every precision are left out; the full "
        "difference table is above."
    )
    lines.append(
        "- Not candidates: the phases in which engine and bare loop do the same work ("
        + ", ".join(f"`{c}`" for c in SAME_WORK)
        + "); their engine - bare differences ("
        + "; ".join(
            f"{p}: "
            + ", ".join(
                f"{100 * sums[p]['beyond'][c] / sums[p]['wall']:+.1f} %" for c in SAME_WORK
            )  # fmt: skip
            for p in precisions
        )
        + " of the round) are the measurement's noise, or an effect of where the batch lies "
        "in memory."
    )
    return lines


def cpu_text(cpu: dict[str, Any] | None) -> str:
    if not cpu:
        return ""
    native = "yes" if cpu["native_bf16"] else "**no**"
    return (
        f"CPU family/model {cpu['cpu_family_model']}, torch CPU kernels "
        f"{cpu['torch_cpu_capability']}, bf16 instructions (avx512_bf16 or amx_bf16): {native}"
    )


def model_costs(precisions: list[str], by: dict[str, Any], sums: dict[str, Any]) -> list[str]:
    """The eight largest (region, operator category) pairs by their largest estimated share
    of the round over the precisions."""
    regions = ("train/forward+loss", "train/backward", "eval/global model")
    share: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    for p in precisions:
        for region in regions:
            info = by[p]["profile"].get(region)
            if not info:
                continue
            timed_s = sums[p]["seconds"][region]
            for cat, (_, seconds) in category_shares(info, region, timed_s).items():
                share[(region, cat)][p] = seconds / sums[p]["wall"]
    ranked = sorted(
        (k for k, v in share.items() if len(v) == len(precisions)),
        key=lambda k: -max(share[k].values()),
    )
    return [
        f"- {cat} in `{region}`: "
        + ", ".join(f"{p} {100 * share[(region, cat)][p]:.1f} %" for p in precisions)
        for region, cat in ranked[:8]
    ]


def fmt_load(load: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in load)


# ----------------------------------------------------------------------------- main


def per_precision(
    values: list[str], precisions: list[str], name: str, minimum: int
) -> dict[str, int]:
    """``--rounds 3`` or ``--rounds 3 bf16=2``: a value for every precision, then overrides."""
    out: dict[str, int] = {}
    default: int | None = None
    for value in values:
        key, _, number = value.rpartition("=")
        try:
            n = int(number)
        except ValueError:
            raise SystemExit(f"{name}: expected N or PRECISION=N, got {value!r}") from None
        if n < minimum:
            raise SystemExit(f"{name}: {value!r} is below {minimum}")
        if key:
            out[key] = n
        else:
            default = n
    unknown = set(out) - set(precisions)
    if unknown:
        raise SystemExit(f"{name}: {', '.join(sorted(unknown))} not among --precisions")
    missing = [p for p in precisions if p not in out and default is None]
    if missing:
        raise SystemExit(f"{name}: no value for {', '.join(missing)}")
    return {p: out.get(p, default) for p in precisions}  # type: ignore[misc]


def cpu_facts() -> dict[str, Any]:
    """What decides bf16 speed on this CPU: torch's kernel level and the bf16 flags (as a
    run folder records them, fedskew.core.machine.cpu_features), and its family/model."""
    features = cpu_features()
    family = model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "cpu family" and not family:
                family = value.strip()
            elif key == "model" and not model:
                model = value.strip()
    shown = ("avx512_bf16", "amx_bf16", "avx512f")
    return {
        "torch_cpu_capability": features["torch_cpu_capability"],
        "cpu_family_model": f"{family}/{model}",
        "bf16_flags": sorted(f for f in shown if features["flags"].get(f)),
        "native_bf16": features["native_bf16"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument(
        "--rounds",
        nargs="+",
        default=["3"],
        help="rounds; 2..R are measured (R, then PRECISION=R overrides, e.g. 3 bf16=2)",
    )
    ap.add_argument(
        "--local-epochs",
        nargs="+",
        default=["5"],
        help="5 in the issue's experiment (E, then PRECISION=E overrides, e.g. 5 bf16=1)",
    )
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--checkpoint-every", type=int, default=1, help="1: fedskew's default")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--no-profiler", dest="profiler", action="store_false",
                    help="no extra round under torch.profiler")  # fmt: skip
    ap.add_argument("--check-precisions", nargs="*", default=None, choices=["fp32", "bf16"],
                    help="precisions of the with/without-wrappers check (default: all; "
                    "none: skip it)")  # fmt: skip
    ap.add_argument("--max-load", type=float, default=1.5,
                    help="with --wait: wait for a 1-minute load average below this")  # fmt: skip
    ap.add_argument("--wait", type=float, default=0.0,
                    help="longest wait (s) for --max-load before each precision")  # fmt: skip
    ap.add_argument(
        "--resume",
        action="store_true",
        help="reuse the check and the precisions an interrupted invocation of the same "
        "settings saved (<out>.partial.json)",
    )
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--report-only", action="store_true", help="rewrite the .md from the .json")
    args = ap.parse_args()
    out = Path(args.out)
    if args.report_only:
        result = json.loads(out.with_suffix(".json").read_text())
        out.write_text(markdown(result))
        print(f"written: {out}")
        return
    args.rounds = per_precision(args.rounds, args.precisions, "--rounds", 2)
    args.local_epochs = per_precision(args.local_epochs, args.precisions, "--local-epochs", 1)
    if args.check_precisions is None:
        args.check_precisions = list(args.precisions)
    torch.set_num_threads(args.threads)
    command = "python benchmarks/round_profile.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    load_before = os.getloadavg()
    # What a precision's measurement depends on: a partial file of other settings is not used.
    key = {
        "threads": args.threads,
        "rounds": args.rounds,
        "local_epochs": args.local_epochs,
        "weight_decay": args.weight_decay,
        "checkpoint_every": args.checkpoint_every,
        "profiler": args.profiler,
        "data_dir": args.data_dir,
        "check_precisions": args.check_precisions,
    }
    partial_path = out.with_suffix(".partial.json")
    partial: dict[str, Any] = {"key": key, "check": None, "precisions": {}}
    if args.resume and partial_path.exists():
        saved = json.loads(partial_path.read_text())
        if saved.get("key") == key:
            partial = saved
            print(f"continuing from {partial_path}: {sorted(partial['precisions'])} measured",
                  flush=True)  # fmt: skip
    workdir = Path(tempfile.mkdtemp(prefix="fedskew-round-profile-"))
    try:
        args.data_dir, source, random_data = data_source(args.data_dir, workdir)
        cost = wrapper_cost()
        if partial["check"] is None:
            partial["check"] = check_identical(args, workdir)
            partial_path.write_text(json.dumps(partial, indent=2) + "\n")
        for p in args.precisions:
            if p not in partial["precisions"]:
                measured = measure_precision(args, p, workdir, cost)
                measured["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
                partial["precisions"][p] = measured
                partial_path.write_text(json.dumps(partial, indent=2) + "\n")
        micro = micro_costs(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    check = partial["check"]
    precisions = [partial["precisions"][p] for p in args.precisions]
    result = {
        "machine": machine_facts(),
        "cpu": cpu_facts(),
        "software": software_facts(),
        "benchmarks_git": git_commit(Path(__file__).resolve().parent),
        "torch": torch.__version__,
        "threads": args.threads,
        "data_source": source,
        "random_data": random_data,
        "seeds": {"experiment": SEED},
        "command": command,
        "load_before": [round(v, 2) for v in load_before],
        "load_after": [round(v, 2) for v in os.getloadavg()],
        "setting": {
            "profiler": args.profiler,
            "text": (
                f"FedAvg, fmnist, fedavg-cnn, {CLIENTS} clients, dirichlet beta {BETA}, "
                f"{PER_ROUND} per round, batch {BATCH}, lr {LR}, momentum {MOMENTUM}, "
                f"weight decay {args.weight_decay}, eval every round, checkpoint every "
                f"{args.checkpoint_every} round(s), seed {SEED}, memory format auto "
                "(channels_last), denormals flush, clients in this process (workers 0), "
                f"{args.threads} torch threads; local epochs E and rounds per precision below"
            ),
        },
        "check": check,
        "check_setting": CHECK,
        "precisions": precisions,
        "micro": micro,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.write_text(markdown(result))
    partial_path.unlink(missing_ok=True)
    print(markdown(result))
    print(f"written: {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
