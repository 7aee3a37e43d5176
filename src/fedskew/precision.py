"""The precision policy: in which number format forward passes run.

``fp32`` runs everything in float32 (the default: bit-for-bit the historical results).
``bf16`` runs forward passes and losses under ``torch.autocast`` with bfloat16, which on CPUs
with AVX-512 BF16 or AMX speeds up convolutions and matrix products (see benchmarks/). Only the
computation changes: parameters (the master weights), gradients, optimizer state, messages
and aggregation stay float32, and a run is still deterministic for a given precision.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch

from fedskew.errors import UsageError

PRECISIONS = ("fp32", "bf16")


def check_precision(value: object) -> str:
    """``value`` if it names a precision, else a one-line UsageError."""
    if value not in PRECISIONS:
        raise UsageError(f"precision must be one of {', '.join(PRECISIONS)}, got {value!r}")
    return str(value)


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
