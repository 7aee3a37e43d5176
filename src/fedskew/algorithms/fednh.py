"""FedNH (Dai et al., AAAI 2023): class prototypes as a frozen cosine classifier.

The head becomes ``PrototypeHead``: logits s * cos(h, mu_c) with one learnable scalar
scale s and the class prototypes mu_c (unit rows, a buffer the server owns). Prototypes
start spread out: orthonormal rows when d >= C, uniform on the sphere otherwise. Clients
never change them (a buffer gets no gradient): local training moves the body and s.

After training, a client uploads its body and s (not the prototypes it was sent) and, for
each class c it holds, n_c * normalize(mean_x normalize(h(x))): count-scaled normalised
class means, only for its classes (with their indices). The server averages body and s by
sample counts as FedAvg does, and moves every class some client held:
    mu_c <- normalize(rho * mu_c + (1 - rho) * normalize(sum_k n_kc nu_kc / sum_k n_kc)).
The counts are not uploaded: the outer normalize removes the positive denominator
sum_k n_kc, so the summed count-scaled means carry all the server needs. A class no client
of the round holds keeps its prototype; a client whose reply does not arrive counts as not
sampled (body, scale and prototypes move with the replies that arrived).

The scale starts at 1 for the small CNNs and the MLP and at 20 for ResNet
(``scale_init=auto``; give a number to override). Prototype initialisation draws from the
global torch generator inside ``adapt_model``, like every other layer's initialisation: the
experiment seeds it, so the initial prototypes are a function of the experiment seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fedskew.core.errors import UsageError
from fedskew.data.federated import ClientData
from fedskew.models.resnet import BasicBlock
from fedskew.training.aggregation import weighted_average
from fedskew.training.interface import (
    Algorithm,
    ClientContext,
    ClientLogic,
    ServerLogic,
    keeps_nothing,
)
from fedskew.training.local import (
    PlainTraining,
    TrainResult,
    get_arrays,
    run_plain,
    set_arrays,
    trained_needs,
    trained_reply,
)
from fedskew.training.protocol import ArraySpec, Channel, Message, arrived

PROTOTYPES = "head.prototypes"
SCALE = "head.scale"
RESNET_SCALE = 20.0
SMALL_MODEL_SCALE = 1.0


@dataclass
class FedNHParams:
    rho: float = 0.9  # smoothing of the server's prototype update (FedNH_smoothing)
    scale_init: str = "auto"  # "auto": 1 for CNN/MLP, 20 for ResNet; or a positive number

    def validate(self) -> None:
        if not 0 <= self.rho <= 1:
            raise UsageError(f"fednh: rho must be in [0, 1], got {self.rho}")
        if self.scale_init != "auto":
            try:
                value = float(self.scale_init)
            except ValueError:
                raise UsageError(
                    f"fednh: scale_init must be 'auto' or a number, got '{self.scale_init}'"
                ) from None
            if not value > 0:
                raise UsageError(f"fednh: scale_init must be > 0, got {self.scale_init}")


def init_prototypes(num_classes: int, dim: int, gen: torch.Generator | None = None) -> torch.Tensor:
    """(C, d) unit rows: orthonormal when d >= C, else Gaussian directions (uniform on the
    sphere), which cannot all be orthogonal."""
    if dim >= num_classes:
        q, _ = torch.linalg.qr(torch.randn(dim, num_classes, generator=gen))
        return q.t().contiguous()
    return F.normalize(torch.randn(num_classes, dim, generator=gen), dim=1)


class PrototypeHead(nn.Module):
    """logits = s * cos(h, mu_c); the prototypes are a buffer, so optimisers skip them."""

    def __init__(self, prototypes: torch.Tensor, scale: float) -> None:
        super().__init__()
        self.register_buffer("prototypes", prototypes)
        self.scale = nn.Parameter(torch.tensor([float(scale)]))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        cos = F.normalize(features, dim=1) @ F.normalize(self.prototypes, dim=1).t()
        return self.scale * cos

    @staticmethod
    def fused_forward(
        tensors: dict[str, torch.Tensor], features: torch.Tensor, clients: int
    ) -> torch.Tensor:
        """K clients' heads at once (``--clients-together fused``, engines/fused.py): client
        k's features are ``features[:, k*d:(k+1)*d]``, its prototypes and scale row k of
        the stacked ``tensors``; its logits go to columns ``[k*C, (k+1)*C)``."""
        n = features.shape[0]
        per_client = F.normalize(features.reshape(n, clients, -1).transpose(0, 1), dim=2)
        prototypes = F.normalize(tensors["prototypes"], dim=2)
        cos = torch.bmm(per_client, prototypes.transpose(1, 2))  # (K, N, C)
        return (tensors["scale"].unsqueeze(1) * cos).transpose(0, 1).reshape(n, -1)


def resolve_scale(params: FedNHParams, model: nn.Module) -> float:
    if params.scale_init != "auto":
        return float(params.scale_init)
    is_resnet = any(isinstance(m, BasicBlock) for m in model.modules())
    return RESNET_SCALE if is_resnet else SMALL_MODEL_SCALE


@torch.no_grad()
def scaled_class_means(
    model: nn.Module, data: ClientData, num_classes: int, batch_size: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """(classes held, n_c * normalize(class mean of normalised features)) in eval mode."""
    was_training = model.training
    model.eval()
    dev = data.device
    sums = torch.zeros(num_classes, model.feature_dim, device=dev)
    counts = torch.zeros(num_classes, dtype=torch.int64, device=dev)
    positions = torch.arange(len(data), device=dev)
    for start in range(0, len(data), batch_size):
        xb, yb = data.batch(positions[start : start + batch_size])
        sums.index_add_(0, yb, F.normalize(model.body(xb).float(), dim=1))
        counts += torch.bincount(yb, minlength=num_classes)
    model.train(was_training)
    classes = torch.nonzero(counts > 0).flatten()
    # normalize(sum) == normalize(mean): the division by n_c is not needed before it.
    scaled = F.normalize(sums[classes], dim=1) * counts[classes].unsqueeze(1).to(sums.dtype)
    return classes, scaled


def update_prototypes(prototypes: torch.Tensor, summed: torch.Tensor, rho: float) -> torch.Tensor:
    """normalize(rho mu + (1 - rho) normalize(summed)) for classes with a non-zero sum."""
    held = summed.norm(dim=1) > 0
    moved = F.normalize(rho * prototypes + (1 - rho) * F.normalize(summed, dim=1), dim=1)
    return torch.where(held.unsqueeze(1), moved, prototypes)


class FedNHServer(ServerLogic):
    params: FedNHParams

    def round(self, rnd: int, clients: list[int], channel: Channel) -> dict[str, float]:
        msg = Message("train", arrays=self.global_arrays)
        model_keys = [k for k in self.global_arrays if k != PROTOTYPES]
        expect = trained_needs((*model_keys, "proto_classes", "proto_sums"), "num_samples")
        replies = channel.exchange({c: msg for c in clients}, expect)
        clients = arrived(clients, replies)
        averaged = weighted_average(
            [{k: replies[c].arrays[k] for k in model_keys} for c in clients],
            [replies[c].scalars["num_samples"] for c in clients],
        )
        prototypes = self.global_arrays[PROTOTYPES]
        summed = torch.zeros_like(prototypes)
        for c in clients:
            summed.index_add_(
                0, replies[c].arrays["proto_classes"], replies[c].arrays["proto_sums"]
            )
        averaged[PROTOTYPES] = update_prototypes(prototypes, summed, self.params.rho)
        self.global_arrays = averaged
        return {
            "train_loss": self.mean_train_loss(replies, clients),
            "scale": float(averaged[SCALE].reshape(-1)[0]),
        }


class FedNHClient(ClientLogic):
    def on_train(self, msg: Message, ctx: ClientContext) -> Message:
        return run_plain(self.plain_train(msg, ctx), ctx)

    def plain_train(self, msg: Message, ctx: ClientContext) -> PlainTraining:
        """FedAvg's plain local training (the prototypes are a buffer no step moves), then
        the count-scaled class means (split so that an engine may train a round's clients
        together)."""
        set_arrays(ctx.model, msg.arrays)

        def finish(result: TrainResult) -> Message:
            classes, scaled = scaled_class_means(ctx.model, ctx.data, ctx.data.num_classes)
            arrays = {k: v for k, v in get_arrays(ctx.model).items() if k != PROTOTYPES}
            arrays["proto_classes"] = classes
            arrays["proto_sums"] = scaled
            return trained_reply(ctx, result.mean_loss, arrays)

        return PlainTraining(finish)


class FedNH(Algorithm):
    name = "fednh"
    description = (
        "FedNH: frozen class-prototype cosine classifier with learnable scale; "
        "server moves prototypes towards clients' class means"
    )
    Params = FedNHParams
    Server = FedNHServer
    Client = FedNHClient
    client_state = classmethod(keeps_nothing)

    @classmethod
    def reply_arrays(
        cls, params: FedNHParams, model: nn.Module, num_classes: int
    ) -> dict[str, ArraySpec]:
        """The count-scaled means and indices of the n classes a client holds."""
        return {
            "proto_classes": ArraySpec(("n",), torch.int64, classes=num_classes),
            "proto_sums": ArraySpec(("n", model.feature_dim)),
        }

    @classmethod
    def adapt_model(cls, params: FedNHParams, model: nn.Module) -> nn.Module:
        num_classes = getattr(model.head, "out_features", None)
        if num_classes is None:
            raise UsageError("fednh needs a model whose head is a linear layer")
        model.head = PrototypeHead(
            init_prototypes(num_classes, model.feature_dim), resolve_scale(params, model)
        )
        return model
