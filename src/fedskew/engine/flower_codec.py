"""fedskew Messages and client state as Flower records, and the checks on what arrives.

Arrays travel as ``ArrayRecord`` (NumPy's ``.npy`` format with pickling disabled),
numbers as ``MetricRecord``, strings and the envelope (message kind, round, client id)
as ``ConfigRecord``. Nothing is pickled.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedskew.protocol import ClientState, Message

ARRAYS = "fedskew.arrays"
SCALARS = "fedskew.scalars"
STRINGS = "fedskew.strings"
ENVELOPE = "fedskew.envelope"
STATE_ARRAYS = "fedskew.state.arrays"
STATE_SCALARS = "fedskew.state.scalars"


class RejectedReply(ValueError):
    """A reply that must not be aggregated (wrong shape or dtype, non-finite values)."""


def _to_array(tensor: torch.Tensor) -> Array:
    return Array.from_numpy_ndarray(np.ascontiguousarray(tensor.detach().cpu().numpy()))


def arrays_record(arrays: Mapping[str, torch.Tensor]) -> ArrayRecord:
    return ArrayRecord({name: _to_array(t) for name, t in arrays.items()})


def arrays_of(record: ArrayRecord) -> dict[str, torch.Tensor]:
    # .copy(): np.load gives read-only buffers, which torch would warn about and share.
    return {name: torch.from_numpy(arr.numpy().copy()) for name, arr in record.items()}


def encode(msg: Message, envelope: Mapping[str, Any]) -> RecordDict:
    """A Message plus its envelope (kind is added) as a RecordDict."""
    return RecordDict(
        {
            ARRAYS: arrays_record(msg.arrays),
            SCALARS: MetricRecord({k: float(v) for k, v in msg.scalars.items()}),
            STRINGS: ConfigRecord(dict(msg.strings)),
            ENVELOPE: ConfigRecord({"kind": msg.kind, **envelope}),
        }
    )


def decode(content: RecordDict) -> tuple[Message, dict[str, Any]]:
    """(message, envelope); KeyError/TypeError when the content is not a fedskew message."""
    envelope = dict(content.config_records[ENVELOPE])
    kind = str(envelope.pop("kind"))
    msg = Message(
        kind,
        arrays=arrays_of(content.array_records[ARRAYS]),
        scalars={k: float(v) for k, v in content.metric_records[SCALARS].items()},
        strings={k: str(v) for k, v in content.config_records[STRINGS].items()},
    )
    return msg, envelope


def store_state(state: ClientState, records: RecordDict) -> None:
    """Write a client's state into a Flower node's ``context.state``."""
    records[STATE_ARRAYS] = arrays_record(state.arrays)
    records[STATE_SCALARS] = MetricRecord({k: float(v) for k, v in state.scalars.items()})


def clear_state(records: RecordDict) -> None:
    for key in (STATE_ARRAYS, STATE_SCALARS):
        if key in records:
            del records[key]


def load_state(records: RecordDict) -> ClientState:
    """The client state kept in ``context.state`` (empty on a node's first message)."""
    if STATE_ARRAYS not in records:
        return ClientState()
    return ClientState(
        arrays=arrays_of(records.array_records[STATE_ARRAYS]),
        scalars={k: float(v) for k, v in records.metric_records[STATE_SCALARS].items()},
    )


def check_reply(reply: Message, reference: Mapping[str, torch.Tensor]) -> None:
    """Raise RejectedReply unless every number is finite and every array named like a
    reference array (the global model's, or one the client was sent) has its shape and
    dtype."""
    for name, value in reply.scalars.items():
        if not math.isfinite(value):
            raise RejectedReply(f"scalar '{name}' is {value}")
    for name, tensor in reply.arrays.items():
        ref = reference.get(name)
        if ref is not None and (tensor.shape != ref.shape or tensor.dtype != ref.dtype):
            raise RejectedReply(
                f"array '{name}' is {tuple(tensor.shape)} {tensor.dtype}, "
                f"expected {tuple(ref.shape)} {ref.dtype}"
            )
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise RejectedReply(f"array '{name}' has non-finite values")
