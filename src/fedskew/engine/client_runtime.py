"""The client side every engine runs: answer one message for one client.

A :class:`ClientRuntime` is what a process needs to answer messages for any client: the
federated data, one scratch model, the algorithm's client logic, the local-training
settings, the seed and the test set. The in-process engine holds one; a worker process and
a Flower node each build one from the experiment configuration (``fedskew.building``).
"""

from __future__ import annotations

from typing import Self

import torch

from fedskew.algorithm_interface import ClientContext, ClientLogic, LocalTrainConfig
from fedskew.building import Prepared, new_model
from fedskew.data.federated import FederatedData
from fedskew.protocol import ClientState, Message


class ClientRuntime:
    """Builds a client's context for a message and calls the algorithm's client logic."""

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

    @classmethod
    def from_prepared(
        cls,
        prep: Prepared,
        client_logic: ClientLogic | None = None,
        model: torch.nn.Module | None = None,
    ) -> Self:
        """The runtime of a prepared experiment; a new client logic and scratch model unless
        the caller already has them."""
        return cls(
            prep.algorithm.Client(prep.params) if client_logic is None else client_logic,
            prep.fed,
            new_model(prep) if model is None else model,
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
