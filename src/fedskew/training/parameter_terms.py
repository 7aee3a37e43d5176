"""Loss terms over all of a model's parameter tensors, in a few operators whatever their number.

A term such as FedProx's ``||w - w_t||^2`` written per tensor (``F.mse_loss(p, a,
reduction="sum")`` for each of ResNet-18's 62 tensors) costs two operators per tensor and step
(its forward and backward) besides the addition of its gradient to the cross-entropy's, which
any form of the term pays; under ``torch.func.vmap`` (clients trained together) a third: a
reduced ``mse_loss`` is batched as an unreduced one and a sum. Here the tensors are
concatenated once and the term is one product and one sum: a handful of operators for any
number of tensors, the same alone, in ``LocalStep`` and under ``vmap`` (``cat``, ``sub``,
``mul`` and ``sum`` have batching rules, so a stack of clients costs what one client costs,
with no loop over the clients and nothing private to functorch).

Why not ``torch._foreach_sub`` for the differences: foreach operators have no batching rule
(torch 2.13 raises under ``vmap``), so the stacked engine would have to take the term out of
``vmap``. Why not a norm: ``||d||`` squared rounds through a square root; ``d . d`` has the
gradient ``2d``, exactly 0 at the anchor itself (a client's first step).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors flattened and concatenated in order: one vector (one operator)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def inner(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``u . v`` of two vectors as a product and a sum, in the vectors' dtype under bf16
    autocast too: ``torch.dot`` under ``vmap`` becomes a batched matrix product, which CPU
    autocast runs in bf16 (measured on torch 2.13), as it does ``@``."""
    return (u * v).sum()


def squared_distance(
    params: Sequence[torch.Tensor], anchors: Sequence[torch.Tensor]
) -> torch.Tensor:
    """``sum_t ||params[t] - anchors[t]||^2`` over pairs of tensors of equal shapes."""
    if len(params) != len(anchors) or any(
        p.shape != a.shape for p, a in zip(params, anchors, strict=False)
    ):
        raise ValueError(
            f"parameters {[tuple(p.shape) for p in params]} "
            f"against anchors {[tuple(a.shape) for a in anchors]}"
        )
    # In place into the concatenated weights (cat's backward needs no values): one
    # model-sized temporary fewer (per client when stacked).
    d = flat(params).sub_(flat(anchors))
    return inner(d, d)
