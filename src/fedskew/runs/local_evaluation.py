"""The server's side of local evaluation: every client scores the global model on its own
test split (``--local-test-fraction``), and only the counts come back.

Each evaluation round sends the model the server scores to every client that holds a split
(``fedskew.training.local_evaluation``) through the run's engine, so workers and Flower
nodes answer like the in-process engine. The server knows each split's size (the split is a
pure function of the configuration, fedskew.data.local_test), so a reply is checked against
it: counts that are not whole numbers between 0 and the split's size are refused, logged
and left out like a lost reply on an engine whose clients cannot be trusted (Flower), and
stop the run elsewhere (there they can only be a fault in fedskew). The traffic is recorded
apart from the round's training traffic.
"""

from __future__ import annotations

import logging
from typing import Any

from fedskew.core.errors import FedskewError
from fedskew.metrics.client_spread import (
    BOOKKEEPING_PREFIX,
    GLOBAL_LIST,
    PERSONAL_LIST,
    client_spread,
)
from fedskew.training.interface import ClientLogic
from fedskew.training.local_evaluation import LOCAL_EVALUATION, LOCAL_RESULT_NEEDS
from fedskew.training.protocol import Message

log = logging.getLogger("fedskew")


def has_personal_part(client_class: type[ClientLogic]) -> bool:
    """Whether the method's clients offer a personalised model (ClientLogic.personal_model)."""
    return client_class.personal_model is not ClientLogic.personal_model


def refused_counts(reply: Message, size: int) -> str | None:
    """Why the counts of ``reply`` cannot be a client's result on ``size`` samples, or None."""
    scalars = reply.scalars
    if scalars.get("total") != size:
        return f"total {scalars.get('total')!r} is not its split's size {size}"
    for name in ("correct", "personal_correct"):
        if name not in scalars:
            continue
        value = scalars[name]
        if not (isinstance(value, int | float) and float(value).is_integer()):
            return f"{name} {value!r} is not a whole number"
        if not 0 <= value <= size:
            return f"{name} {value!r} is outside 0..{size}"
    return None


def evaluate_on_clients(
    engine: Any, rnd: int, arrays: Any, sizes: list[int], personal: bool
) -> dict[str, Any]:
    """The metrics record's per-client part for round ``rnd`` (0-based): ``client_accuracy``
    (a list by client id, None where no valid reply came back) and its spread
    (``client_accuracy_mean``, ``_std``, ``_worst10``, ``_gap``); the same for
    ``client_personal_accuracy`` where the method has a personal part; the bytes carried."""
    messages = {c: Message(LOCAL_EVALUATION, arrays=arrays) for c, n in enumerate(sizes) if n}
    replies = engine.exchange(messages, LOCAL_RESULT_NEEDS)
    accuracy: list[float | None] = [None] * len(sizes)
    mine: list[float | None] = [None] * len(sizes)
    for cid, reply in replies.items():
        why = refused_counts(reply, sizes[cid])
        if why is not None:
            if not engine.may_lose_replies:
                raise FedskewError(f"round {rnd + 1}: local evaluation of client {cid}: {why}")
            log.warning("round %d: local evaluation of client %d refused: %s", rnd + 1, cid, why)
            continue
        accuracy[cid] = reply.scalars["correct"] / sizes[cid]
        if "personal_correct" in reply.scalars:
            mine[cid] = reply.scalars["personal_correct"] / sizes[cid]
    record: dict[str, Any] = {}
    series = [(GLOBAL_LIST, accuracy)]
    if personal:
        series.append((PERSONAL_LIST, mine))
    for name, values in series:
        record[name] = [None if v is None else round(v, 6) for v in values]
        record.update({f"{name}_{k}": v for k, v in client_spread(values).items()})
    answered = [c for c in messages if accuracy[c] is not None]
    if len(answered) < len(messages):
        record[f"{BOOKKEEPING_PREFIX}missing"] = sorted(set(messages) - set(answered))
    record[f"{BOOKKEEPING_PREFIX}bytes_down"] = sum(m.nbytes() for m in messages.values())
    record[f"{BOOKKEEPING_PREFIX}bytes_up"] = sum(r.nbytes() for r in replies.values())
    return record
