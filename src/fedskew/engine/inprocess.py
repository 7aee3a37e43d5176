"""The in-process engine: runs every client in this process, one scratch model for all.

It keeps per-client state, builds each client's context, and counts the bytes of
every message that crosses the channel, down and up.
"""

from __future__ import annotations

from collections.abc import Mapping

from fedskew.engine.client_runtime import ClientRuntime, ClientStateKeeper, TrafficCounter
from fedskew.protocol import Message

# TrafficCounter was first defined here: code outside the package may import it from here.
__all__ = ["InProcessEngine", "TrafficCounter"]


class InProcessEngine(ClientRuntime, ClientStateKeeper):
    """Carries an algorithm's messages to client handlers running in this process.

    Built like a ClientRuntime (client logic, data, scratch model, training settings, seed,
    test set); it also keeps every client's state and counts the traffic."""

    def exchange(self, messages: Mapping[int, Message]) -> dict[int, Message]:
        self.traffic.exchanges += 1
        replies: dict[int, Message] = {}
        for cid, msg in messages.items():
            self.traffic.bytes_down += msg.nbytes()
            reply = self.handle(cid, self.round, msg, self.state_of(cid))
            self.traffic.bytes_up += reply.nbytes()
            replies[cid] = reply
        return replies
