"""An algorithm written outside fedskew, in one file: FedAvgM (Hsu et al., 2019).

FedAvg with server momentum: the server treats the averaged client update as a gradient,
keeps a velocity v <- beta * v + (w_t - avg_k w_k) and moves w_{t+1} = w_t - server_lr * v.
beta = 0 is FedAvg. Clients train as in FedAvg.

Run it from this folder without installing anything:

    cd examples
    fedskew run -a fedavgm:FedAvgM -p beta=0.9 -r 10

or from Python: ``fedskew.run({"rounds": 10, "params": {"beta": 0.9}}, algorithm=FedAvgM)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedskew.core.errors import UsageError
from fedskew.training.aggregation import weighted_average
from fedskew.training.interface import (
    Algorithm,
    ClientContext,
    ClientLogic,
    ServerLogic,
    ServerSetup,
)
from fedskew.training.local import set_arrays, train_client, trained_needs, trained_reply
from fedskew.training.protocol import Channel, Message, arrived


@dataclass
class FedAvgMParams:
    beta: float = 0.9  # server momentum
    server_lr: float = 1.0

    def validate(self) -> None:
        if not 0 <= self.beta < 1:
            raise UsageError(f"fedavgm: beta must be in [0, 1), got {self.beta}")
        if self.server_lr <= 0:
            raise UsageError(f"fedavgm: server_lr must be > 0, got {self.server_lr}")


class FedAvgMServer(ServerLogic):
    # The velocity must survive a resume: the checkpoint saves exactly these attributes.
    checkpoint_fields = ("velocity",)

    def __init__(self, params: FedAvgMParams, setup: ServerSetup) -> None:
        super().__init__(params, setup)
        self.velocity: dict[str, torch.Tensor] = {}

    def round(self, rnd: int, clients: list[int], channel: Channel) -> dict[str, float]:
        replies = channel.exchange(
            {c: Message("train", arrays=self.global_arrays) for c in clients},
            # What the average below reads: a reply without it is left out on Flower.
            trained_needs(self.global_arrays, "num_samples"),
        )
        clients = arrived(clients, replies)  # a real deployment can lose replies
        average = weighted_average(
            [replies[c].arrays for c in clients],
            [replies[c].scalars["num_samples"] for c in clients],
        )
        beta, lr = self.params.beta, self.params.server_lr
        new: dict[str, torch.Tensor] = {}
        for key, w in self.global_arrays.items():
            if not w.is_floating_point():  # BatchNorm's counter: take the average's
                new[key] = average[key]
                continue
            step = w - average[key]
            v = beta * self.velocity[key] + step if key in self.velocity else step
            self.velocity[key] = v
            new[key] = w - lr * v
        self.global_arrays = new
        return {"train_loss": self.mean_train_loss(replies, clients)}


class FedAvgMClient(ClientLogic):
    def on_train(self, msg: Message, ctx: ClientContext) -> Message:
        set_arrays(ctx.model, msg.arrays)
        result = train_client(ctx)
        return trained_reply(ctx, result.mean_loss)


class FedAvgM(Algorithm):
    name = "fedavgm"
    description = "FedAvgM: FedAvg with server momentum (example of an external algorithm)"
    Params = FedAvgMParams
    Server = FedAvgMServer
    Client = FedAvgMClient


if __name__ == "__main__":
    import fedskew

    result = fedskew.run({"rounds": 5, "quiet": True, "params": {"beta": 0.9}}, algorithm=FedAvgM)
    print(f"FedAvgM: final accuracy {result.summary['final_accuracy']:.4f} in {result.folder}")
