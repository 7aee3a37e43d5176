"""The client's side of local evaluation: the global model on the client's own test split.

With ``--local-test-fraction`` every evaluation round sends each client the model the
server scores (``LOCAL_EVALUATION``); the client answers with counts only
(``LOCAL_RESULT``): how many of its held-out samples the model classifies correctly, how
many it holds, and, for a method that keeps a personal part on the client
(``ClientLogic.personal_model``: FedROD's personal head), how many the personalised model
gets right. The split never leaves the client, so the same numbers come back from every
engine (in process, worker processes, Flower nodes). Answering trains nothing and changes
neither the client's state nor any generator.
"""

from __future__ import annotations

import torch

from fedskew.data.federated import ClientData
from fedskew.metrics.evaluation import evaluate
from fedskew.training.interface import ClientContext, ClientLogic
from fedskew.training.local import set_arrays
from fedskew.training.protocol import Message, needs

LOCAL_EVALUATION = "local_evaluation"
LOCAL_RESULT = "local_result"
# What the server reads from every reply (``personal_correct`` only where the method has
# a personal part and the client has one yet).
LOCAL_RESULT_NEEDS = {LOCAL_RESULT: needs(scalars=("correct", "total"))}


def answer_local_evaluation(
    logic: ClientLogic, msg: Message, ctx: ClientContext, test: ClientData | None
) -> Message:
    """The counts of the message's model (and of the client's personalised model) on the
    client's test split ``test``; an empty reply's ``total`` is 0."""
    if test is None or len(test) == 0:
        return Message(LOCAL_RESULT, scalars={"correct": 0.0, "total": 0.0})
    set_arrays(ctx.model, msg.arrays)
    x, y = test.batch(torch.arange(len(test)))
    result = evaluate(ctx.model, x, y, test.num_classes, precision=ctx.train.precision)
    scalars = {
        "correct": float(result.correct),
        "total": float(len(test)),
        "loss": result.loss,
    }
    personal = logic.personal_model(ctx)
    if personal is not None:
        mine = evaluate(personal, x, y, test.num_classes, precision=ctx.train.precision)
        scalars["personal_correct"] = float(mine.correct)
    return Message(LOCAL_RESULT, scalars=scalars)
