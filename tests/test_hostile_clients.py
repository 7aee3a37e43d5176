"""A Flower client must never stop or steer the server (issue 40).

Generated hostile replies and setup answers go through the server's real code
(``FlowerEngine.exchange`` and ``handshake``) with a Grid that answers with them; the
property: no exception reaches the server, and a reply that is accepted is one the server
can aggregate (every number finite and in its range, arrays as the model has them, the
sample count the client really has). A whole run with one hostile client ends with the
other clients' aggregate, the hostile replies recorded as rejected.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from run_metrics import metrics

pytest.importorskip("flwr")

from flower_grid import LocalGrid  # noqa: E402
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict  # noqa: E402
from flwr.app import Message as FlowerMessage  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fedskew.apps.flower.server import handshake, serve  # noqa: E402
from fedskew.config import build_config  # noqa: E402
from fedskew.engines.flower_codec import (  # noqa: E402
    ARRAYS,
    ENVELOPE,
    SCALARS,
    STRINGS,
    arrays_of,
    arrays_record,
    encode,
)
from fedskew.engines.flower_engine import FlowerEngine  # noqa: E402
from fedskew.training.protocol import ArraySpec, Message, ScalarSpec, needs  # noqa: E402

MODEL = {"w": torch.zeros(3, 2), "b": torch.zeros(3), "steps": torch.zeros((), dtype=torch.int64)}
SIZES = [40, 25]
DECLARED = {"counts": ArraySpec((4,), torch.int64, sample_counts=True)}
SCALAR_SPECS = {"a": ScalarSpec(low=0.0, low_open=True)}
EXPECT = {"trained": needs(("w", "b", "steps"), ("num_samples", "a"))}

ODD_NUMBERS = st.sampled_from(
    [math.nan, math.inf, -math.inf, -1.0, 0.0, 0.5, 3.5, 1e30, -1e30, 2.0**63, 25.0, 40.0]
)
ODD_DTYPES = st.sampled_from(
    [torch.float64, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool,
     torch.complex64]
)  # fmt: skip


def valid_reply(cid: int) -> RecordDict:
    arrays = {k: v + cid for k, v in MODEL.items()}
    arrays["counts"] = torch.tensor([5, 0, 3, 2])
    msg = Message("trained", arrays=arrays, scalars={"num_samples": float(SIZES[cid]), "a": 2.0})
    return encode(msg, {})


@st.composite
def mutations(draw) -> Callable[[RecordDict], RecordDict]:
    """One hostile change of a valid reply's content."""
    kind = draw(
        st.sampled_from(
            ["drop_record", "wrong_record", "scalar", "scalar_list", "scalar_int", "array_dtype",
             "array_shape", "array_value", "array_extra", "array_drop", "envelope", "strings",
             "counts"]
        )
    )  # fmt: skip
    record = draw(st.sampled_from([ARRAYS, SCALARS, STRINGS, ENVELOPE]))
    name = draw(st.sampled_from(["num_samples", "a", "loss", "w", "b", "steps", "counts"]))
    number = draw(ODD_NUMBERS)
    dtype = draw(ODD_DTYPES)
    length = draw(st.integers(0, 3))
    wrong = draw(st.sampled_from([ConfigRecord({"x": 1}), MetricRecord({"x": 1.0}), ArrayRecord()]))

    def apply(content: RecordDict) -> RecordDict:
        arrays = arrays_of(content.array_records[ARRAYS])
        scalars = dict(content.metric_records[SCALARS])
        if kind == "drop_record":
            del content[record]
        elif kind == "wrong_record":
            content[record] = wrong
        elif kind == "scalar":
            scalars[name] = number
        elif kind == "scalar_list":
            scalars[name] = [1.0] * length
        elif kind == "scalar_int":
            scalars[name] = int(min(abs(number), 2.0**62)) if math.isfinite(number) else 7
        elif kind == "array_dtype" and name in arrays:
            arrays[name] = arrays[name].to(dtype)
        elif kind == "array_shape" and name in arrays:
            arrays[name] = torch.zeros((length,) * max(arrays[name].dim(), 1))
        elif kind == "array_value" and name in arrays:
            if arrays[name].is_floating_point():
                arrays[name] = torch.full_like(arrays[name], number)
            else:
                whole = int(max(-(2.0**62), min(number, 2.0**62))) if math.isfinite(number) else -1
                arrays[name] = torch.full_like(arrays[name], whole)
        elif kind == "array_extra":
            arrays[f"extra{length}"] = torch.ones(length)
        elif kind == "array_drop":
            arrays.pop(name, None)
        elif kind == "envelope":
            content[ENVELOPE] = ConfigRecord({"kind": ["trained"] * length})
        elif kind == "strings":
            content[STRINGS] = ConfigRecord({"x": b"\xff" * length})
        elif kind == "counts":
            arrays["counts"] = torch.tensor([int(min(abs(number), 1e9)) if math.isfinite(number)
                                             else 10**9, -length, 0, 1])  # fmt: skip
        if kind not in ("drop_record", "wrong_record", "envelope", "strings"):
            content[ARRAYS] = arrays_record(arrays)
            content[SCALARS] = MetricRecord(scalars)
        return content

    return apply


class ReplyGrid:
    """Answers every message with the content ``reply_of(client id)`` gives."""

    def __init__(self, reply_of: Callable[[int], RecordDict]) -> None:
        # What Flower's runtime sets in a ServerApp process before messages are made.
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
        self.reply_of = reply_of

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            cid = msg.metadata.dst_node_id - 1000
            replies.append(FlowerMessage(self.reply_of(cid), reply_to=msg))
        return replies


def accepted_is_usable(reply: Message, cid: int) -> None:
    for name, ref in MODEL.items():
        assert reply.arrays[name].shape == ref.shape and reply.arrays[name].dtype == ref.dtype
        assert bool(torch.isfinite(reply.arrays[name].double()).all())
    assert set(reply.arrays) <= {*MODEL, "counts"}
    assert reply.scalars["num_samples"] == SIZES[cid]
    assert math.isfinite(reply.scalars["a"]) and reply.scalars["a"] > 0
    if "counts" in reply.arrays:
        counts = reply.arrays["counts"]
        assert counts.dtype == torch.int64 and int(counts.min()) >= 0
        assert int(counts.sum()) <= SIZES[cid]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutation=mutations())
def test_a_hostile_reply_is_accepted_only_when_usable_and_never_raises(mutation):
    grid = ReplyGrid(lambda cid: mutation(valid_reply(cid)) if cid == 1 else valid_reply(cid))
    engine = FlowerEngine(grid, {0: 1000, 1: 1001}, MODEL, declared=DECLARED,
                          scalars=SCALAR_SPECS, client_sizes=SIZES)  # fmt: skip
    engine.begin_round(0)
    messages = {c: Message("train", arrays=dict(MODEL)) for c in (0, 1)}
    replies = engine.exchange(messages, EXPECT)
    assert 0 in replies  # the honest client is never lost with the other
    accepted_is_usable(replies[0], 0)
    if 1 in replies:
        accepted_is_usable(replies[1], 1)
    else:
        assert 1 in engine.faults().missing


# --------------------------------------------------------------------------- setup answers


def setup_cfg(tmp_path: Path, **extra):
    values = dict(algorithm="fedavg", num_clients=3, clients_per_round=3, rounds=2,
                  out_dir=str(tmp_path), quiet=True)  # fmt: skip
    values.update(extra)
    return build_config({}, values)


SETUP_VALUES = st.one_of(
    ODD_NUMBERS,
    st.just(None),  # left out
    st.lists(st.floats(allow_nan=True), max_size=3),
    st.integers(-5, 5).map(float),
)


@st.composite
def setup_answers(draw):
    """A node's hostile setup answer: its partition id changed, or its record damaged."""
    how = draw(st.sampled_from(["id", "no_envelope", "no_scalars", "denormals", "wrong_record"]))
    value = draw(SETUP_VALUES)

    def answer(content: RecordDict) -> None:
        if how == "id":
            scalars = dict(content.metric_records[SCALARS])
            if value is None:
                scalars.pop("partition_id")
            else:
                scalars["partition_id"] = value
            content[SCALARS] = MetricRecord(scalars)
        elif how == "no_envelope":
            del content[ENVELOPE]
        elif how == "no_scalars":
            del content[SCALARS]
        elif how == "denormals":
            content[STRINGS] = ConfigRecord({"denormals": [1, 2]})
        else:
            content[SCALARS] = ConfigRecord({"partition_id": "0"})

    return answer


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture])  # fmt: skip
@given(answer=setup_answers())
def test_a_hostile_setup_answer_leaves_the_node_out_and_never_raises(tmp_path, answer):
    grid = LocalGrid(3, corrupt={(-1, 2): answer})
    node_of = handshake(grid, list(grid.contexts), setup_cfg(tmp_path), timeout=5)
    assert node_of[0] == 1000 and node_of[1] == 1001  # the honest nodes keep their partitions
    assert set(node_of) <= {0, 1, 2}
    if 2 in node_of:
        assert node_of[2] == 1002


def test_a_node_claiming_a_partition_already_held_is_left_out(tmp_path, caplog):
    grid = LocalGrid(3)
    grid.contexts[1002].node_config["partition-id"] = 0
    node_of = handshake(grid, list(grid.contexts), setup_cfg(tmp_path), timeout=5)
    assert node_of == {0: 1000, 1: 1001}
    assert "also claims partition 0" in caplog.text


# --------------------------------------------------------------------------- a whole run


def test_a_run_with_one_hostile_client_ends_with_the_others_aggregate(tmp_path):
    """Client 1 answers every round with something else: a NaN, a claim of 1e30 samples, a
    list where a number belongs, a reply without its envelope. The run finishes, each of
    them recorded as rejected, with the curve of a run where client 1's replies were lost."""

    def scalar(name: str, value) -> Callable[[RecordDict], None]:
        def change(content: RecordDict) -> None:
            scalars = dict(content.metric_records[SCALARS])
            scalars[name] = value
            content[SCALARS] = MetricRecord(scalars)

        return change

    def no_envelope(content: RecordDict) -> None:
        del content[ENVELOPE]

    def nan_weights(content: RecordDict) -> None:
        arrays = arrays_of(content.array_records[ARRAYS])
        first = next(iter(arrays))
        arrays[first] = torch.full_like(arrays[first], math.nan)
        content[ARRAYS] = arrays_record(arrays)

    hostile = [nan_weights, scalar("num_samples", 1e30), scalar("num_samples", [1.0, 2.0]),
               no_envelope]  # fmt: skip
    rounds = len(hostile)

    def cfg(sub: str):
        return build_config(
            {},
            dict(
                algorithm="fednova",
                num_clients=3,
                clients_per_round=3,
                rounds=rounds,
                out_dir=str(tmp_path / sub),
                quiet=True,
            ),
        )

    bad, summary = serve(LocalGrid(3, corrupt={(r, 1): f for r, f in enumerate(hostile)}),
                         cfg("hostile"))  # fmt: skip
    rows = metrics(bad)
    assert [r["rejected_replies"] for r in rows] == [[1]] * rounds
    assert math.isfinite(summary["final_accuracy"])
    lost, _ = serve(LocalGrid(3, drop={(r, 1) for r in range(rounds)}), cfg("lost"))
    for a, b in zip(rows, metrics(lost), strict=True):
        for key in ("accuracy", "loss", "train_loss", "tau_eff"):
            assert a.get(key) == b.get(key), (a["round"], key)
