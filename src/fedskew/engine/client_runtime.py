"""The client side every engine runs, and the bookkeeping of engines that keep client state.

A :class:`ClientRuntime` is what a process needs to answer messages for any client: the
federated data, one scratch model, the algorithm's client logic, the local-training
settings, the seed and the test set. The in-process engine is one; a worker process and
a Flower node each build one from the experiment configuration.

:class:`ClientStateKeeper` holds what an engine that keeps every client's state on the
server side tracks between exchanges (the in-process and worker-pool engines; a Flower
node keeps its client's state itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Self

import torch

from fedskew.algorithm_interface import ClientContext, ClientLogic, LocalTrainConfig
from fedskew.data.federated import FederatedData
from fedskew.protocol import ClientState, Message

if TYPE_CHECKING:
    from fedskew.experiment import Prepared


@dataclass
class TrafficCounter:
    bytes_down: int = 0
    bytes_up: int = 0
    exchanges: int = 0

    def reset(self) -> None:
        self.bytes_down = self.bytes_up = self.exchanges = 0


class ClientRuntime:
    """Answers one message for one client: builds the client's context, calls the logic.

    An engine that also keeps client state lists this class before ClientStateKeeper, so
    that this constructor's ``super().__init__()`` sets up the bookkeeping too."""

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
        super().__init__()

    @classmethod
    def from_prepared(
        cls,
        prep: Prepared,
        client_logic: ClientLogic | None = None,
        model: torch.nn.Module | None = None,
    ) -> Self:
        """The runtime of a prepared experiment; a new client logic and scratch model unless
        the caller already has them."""
        if model is None:
            # experiment imports the engines, so it cannot be imported at module level.
            from fedskew.experiment import new_model

            model = new_model(prep)
        if client_logic is None:
            client_logic = prep.algorithm.Client(prep.params)
        return cls(
            client_logic,
            prep.fed,
            model,
            prep.train,
            prep.cfg.seed,
            test=(prep.dataset.x_test, prep.dataset.y_test),
        )

    def handle(self, cid: int, rnd: int, msg: Message, state: ClientState) -> Message:
        ctx = ClientContext(
            client_id=cid,
            round=rnd,
            seed=self.seed,
            data=self.data.client(cid),
            model=self.model,
            state=state,
            train=self.train,
            test_x=None if self.test is None else self.test[0],
            test_y=None if self.test is None else self.test[1],
        )
        return self.client_logic.handle(msg, ctx)


class ClientStateKeeper:
    """The round, the traffic count and every client's state, created on first use."""

    def __init__(self) -> None:
        self.client_states: dict[int, ClientState] = {}
        self.traffic = TrafficCounter()
        self.round = 0
        super().__init__()

    def begin_round(self, rnd: int) -> None:
        self.round = rnd
        self.traffic.reset()

    def state_of(self, client_id: int) -> ClientState:
        state = self.client_states.get(client_id)
        if state is None:
            state = self.client_states[client_id] = ClientState()
        return state
