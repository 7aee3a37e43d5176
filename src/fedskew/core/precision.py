"""The precision policy: in which number format forward passes run.

``fp32`` runs everything in float32 (the default: bit-for-bit the historical results).
``bf16`` runs forward passes under ``torch.autocast`` with bfloat16, which on CPUs
with AVX-512 BF16 or AMX speeds up convolutions and matrix products (see benchmarks/). Only the
computation changes: parameters (the master weights), gradients, optimizer state, messages
and aggregation stay float32, and a run is still deterministic for a given precision.
The algorithms' own loss terms (distillation, contrastive and alignment terms, regularisers)
are computed in float32 from the bf16 forward's outputs (:func:`in_fp32`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import torch

from fedskew.core.errors import UsageError
from fedskew.core.option_values import PRECISIONS, check_precision  # noqa: F401 (re-exported)

_LOW = (torch.bfloat16, torch.float16)
F_ = TypeVar("F_", bound=Callable[..., Any])


def autocast(precision: str, device_type: str) -> AbstractContextManager[object]:
    """The context a forward pass runs in under ``precision`` on ``device_type`` tensors.

    Enter it around the forward pass and loss only: backward runs outside, as PyTorch
    recommends, and leaving the context each step drops autocast's cache of bf16 weight
    copies, which an optimizer step would otherwise leave stale.
    """
    if precision == "fp32":
        # Not autocast(enabled=False): that would switch off an autocast a caller entered.
        return contextlib.nullcontext()
    if precision == "bf16":
        return torch.autocast(device_type=device_type, dtype=torch.bfloat16)
    raise UsageError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")


def in_fp32(fn: F_) -> F_:
    """Compute a loss term in float32 even when it is called under bf16 autocast.

    CPU autocast casts only a few losses (cross_entropy, kl_div, mse_loss) up: softmax and
    log_softmax of bf16 logits stay bf16, and matrix products, even of float32 parameters,
    run in bf16. Log-probabilities, cosine logits, a feature Gram matrix or a dot product over
    all of a model's parameters would keep 8 bits of mantissa. Only the model's forward pass
    is the policy's to speed up; its loss terms get bf16 inputs cast up and autocast off. In
    fp32 runs this is the identity."""

    def up(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dtype in _LOW:
            return value.float()
        return value

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # Autocast is switched off for the device the term computes on (a CUDA autocast
        # is untouched by the CPU one, and the other way round).
        device_type = _device_type((*args, *kwargs.values()))
        with torch.autocast(device_type=device_type, enabled=False):
            return fn(*(up(a) for a in args), **{k: up(v) for k, v in kwargs.items()})

    return wrapper  # type: ignore[return-value]


def _device_type(values: Any) -> str:
    """The device type of the first tensor in ``values`` (looking into lists and tuples),
    "cpu" when there is none."""
    tensor = _first_tensor(values)
    return "cpu" if tensor is None else tensor.device.type


def _first_tensor(values: Any) -> torch.Tensor | None:
    for value in values:
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (list, tuple)):
            found = _first_tensor(value)
            if found is not None:
                return found
    return None
