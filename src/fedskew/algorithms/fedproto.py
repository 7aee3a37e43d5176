"""Generalised FedProto (after Tan et al., AAAI 2022), as FedFM compares against it.

FedProto is a personalisation method; FedFM's "generalised" version keeps its prototype
regulariser but trains and evaluates ONE global model with FedAvg. Local loss:
    CE(f(x), y) + ld * R(h(x), P_y),
where P_y is the global prototype (class mean of body features) of the label y, broadcast
by the server. A sample whose class has no global prototype yet adds nothing (round 0 is
plain FedAvg).

After training, each client computes the class means of its features with its trained
model (eval mode, every sample once) and uploads them with the class counts, only for the
classes it holds. The server averages them weighted by the counts,
P_c = sum_k n_kc a_kc / sum_k n_kc, and broadcasts the prototypes that exist (with their
class indices) in the next round's training message.

Choices FedFM leaves open:
- R is FedProto's reference regulariser, the mean squared error over batch AND feature
  dimension ((1 / (N d)) sum_i ||h_i - P_{y_i}||^2, samples without a prototype counted
  as zero); ``distance=sq`` uses the squared L2 distance averaged over the batch
  ((1 / N) sum_i ||h_i - P_{y_i}||^2), d times stronger for the same ``ld``.
- A class no client of the round holds keeps its previous prototype (``keep_stale=true``);
  ``keep_stale=false`` forgets it, as FedProto's server builds prototypes from the round's
  uploads only.
- A client whose reply does not arrive counts as not sampled: models and prototypes are
  aggregated over the replies that arrived.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fedskew.core.errors import UsageError
from fedskew.core.precision import in_fp32
from fedskew.training.aggregation import weighted_average
from fedskew.training.interface import (
    Algorithm,
    ClientContext,
    ClientLogic,
    InactiveMechanism,
    RunShape,
    ServerLogic,
    ServerSetup,
    check_one_of,
    keeps_nothing,
    starts_too_late,
)
from fedskew.training.local import (
    LossOutput,
    PlainTraining,
    TrainResult,
    class_feature_means,
    get_arrays,
    run_plain,
    set_arrays,
    trained_needs,
    trained_reply,
)
from fedskew.training.protocol import ArraySpec, Channel, Message, arrived
from fedskew.training.state_spec import OrNone, Spec

DISTANCES = ("mse", "sq")
PROTOS, PROTO_CLASSES, PROTO_COUNTS = "proto.values", "proto.classes", "proto.counts"
PROTO_ARRAYS = (PROTOS, PROTO_CLASSES, PROTO_COUNTS)


@dataclass
class FedProtoParams:
    ld: float = 1.0  # weight of the prototype regulariser (FedProto's lambda)
    distance: str = "mse"
    keep_stale: bool = True

    def validate(self) -> None:
        if self.ld < 0:
            raise UsageError(f"fedproto: ld must be >= 0, got {self.ld}")
        check_one_of("fedproto", "distance", self.distance, DISTANCES)


@in_fp32
def prototype_regulariser(
    features: torch.Tensor,
    y: torch.Tensor,
    prototypes: torch.Tensor,
    known: torch.Tensor,
    distance: str,
) -> torch.Tensor:
    """Mean over the batch of the distance of each feature to its class prototype;
    samples of classes without a prototype (``known`` False) contribute zero."""
    mask = known[y].to(features.dtype).unsqueeze(1)
    sq = ((features - prototypes[y]) * mask) ** 2
    return sq.mean() if distance == "mse" else sq.sum(dim=1).mean()


class FedProtoServer(ServerLogic):
    params: FedProtoParams
    checkpoint_fields = ("prototypes", "known")  # server state a resumed run needs

    def __init__(self, params: FedProtoParams, setup: ServerSetup) -> None:
        super().__init__(params, setup)
        self.prototypes: torch.Tensor | None = None  # (C, d), valid where self.known
        self.known = torch.zeros(setup.num_classes, dtype=torch.bool, device="cpu")

    def round(self, rnd: int, clients: list[int], channel: Channel) -> dict[str, float]:
        arrays = dict(self.global_arrays)
        if self.prototypes is not None and bool(self.known.any()):
            classes = torch.nonzero(self.known).flatten()
            arrays[PROTOS] = self.prototypes[classes]
            arrays[PROTO_CLASSES] = classes
        expect = trained_needs((*self.global_arrays, *PROTO_ARRAYS), "num_samples")
        replies = channel.exchange({c: Message("train", arrays=arrays) for c in clients}, expect)
        clients = arrived(clients, replies)
        model_keys = list(self.global_arrays)
        self.global_arrays = weighted_average(
            [{k: replies[c].arrays[k] for k in model_keys} for c in clients],
            [replies[c].scalars["num_samples"] for c in clients],
        )
        self.aggregate_prototypes([replies[c] for c in clients])
        return {"train_loss": self.mean_train_loss(replies, clients)}

    def aggregate_prototypes(self, replies: list[Message]) -> None:
        """P_c = sum_k n_kc a_kc / sum_k n_kc over the replies holding class c."""
        dim = replies[0].arrays[PROTOS].shape[1]
        dev = self.known.device
        sums = torch.zeros(self.setup.num_classes, dim, dtype=torch.float64, device=dev)
        counts = torch.zeros(self.setup.num_classes, dtype=torch.float64, device=dev)
        for reply in replies:
            cls, n = reply.arrays[PROTO_CLASSES], reply.arrays[PROTO_COUNTS].to(torch.float64)
            sums.index_add_(0, cls, reply.arrays[PROTOS].to(torch.float64) * n[:, None])
            counts.index_add_(0, cls, n)
        held = counts > 0
        fresh = (sums / counts.clamp(min=1)[:, None]).to(torch.float32)
        if self.prototypes is None or not self.params.keep_stale:
            self.prototypes = torch.where(held[:, None], fresh, torch.zeros_like(fresh))
            self.known = held
        else:
            self.prototypes = torch.where(held[:, None], fresh, self.prototypes)
            self.known = self.known | held


class FedProtoClient(ClientLogic):
    params: FedProtoParams

    def on_train(self, msg: Message, ctx: ClientContext) -> Message:
        return run_plain(self.plain_train(msg, ctx), ctx)

    def plain_train(self, msg: Message, ctx: ClientContext) -> PlainTraining:
        """Load the global model; the global prototypes go with the training (none before
        any is known, or with ``ld`` 0); then reply with the local class means."""
        set_arrays(ctx.model, {k: v for k, v in msg.arrays.items() if not k.startswith("proto.")})
        num_classes = ctx.data.num_classes
        dev = ctx.data.device
        prototypes = torch.zeros(num_classes, ctx.model.feature_dim, device=dev)
        known = torch.zeros(num_classes, dtype=torch.bool, device=dev)
        if PROTO_CLASSES in msg.arrays:
            prototypes[msg.arrays[PROTO_CLASSES]] = msg.arrays[PROTOS]
            known[msg.arrays[PROTO_CLASSES]] = True
        regularise = self.params.ld > 0 and bool(known.any())
        tensors = {"prototypes": prototypes, "known": known} if regularise else {}

        def finish(result: TrainResult) -> Message:
            means, counts = class_feature_means(ctx.model, ctx.data, num_classes)
            held = torch.nonzero(counts > 0).flatten()
            arrays = get_arrays(ctx.model)
            arrays[PROTOS] = means[held]
            arrays[PROTO_CLASSES] = held
            arrays[PROTO_COUNTS] = counts[held]
            return trained_reply(ctx, result.mean_loss, arrays)

        return PlainTraining(finish, loss=self.loss, tensors=tensors)

    def loss(
        self,
        model: torch.nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        tensors: Mapping[str, torch.Tensor],
    ) -> LossOutput:
        """CE, plus ``ld`` times the distance to the global prototypes when they came."""
        features = model.body(x)
        logits = model.head(features)
        loss = F.cross_entropy(logits, y)
        if tensors:
            loss = loss + self.params.ld * prototype_regulariser(
                features, y, tensors["prototypes"], tensors["known"], self.params.distance
            )
        return LossOutput(loss, features, logits)


class FedProto(Algorithm):
    name = "fedproto"
    description = (
        "Generalised FedProto (FedFM's baseline): global model with CE + ld * distance of "
        "features to count-weighted global class prototypes"
    )
    Params = FedProtoParams
    Server = FedProtoServer
    Client = FedProtoClient
    client_state = classmethod(keeps_nothing)

    @classmethod
    def reply_arrays(
        cls, params: FedProtoParams, model: torch.nn.Module, num_classes: int
    ) -> dict[str, ArraySpec]:
        """The means, indices and counts of the n classes a client holds."""
        return {
            PROTOS: ArraySpec(("n", model.feature_dim)),
            PROTO_CLASSES: ArraySpec(("n",), torch.int64, classes=num_classes),
            PROTO_COUNTS: ArraySpec(("n",), torch.int64),
        }

    @classmethod
    def checkpoint_specs(
        cls, params: FedProtoParams, model: torch.nn.Module, num_classes: int
    ) -> dict[str, Spec]:
        """The global prototypes, once the first round has made them."""
        return {"prototypes": OrNone(ArraySpec((num_classes, model.feature_dim)))}

    @classmethod
    def inactive_mechanisms(
        cls, params: FedProtoParams, shape: RunShape
    ) -> list[InactiveMechanism]:
        """The regulariser in a one-round run: prototypes come from the first round's uploads."""
        if params.ld == 0:
            return []
        return starts_too_late(
            "prototype regulariser", 1, shape, {"ld": params.ld},
            "the global prototypes come from the first round's uploads; the run is FedAvg",
        )  # fmt: skip
