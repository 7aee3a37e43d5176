"""A tiny convolutional model with BatchNorm for 8x8 digits: the tests' stand-in for
ResNet-18's BatchNorm buffers (running statistics, batch counter) at a size that trains in
milliseconds. Registered as ``tiny-bn-cnn`` on import."""

from __future__ import annotations

from collections import OrderedDict

from torch import nn

from fedskew.models import register_model
from fedskew.models.base import BodyHeadModel

NAME = "tiny-bn-cnn"


def build_tiny_bn_cnn(input_shape: tuple[int, ...], num_classes: int) -> BodyHeadModel:
    """conv 3x3 (8) + BatchNorm2d + ReLU + 2x2 pool, then 32 features with BatchNorm1d."""
    channels, height, width = input_shape
    body = nn.Sequential(
        OrderedDict(
            conv=nn.Conv2d(channels, 8, 3, padding=1),
            bn1=nn.BatchNorm2d(8),
            relu1=nn.ReLU(),
            pool=nn.MaxPool2d(2),
            flatten=nn.Flatten(),
            fc=nn.Linear(8 * (height // 2) * (width // 2), 32),
            bn2=nn.BatchNorm1d(32),
            relu2=nn.ReLU(),
        )
    )
    return BodyHeadModel(body, nn.Linear(32, num_classes), 32)


register_model(NAME, build_tiny_bn_cnn)
