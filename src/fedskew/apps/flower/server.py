"""The ServerApp: wait for the nodes, send each the experiment (the setup handshake), then
run the round loop with a Flower engine."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from flwr.app import Context
from flwr.app import Message as FlowerMessage
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.exit import ExitCode

from fedskew.apps.flower.run_config import (
    NODE_WAIT_SECONDS,
    SERVER_KEYS,
    SETUP_TIMEOUT_SECONDS,
    SIMULATION_VARIABLE,
    config_from_run_config,
    output_root,
    resumed_config,
    server_options,
)
from fedskew.assembly.prepare import Prepared
from fedskew.config import ExperimentConfig
from fedskew.core.errors import FedskewError
from fedskew.engines.flower_codec import SETUP, decode, encode
from fedskew.engines.flower_engine import MESSAGE_TYPE, FlowerEngine
from fedskew.runs.loop import run
from fedskew.training.interface import ClientLogic
from fedskew.training.privacy import reply_arrays as privacy_reply_arrays
from fedskew.training.protocol import Message
from fedskew.version import __version__

log = logging.getLogger("fedskew")
PROGRESS_SECONDS = 30.0  # a slow setup or node wait says where it stands this often
POLL_SECONDS = 0.5


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
    """Node ids once ``wanted`` nodes are connected, or those there are after ``timeout``;
    a one-line error when none is: the setup cannot then be what went wrong."""
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
    if not nodes:
        # Flower's SuperNodes do not come back after their SuperLink restarts (the new one
        # does not know them): the likeliest cause.
        raise FedskewError(
            f"no SuperNode is connected to the SuperLink (waited {timeout:.0f} s: node-wait); "
            f"start one per client ({wanted}) with flower-supernode, and again after a "
            "SuperLink restart: SuperNodes do not reconnect to a restarted SuperLink"
        )
    if len(nodes) < wanted:
        log.warning(
            "Flower: %d of %d nodes connected after %.0f s (node-wait); the others' "
            "partitions count as missing", len(nodes), wanted, time.monotonic() - start,
        )  # fmt: skip
    return nodes


def handshake(
    grid: Grid,
    nodes: list[int],
    cfg: ExperimentConfig,
    timeout: float | None = None,
    denormals: dict[str, int] | None = None,
    facts: dict[int, dict[str, Any]] | None = None,
) -> dict[int, int]:
    """Send the configuration to every node; return {client id: node id}. ``denormals``
    counts what the ready nodes measured of their denormal handling ({state: nodes});
    ``facts`` gets what each ready node computes with ({client id: NODE_FACTS}).

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
    failures: list[str] = []  # what nodes that failed the setup said, for the error below
    answered = 0
    start = last_answer = time.monotonic()
    next_report = start + PROGRESS_SECONDS
    while pending:
        for reply in grid.pull_messages(list(pending)):
            node = pending.pop(reply.metadata.reply_to_message_id, None)
            if node is None:
                continue
            last_answer = time.monotonic()
            answered += 1
            if reply.has_error():
                failures.append(f"node {node}: {reply.error.reason}")
            cid = _setup_reply(reply, node, cfg, node_of)
            if cid is not None:
                node_of[cid] = node
                if denormals is not None:
                    state = _node_denormals(reply, node, cfg)
                    denormals[state] = denormals.get(state, 0) + 1
                if facts is not None:
                    facts[cid] = _node_facts(reply, node, cid)
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
        raise FedskewError(_no_ready_node(len(nodes), answered, failures, absent, start))
    if absent:
        log.warning("no node holds partitions %s; they count as missing", ranges(absent))
    return node_of


def _no_ready_node(
    connected: int, answered: int, failures: list[str], absent: list[int], start: float
) -> str:
    """Why the setup left no node to train with, in one line: the nodes failed it (their
    first reason: a ClientApp that cannot import fedskew says so here), answered without a
    partition of this run, or were connected but silent (still starting, or stuck)."""
    if failures:
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        return (
            f"every SuperNode that answered failed the setup message; {failures[0]}{more} "
            "(is fedskew[flower] installed where the SuperNode runs its ClientApp?)"
        )
    if answered:
        return (
            f"{answered} SuperNodes answered the setup but none holds a partition of this run "
            f"(0 .. {len(absent) - 1}): check their --node-config partition-id"
        )
    return (
        f"{connected} SuperNodes are connected but none answered the setup message within "
        f"{time.monotonic() - start:.0f} s (partitions {ranges(absent)} still starting); "
        "see the SuperNodes' logs, and give a busy machine a longer setup-timeout"
    )


def _starting(cfg: ExperimentConfig, node_of: dict[int, int]) -> str:
    return ranges(set(range(cfg.num_clients)) - set(node_of)) or "none"


def _setup_reply(
    reply: FlowerMessage, node: int, cfg: ExperimentConfig, node_of: dict[int, int]
) -> int | None:
    """The partition id a node answered the setup with; None, with a warning, when it failed
    the setup or its answer is not one: a node must not stop the server, so a malformed
    answer, a partition outside the run or one another node holds leaves this node out."""
    if reply.has_error():
        log.warning("node %d failed the setup: %s", node, reply.error.reason)
        return None
    try:
        msg, _ = decode(reply.content)
    except Exception as exc:  # noqa: BLE001 - whatever a node answers must not stop the server
        log.warning("node %d left out: its setup answer is not fedskew's (%s)", node, exc)
        return None
    value = msg.scalars.get("partition_id")
    if value is None or not math.isfinite(value) or not float(value).is_integer():
        log.warning("node %d left out: its setup answer has no partition id (%r)", node, value)
        return None
    cid = int(value)
    if not 0 <= cid < cfg.num_clients:
        log.warning(
            "node %d left out: it holds partition %d, outside 0..%d (check its partition-id)",
            node, cid, cfg.num_clients - 1,
        )  # fmt: skip
        return None
    if cid in node_of:
        log.warning(
            "node %d left out: it also claims partition %d, held by node %d (two SuperNodes "
            "with one partition-id)", node, cid, node_of[cid],
        )  # fmt: skip
        return None
    return cid


def _node_denormals(reply: FlowerMessage, node: int, cfg: ExperimentConfig) -> str:
    """What a ready node says its threads do with denormals; a warning when it is not what
    the run asks for (a node of an older fedskew says nothing: "unknown")."""
    msg, _ = decode(reply.content)
    state = str(msg.strings.get("denormals", "unknown"))[:40]
    if state != cfg.denormals:
        log.warning("node %d computes with denormals %s, not %s", node, state, cfg.denormals)
    return state


# What a node's setup answer says it computes with (client.py), recorded per node in
# processes.jsonl; the first three are compared with the server's.
NODE_FACTS = ("torch", "fedskew", "device", "device_name", "python", "denormals")
COMPARED_FACTS = ("torch", "fedskew", "device")
_FACT_LENGTH = 80  # a node's answer is not trusted to be short


def _node_facts(reply: FlowerMessage, node: int, cid: int) -> dict[str, Any]:
    """What a ready node said it computes with (None for what an older fedskew does not
    say)."""
    msg, _ = decode(reply.content)
    said = {k: msg.strings.get(k) for k in NODE_FACTS}
    return {
        "partition": cid,
        "node": node,
        **{k: None if v is None else str(v)[:_FACT_LENGTH] for k, v in said.items()},
    }


def server_facts(device: torch.device) -> dict[str, str]:
    """What the server computes with, as a node says it of itself."""
    return {"torch": torch.__version__, "fedskew": __version__, "device": str(device)}


def compare_nodes(nodes: dict[int, dict[str, Any]], server: dict[str, str]) -> list[str]:
    """One warning per fact in which nodes differ from the server (torch, fedskew, the kind
    of device): their clients' updates may then differ from the in-process run's, in the
    low bits or more, and the run folder holds the server's versions only in its own line."""
    lines: list[str] = []
    for key in COMPARED_FACTS:
        ours = server[key] if key != "device" else torch.device(server[key]).type
        differ: dict[str, list[int]] = {}
        for cid, facts in nodes.items():
            value = facts.get(key)
            if key == "device" and value is not None:
                value = value.split(":", 1)[0]
            if value != ours:
                differ.setdefault("unknown" if value is None else value, []).append(cid)
        for value, cids in sorted(differ.items()):
            lines.append(
                f"the SuperNodes of partitions {ranges(cids)} run {key} {value}, the server "
                f"{ours}: their clients may compute other results than the server's {key} "
                "would (processes.jsonl records each node's)"
            )
    return lines


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
    node_denormals: dict[str, int] = {}
    node_facts: dict[int, dict[str, Any]] = {}
    node_of = handshake(grid, nodes, cfg, setup_timeout, node_denormals, node_facts)
    timeout = cfg.reply_timeout or None

    def engine_factory(
        prep: Prepared, client_logic: ClientLogic, model: torch.nn.Module
    ) -> FlowerEngine:
        declared = prep.algorithm.reply_arrays(prep.params, model, prep.dataset.num_classes)
        if declared is not None:  # a summand's extra arrays, where the server sees summands
            declared = {**declared, **privacy_reply_arrays(prep.privacy)}
        engine = FlowerEngine(
            grid, node_of, model.state_dict(), timeout=timeout, declared=declared,
            client_sizes=[len(p) for p in prep.partition],
            scalars=prep.algorithm.reply_scalars(prep.params),
        )  # fmt: skip
        engine.client_denormals = dict(node_denormals)
        engine.client_nodes = [node_facts[cid] for cid in sorted(node_facts)]
        for line in compare_nodes(node_facts, server_facts(prep.device)):
            log.warning("%s", line)
        return engine

    return run(cfg, on_round=on_round, resume=resume, on_start=on_start,
               engine_factory=engine_factory)  # fmt: skip


server_app = ServerApp()


def _percent(value: Any) -> str:
    return "n/a" if value is None else f"{100 * value:.2f} %"


def round_line(record: dict[str, Any], rounds: int) -> str:
    """What the streamed log says of a round: its accuracy where it was evaluated, the
    privacy spent where DP is on, and the clients that did not count."""
    parts = [f"round {record['round']}/{rounds}"]
    if record.get("skipped"):
        parts.append("skipped (no reply arrived)")
    if "accuracy" in record:
        parts.append(f"accuracy {_percent(record['accuracy'])}")
    if "dp_epsilon" in record:
        eps = record["dp_epsilon"]
        parts.append("no finite epsilon (no noise)" if eps is None else f"epsilon {eps:.3g}")
    missing = record.get("missing_replies") or []
    if missing:
        parts.append(f"{len(missing)} replies missing")
    return ", ".join(parts)


def final_line(folder: Path, summary: dict[str, Any]) -> str:
    """The streamed log's last fedskew line: where the run folder is and what it reached."""
    line = (
        f"fedskew run finished after {summary.get('rounds')} rounds: final accuracy "
        f"{_percent(summary.get('final_accuracy'))}, best {_percent(summary.get('best_accuracy'))}"
    )
    if summary.get("dp", "off") != "off":
        eps = summary.get("dp_epsilon")
        spent = "no finite epsilon" if eps is None else f"epsilon {eps:.3g}"
        line += f", {summary['dp']} DP {spent} at delta {summary.get('dp_delta', 0):g}"
    return f"{line}; run folder {folder}"


class OneLineRefusal(logging.Filter):
    """Keeps a fedskew error to the one line the ServerApp logs itself.

    Flower logs an exception that leaves a ServerApp with its traceback, then its exit
    code's help ("An unhandled exception occurred in the ServerApp"), into the log that
    ``flwr log`` streams to the user: for a refused run config that is twenty lines of
    fedskew's internals around a line that already says what is wrong. Only records that
    carry a FedskewError, and the exit message that follows one, are dropped; any other
    exception keeps its traceback (a fault in fedskew, to be reported)."""

    def __init__(self) -> None:
        super().__init__()
        self.refused = False

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, FedskewError):
            self.refused = True
            return False
        exit_line = f"Exit Code: {int(ExitCode.SERVERAPP_EXCEPTION)}"
        if self.refused and str(record.msg).startswith(exit_line):
            self.refused = False  # the one exit message of that error
            return False
        return True


def _one_line_refusals() -> None:
    """Put the filter on Flower's logger once per process, with nothing refused yet."""
    flwr_log = logging.getLogger("flwr")
    for old in [f for f in flwr_log.filters if isinstance(f, OneLineRefusal)]:
        flwr_log.removeFilter(old)
    flwr_log.addFilter(OneLineRefusal())


@server_app.main()
def _server_main(grid: Grid, context: Context) -> None:
    # fedskew's warnings (lost or rejected replies) go where Flower's own log goes.
    fedskew_log = logging.getLogger("fedskew")
    if not fedskew_log.handlers:
        for handler in logging.getLogger("flwr").handlers:
            fedskew_log.addHandler(handler)
        fedskew_log.setLevel(logging.INFO)
    _one_line_refusals()
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
        if os.environ.get(SIMULATION_VARIABLE) == "1":
            cfg.engine = "flower-sim"  # `fedskew run --engine flower-sim`'s own SuperLink
        rounds = cfg.rounds

        def say_round(record: dict[str, Any]) -> None:
            log.info("%s", round_line(record, rounds))

        folder, summary = serve(grid, cfg, on_round=say_round, resume=resume, **options)
    except FedskewError as exc:
        log.error("fedskew: %s", exc)  # the one line; OneLineRefusal keeps it the only one
        raise
    finally:
        remove_runtime_environment(context.run_id)
    log.info("%s", final_line(folder, summary))


def remove_runtime_environment(run_id: int) -> None:
    """Delete the environment Flower's runtime dependency installation made for this run,
    now rather than on Flower's exit.

    Flower 1.42 deletes it first among its exit handlers, before it reports the ServerApp's
    status, and kills the process 5 s into them: the environment holds torch (tens of
    thousands of files, about 10 s to delete on a busy 2-core machine), so the status never
    went out and the SuperLink marked every finished run "failed: No heartbeat received from
    the task" (flwrlabs/flower PR 7921 reorders the handlers). Deleted here, Flower finds
    nothing left to delete. Only the folder Flower made for this run is touched: the one its
    installer activated (VIRTUAL_ENV), named after the run, in a ``runtime-envs`` folder."""
    value = os.environ.get("VIRTUAL_ENV", "")
    if not value:
        return
    env = Path(value)
    if env.name != str(run_id) or env.parent.name != "runtime-envs" or not env.is_dir():
        return  # not Flower's per-run environment: the operator's own, never touched
    started = time.monotonic()
    shutil.rmtree(env, ignore_errors=True)  # loaded modules stay loaded; nothing imports later
    log.info("removed the run's environment %s in %.1f s", env, time.monotonic() - started)
