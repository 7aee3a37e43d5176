"""The ClientApp: each message goes to the algorithm's client handler through the node's
client runtime, with the client's state kept in the node's ``context.state``."""

from __future__ import annotations

import platform

import torch
from flwr.app import ConfigRecord, Context, Error
from flwr.app import Message as FlowerMessage
from flwr.clientapp import ClientApp

from fedskew.core.denormals import denormals_state
from fedskew.core.device import device_name
from fedskew.core.errors import Diverged, FedskewError, UsageError
from fedskew.engines.client_runtime import ClientRuntime, runtime_from_config_json
from fedskew.engines.flower_codec import (
    CLIENT_DIVERGED,
    CONFIG_RECORD,
    SETUP,
    clear_state,
    decode,
    encode,
    load_state,
    store_state,
)
from fedskew.engines.flower_secagg import is_secure_stage, secure_aggregation_mod, secure_reply
from fedskew.training.protocol import Message
from fedskew.version import __version__

_RUNTIMES: dict[str, ClientRuntime] = {}  # config JSON -> runtime; one process, many nodes


def _runtime(config_json: str, data_dir: str | None) -> ClientRuntime:
    """What a node builds once per experiment: data, partition, scratch model, logic."""
    key = f"{config_json}\n{data_dir}"
    runtime = _RUNTIMES.get(key)
    if runtime is None:
        _RUNTIMES.clear()  # a node serves one experiment at a time
        # The node runs the client side itself, on its own device and copy of the data.
        node = {"engine": "inprocess", **({"data_dir": data_dir} if data_dir else {})}
        runtime = runtime_from_config_json(config_json, "setup message", node)
        _RUNTIMES[key] = runtime
    return runtime


def _partition_id(context: Context) -> int:
    value = context.node_config.get("partition-id")
    if value is None:
        raise UsageError("this SuperNode has no 'partition-id' in its node config")
    return int(value)


client_app = ClientApp()


# SecAgg+'s mod sees only the messages of a secure exchange (secure_aggregation_mod).
@client_app.train(mods=[secure_aggregation_mod])
def _client_main(message: FlowerMessage, context: Context) -> FlowerMessage:
    msg, envelope = decode(message.content)
    pid = _partition_id(context)
    data_dir = context.node_config.get("data-dir")
    data_dir = str(data_dir) if data_dir else None
    if msg.kind == SETUP:
        # A new experiment: state left by an earlier one on this node must not leak in.
        clear_state(context.state)
        context.state[CONFIG_RECORD] = ConfigRecord({"json": msg.strings["config"]})
        runtime = _runtime(msg.strings["config"], data_dir)  # load data now, not in round 1
        with runtime.denormals_held():  # what the node's handlers will compute under
            denormals = denormals_state()
        # What the node computes with, for the run folder's provenance (processes.jsonl)
        # and the server's warning when it is not what the server runs.
        facts = {
            "denormals": denormals,
            "torch": torch.__version__,
            "fedskew": __version__,
            "device": str(runtime.device),
            "device_name": device_name(runtime.device),
            "python": platform.python_version(),
        }
        reply = Message("ready", scalars={"partition_id": float(pid)}, strings=facts)
        return FlowerMessage(encode(reply, {}), reply_to=message)
    if CONFIG_RECORD not in context.state:
        raise FedskewError("message before the setup message")
    runtime = _runtime(str(context.state.config_records[CONFIG_RECORD]["json"]), data_dir)
    cid = int(envelope["client_id"])
    if cid != pid:
        raise FedskewError(f"message for client {cid} reached the node of partition {pid}")
    state = load_state(context.state)
    rnd = int(envelope["round"])
    try:
        reply = runtime.handle(cid, rnd, msg, state)
    except Diverged as exc:
        if is_secure_stage(message):
            raise  # through SecAgg+'s mod, which answers it the same way
        # One line the server can act on (stop as the in-process run does), instead of an
        # exception Flower would send back as a traceback and the server count as lost.
        error = Error(code=CLIENT_DIVERGED, reason=str(exc).splitlines()[0][:300])
        return FlowerMessage(error, reply_to=message)
    store_state(state, context.state)
    if is_secure_stage(message):  # SecAgg+'s mod masks the summand on its way out
        return FlowerMessage(secure_reply(reply, msg, runtime.seed, rnd, cid), reply_to=message)
    return FlowerMessage(encode(reply, {}), reply_to=message)
