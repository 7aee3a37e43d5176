"""The in-process engine: runs every client in this process, one scratch model for all.

It keeps per-client state, builds each client's context, and counts the bytes of
every message that crosses the channel, down and up.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedskew.data.federated import FederatedData
from fedskew.engines.base import ServerSideClientStates, refuse_unmet
from fedskew.engines.client_runtime import ClientRuntime
from fedskew.engines.together import TOGETHER
from fedskew.training.interface import ClientLogic, LocalTrainConfig
from fedskew.training.protocol import Expected, Message


class InProcessEngine(ClientRuntime, ServerSideClientStates):
    """Carries an algorithm's messages to client handlers running in this process.

    It is a :class:`ClientRuntime` (built the same way: client logic, data, scratch model,
    training settings, seed, test set) that also keeps every client's state and counts the
    traffic."""

    def __init__(
        self,
        client_logic: ClientLogic,
        data: FederatedData,
        model: torch.nn.Module,
        train: LocalTrainConfig,
        seed: int,
        test: tuple[torch.Tensor, torch.Tensor] | None = None,
        clients_together: str = "off",
        denormals: str | None = None,
        clients_together_max: int | str = "auto",
    ) -> None:
        ClientRuntime.__init__(
            self, client_logic, data, model, train, seed, test, clients_together, denormals,
            clients_together_max,
        )  # fmt: skip
        ServerSideClientStates.__init__(self)

    def exchange(
        self, messages: Mapping[int, Message], expect: Expected | None = None
    ) -> dict[int, Message]:
        replies = self._exchange(messages)
        refuse_unmet(self.round, replies, expect)
        return replies

    def _exchange(self, messages: Mapping[int, Message]) -> dict[int, Message]:
        self.traffic.exchanges += 1
        if self.clients_together in TOGETHER and len(messages) > 1:
            states = {cid: self.state_of(cid) for cid in messages}
            together = self.handle_together(self.round, messages, states)
            if together is not None:
                for cid, msg in messages.items():
                    self.traffic.bytes_down += msg.nbytes()
                    self.traffic.bytes_up += together[cid].nbytes()
                return together
        replies: dict[int, Message] = {}
        for cid, msg in messages.items():
            self.traffic.bytes_down += msg.nbytes()
            reply = self.handle(cid, self.round, msg, self.state_of(cid))
            self.traffic.bytes_up += reply.nbytes()
            replies[cid] = reply
        return replies
