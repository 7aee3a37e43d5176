"""An in-memory Flower Grid for tests: the real ServerApp logic talks to the real ClientApp
in this process (test_flower.py, and the Flower leg of test_resume.py)."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterable

from flwr.app import Context, RecordDict
from flwr.app import Message as FlowerMessage
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from fedskew.apps.flower.client import client_app


class LocalGrid(Grid):
    """Delivers messages to the ClientApp in this process, one Context per node.

    ``drop`` lists (round, partition id) pairs whose reply is lost (round -1 is the setup);
    ``corrupt`` maps such pairs to a function applied to the reply content;
    ``setup_delay`` maps partition ids to the seconds their setup reply takes to come back
    (``math.inf``: never).
    """

    def __init__(self, num_nodes: int, drop=(), corrupt=None, setup_delay=None) -> None:
        # What Flower's runtime sets in a ServerApp process before messages are made.
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
        self.contexts = {
            1000 + pid: Context(
                run_id=1,
                node_id=1000 + pid,
                node_config={"partition-id": pid, "num-partitions": num_nodes},
                state=RecordDict(),
                run_config={},
            )
            for pid in range(num_nodes)
        }
        self.drop = set(drop)
        self.corrupt = dict(corrupt or {})
        self.setup_delay = dict(setup_delay or {})
        self.sent_to: list[int] = []
        self.pushed: dict[str, tuple[float, FlowerMessage | None]] = {}

    def set_run(self, run) -> None:  # pragma: no cover - not used by fedskew
        raise NotImplementedError

    @property
    def run(self):  # pragma: no cover
        raise NotImplementedError

    def create_message(self, *args, **kwargs):  # pragma: no cover
        raise NotImplementedError

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def deliver(self, msg: FlowerMessage) -> FlowerMessage | None:
        """The ClientApp's reply to ``msg``, or None when it is lost."""
        node = msg.metadata.dst_node_id
        self.sent_to.append(node)
        reply = client_app(msg, self.contexts[node])
        key = (int(msg.metadata.group_id or -1), node - 1000)
        if key in self.drop:
            return None
        if key in self.corrupt:
            self.corrupt[key](reply.content)
        return reply

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = msg_id = uuid.uuid4().hex
            delay = self.setup_delay.get(msg.metadata.dst_node_id - 1000, 0.0)
            self.pushed[msg_id] = (time.monotonic() + delay, self.deliver(msg))
            ids.append(msg_id)
        return ids

    def pull_messages(self, message_ids):
        now, replies = time.monotonic(), []
        for msg_id in message_ids:
            ready, reply = self.pushed.get(msg_id, (math.inf, None))
            if reply is not None and ready <= now:
                replies.append(reply)
                del self.pushed[msg_id]
        return replies

    def send_and_receive(self, messages, *, timeout=None) -> Iterable[FlowerMessage]:
        return [r for r in map(self.deliver, messages) if r is not None]
