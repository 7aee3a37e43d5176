"""FedAvg (McMahan et al., AISTATS 2017): local SGD, sample-count weighted averaging.

``server_lr`` (1.0 by default, which is plain FedAvg) moves the global model by
server_lr times the averaged update, as in FedOpt's FedAvgM without momentum.

A sampled client whose reply does not arrive (a dead node, a rejected reply) is left out:
the average and the metrics are over the clients that replied.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedskew.algorithm_interface import Algorithm, ClientContext, ClientLogic, ServerLogic
from fedskew.algorithms.local import (
    apply_server_lr,
    set_arrays,
    train_client,
    trained_reply,
    weighted_average,
)
from fedskew.errors import UsageError
from fedskew.protocol import Channel, Message, arrived


@dataclass
class FedAvgParams:
    server_lr: float = 1.0

    def validate(self) -> None:
        if self.server_lr <= 0:
            raise UsageError(f"fedavg: server_lr must be > 0, got {self.server_lr}")


class FedAvgServer(ServerLogic):
    def round(self, rnd: int, clients: list[int], channel: Channel) -> dict[str, float]:
        msg = Message("train", arrays=self.global_arrays)
        replies = channel.exchange({c: msg for c in clients})
        clients = arrived(clients, replies)
        states = [replies[c].arrays for c in clients]
        weights = [replies[c].scalars["num_samples"] for c in clients]
        averaged = weighted_average(states, weights)
        self.global_arrays = apply_server_lr(self.global_arrays, averaged, self.params.server_lr)
        return {"train_loss": sum(replies[c].scalars["loss"] for c in clients) / len(clients)}


class FedAvgClient(ClientLogic):
    def on_train(self, msg: Message, ctx: ClientContext) -> Message:
        set_arrays(ctx.model, msg.arrays)
        result = train_client(ctx)
        return trained_reply(ctx, result.mean_loss)


class FedAvg(Algorithm):
    name = "fedavg"
    description = "FedAvg: local SGD, sample-weighted model averaging (optional server lr)"
    Params = FedAvgParams
    Server = FedAvgServer
    Client = FedAvgClient
