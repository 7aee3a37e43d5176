"""ResNet-18 with a CIFAR or ImageNet stem and BatchNorm or GroupNorm."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import nn

from fedskew.core.errors import UsageError
from fedskew.models.base import (
    BodyHeadModel,
    image_shape,
    option_bool,
    option_choice,
    option_positive_int,
)

NormFactory = Callable[[int], nn.Module]

STEMS = ("cifar", "imagenet")
NORMS = ("bn", "gn")
STAGE_MULTIPLES = (1, 2, 4, 8)
BLOCKS_PER_STAGE = (2, 2, 2, 2)


def _norm_factory(norm: str) -> NormFactory:
    if norm == "bn":
        return nn.BatchNorm2d
    # Two groups, as in FedNH's ResNet: GroupNorm keeps no running statistics, which
    # avoids averaging BatchNorm statistics across clients with skewed label distributions.
    return lambda channels: nn.GroupNorm(2, channels)


class GlobalAvgPool(nn.AdaptiveAvgPool2d):
    """Global average pooling, ``nn.AdaptiveAvgPool2d(1)``, computed as the mean over height
    and width: the value PyTorch itself computes for a 1x1 output (the same bits on the CPU),
    without the two detours the layer takes. On CUDA under ``use_deterministic_algorithms``
    the layer's backward has no deterministic kernel, and inside ``vmap`` (clients trained
    together) its re-striding of the output has no batching rule, so every call fell back to
    a slow per-client loop. No parameters either way, so the state dict is unchanged."""

    def __init__(self) -> None:
        super().__init__(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(2, 3), keepdim=True)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with an identity (or 1x1 projection) shortcut."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, norm: NormFactory):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.norm1 = norm(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.norm2 = norm(out_channels)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), norm(out_channels)
            )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


def _stem(in_channels: int, stem: str, norm: NormFactory, width: int) -> nn.Sequential:
    if stem == "cifar":
        # Small images lose too much resolution to a strided 7x7 conv and a max pool.
        return nn.Sequential(
            OrderedDict(
                conv=nn.Conv2d(in_channels, width, 3, 1, 1, bias=False),
                norm=norm(width),
                relu=nn.ReLU(),
            )
        )
    return nn.Sequential(
        OrderedDict(
            conv=nn.Conv2d(in_channels, width, 7, 2, 3, bias=False),
            norm=norm(width),
            relu=nn.ReLU(),
            pool=nn.MaxPool2d(3, 2, 1),
        )
    )


def build_resnet18(
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    stem: str = "cifar",
    norm: str = "bn",
    head_bias: bool | str = True,
    width: int | str = 64,
) -> BodyHeadModel:
    """ResNet-18 whose body ends in global average pooling (512-d, post-ReLU features).

    Adaptive pooling makes any input of at least 1x1 valid, e.g. 8x8 digits. ``width`` is
    the first stage's channel count (64 in the paper; the stages have width x 1, 2, 4, 8):
    a smaller one keeps the architecture, normalisation included, at a fraction of the cost
    (features are 8 x width wide). With GroupNorm the width must be even.
    """
    in_channels, _, _ = image_shape("resnet18", input_shape)
    stem = option_choice("resnet18", "stem", stem, STEMS)
    norm_factory = _norm_factory(option_choice("resnet18", "norm", norm, NORMS))
    bias = option_bool("resnet18", "head_bias", head_bias)
    base = option_positive_int("resnet18", "width", width)
    if norm == "gn" and base % 2:
        raise UsageError(f"model 'resnet18': width must be even with norm=gn, got {base}")

    layers: OrderedDict[str, nn.Module] = OrderedDict(
        stem=_stem(in_channels, stem, norm_factory, base)
    )
    channels = base
    for index, (multiple, blocks) in enumerate(zip(STAGE_MULTIPLES, BLOCKS_PER_STAGE, strict=True)):
        stage = []
        for block in range(blocks):
            stride = 2 if index > 0 and block == 0 else 1
            stage.append(BasicBlock(channels, base * multiple, stride, norm_factory))
            channels = base * multiple
        layers[f"layer{index + 1}"] = nn.Sequential(*stage)
    layers["pool"] = GlobalAvgPool()
    layers["flatten"] = nn.Flatten()
    return BodyHeadModel(
        nn.Sequential(layers), nn.Linear(channels, num_classes, bias=bias), channels
    )
