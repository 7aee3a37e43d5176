"""The body + head model contract shared by every fedskew model, and option helpers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fedskew.core.errors import UsageError


class BodyHeadModel(nn.Module):
    """A classifier split into a feature extractor (``body``) and a classifier (``head``).

    Algorithms rely on the split: some exchange only head parameters, others regularise the
    body's features. Keeping exactly two child modules guarantees that every state_dict key
    starts with ``body.`` or ``head.``.
    """

    def __init__(self, body: nn.Module, head: nn.Module, feature_dim: int) -> None:
        super().__init__()
        if isinstance(feature_dim, bool) or not isinstance(feature_dim, int) or feature_dim < 1:
            raise ValueError(f"feature_dim must be a positive int, got {feature_dim!r}")
        self.body = body
        self.head = head
        self.feature_dim = feature_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The flat (N, feature_dim) representation the head classifies."""
        return self.body(x)


@dataclass(frozen=True)
class ModelInfo:
    """A registry entry: ``builder(input_shape, num_classes, **options)``."""

    name: str
    description: str  # one line for `fedskew list`
    builder: Callable[..., BodyHeadModel]


# --- shape arithmetic ---------------------------------------------------------------------


def conv_out(size: int, kernel: int, stride: int = 1, padding: int = 0) -> int:
    """Spatial output size of a convolution or pooling layer (floor mode, dilation 1)."""
    return (size + 2 * padding - kernel) // stride + 1


def image_shape(model: str, input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    """``input_shape`` as (C, H, W), or a one-line UsageError naming the model."""
    if len(input_shape) != 3:
        raise UsageError(
            f"model '{model}' needs image input (C, H, W), got input shape {tuple(input_shape)}"
        )
    c, h, w = input_shape
    return c, h, w


# --- option coercion ----------------------------------------------------------------------
# Options may arrive from the command line or a YAML file as strings, so builders accept
# both the typed value and its text form.

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def option_bool(model: str, name: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise UsageError(f"model '{model}': option {name} must be true or false, got {value!r}")


def option_positive_int(model: str, name: str, value: object) -> int:
    result = None
    # bool is an int subclass; hidden=True is surely a mistake, not 1.
    if isinstance(value, int) and not isinstance(value, bool):
        result = value
    elif isinstance(value, str):
        try:  # not str.isdigit(): it holds for '²', which int() refuses
            result = int(value.strip())
        except ValueError:
            result = None
    if result is None or result < 1:
        raise UsageError(
            f"model '{model}': option {name} must be a positive integer, got {value!r}"
        )
    return result


def option_choice(model: str, name: str, value: object, choices: tuple[str, ...]) -> str:
    if isinstance(value, str) and value.strip().lower() in choices:
        return value.strip().lower()
    raise UsageError(
        f"model '{model}': option {name} must be one of {', '.join(choices)}, got {value!r}"
    )
