"""The server side every averaging algorithm reuses: weighted means of named tensors and
the server learning rate."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def weighted_average(
    states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]
) -> dict[str, torch.Tensor]:
    """Weighted mean of named tensors, weights normalised to sum 1.

    Integer buffers (BatchNorm's batch counter) are not averaged: the largest is kept.
    """
    if not states:
        raise ValueError("nothing to average")
    # Host numbers: the weights are read back as Python floats.
    w = torch.tensor([float(x) for x in weights], dtype=torch.float64, device="cpu")
    if float(w.sum()) <= 0:
        raise ValueError("aggregation weights sum to zero")
    w = w / w.sum()
    out: dict[str, torch.Tensor] = {}
    for key, first in states[0].items():
        if first.is_floating_point():
            acc = torch.zeros_like(first, dtype=torch.float64)
            for wi, s in zip(w.tolist(), states, strict=True):
                acc.add_(s[key].to(torch.float64), alpha=wi)
            out[key] = acc.to(first.dtype)
        else:
            out[key] = torch.stack([s[key] for s in states]).max(dim=0).values
    return out


def apply_server_lr(
    old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], server_lr: float
) -> dict[str, torch.Tensor]:
    """old + server_lr * (new - old) for float tensors; other tensors taken from ``new``."""
    if server_lr == 1.0:
        return dict(new)
    return {
        k: old[k] + server_lr * (v - old[k]) if v.is_floating_point() else v for k, v in new.items()
    }
