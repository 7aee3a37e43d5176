"""Small fully connected and convolutional models used by the label-skew papers."""

from __future__ import annotations

import math
from collections import OrderedDict

from torch import nn

from fedskew.core.errors import UsageError
from fedskew.models.base import (
    BodyHeadModel,
    conv_out,
    image_shape,
    option_choice,
    option_positive_int,
)


def build_mlp(
    input_shape: tuple[int, ...], num_classes: int, *, hidden: int | str = 200
) -> BodyHeadModel:
    """Two hidden ReLU layers over the flattened input; works on tabular and image inputs."""
    width = option_positive_int("mlp", "hidden", hidden)
    in_features = math.prod(input_shape)
    body = nn.Sequential(
        OrderedDict(
            flatten=nn.Flatten(),
            fc1=nn.Linear(in_features, width),
            relu1=nn.ReLU(),
            fc2=nn.Linear(width, width),
            relu2=nn.ReLU(),
        )
    )
    return BodyHeadModel(body, nn.Linear(width, num_classes), width)


def _two_conv_flat_size(
    model: str, input_shape: tuple[int, ...], out_channels: int
) -> tuple[int, int]:
    """(input channels, flattened size) after conv5-pool2-conv5-pool2 without padding.

    The papers' architectures use no padding, so small inputs are rejected rather than
    silently padded into a different model.
    """
    channels, height, width = image_shape(model, input_shape)
    sizes = []
    for size in (height, width):
        for kernel, stride in ((5, 1), (2, 2), (5, 1), (2, 2)):
            size = conv_out(size, kernel, stride)
            if size < 1:
                raise UsageError(
                    f"model '{model}' needs inputs of at least 16x16 (two unpadded 5x5 convs "
                    f"with 2x2 pooling), got {height}x{width}"
                )
        sizes.append(size)
    return channels, out_channels * sizes[0] * sizes[1]


NORMS = ("none", "bn", "gn")


def _norm_layer(norm: str, channels: int, conv: bool) -> nn.Module | None:
    """The normalisation after a layer, before its ReLU (None: the papers' plain CNNs)."""
    if norm == "bn":
        return nn.BatchNorm2d(channels) if conv else nn.BatchNorm1d(channels)
    if norm == "gn":
        # Two groups as in resnet18's gn; GroupNorm(2, C) on (N, C) normalises each half of a
        # feature vector over itself, with no running statistics to average across clients.
        return nn.GroupNorm(2, channels)
    return None


def _two_conv_body(
    channels: int, flat: int, convs: tuple[int, int], fcs: tuple[int, ...], norm: str = "none"
) -> nn.Module:
    """conv5-ReLU-pool2 twice, then ReLU fully connected layers: the shape the papers' small
    CNNs share; only the widths and the number of fully connected layers differ. ``norm``
    puts a normalisation after every convolution and fully connected layer, before its ReLU
    (the feature path of a normalised network).

    Each convolution block runs its 2x2 max-pooling before the ReLU. The two commute exactly
    (ReLU is monotone, so the window's maximum is kept either way, and both send a gradient
    only to a positive maximum), so the values and gradients are those of conv-ReLU-pool,
    while the ReLU and its backward touch a quarter of the elements: less time per fp32
    training step, most for fedavg-cnn's wide first layer (benchmarks/pool_relu_order.py
    trains both orders side by side and checks they agree bit for bit).
    """
    c1, c2 = convs
    layers: OrderedDict[str, nn.Module] = OrderedDict()

    def add(name: str, layer: nn.Module, out: int, conv: bool, relu: str, pool: str = "") -> None:
        layers[name] = layer
        normalise = _norm_layer(norm, out, conv)
        if normalise is not None:
            layers[f"norm_{name}"] = normalise
        if pool:
            layers[pool] = nn.MaxPool2d(2)
        layers[relu] = nn.ReLU()

    add("conv1", nn.Conv2d(channels, c1, 5), c1, True, "relu1", "pool1")
    add("conv2", nn.Conv2d(c1, c2, 5), c2, True, "relu2", "pool2")
    layers["flatten"] = nn.Flatten()
    width = flat
    for i, out in enumerate(fcs):
        add(f"fc{i + 1}", nn.Linear(width, out), out, False, f"relu{i + 3}")
        width = out
    return nn.Sequential(layers)


def build_simple_cnn(
    input_shape: tuple[int, ...], num_classes: int, *, norm: str = "none"
) -> BodyHeadModel:
    """The LeNet-style "simple-cnn" of MOON and FedCME (84-d features).

    ``norm`` = bn or gn is not in those papers: it adds BatchNorm or GroupNorm before every
    ReLU, a normalised feature path at simple-cnn's cost (FedFM's claim is made on
    ResNet-18 with BatchNorm)."""
    channels, flat = _two_conv_flat_size("simple-cnn", input_shape, 16)
    norm = option_choice("simple-cnn", "norm", norm, NORMS)
    body = _two_conv_body(channels, flat, (6, 16), (120, 84), norm)
    return BodyHeadModel(body, nn.Linear(84, num_classes), 84)


def build_fedavg_cnn(input_shape: tuple[int, ...], num_classes: int) -> BodyHeadModel:
    """McMahan et al.'s FedAvg CNN for 28x28 images (582,026 parameters with 10 classes).

    conv 32 5x5 and conv 64 5x5 without padding, each followed by ReLU and 2x2 pooling, then
    one fully connected ReLU layer of 512 units as the features and a linear head.
    """
    channels, flat = _two_conv_flat_size("fedavg-cnn", input_shape, 64)
    body = _two_conv_body(channels, flat, (32, 64), (512,))
    return BodyHeadModel(body, nn.Linear(512, num_classes), 512)


def build_cnn_cifar(input_shape: tuple[int, ...], num_classes: int) -> BodyHeadModel:
    """McMahan et al.'s CIFAR CNN ("Conv2Cifar" in FedNH / FedACD), 192-d features.

    The head has no bias, as in FedNH, whose prototype head is a bias-free linear map.
    """
    channels, flat = _two_conv_flat_size("cnn-cifar", input_shape, 64)
    body = _two_conv_body(channels, flat, (64, 64), (384, 192))
    return BodyHeadModel(body, nn.Linear(192, num_classes, bias=False), 192)
