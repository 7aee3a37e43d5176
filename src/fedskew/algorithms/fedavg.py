"""FedAvg (McMahan et al., AISTATS 2017): local SGD, sample-count weighted averaging.

``server_lr`` (1.0 by default, which is plain FedAvg) moves the global model by
server_lr times the averaged update, as in FedOpt's FedAvgM without momentum.

A sampled client whose reply does not arrive (a dead node, a rejected reply) is left out:
the average and the metrics are over the clients that replied.

Under secure aggregation or DP (``fedskew.training.privacy``) the server gets only the mean
of the clients' updates: sample-weighted under secure aggregation alone and local DP, equal
weights under central DP (a client's weight would be its sensitivity). The methods that keep
this server and change only the clients' training (FedProx, FedDecorr, FedLC, FedNTD, FedRS,
MOON) take both mechanisms too (``AVERAGED_UPDATES``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from fedskew.core.errors import UsageError
from fedskew.training.aggregation import apply_server_lr, weighted_average
from fedskew.training.interface import (
    Algorithm,
    ClientContext,
    ClientLogic,
    ServerLogic,
    ServerSetup,
    keeps_nothing,
)
from fedskew.training.local import (
    PlainTraining,
    run_plain,
    set_arrays,
    trained_needs,
    trained_reply,
)
from fedskew.training.privacy import PrivateAggregation, moved
from fedskew.training.protocol import Channel, Expected, Message, arrived

# Algorithm.privacy of a method whose server moves the model by the mean of the clients'
# updates and nothing else: both mechanisms apply.
AVERAGED_UPDATES: dict[str, str | None] = {"secure_aggregation": None, "dp": None}


@dataclass
class FedAvgParams:
    """FedAvg's hyper-parameters; the baselines that keep FedAvg's server extend them."""

    # The algorithm named in error messages (each subclass names its own).
    algorithm: ClassVar[str] = "fedavg"
    server_lr: float = 1.0

    def validate(self) -> None:
        """Subclasses check their own fields, then call ``super().validate()``."""
        if self.server_lr <= 0:
            raise UsageError(f"{self.algorithm}: server_lr must be > 0, got {self.server_lr}")


class FedAvgServer(ServerLogic):
    """One exchange, then the weighted average. A method that changes only the weights
    (FedACD) overrides ``weights``, and ``metrics`` for what it adds to the log."""

    def __init__(self, params: FedAvgParams, setup: ServerSetup) -> None:
        super().__init__(params, setup)
        self.private = PrivateAggregation.install(self)  # None without secure aggregation/DP

    def round(self, rnd: int, clients: list[int], channel: Channel) -> dict[str, float]:
        msg = Message("train", arrays=self.global_arrays)
        if self.private is not None:
            return self.private_round(rnd, clients, channel, msg)
        replies = channel.exchange({c: msg for c in clients}, self.expected())
        clients = arrived(clients, replies)
        weights = self.weights(replies, clients)
        metrics = self.metrics(replies, clients, weights)
        # On the device the replies are on (takes_device_replies), then one copy of the
        # average to where the global model lives, not one of every reply.
        averaged = weighted_average([replies[c].arrays for c in clients], weights)
        averaged = {k: v.to(self.global_arrays[k].device) for k, v in averaged.items()}
        self.global_arrays = apply_server_lr(self.global_arrays, averaged, self.server_lr())
        return metrics

    def takes_device_replies(self) -> bool:
        """The plain round reads the replies' arrays only in the average (and its
        subclasses' weights and metrics only their numbers); the summed exchanges of secure
        aggregation and DP are left on the host."""
        return self.private is None

    def private_round(
        self, rnd: int, clients: list[int], channel: Channel, msg: Message
    ) -> dict[str, float]:
        """The round over a summed exchange: the global model moves by the server learning
        rate times the (noised, under central DP) mean update; one client's is never seen."""
        assert self.private is not None
        summed = self.private.exchange(channel, rnd, clients, msg, self.privacy_state)
        update, metrics = self.private.finish(rnd, summed, self.privacy_state)
        self.global_arrays = moved(self.global_arrays, update, self.server_lr())
        return metrics

    def expected(self) -> Expected:
        """What ``round`` reads from each reply: the model, the sample count, the loss."""
        return trained_needs(self.global_arrays, "num_samples")

    def weights(self, replies: Mapping[int, Message], clients: list[int]) -> list[float]:
        """The aggregation weights of the replying ``clients``: their sample counts."""
        return [replies[c].scalars["num_samples"] for c in clients]

    def metrics(
        self, replies: Mapping[int, Message], clients: list[int], weights: list[float]
    ) -> dict[str, float]:
        """The round's metrics, given the replies and the weights the average used."""
        return {"train_loss": self.mean_train_loss(replies, clients)}

    def server_lr(self) -> float:
        """The step towards the average (1.0: the global model becomes the average)."""
        return self.params.server_lr


class FedAvgClient(ClientLogic):
    def on_train(self, msg: Message, ctx: ClientContext) -> Message:
        return run_plain(self.plain_train(msg, ctx), ctx)

    def plain_train(self, msg: Message, ctx: ClientContext) -> PlainTraining:
        """Load the global model; after plain local training, reply with the trained model
        (split so that an engine may train a round's clients together)."""
        set_arrays(ctx.model, msg.arrays)
        return PlainTraining(lambda result: trained_reply(ctx, result.mean_loss))


class FedAvg(Algorithm):
    name = "fedavg"
    description = "FedAvg: local SGD, sample-weighted model averaging (optional server lr)"
    Params = FedAvgParams
    Server = FedAvgServer
    Client = FedAvgClient
    client_state = classmethod(keeps_nothing)
    privacy = AVERAGED_UPDATES
