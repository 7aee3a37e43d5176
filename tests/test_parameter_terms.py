"""Terms over all of a model's parameter tensors (training/parameter_terms.py): the value and
gradient of the per-tensor formula they replace, a zero gradient at the anchor itself, the
same values under vmap over stacked clients, and a clear error for tensors that do not pair."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import vmap

from fedskew.training.parameter_terms import flat, inner, squared_distance

SHAPES = [(4, 3, 3, 3), (4,), (10, 4), (10,), ()]


def _tensors(seed: int, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=dtype) for s in SHAPES]


def test_squared_distance_is_the_sum_of_per_tensor_squared_errors_with_their_gradients():
    params = [t.requires_grad_() for t in _tensors(0)]
    anchors = _tensors(1)
    value = squared_distance(params, anchors)
    value.backward()
    want = sum(F.mse_loss(p, a, reduction="sum") for p, a in zip(params, anchors, strict=True))
    assert value.item() == pytest.approx(float(want.detach()), rel=1e-12)
    for p, a in zip(params, anchors, strict=True):
        assert torch.allclose(p.grad, 2 * (p.detach() - a), rtol=1e-12, atol=0)


def test_the_gradient_at_the_anchor_is_exactly_zero():
    # A client's first step starts from its anchor: a norm's gradient there would be NaN.
    params = [t.requires_grad_() for t in _tensors(0, torch.float32)]
    anchors = [p.detach().clone() for p in params]
    value = squared_distance(params, anchors)
    value.backward()
    assert value.item() == 0.0
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in params)


def test_under_vmap_each_client_gets_its_own_distance_and_gradient():
    clients = [(_tensors(2 * k), _tensors(2 * k + 1)) for k in range(3)]
    stacks = [torch.stack([c[0][t] for c in clients]).requires_grad_() for t in range(len(SHAPES))]
    anchors = [torch.stack([c[1][t] for c in clients]) for t in range(len(SHAPES))]
    values = vmap(squared_distance)(stacks, anchors)
    values.sum().backward()
    for k, (params, anchor) in enumerate(clients):
        assert values[k].item() == pytest.approx(squared_distance(params, anchor).item(), rel=1e-12)
        for t, (p, a) in enumerate(zip(params, anchor, strict=True)):
            assert torch.allclose(stacks[t].grad[k], 2 * (p - a), rtol=1e-12, atol=0)


def test_flat_and_inner():
    u, v = _tensors(0), _tensors(1)
    assert flat(u).shape == (sum(t.numel() for t in u),)
    want = sum(float((a * b).sum()) for a, b in zip(u, v, strict=True))
    assert inner(flat(u), flat(v)).item() == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize(
    "anchors", [_tensors(1)[:-1], [*_tensors(1)[:2], torch.zeros(40), *_tensors(1)[3:]]]
)
def test_tensors_that_do_not_pair_are_refused(anchors: list[torch.Tensor]):
    # (10, 4) against (40,): as many numbers, another shape, refused all the same.
    with pytest.raises(ValueError, match="against anchors"):
        squared_distance(_tensors(0), anchors)


def test_bf16_autocast_leaves_the_terms_in_float32_alone_and_under_vmap():
    # torch.dot under vmap (a batched matrix product) and @ would run in bf16 under autocast.
    def stacked(seeds: range) -> list[torch.Tensor]:  # three clients' tensors, stacked
        clients = [_tensors(seed, torch.float32) for seed in seeds]
        return [torch.stack([c[t] for c in clients]) for t in range(len(SHAPES))]

    stacks = [stacked(range(0, 3)), stacked(range(3, 6))]
    plain = vmap(squared_distance)(*stacks)
    plain_inner = vmap(lambda u, v: inner(flat(u), flat(v)))(*stacks)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = vmap(squared_distance)(*stacks)
        under_inner = vmap(lambda u, v: inner(flat(u), flat(v)))(*stacks)
        alone = squared_distance([t[0] for t in stacks[0]], [t[0] for t in stacks[1]])
    assert under.dtype == under_inner.dtype == alone.dtype == torch.float32
    assert torch.equal(under, plain) and torch.equal(under_inner, plain_inner)
    assert torch.equal(alone, plain[0])
