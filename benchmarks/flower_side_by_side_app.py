"""The Flower side of benchmarks/flower_side_by_side.py: a plain Flower 1.42 app, written the
way Flower's PyTorch documentation writes one (quickstart-pytorch: a ``ClientApp`` whose
``@app.train()`` builds the model, loads the received ``ArrayRecord``, trains over a
``DataLoader`` with a per-batch loop and replies with an ``ArrayRecord`` and a
``MetricRecord``; a ``ServerApp`` whose ``@app.main()`` starts a ``FedAvg`` strategy with a
central ``evaluate_fn``; ``flwr.simulation.run_simulation`` on Ray).

    python benchmarks/flower_side_by_side_app.py SPEC.json RESULT.json

SPEC.json (written by flower_side_by_side.py) holds the experiment: variant (``docs`` or
``tricks``), precision (``fp32`` or ``bf16``), rounds, local epochs, batch size, SGD lr and
momentum, seed, the fedskew partition file, the clients of every round and the client
resources. What differs from the documentation's app, and why:

- Data: fedskew's Fashion-MNIST loader (the same normalised tensors as fedskew's side) and
  the client index lists of fedskew's partition file, held in a ``TensorDataset`` per
  client; loaded once per process in this importable module (the documentation caches its
  ``FederatedDataset`` the same way). The model is fedskew's ``fedavg-cnn``, and the server
  starts from fedskew's initial weights for the seed.
- The clients of each round: fedskew's (``PinnedFedAvg.configure_train``), not FedAvg's
  random sample, so both sides train the same clients. Flower's node ids are random, so
  before the strategy starts the server asks every node its ``partition-id`` (one query
  message each; counted in startup, not in a round).
- The round time: from ``configure_train`` (before the messages are sent) to the end of
  ``aggregate_train``, the span fedskew's ``seconds`` covers (send, train, reply, average);
  the central evaluation is timed apart.
- Every reply also carries three probe figures (``torch_threads``, ``denormals_flushed``,
  ``pid``) that the result records; the DataLoader's shuffle is seeded per (seed, round,
  client) so that a repeat trains the same batches.

The ``tricks`` variant adds by hand, in the client only, what fedskew does for speed in
fp32: ``torch.set_flush_denormal(True)`` at the top of every train call, and the model and
every input batch in ``channels_last``. Precision ``bf16`` adds the forward pass and loss
under bf16 autocast (weights stay fp32; the central evaluation runs under bf16 autocast too,
as fedskew's bf16 runs do); ``fp32`` trains without autocast.

The flush flag is per thread (the x86 MXCSR register): it holds on the thread that sets it,
and torch's OpenMP pool threads keep the one they were started with. In the actors
OMP_NUM_THREADS=1, so torch has no pool thread (the ``torch_threads`` probe shows 1) and the
whole training runs on the thread that calls the train function: the DataLoader has no
worker processes, and CPU autograd runs backward on the calling thread. The flag is set at
the top of that call, and the ``denormals_flushed`` probe runs at its end, on the same thread;
the probe's tensor is large enough to be split over up to 32 pool threads, so it would also
show a pool thread that does not flush (see ``denormals_flushed``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from functools import lru_cache
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from torch.utils.data import DataLoader, TensorDataset

HERE = Path(__file__).resolve().parent
MODEL = "fedavg-cnn"
DATASET = "fmnist"
EVAL_BATCH = 128  # the documentation's central evaluation batch
VARIANTS = ("docs", "tricks")
PRECISIONS = ("fp32", "bf16")

# ----------------------------------------------------------------------------- task


DENORMAL_BITS = 1 << 22  # float32 bits of a denormal (about 5.9e-39)


def denormals_flushed() -> bool:
    """Whether every thread that computes for this one flushes denormal floats: this thread
    and the torch pool threads that share a multiplication of 2**20 elements (32 of torch's
    32,768-element grains). The denormals are made from their bits and the products read
    as bits, so no float conversion or comparison on this thread can hide a pool thread
    that keeps them (``torch.full(n, 1e-39)`` would: the value is converted once, on this
    thread, and flushed there)."""
    x = torch.full((1 << 20,), DENORMAL_BITS, dtype=torch.int32).view(torch.float32)
    return int(((x * 1.0).view(torch.int32) != 0).sum()) == 0


def build_model() -> torch.nn.Module:
    from fedskew.models import build_model as fedskew_build_model

    return fedskew_build_model(MODEL, (1, 28, 28), 10)


def initial_model(seed: int) -> torch.nn.Module:
    """fedskew's initial model for ``seed`` (fedskew.assembly.prepare.new_model for FedAvg)."""
    from fedskew.core.rng import derive_seed

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, -1, -1, "model-init"))
        return build_model()


@lru_cache(maxsize=1)
def dataset(data_dir: str) -> Any:
    """Fashion-MNIST from fedskew's loader, once per process."""
    from fedskew.data.sources import load_dataset

    return load_dataset(DATASET, data_dir or None)


@lru_cache(maxsize=1)
def partition(path: str) -> list[Any]:
    from fedskew.data.partition import read_partition_file

    return read_partition_file(path)


def load_data(partition_id: int, config: ConfigRecord, seed: int) -> DataLoader:
    """The client's training data as a shuffled DataLoader, as the documentation builds it."""
    data = dataset(str(config["data-dir"]))
    idx = torch.from_numpy(partition(str(config["partition-file"]))[partition_id])
    trainset = TensorDataset(data.x_train[idx], data.y_train[idx])
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(
        trainset, batch_size=int(config["batch-size"]), shuffle=True, generator=generator
    )


def train(
    model: torch.nn.Module,
    trainloader: DataLoader,
    epochs: int,
    lr: float,
    momentum: float,
    channels_last: bool,
    bf16: bool,
) -> float:
    """The documentation's training loop; with ``channels_last``, channels_last inputs; with
    ``bf16``, forward and loss under bf16 autocast."""
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    model.train()
    running_loss = 0.0
    for _ in range(epochs):
        for images, labels in trainloader:
            if channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = criterion(model(images), labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    return running_loss / (epochs * len(trainloader))


def test(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, channels_last: bool, bf16: bool
) -> dict:
    """Loss and accuracy on the test set."""
    testloader = DataLoader(TensorDataset(x, y), batch_size=EVAL_BATCH)
    criterion = torch.nn.CrossEntropyLoss(reduction="sum")
    model.eval()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for images, labels in testloader:
            if channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                outputs = model(images)
            loss += criterion(outputs.float(), labels).item()
            correct += (outputs.argmax(1) == labels).sum().item()
    return {"accuracy": correct / len(y), "loss": loss / len(y)}


# ----------------------------------------------------------------------------- ClientApp

app = ClientApp()


@app.query()
def query(msg: Message, context: Context) -> Message:
    """The node's partition id (the server maps node ids to fedskew's client ids)."""
    content = RecordDict(
        {"metrics": MetricRecord({"partition-id": int(context.node_config["partition-id"])})}
    )
    return Message(content=content, reply_to=msg)


@app.train()
def client_train(msg: Message, context: Context) -> Message:
    """Train the received model on this node's data."""
    config = msg.content["config"]
    tricks = config["variant"] == "tricks"
    if tricks:  # per thread: this one trains, and torch has no pool (OMP_NUM_THREADS=1)
        torch.set_flush_denormal(True)
    model = build_model()
    if tricks:
        model = model.to(memory_format=torch.channels_last)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    partition_id = int(context.node_config["partition-id"])
    seed = int(config["seed"]) * 1_000_003 + int(config["server-round"]) * 1_009 + partition_id
    trainloader = load_data(partition_id, config, seed)
    train_loss = train(
        model,
        trainloader,
        int(config["local-epochs"]),
        float(config["lr"]),
        float(config["momentum"]),
        channels_last=tricks,
        bf16=config["precision"] == "bf16",
    )
    metrics = {
        "train_loss": train_loss,
        "num-examples": len(trainloader.dataset),
        "partition-id": partition_id,
        "torch_threads": torch.get_num_threads(),
        "denormals_flushed": int(denormals_flushed()),  # this thread, after training
        "pid": os.getpid(),
    }
    content = RecordDict(
        {"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord(metrics)}
    )
    return Message(content=content, reply_to=msg)


# ----------------------------------------------------------------------------- ServerApp


class PinnedFedAvg(FedAvg):
    """FedAvg that trains the given clients each round (fedskew's sample) and times the
    round from sending to the end of the averaging."""

    def __init__(self, clients: list[list[int]], node_of: dict[int, int], **kwargs: Any):
        super().__init__(fraction_evaluate=0.0, **kwargs)  # central evaluation only
        self.clients = clients
        self.node_of = node_of
        self.rounds: list[dict[str, Any]] = []
        self._started = 0.0

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> list[Message]:
        self._started = time.perf_counter()
        config["server-round"] = server_round
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        nodes = [self.node_of[c] for c in self.clients[server_round - 1]]
        return list(self._construct_messages(record, nodes, MessageType.TRAIN))

    def aggregate_train(
        self, server_round: int, replies: Any
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        arrays, metrics = super().aggregate_train(server_round, replies)
        seconds = time.perf_counter() - self._started
        errors = [r.error.reason for r in replies if r.has_error()]
        per_client = [dict(r.content["metrics"]) for r in replies if not r.has_error()]
        self.rounds.append(
            {
                "round": server_round,
                "seconds": round(seconds, 4),
                "clients": sorted(int(m["partition-id"]) for m in per_client),
                "num_examples": {
                    int(m["partition-id"]): int(m["num-examples"]) for m in per_client
                },
                "probes": [
                    {k: m[k] for k in ("partition-id", "torch_threads", "denormals_flushed", "pid")}
                    for m in per_client
                ],
                "errors": errors,
            }
        )
        if errors:
            raise RuntimeError(f"round {server_round}: {len(errors)} client(s) failed: {errors[0]}")
        return arrays, metrics


def partition_ids(grid: Grid, num_nodes: int, timeout: float) -> dict[int, int]:
    """{partition id: node id}, asked of every node once all ``num_nodes`` are connected."""
    deadline = time.monotonic() + timeout
    nodes = list(grid.get_node_ids())
    while len(nodes) < num_nodes and time.monotonic() < deadline:
        time.sleep(0.2)
        nodes = list(grid.get_node_ids())
    messages = [
        Message(content=RecordDict(), message_type=MessageType.QUERY, dst_node_id=node)
        for node in nodes
    ]
    node_of: dict[int, int] = {}
    for reply in grid.send_and_receive(messages, timeout=timeout):
        if reply.has_error():
            raise RuntimeError(f"node {reply.metadata.src_node_id}: {reply.error.reason}")
        node_of[int(reply.content["metrics"]["partition-id"])] = reply.metadata.src_node_id
    if len(node_of) != num_nodes:
        raise RuntimeError(f"{len(node_of)} of {num_nodes} nodes answered the partition query")
    return node_of


def make_server_app(spec: dict[str, Any], outcome: dict[str, Any]) -> ServerApp:
    server = ServerApp()
    tricks = spec["variant"] == "tricks"
    bf16 = spec["precision"] == "bf16"

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        strategy: PinnedFedAvg | None = None
        try:
            t0 = time.perf_counter()
            node_of = partition_ids(grid, spec["num_clients"], spec["setup_timeout"])
            outcome["query_seconds"] = round(time.perf_counter() - t0, 3)
            data = dataset(spec["data_dir"])
            strategy = PinnedFedAvg(spec["clients"], node_of)
            evaluations: list[dict[str, Any]] = []

            def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
                if server_round == 0:  # fedskew does not test the initial model either
                    return None
                start = time.perf_counter()
                model = build_model()
                if tricks:
                    model = model.to(memory_format=torch.channels_last)
                model.load_state_dict(arrays.to_torch_state_dict())
                result = test(model, data.x_test, data.y_test, tricks, bf16)
                result["eval_seconds"] = round(time.perf_counter() - start, 4)
                evaluations.append({"round": server_round, **result})
                return MetricRecord(result)

            train_config = ConfigRecord(
                {
                    "variant": spec["variant"],
                    "precision": spec["precision"],
                    "lr": spec["lr"],
                    "momentum": spec["momentum"],
                    "local-epochs": spec["epochs"],
                    "batch-size": spec["batch_size"],
                    "seed": spec["seed"],
                    "partition-file": spec["partition_file"],
                    "data-dir": spec["data_dir"],
                }
            )
            strategy.start(
                grid=grid,
                initial_arrays=ArrayRecord(initial_model(spec["seed"]).state_dict()),
                num_rounds=spec["rounds"],
                timeout=spec["round_timeout"],
                train_config=train_config,
                evaluate_fn=global_evaluate,
            )
            outcome["rounds"] = strategy.rounds
            outcome["evaluations"] = evaluations
            outcome["dataset_source"] = data.source
            outcome["train_samples"] = int(data.y_train.numel())
            outcome["test_samples"] = int(data.y_test.numel())
            outcome["server_torch_threads"] = torch.get_num_threads()
        except BaseException as exc:  # reported by main(), outside Flower's thread
            outcome["error"] = f"{type(exc).__name__}: {exc}"
            if strategy is not None:  # the rounds that finished
                outcome.setdefault("rounds", strategy.rounds)

    return server


def merge(outcome: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per round: the strategy's timing and clients with the central evaluation."""
    evaluations = {e["round"]: e for e in outcome.get("evaluations", [])}
    rows = []
    for r in outcome.get("rounds", []):
        e = evaluations.get(r["round"], {})
        rows.append({**r, **{k: e[k] for k in ("accuracy", "loss", "eval_seconds") if k in e}})
    return rows


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python benchmarks/flower_side_by_side_app.py SPEC.json RESULT.json")
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    if spec["variant"] not in VARIANTS or spec["precision"] not in PRECISIONS:
        print(f"variant must be one of {VARIANTS}, precision one of {PRECISIONS}")
        return 2
    # Ray's actors import this module by name (the ClientApp is pickled by reference):
    # they need benchmarks/ and src/ on their path, which they inherit from this process.
    paths = [str(HERE), str(HERE.parent / "src")]
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + ([old] if old else []))
    sys.path[:0] = [p for p in paths if p not in sys.path]
    logging.getLogger("flwr").setLevel(logging.WARNING)
    from flower_probe import install
    from flwr.simulation import run_simulation

    facts_file = Path(argv[1]).with_suffix(".ray.json")
    install(facts_file)  # records the Ray actor pool Flower builds; changes nothing
    import flower_side_by_side_app as named  # the module Ray's actors import

    outcome: dict[str, Any] = {}
    run_simulation(
        server_app=named.make_server_app(spec, outcome),
        client_app=named.app,
        num_supernodes=spec["num_clients"],
        backend_config={
            "client_resources": {"num_cpus": spec["num_cpus"], "num_gpus": 0.0},
        },
    )
    result = {
        "variant": spec["variant"],
        "precision": spec["precision"],
        "flwr": version("flwr"),
        "ray": version("ray"),
        "torch": torch.__version__,
        "ray_facts": json.loads(facts_file.read_text()) if facts_file.exists() else None,
        "rounds": merge(outcome),
        **{k: v for k, v in outcome.items() if k not in ("rounds", "evaluations")},
    }
    Path(argv[1]).write_text(json.dumps(result, indent=1) + "\n")
    if "error" in result:
        print(f"flower side failed: {result['error']}", file=sys.stderr)
        return 1
    if len(result["rounds"]) != spec["rounds"]:
        print(f"flower side: {len(result['rounds'])} of {spec['rounds']} rounds", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
