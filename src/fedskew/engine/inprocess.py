"""The in-process engine: runs every client in this process, one scratch model for all.

It keeps per-client state, builds each client's context, and counts the bytes of
every message that crosses the channel, down and up.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fedskew.data.federated import FederatedData
from fedskew.protocol import (
    ClientContext,
    ClientLogic,
    ClientState,
    LocalTrainConfig,
    Message,
)


@dataclass
class TrafficCounter:
    bytes_down: int = 0
    bytes_up: int = 0
    exchanges: int = 0

    def reset(self) -> None:
        self.bytes_down = self.bytes_up = self.exchanges = 0


class InProcessEngine:
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
        self.client_logic = client_logic
        self.data = data
        self.model = model
        self.train = train
        self.seed = seed
        self.test = test
        self.client_states: dict[int, ClientState] = {}
        self.traffic = TrafficCounter()
        self.round = 0

    def begin_round(self, rnd: int) -> None:
        self.round = rnd
        self.traffic.reset()

    def state_of(self, client_id: int) -> ClientState:
        state = self.client_states.get(client_id)
        if state is None:
            state = self.client_states[client_id] = ClientState()
        return state

    def exchange(self, messages: Mapping[int, Message]) -> dict[int, Message]:
        self.traffic.exchanges += 1
        replies: dict[int, Message] = {}
        for cid, msg in messages.items():
            self.traffic.bytes_down += msg.nbytes()
            ctx = ClientContext(
                client_id=cid,
                round=self.round,
                seed=self.seed,
                data=self.data.client(cid),
                model=self.model,
                state=self.state_of(cid),
                train=self.train,
                test_x=None if self.test is None else self.test[0],
                test_y=None if self.test is None else self.test[1],
            )
            reply = self.client_logic.handle(msg, ctx)
            self.traffic.bytes_up += reply.nbytes()
            replies[cid] = reply
        return replies
