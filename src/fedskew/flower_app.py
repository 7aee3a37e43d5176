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
node may point at its local copy of the data with the node config key ``data-dir``. The
setup has no fixed deadline: it waits while nodes keep answering (:func:`handshake`).

Paths: a deployed ServerApp writes only under the output root that the server operator sets
in ``$FEDSKEW_OUTPUT_ROOT``; paths in the run config are relative to it (:func:`path_in_root`).
``fedskew run --engine flower-sim`` writes where ``-o`` says: its user is its operator.

Entry points: ``server_app`` / ``client_app`` (named in the Flower app's pyproject for
``flwr run``), and :func:`run_simulation` for ``fedskew run --engine flower-sim``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from flwr.app import ConfigRecord, Context
from flwr.app import Message as FlowerMessage
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fedskew.algorithm_interface import ClientLogic
from fedskew.building import Prepared, execution_settings, prepare
from fedskew.config import (
    NOT_IN_FLOWER_RUN_CONFIG,
    TABLES,
    ExperimentConfig,
    build_config,
    normalise_keys,
    parse_value,
    read_config_file,
)
from fedskew.device import apply_settings, resolve_device
from fedskew.engine.client_runtime import ClientRuntime
from fedskew.engine.flower_codec import clear_state, decode, encode, load_state, store_state
from fedskew.engine.flower_engine import MESSAGE_TYPE, FlowerEngine
from fedskew.errors import FedskewError, UsageError
from fedskew.experiment import run
from fedskew.protocol import Message
from fedskew.runfolder import RunFolder, saved_config

log = logging.getLogger("fedskew")
SETUP = "fedskew.setup"
CONFIG_RECORD = "fedskew.config"
# How long the ServerApp waits for one SuperNode per client to connect (run config node-wait).
NODE_WAIT_SECONDS = 120.0
# How long the setup may go without any node answering, on an idle machine: the default limit
# is this times the load per core (see setup_limit); run config setup-timeout overrides it.
SETUP_TIMEOUT_SECONDS = 120.0
PROGRESS_SECONDS = 30.0  # a slow setup or node wait says where it stands this often
POLL_SECONDS = 0.5
# Where a deployed ServerApp may write: set by the server operator, never by the run config.
OUTPUT_ROOT_VARIABLE = "FEDSKEW_OUTPUT_ROOT"
# Run config keys that only the ServerApp reads (not experiment configuration).
SERVER_KEYS = ("resume", "node-wait", "setup-timeout")
# The config keys of `fedskew run` that flower/pyproject.toml does not declare, and why
# (flwr refuses a --run-config key the app does not declare: every other key must be there).
# Declared with the options (tag flower: False in fedskew.config).
NOT_IN_RUN_CONFIG = NOT_IN_FLOWER_RUN_CONFIG
# Processes started by a Flower simulation carry this variable (see run_simulation).
PROCESS_TAG_VARIABLE = "FEDSKEW_SIMULATION_TAG"


# ---------------------------------------------------------------------------- paths


def output_root() -> Path:
    """The folder a deployed ServerApp writes under: ``$FEDSKEW_OUTPUT_ROOT`` of the process
    that runs the ServerApp (the SuperLink's environment reaches it). Without it the
    ServerApp refuses to start: its working directory is wherever the SuperLink was
    started, and no folder should be written that the operator did not choose."""
    value = os.environ.get(OUTPUT_ROOT_VARIABLE, "").strip()
    if not value:
        raise UsageError(
            f"{OUTPUT_ROOT_VARIABLE} is not set: the fedskew ServerApp writes run folders only "
            f"under the folder the server operator names in {OUTPUT_ROOT_VARIABLE} (in the "
            "environment of flower-superlink, or of the process that runs the ServerApp)"
        )
    root = Path(value).expanduser()
    if not root.is_absolute():
        raise UsageError(f"{OUTPUT_ROOT_VARIABLE} must be an absolute path, got {value!r}")
    if not root.is_dir():
        raise UsageError(f"{OUTPUT_ROOT_VARIABLE}={value} is not a folder (create it first)")
    return root.resolve()


def path_in_root(root: Path, value: str, key: str, absolute_ok: bool = False) -> Path:
    """A path from the run config, inside ``root``: relative to it (an absolute path only
    when ``absolute_ok``), no ``..``, and still inside it once symbolic links are followed."""
    text = str(value)
    where = f"run config '{key}'"
    if "\0" in text:
        raise UsageError(f"{where}: a path cannot hold a NUL character")
    path = Path(text)
    if path.is_absolute() or text.startswith(("/", "\\")):
        if not absolute_ok:
            raise UsageError(
                f"{where} must be a path relative to the output root {root} "
                f"({OUTPUT_ROOT_VARIABLE}), got {text!r}"
            )
    elif ".." in PurePosixPath(text.replace("\\", "/")).parts:
        raise UsageError(f"{where} must stay inside the output root: no '..', got {text!r}")
    resolved = (root / path).resolve()
    if resolved != root and root not in resolved.parents:
        raise UsageError(f"{where}: {text!r} is outside the output root {root}")
    return resolved


# ---------------------------------------------------------------------------- server


def config_from_run_config(run_config: dict[str, Any], root: Path) -> ExperimentConfig:
    """An ExperimentConfig from Flower's run config, for a ServerApp that writes under
    ``root`` (the operator's output root).

    Keys are the config keys of ``fedskew run`` (dashes or underscores); ``config-file``
    names a fedskew TOML/YAML file read first; the tables ``params``, ``partition-params``
    and ``model-options`` are strings of ``key=value`` pairs ("lam=10 start_round=0");
    empty strings mean "not set". Paths are relative to ``root``: ``out-dir`` (default:
    the root itself), ``config-file`` and ``partition-file``; ``data-dir`` is refused (the
    server reads datasets from ``$FEDSKEW_DATA`` or its cache, each node from its node
    config), also when a config file sets these keys.
    """
    values: dict[str, Any] = {}
    file_values: dict[str, Any] = {}
    for raw_key, value in run_config.items():
        key = raw_key.replace("-", "_")
        if value == "":
            continue
        if key == "config_file":
            path = path_in_root(root, str(value), raw_key)
            file_values = normalise_keys(read_config_file(path), "config-file")
        elif key in TABLES:
            values[key] = parse_value(key, str(value), f"run config '{raw_key}'")
        else:
            values[key] = value
    values = normalise_keys(values, "Flower run config")
    merged = {**file_values, **values}
    if merged.get("data_dir") not in (None, ""):
        raise UsageError(
            "data-dir is not taken from the run config of a deployment: the server reads "
            "datasets from $FEDSKEW_DATA or its cache, each SuperNode from its node config "
            "data-dir"
        )
    for key in ("data_dir", "out_dir", "partition_file"):
        file_values.pop(key, None)
        values.pop(key, None)
    values["out_dir"] = str(path_in_root(root, str(merged.get("out_dir") or "."), "out-dir"))
    if merged.get("partition_file") not in (None, ""):
        values["partition_file"] = str(
            path_in_root(root, str(merged["partition_file"]), "partition-file")
        )
    cfg = build_config(file_values, values)
    cfg.engine = "flower"
    return cfg


def resumed_config(value: str, root: Path) -> tuple[ExperimentConfig, Path]:
    """The configuration saved in an unfinished run folder inside ``root`` (a path relative
    to it, or an absolute one that lies in it), to continue it on Flower."""
    folder = path_in_root(root, value, "resume", absolute_ok=True)
    if folder == root:
        raise UsageError(f"run config 'resume' must name a run folder inside {root}, not the root")
    run_folder = RunFolder.reopen(folder)
    cfg = saved_config(run_folder.path)
    cfg.engine = "flower"
    return cfg, run_folder.path


def server_options(run_config: dict[str, Any]) -> dict[str, float | None]:
    """``node-wait`` and ``setup-timeout`` from the run config, in seconds (setup-timeout
    0 or absent: the default, which grows with the machine's load)."""
    options: dict[str, float | None] = {"node_wait": NODE_WAIT_SECONDS, "setup_timeout": None}
    for key in ("node-wait", "setup-timeout"):
        value = run_config.get(key, "")
        if value == "":
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise UsageError(f"run config '{key}' must be a number of seconds, got {value!r}")
        if not math.isfinite(value) or value < 0:
            raise UsageError(f"run config '{key}' must be a number of seconds >= 0, got {value}")
        options[key.replace("-", "_")] = float(value) if value > 0 else None
    if options["node_wait"] is None:
        options["node_wait"] = 0.0
    return options


def machine_load() -> float:
    """Runnable processes per core over the last minute (1.0 where unknown or lower)."""
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        return 1.0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1.0, load / (cores or 1))


def setup_limit(timeout: float | None) -> float:
    """Seconds the setup may go without an answer: ``timeout``, or SETUP_TIMEOUT_SECONDS
    times the load per core (a machine busy twice over its cores gets twice as long)."""
    return timeout if timeout is not None else SETUP_TIMEOUT_SECONDS * machine_load()


def ranges(numbers: Iterable[int]) -> str:
    """'0, 2-4, 7' for [0, 2, 3, 4, 7]."""
    parts: list[list[int]] = []
    for n in sorted(numbers):
        if parts and parts[-1][1] == n - 1:
            parts[-1][1] = n
        else:
            parts.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)


def wait_for_nodes(grid: Grid, wanted: int, timeout: float = NODE_WAIT_SECONDS) -> list[int]:
    """Node ids once ``wanted`` nodes are connected, or those there are after ``timeout``."""
    start = time.monotonic()
    next_report = start + PROGRESS_SECONDS
    nodes = list(grid.get_node_ids())
    while len(nodes) < wanted and time.monotonic() - start < timeout:
        if time.monotonic() >= next_report:
            next_report += PROGRESS_SECONDS
            log.warning(
                "Flower: %d of %d nodes connected after %.0f s (waiting up to %.0f s: node-wait)",
                len(nodes), wanted, time.monotonic() - start, timeout,
            )  # fmt: skip
        time.sleep(POLL_SECONDS)
        nodes = list(grid.get_node_ids())
    return nodes


def handshake(
    grid: Grid, nodes: list[int], cfg: ExperimentConfig, timeout: float | None = None
) -> dict[int, int]:
    """Send the configuration to every node; return {client id: node id}.

    Waits as long as the nodes keep answering: it gives up only after ``setup_limit(timeout)``
    seconds without any answer, so the wait grows with the number of nodes and the machine's
    load. A slow setup says every PROGRESS_SECONDS which partitions are still starting."""
    text = json.dumps(cfg.to_dict())
    messages = [
        FlowerMessage(
            encode(Message(SETUP, strings={"config": text}), {"round": -1, "client_id": -1}),
            node,
            MESSAGE_TYPE,
        )
        for node in nodes
    ]
    pending: dict[str, int] = {}  # message id -> node id
    for msg_id, node in zip(grid.push_messages(messages), nodes, strict=True):
        if msg_id:
            pending[str(msg_id)] = node
        else:
            log.warning("node %d: the setup message could not be sent", node)
    node_of: dict[int, int] = {}
    start = last_answer = time.monotonic()
    next_report = start + PROGRESS_SECONDS
    while pending:
        for reply in grid.pull_messages(list(pending)):
            node = pending.pop(reply.metadata.reply_to_message_id, None)
            if node is None:
                continue
            last_answer = time.monotonic()
            cid = _setup_reply(reply, node, cfg, node_of)
            if cid is not None:
                node_of[cid] = node
        now = time.monotonic()
        limit = setup_limit(timeout)
        if not pending or now - last_answer > limit:
            break
        if now >= next_report:
            next_report += PROGRESS_SECONDS
            log.warning(
                "Flower setup: %d of %d nodes ready after %.0f s; partitions still starting: "
                "%s (gives up after %.0f s without an answer: setup-timeout)",
                len(node_of), len(nodes), now - start, _starting(cfg, node_of), limit,
            )  # fmt: skip
        time.sleep(POLL_SECONDS)
    absent = sorted(set(range(cfg.num_clients)) - set(node_of))
    if len(absent) == cfg.num_clients:
        raise FedskewError(
            f"no Flower node answered the setup message within {time.monotonic() - start:.0f} s "
            f"(partitions {ranges(absent)} still starting; a busy machine may need a longer "
            "setup-timeout)"
        )
    if absent:
        log.warning("no node holds partitions %s; they count as missing", ranges(absent))
    return node_of


def _starting(cfg: ExperimentConfig, node_of: dict[int, int]) -> str:
    return ranges(set(range(cfg.num_clients)) - set(node_of)) or "none"


def _setup_reply(
    reply: FlowerMessage, node: int, cfg: ExperimentConfig, node_of: dict[int, int]
) -> int | None:
    """The partition id a node answered the setup with (None: it failed the setup)."""
    if reply.has_error():
        log.warning("node %d failed the setup: %s", node, reply.error.reason)
        return None
    msg, _ = decode(reply.content)
    cid = int(msg.scalars["partition_id"])
    if cid in node_of:
        raise UsageError(f"nodes {node_of[cid]} and {node} both hold partition {cid}")
    if not 0 <= cid < cfg.num_clients:
        raise UsageError(f"node {node} holds partition {cid}, outside 0..{cfg.num_clients - 1}")
    return cid


def serve(
    grid: Grid,
    cfg: ExperimentConfig,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    on_start: Callable[[int], None] | None = None,
    resume: Path | None = None,
    node_wait: float = NODE_WAIT_SECONDS,
    setup_timeout: float | None = None,
) -> tuple[Path, dict[str, Any]]:
    """Run the experiment through ``grid``: the body of the ServerApp. It waits up to
    ``node_wait`` seconds for one node per client, then starts with those connected; the
    setup waits as :func:`handshake` says."""
    cfg.validate()
    nodes = wait_for_nodes(grid, cfg.num_clients, node_wait)
    node_of = handshake(grid, nodes, cfg, setup_timeout)
    timeout = cfg.reply_timeout or None

    def engine_factory(
        prep: Prepared, client_logic: ClientLogic, model: torch.nn.Module
    ) -> FlowerEngine:
        declared = prep.algorithm.reply_arrays(prep.params, model, prep.dataset.num_classes)
        return FlowerEngine(grid, node_of, model.state_dict(), timeout=timeout, declared=declared)

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
    try:
        root = output_root()
        run_config = dict(context.run_config)
        options = server_options(run_config)
        resume_dir = str(run_config.get("resume", "") or "")
        experiment = {k: v for k, v in run_config.items() if k not in SERVER_KEYS}
        if resume_dir:
            cfg, resume = resumed_config(resume_dir, root)
        else:
            cfg, resume = config_from_run_config(experiment, root), None
        folder, summary = serve(grid, cfg, resume=resume, **options)
    except FedskewError as exc:
        log.error("fedskew: %s", exc)  # one line, above Flower's traceback
        raise
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
    setup_timeout: float | None = None,
    gpus_per_client: float | None = None,
) -> tuple[Path, dict[str, Any]]:
    """``fedskew run --engine flower-sim``: the experiment on Flower's simulation engine
    (Ray backend), one virtual SuperNode per client. The setup waits as :func:`handshake`
    says (``setup_timeout``: seconds without an answer; None: grows with the load).

    Every process the simulation starts inherits a tag in its environment; when it ends,
    successfully or not, any tagged process still running (Ray may leave a ClientAppActor
    that was still starting when the run failed) is ended, and nothing else.

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
            outcome["result"] = serve(
                grid, cfg, on_round, on_start, resume, setup_timeout=setup_timeout
            )
        except BaseException as exc:  # re-raised below, outside Flower's thread
            outcome["error"] = exc

    if cfg.quiet:
        logging.getLogger("flwr").setLevel(logging.WARNING)
    tag = uuid.uuid4().hex
    previous = os.environ.get(PROCESS_TAG_VARIABLE)
    os.environ[PROCESS_TAG_VARIABLE] = tag
    try:
        flower_run_simulation(
            server_app=app,
            client_app=client_app,
            num_supernodes=cfg.num_clients,
            backend_config={
                "client_resources": {"num_cpus": cpus_per_client, "num_gpus": gpus_per_client},
                "init_args": {"log_to_driver": False, "logging_level": "error"},
            },
        )
    finally:
        if previous is None:
            os.environ.pop(PROCESS_TAG_VARIABLE, None)
        else:
            os.environ[PROCESS_TAG_VARIABLE] = previous
        ended = end_processes(tagged_processes(PROCESS_TAG_VARIABLE, tag))
        if ended:
            log.info("ended %d processes the Flower simulation left running", len(ended))
    if "error" in outcome:
        raise outcome["error"]
    if "result" not in outcome:
        raise FedskewError("the Flower simulation ended without a result (see its log)")
    return outcome["result"]


def simulation_gpus_per_client(cfg: ExperimentConfig) -> float:
    """The GPU fraction of a virtual client: 0 on the CPU, else 1/k with k the clients each
    GPU must hold for a round's clients to train at once (at most one GPU each). Ray places
    a fraction below 1 on a single GPU, so 2 GPUs and 3 clients take 1/2 each, not 2/3 (two
    of which would not fit on one GPU)."""
    if cfg.device.startswith("cuda:"):
        raise UsageError(
            "--engine flower-sim places its clients on the GPUs through Ray (each client "
            "actor sees its GPU as cuda:0): use --device cuda or auto"
        )
    device = resolve_device(cfg.device)
    if device.type != "cuda":
        return 0.0
    return 1.0 / math.ceil(cfg.per_round() / torch.cuda.device_count())


# ---------------------------------------------------------------------------- processes


def _start_time(pid: int) -> int | None:
    """A process's start time (clock ticks since boot), None when it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def tagged_processes(variable: str, tag: str) -> list[tuple[int, int]]:
    """(pid, start time) of the live processes, other than this one, whose environment holds
    ``variable=tag``: those a run started, and what they started. Only this user's processes
    can be read; none where there is no /proc."""
    marker = f"{variable}={tag}".encode()
    found: list[tuple[int, int]] = []
    proc = Path("/proc")
    if not proc.is_dir():
        return found
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if marker in environ.split(b"\0"):
            started = _start_time(int(entry.name))
            if started is not None:
                found.append((int(entry.name), started))
    return found


def end_processes(processes: list[tuple[int, int]], grace: float = 5.0) -> list[int]:
    """SIGTERM each (pid, start time) still running, SIGKILL after ``grace`` seconds what is
    left; a pid whose start time changed belongs to another process and is left alone.
    Returns the pids signalled."""

    def same(pid: int, started: int) -> bool:
        return _start_time(pid) == started

    signalled: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid, started in processes:
            if same(pid, started):
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    continue
                if pid not in signalled:
                    signalled.append(pid)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(same(p, s) for p, s in processes):
            time.sleep(0.1)
        if not any(same(p, s) for p, s in processes):
            break
    return signalled
