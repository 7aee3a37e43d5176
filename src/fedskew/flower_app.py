"""fedskew as a Flower app: a ServerApp that drives any algorithm, a ClientApp that runs it.

An app on top of the run loop, like the command line: the same algorithm file runs here as
in the in-process engine. The ServerApp runs the run loop :func:`fedskew.experiment.run`
with a :class:`~fedskew.engine.flower_engine.FlowerEngine`; the
ClientApp routes each message to the algorithm's client handler, keeping the client's
state in the node's ``context.state``.

Start-up handshake: the ServerApp waits for the nodes, then sends each one a ``setup``
message carrying the experiment configuration (JSON); the node answers with the partition
id from its node config (``partition-id``), which becomes its fedskew client id. Every
node thus builds the same data partition from the same seed and takes its own part; a
node may point at its local copy of the data with the node config key ``data-dir``.

Entry points: ``server_app`` / ``client_app`` (named in the Flower app's pyproject for
``flwr run``), and :func:`run_simulation` for ``fedskew run --engine flower-sim``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from flwr.app import ConfigRecord, Context
from flwr.app import Message as FlowerMessage
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fedskew.algorithm_interface import ClientLogic
from fedskew.building import Prepared, execution_settings, prepare
from fedskew.config import (
    TABLES,
    ExperimentConfig,
    build_config,
    normalise_keys,
    parse_pairs,
    read_config_file,
)
from fedskew.device import apply_settings, resolve_device
from fedskew.engine.client_runtime import ClientRuntime
from fedskew.engine.flower_codec import clear_state, decode, encode, load_state, store_state
from fedskew.engine.flower_engine import MESSAGE_TYPE, FlowerEngine
from fedskew.errors import FedskewError, UsageError
from fedskew.experiment import run
from fedskew.protocol import Message
from fedskew.runfolder import RunFolder

log = logging.getLogger("fedskew")
SETUP = "fedskew.setup"
CONFIG_RECORD = "fedskew.config"
NODE_WAIT_SECONDS = 120.0


# ---------------------------------------------------------------------------- server


def config_from_run_config(run_config: dict[str, Any]) -> ExperimentConfig:
    """An ExperimentConfig from Flower's run config.

    Keys are the config keys of ``fedskew run`` (dashes or underscores); ``config-file``
    names a fedskew TOML/YAML file read first; the tables ``params``, ``partition-params``
    and ``model-options`` are strings of ``key=value`` pairs ("lam=10 start_round=0");
    empty strings mean "not set".
    """
    values: dict[str, Any] = {}
    file_values: dict[str, Any] = {}
    for raw_key, value in run_config.items():
        key = raw_key.replace("-", "_")
        if value == "":
            continue
        if key == "config_file":
            file_values = read_config_file(str(value))
        elif key in TABLES:
            values[key] = parse_pairs(str(value), f"run config '{raw_key}'")
        else:
            values[key] = value
    values = normalise_keys(values, "Flower run config")
    cfg = build_config(normalise_keys(file_values, "config-file"), values)
    cfg.engine = "flower"
    return cfg


def resumed_config(folder: Path) -> tuple[ExperimentConfig, Path]:
    """The configuration saved in an unfinished run folder, to continue it on Flower."""
    run_folder = RunFolder.reopen(folder)
    saved = run_folder.read_config()
    saved.pop("resolved", None)
    cfg = build_config(normalise_keys(saved, str(run_folder.path / "config.json")), {})
    cfg.engine = "flower"
    return cfg, run_folder.path


def wait_for_nodes(grid: Grid, wanted: int, timeout: float = NODE_WAIT_SECONDS) -> list[int]:
    """Node ids once ``wanted`` nodes are connected, or those there are after ``timeout``."""
    deadline = time.monotonic() + timeout
    nodes = list(grid.get_node_ids())
    while len(nodes) < wanted and time.monotonic() < deadline:
        time.sleep(0.5)
        nodes = list(grid.get_node_ids())
    return nodes


def handshake(grid: Grid, nodes: list[int], cfg: ExperimentConfig) -> dict[int, int]:
    """Send the configuration to every node; return {client id: node id}."""
    text = json.dumps(cfg.to_dict())
    messages = [
        FlowerMessage(
            encode(Message(SETUP, strings={"config": text}), {"round": -1, "client_id": -1}),
            node,
            MESSAGE_TYPE,
        )
        for node in nodes
    ]
    node_of: dict[int, int] = {}
    for reply in grid.send_and_receive(messages, timeout=NODE_WAIT_SECONDS):
        node = reply.metadata.src_node_id
        if reply.has_error():
            log.warning("node %d failed the setup: %s", node, reply.error.reason)
            continue
        msg, _ = decode(reply.content)
        cid = int(msg.scalars["partition_id"])
        if cid in node_of:
            raise UsageError(f"nodes {node_of[cid]} and {node} both hold partition {cid}")
        if not 0 <= cid < cfg.num_clients:
            raise UsageError(f"node {node} holds partition {cid}, outside 0..{cfg.num_clients - 1}")
        node_of[cid] = node
    absent = sorted(set(range(cfg.num_clients)) - set(node_of))
    if len(absent) == cfg.num_clients:
        raise FedskewError("no Flower node answered the setup message")
    if absent:
        log.warning("no node holds partitions %s; they count as missing", absent)
    return node_of


def serve(
    grid: Grid,
    cfg: ExperimentConfig,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    on_start: Callable[[int], None] | None = None,
    resume: Path | None = None,
    node_wait: float = NODE_WAIT_SECONDS,
) -> tuple[Path, dict[str, Any]]:
    """Run the experiment through ``grid``: the body of the ServerApp. It waits up to
    ``node_wait`` seconds for one node per client, then starts with those connected."""
    cfg.validate()
    node_of = handshake(grid, wait_for_nodes(grid, cfg.num_clients, node_wait), cfg)
    timeout = cfg.reply_timeout or None

    def engine_factory(
        prep: Prepared, client_logic: ClientLogic, model: torch.nn.Module
    ) -> FlowerEngine:
        return FlowerEngine(grid, node_of, model.state_dict(), timeout=timeout)

    return run(cfg, on_round=on_round, resume=resume, on_start=on_start,
               engine_factory=engine_factory)  # fmt: skip


server_app = ServerApp()


@server_app.main()
def _server_main(grid: Grid, context: Context) -> None:
    # fedskew's warnings (lost or rejected replies) go where Flower's own log goes.
    fedskew_log = logging.getLogger("fedskew")
    if not fedskew_log.handlers:
        for handler in logging.getLogger("flwr").handlers:
            fedskew_log.addHandler(handler)
        fedskew_log.setLevel(logging.INFO)
    run_config = dict(context.run_config)
    resume_dir = str(run_config.pop("resume", "") or "")
    if resume_dir:
        cfg, resume = resumed_config(Path(resume_dir))
    else:
        cfg, resume = config_from_run_config(run_config), None
    folder, summary = serve(grid, cfg, resume=resume)
    log.info("fedskew run finished: %s, final accuracy %s", folder, summary.get("final_accuracy"))


# ---------------------------------------------------------------------------- client


_RUNTIMES: dict[str, ClientRuntime] = {}  # config JSON -> runtime; one process, many nodes


def _runtime(config_json: str, data_dir: str | None) -> ClientRuntime:
    """What a node builds once per experiment: data, partition, scratch model, logic."""
    key = f"{config_json}\n{data_dir}"
    runtime = _RUNTIMES.get(key)
    if runtime is None:
        raw = json.loads(config_json)
        if data_dir:
            raw["data_dir"] = data_dir
        raw["engine"] = "inprocess"  # the node runs the client side itself
        cfg = build_config(normalise_keys(raw, "setup message"), {})
        _RUNTIMES.clear()  # a node serves one experiment at a time
        apply_settings(execution_settings(cfg))  # the node's device (its own GPU, if any)
        runtime = _RUNTIMES[key] = ClientRuntime.from_prepared(prepare(cfg))
    return runtime


def _partition_id(context: Context) -> int:
    value = context.node_config.get("partition-id")
    if value is None:
        raise UsageError("this SuperNode has no 'partition-id' in its node config")
    return int(value)


client_app = ClientApp()


@client_app.train()
def _client_main(message: FlowerMessage, context: Context) -> FlowerMessage:
    msg, envelope = decode(message.content)
    pid = _partition_id(context)
    data_dir = context.node_config.get("data-dir")
    data_dir = str(data_dir) if data_dir else None
    if msg.kind == SETUP:
        # A new experiment: state left by an earlier one on this node must not leak in.
        clear_state(context.state)
        context.state[CONFIG_RECORD] = ConfigRecord({"json": msg.strings["config"]})
        _runtime(msg.strings["config"], data_dir)  # load data now, not in round 1
        reply = Message("ready", scalars={"partition_id": float(pid)})
        return FlowerMessage(encode(reply, {}), reply_to=message)
    if CONFIG_RECORD not in context.state:
        raise FedskewError("message before the setup message")
    runtime = _runtime(str(context.state.config_records[CONFIG_RECORD]["json"]), data_dir)
    cid = int(envelope["client_id"])
    if cid != pid:
        raise FedskewError(f"message for client {cid} reached the node of partition {pid}")
    state = load_state(context.state)
    reply = runtime.handle(cid, int(envelope["round"]), msg, state)
    store_state(state, context.state)
    return FlowerMessage(encode(reply, {}), reply_to=message)


# ---------------------------------------------------------------------------- simulation


def run_simulation(
    cfg: ExperimentConfig,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    on_start: Callable[[int], None] | None = None,
    resume: Path | None = None,
    cpus_per_client: float = 1.0,
    gpus_per_client: float | None = None,
) -> tuple[Path, dict[str, Any]]:
    """``fedskew run --engine flower-sim``: the experiment on Flower's simulation engine
    (Ray backend), one virtual SuperNode per client.

    On CUDA (``device`` cuda, or auto with a GPU) each virtual client gets a GPU fraction,
    ``gpus_per_client`` (default: the visible GPUs shared by the clients of a round), and
    Ray shows each client actor its GPU as cuda:0."""
    from flwr.simulation import run_simulation as flower_run_simulation

    if gpus_per_client is None:
        gpus_per_client = simulation_gpus_per_client(cfg)

    outcome: dict[str, Any] = {}
    app = ServerApp()

    @app.main()
    def _main(grid: Grid, context: Context) -> None:
        try:
            outcome["result"] = serve(grid, cfg, on_round, on_start, resume)
        except BaseException as exc:  # re-raised below, outside Flower's thread
            outcome["error"] = exc

    if cfg.quiet:
        logging.getLogger("flwr").setLevel(logging.WARNING)
    flower_run_simulation(
        server_app=app,
        client_app=client_app,
        num_supernodes=cfg.num_clients,
        backend_config={
            "client_resources": {"num_cpus": cpus_per_client, "num_gpus": gpus_per_client},
            "init_args": {"log_to_driver": False, "logging_level": "error"},
        },
    )
    if "error" in outcome:
        raise outcome["error"]
    if "result" not in outcome:
        raise FedskewError("the Flower simulation ended without a result (see its log)")
    return outcome["result"]


def simulation_gpus_per_client(cfg: ExperimentConfig) -> float:
    """The GPU fraction of a virtual client: 0 on the CPU, else the visible GPUs divided
    among a round's clients (at most one each), so that a round's clients train at once."""
    if cfg.device.startswith("cuda:"):
        raise UsageError(
            "--engine flower-sim places its clients on the GPUs through Ray (each client "
            "actor sees its GPU as cuda:0): use --device cuda or auto"
        )
    device = resolve_device(cfg.device)
    if device.type != "cuda":
        return 0.0
    return min(1.0, torch.cuda.device_count() / cfg.per_round())
