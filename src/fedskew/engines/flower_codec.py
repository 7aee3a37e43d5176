"""fedskew Messages and client state as Flower records, and the checks on what arrives.

Arrays travel as ``ArrayRecord`` (NumPy's ``.npy`` format with pickling disabled),
numbers as ``MetricRecord``, strings and the envelope (message kind, round, client id)
as ``ConfigRecord``. Nothing is pickled.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedskew.training.protocol import ArraySpec, ClientState, Message, ScalarSpec

ARRAYS = "fedskew.arrays"
SCALARS = "fedskew.scalars"
STRINGS = "fedskew.strings"
ENVELOPE = "fedskew.envelope"
STATE_ARRAYS = "fedskew.state.arrays"
STATE_SCALARS = "fedskew.state.scalars"
# The fedskew Flower app's setup handshake: the message kind, and the node's record of the
# experiment it serves.
SETUP = "fedskew.setup"
CONFIG_RECORD = "fedskew.config"
# The error code of a reply by which a client says its update diverged (NaN or Inf where the
# server could not see it: inside a summed exchange); Flower's own codes are 0 to 8.
CLIENT_DIVERGED = 1001


class RejectedReply(ValueError):
    """A reply that must not be aggregated (wrong shape or dtype, non-finite values)."""


def _to_array(tensor: torch.Tensor) -> Array:
    # torch's .contiguous(), not np.ascontiguousarray: the latter makes a 0-d array (a
    # BatchNorm's num_batches_tracked) 1-d, and every reply of such a model was rejected.
    return Array.from_numpy_ndarray(tensor.detach().cpu().contiguous().numpy())


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


def check_reply(
    reply: Message,
    reference: Mapping[str, torch.Tensor],
    declared: Mapping[str, ArraySpec] | None = None,
    scalars: Mapping[str, ScalarSpec] | None = None,
    size: int | None = None,
) -> None:
    """Raise RejectedReply unless every number is finite and in its declared range
    (``scalars``, from ``Algorithm.reply_scalars``) and every array fits: a declared
    one (``declared``, from ``Algorithm.reply_arrays``) its spec, else one named like a
    reference array (the global model's, or one the client was sent) that array's shape and
    dtype. Where the algorithm declares (not ``None``), no other array is accepted; ``None``
    leaves other arrays unchecked. ``size``: the client's training samples where the server
    knows them (its sample counts may not add up to more)."""
    for name, value in reply.scalars.items():
        if not math.isfinite(value):
            raise RejectedReply(f"scalar '{name}' is {value}")
        why = None if scalars is None or name not in scalars else scalars[name].why_not(value)
        if why is not None:
            raise RejectedReply(f"scalar '{name}' {why}")
    sizes: dict[str, int] = {}  # the named sizes of the declared shapes, as this reply has them
    for name, tensor in reply.arrays.items():
        ref = reference.get(name)
        # A declaration comes first: a client may answer under the name of an array it was
        # sent with another shape (FedProto: global prototypes down, its own classes' up).
        if declared is not None and name in declared:
            check_declared(name, tensor, declared[name], sizes, size)
        elif ref is not None:
            if tensor.shape != ref.shape or tensor.dtype != ref.dtype:
                raise RejectedReply(
                    f"array '{name}' is {tuple(tensor.shape)} {tensor.dtype}, "
                    f"expected {tuple(ref.shape)} {ref.dtype}"
                )
        elif declared is not None:
            raise RejectedReply(f"array '{name}' is not one this algorithm's clients send")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise RejectedReply(f"array '{name}' has non-finite values")


def check_sample_count(reply: Message, size: int | None) -> None:
    """Raise RejectedReply unless the reply's ``num_samples`` (where it has one) is a whole
    number above 0, and ``size`` where the server knows the client's size: every method
    weighs a client's reply by it."""
    if "num_samples" not in reply.scalars:
        return
    value = reply.scalars["num_samples"]
    if not (float(value).is_integer() and value > 0):
        raise RejectedReply(f"num_samples {value!r} is not a whole number above 0")
    if size is not None and value != size:
        raise RejectedReply(f"num_samples {value:g} is not the client's {size} training samples")


def check_declared(
    name: str, tensor: torch.Tensor, spec: ArraySpec, sizes: dict[str, int],
    samples: int | None = None,
) -> None:  # fmt: skip
    """One declared array against its spec; ``sizes`` binds the spec's named sizes across
    the arrays of one reply; ``samples``: the client's training samples, where known."""
    shown = "(" + ", ".join(str(d) for d in spec.shape) + ")"
    if tensor.dtype != spec.dtype or tensor.dim() != len(spec.shape):
        raise RejectedReply(
            f"array '{name}' is {tuple(tensor.shape)} {tensor.dtype}, expected {shown} {spec.dtype}"
        )
    for got, want in zip(tensor.shape, spec.shape, strict=True):
        bound = sizes.setdefault(want, got) if isinstance(want, str) else want
        if got != bound:
            raise RejectedReply(
                f"array '{name}' is {tuple(tensor.shape)}, expected {shown} with "
                f"{', '.join(f'{k}={v}' for k, v in sizes.items()) or 'these sizes'}"
            )
    if spec.classes is not None and tensor.numel():
        if int(tensor.min()) < 0 or int(tensor.max()) >= spec.classes:
            raise RejectedReply(f"array '{name}' holds a class index outside 0..{spec.classes - 1}")
        if torch.unique(tensor).numel() != tensor.numel():
            raise RejectedReply(f"array '{name}' repeats a class index")
    if spec.sample_counts and tensor.numel():
        if int(tensor.min()) < 0:
            raise RejectedReply(f"array '{name}' holds a negative sample count")
        total = sum(tensor.tolist())  # Python ints: an int64 sum could wrap round
        if samples is not None and total > samples:
            raise RejectedReply(f"array '{name}' counts {total} samples, the client has {samples}")
    if spec.true_count is not None:
        true = int(tensor.sum())
        if sizes.setdefault(spec.true_count, true) != true:
            raise RejectedReply(
                f"array '{name}' marks {true} entries, expected "
                f"{spec.true_count}={sizes[spec.true_count]}"
            )
