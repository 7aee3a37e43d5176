"""Candidate remedies for FedFM's launching round; neither is in the paper.

At the launching round the full lam x l_FM arrives at once, and with a normalisation-free
feature path it can drive the local models to NaN. Two remedies plug into FedFM
(``fedskew.algorithms.fedfm``), both off by default so that the paper's behaviour is what
runs unless asked:

- ``lam_warmup`` = W > 0 (FedFM, FedFM-Lite and the feature-matching plug-in): lam grows
  linearly over the W rounds from the launching round T_s on: lam x (r - T_s + 1) / W in
  round r, the full lam from round T_s + W - 1 on. W = 1 is the paper.
- ``match_on`` = pre_relu (FedFM only): the anchors and the matching term use the body's
  output before its last ReLU (after the normalisation, on a model with ``norm=bn``) instead
  of the features the head reads; the network and its cross-entropy are unchanged. The idea:
  post-ReLU features all lie in the positive orthant, which could be why the anchors are
  nearly collinear at the launching round and the CG loss keeps a high floor; before the
  ReLU they may point anywhere. It needs a body that ends with a ReLU (simple-cnn,
  cnn-cifar, fedavg-cnn, mlp; not resnet18, whose body ends in pooling).

How they fare is measured in reproduction/REPRODUCTION.md (FedFM's stability and the
"FedFM (remedy)" claims); reproduction/NOTES.md sums it up.

The hook: FedFM's parameter classes mix in ``LamWarmupParams`` and ``MatchOnParams``; FedFM
asks ``lam_in_round`` for the round's lam, and ``anchor_features`` and ``matching_loss``
for what its clients match on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from fedskew.core.errors import UsageError
from fedskew.training.interface import check_one_of
from fedskew.training.local import FeatureFn, LossFn, LossOutput, cross_entropy_loss

# --- lam_warmup ------------------------------------------------------------------------------


@dataclass
class LamWarmupParams:
    lam_warmup: int = 0  # rounds; 0: off (the paper's constant lam)


def lam_in_round(lam: float, start_round: int, warmup: int, rnd: int) -> float:
    """lam in round ``rnd`` (0-based): the full lam, or its share of the warm-up."""
    if warmup <= 0:
        return lam
    return lam * min(1.0, max(0, rnd - start_round + 1) / warmup)


def check_lam_warmup(warmup: int, name: str = "lam_warmup") -> None:
    """``name``: what the user calls the parameter."""
    if warmup < 0:
        raise UsageError(f"feature matching: {name} must be >= 0 rounds, got {warmup}")


# --- match_on = pre_relu ---------------------------------------------------------------------

MATCH_ON = ("features", "pre_relu")


@dataclass
class MatchOnParams:
    match_on: str = "features"

    def validate(self) -> None:
        check_one_of("fedfm", "match_on", self.match_on, MATCH_ON)


def pre_relu_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The body's layers up to (without) its final ReLU, or a one-line UsageError."""
    body = getattr(model, "body", None)
    layers = list(body) if isinstance(body, torch.nn.Sequential) else []
    if not layers or not isinstance(layers[-1], torch.nn.ReLU):
        last = type(layers[-1]).__name__ if layers else type(body).__name__
        raise UsageError(
            "fedfm: match_on=pre_relu needs a model whose body ends with a ReLU (simple-cnn, "
            f"cnn-cifar, fedavg-cnn, mlp); this model's body ends with {last}"
        )
    return layers[:-1]


def pre_relu_features(layers: Sequence[torch.nn.Module], x: torch.Tensor) -> torch.Tensor:
    """The body's output before its final ReLU (``layers`` from ``pre_relu_layers``, taken
    once per handler rather than per batch): what the head reads is relu() of it."""
    for layer in layers:
        x = layer(x)
    return x


def pre_relu_cross_entropy(
    layers: Sequence[torch.nn.Module], model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor
) -> LossOutput:
    """The plain cross-entropy of the unchanged network, handing the pre-ReLU features to the
    matching term. Bind ``layers`` (``pre_relu_layers(model)``) with functools.partial."""
    z = pre_relu_features(layers, x)
    logits = model.head(F.relu(z))
    return LossOutput(F.cross_entropy(logits, y), z, logits)


def check_model(params: Any, model: torch.nn.Module) -> None:
    """Refuse match_on=pre_relu up front where the body does not end with a ReLU."""
    if params.match_on == "pre_relu":
        pre_relu_layers(model)


def anchor_features(params: Any, model: torch.nn.Module) -> FeatureFn | None:
    """What the local anchors average: None for the body output (the paper)."""
    if params.match_on == "pre_relu":
        return partial(pre_relu_features, pre_relu_layers(model))
    return None


def matching_loss(params: Any, model: torch.nn.Module) -> LossFn:
    """The local loss whose features the matching term sees: cross-entropy either way."""
    if params.match_on == "pre_relu":
        return partial(pre_relu_cross_entropy, pre_relu_layers(model))
    return cross_entropy_loss
