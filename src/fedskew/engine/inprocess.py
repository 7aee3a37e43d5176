"""The in-process engine: runs every client in this process, one scratch model for all.

It keeps per-client state, builds each client's context, and counts the bytes of
every message that crosses the channel, down and up.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedskew.data.federated import FederatedData
from fedskew.engine.client_runtime import ClientRuntime, ClientStateKeeper, TrafficCounter
from fedskew.protocol import ClientLogic, LocalTrainConfig, Message

# TrafficCounter was first defined here: code outside the package may import it from here.
__all__ = ["InProcessEngine", "TrafficCounter"]


class InProcessEngine(ClientStateKeeper, ClientRuntime):
    """Carries an algorithm's messages to client handlers running in this process."""

    def __init__(
        self,
        client_logic: ClientLogic,
        data: FederatedData,
        model: torch.nn.Module,
        train: LocalTrainConfig,
        seed: int,
        test: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        ClientStateKeeper.__init__(self)
        ClientRuntime.__init__(self, client_logic, data, model, train, seed, test)

    def exchange(self, messages: Mapping[int, Message]) -> dict[int, Message]:
        self.traffic.exchanges += 1
        replies: dict[int, Message] = {}
        for cid, msg in messages.items():
            self.traffic.bytes_down += msg.nbytes()
            reply = self.handle(cid, self.round, msg, self.state_of(cid))
            self.traffic.bytes_up += reply.nbytes()
            replies[cid] = reply
        return replies
