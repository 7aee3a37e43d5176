"""The rewrites that keep a GPU's training steps from waiting for the host (no per-batch host
draws, no boolean masks, no bincount) compute what the masked and per-batch versions did:
exactly where the arithmetic is the same, and within the stated rounding where the order of a
sum changed. The references below are the earlier versions, kept here as the specification.

On CUDA, tests/test_device.py counts the syncs themselves; the same check runs here with a
CPU proxy counter (tests/host_sync_check.py), which also shows that the check can fail: a
planted per-step sync turns it red."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from host_sync_check import ALLOWED, SYNC_CASES, cpu_syncs, sync_counts, waits_per_step

from fedskew.algorithms.fedacd import log_margins
from fedskew.algorithms.fedcme import alignment_loss
from fedskew.algorithms.feddecorr import EPS as DECORR_EPS
from fedskew.algorithms.feddecorr import decorrelation_loss
from fedskew.algorithms.fedntd import not_true_logits
from fedskew.core.rng import torch_rng
from fedskew.metrics.evaluation import evaluate
from fedskew.training.local import crop_and_flip, draw_augmentation


def augment_batch_by_batch(x: torch.Tensor, gen: torch.Generator, pad: int = 4) -> torch.Tensor:
    """The earlier augmentation: draws per batch, flips through a boolean mask."""
    n, _, h, w = x.shape
    padded = F.pad(x, (pad, pad, pad, pad))
    dy = torch.randint(0, 2 * pad + 1, (n,), generator=gen)
    dx = torch.randint(0, 2 * pad + 1, (n,), generator=gen)
    rows = (dy[:, None] + torch.arange(h)[None, :])[:, None, :, None]
    cols = (dx[:, None] + torch.arange(w)[None, :])[:, None, None, :]
    out = padded[
        torch.arange(n)[:, None, None, None],
        torch.arange(x.shape[1])[None, :, None, None],
        rows,
        cols,
    ]
    flip = torch.rand(n, generator=gen) < 0.5
    out[flip] = out[flip].flip(-1)
    return out


def test_an_epochs_augmentation_drawn_at_once_is_the_batches_drawn_one_by_one() -> None:
    sizes = [16, 16, 16, 9]
    x = torch.randn(sum(sizes), 3, 8, 8, generator=torch.Generator().manual_seed(0))
    draws = draw_augmentation(torch_rng(0, 1, 2, "train"), sizes)
    gen = torch_rng(0, 1, 2, "train")
    start = 0
    for size in sizes:
        batch = x[start : start + size]
        want = augment_batch_by_batch(batch, gen)
        assert torch.equal(crop_and_flip(batch, draws[:, start : start + size]), want)
        start += size
    # Offsets (pad, pad) and no flip are the identity: padding rows of a stacked step.
    identity = torch.tensor([[4] * 5, [4] * 5, [0] * 5])
    assert torch.equal(crop_and_flip(x[:5], identity), x[:5])


def test_not_true_logits_by_gather_are_the_masked_ones_exactly() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 10, generator=gen)
    y = torch.randint(0, 10, (64,), generator=gen)
    keep = torch.ones_like(logits, dtype=torch.bool)
    keep[torch.arange(64), y] = False
    assert torch.equal(not_true_logits(logits, y), logits[keep].view(64, 9))


def test_decorrelation_without_a_mask_is_the_masked_mean_up_to_rounding() -> None:
    """Multiplying the diagonal away sums the same squares (plus zeros) in another order:
    measured at most 8e-8 relative in float32 on these inputs."""
    gen = torch.Generator().manual_seed(2)
    for n, d in ((32, 16), (64, 128), (8, 512)):
        z = torch.randn(n, d, generator=gen) @ torch.randn(d, d, generator=gen)
        centred = z - z.mean(dim=0, keepdim=True)
        standard = centred / torch.sqrt(centred.var(dim=0, keepdim=True) + DECORR_EPS)
        gram = standard.T @ standard
        masked = gram[~torch.eye(d, dtype=torch.bool)].pow(2).mean() / n
        got = decorrelation_loss(z)
        assert torch.allclose(got, masked, rtol=1e-6, atol=0), (n, d, float(got), float(masked))


def alignment_masked(features, y, global_features, known):
    """The earlier FedCME alignment term: masks and bincount."""
    keep = known[y]
    if not bool(keep.any()):
        return features.sum() * 0.0
    f, labels = features[keep], y[keep]
    sq = ((f - global_features[labels]) ** 2).sum(dim=1)
    c = global_features.shape[0]
    sums = torch.zeros(c, dtype=sq.dtype).index_add(0, labels, sq)
    counts = torch.bincount(labels, minlength=c)
    in_batch = counts > 0
    return (sums[in_batch] / counts[in_batch].to(sq.dtype)).mean()


def test_alignment_weighted_is_the_masked_term_up_to_rounding() -> None:
    """Zero weights instead of a mask, a where-sum instead of a masked mean: measured at most
    1.2e-7 relative in float32 on these inputs, with the same gradient; a batch with no
    known class gives 0 with the graph kept, as before."""
    gen = torch.Generator().manual_seed(3)
    for trial in range(20):
        features = torch.randn(48, 32, generator=gen, requires_grad=True)
        y = torch.randint(0, 10, (48,), generator=gen)
        global_features = torch.randn(10, 32, generator=gen)
        known = torch.rand(10, generator=gen) < (0.0 if trial == 0 else 0.6)
        got = alignment_loss(features, y, global_features, known)
        want = alignment_masked(features, y, global_features, known)
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7), trial
        (g_got,) = torch.autograd.grad(got, features)
        (g_want,) = torch.autograd.grad(want, features)
        assert torch.allclose(g_got, g_want, rtol=1e-5, atol=1e-8), trial


def test_margins_by_where_are_the_masked_ones_exactly() -> None:
    gen = torch.Generator().manual_seed(4)
    confusion = torch.rand(6, 6, generator=gen, dtype=torch.float64)
    present = torch.tensor([True, False, True, True, False, True])
    delta = 0.1
    ratio = confusion / (confusion.t() + 1e-8)
    want = torch.log(ratio.clamp(min=delta, max=1.0 / delta))
    want[:, ~present] = torch.log(torch.tensor(delta, dtype=torch.float64))
    want[~present, :] = 0.0
    want.fill_diagonal_(0.0)
    assert torch.equal(log_margins(confusion, present, delta), want)


def test_evaluation_counted_on_the_device_is_the_per_batch_readout() -> None:
    """Loss summed in float64 and counts by index_add: the same numbers as reading each
    batch's loss and bincounts back."""
    gen = torch.Generator().manual_seed(5)
    model = torch.nn.Linear(12, 7)
    x = torch.randn(2500, 12, generator=gen)
    y = torch.randint(0, 7, (2500,), generator=gen)
    result = evaluate(model, x, y, 7, batch_size=1024)
    loss_sum, correct, total = (
        0.0,
        torch.zeros(7, dtype=torch.int64),
        torch.zeros(7, dtype=torch.int64),
    )
    with torch.no_grad():
        for start in range(0, 2500, 1024):
            logits = model(x[start : start + 1024])
            yb = y[start : start + 1024]
            loss_sum += float(F.cross_entropy(logits, yb, reduction="sum"))
            hit = logits.argmax(dim=1) == yb
            correct += torch.bincount(yb[hit], minlength=7)
            total += torch.bincount(yb, minlength=7)
    assert result.loss == loss_sum / 2500
    assert result.accuracy == float(correct.sum()) / 2500
    assert (result.class_counts == total.numpy()).all()


# ---------------------------------------------------------------------------- the sync check


@pytest.mark.parametrize("case", sorted(SYNC_CASES))
def test_local_steps_do_not_wait_for_the_host_by_the_cpu_proxy(case: str, tmp_path: Path) -> None:
    """The CUDA test's check, counted by the CPU proxy: 0 more syncs at 4 epochs than at 2
    in every case (FedCME included, whose 1 against 3 epochs were two protocols: 124
    against 1563 by this proxy)."""
    short, long = sync_counts(cpu_syncs, SYNC_CASES[case], "cpu", tmp_path)
    assert short > 0  # the proxy sees the per-client reads (a client's mean loss, ...)
    assert not waits_per_step(short, long), (short, long)


def _item_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A per-step read-back, as a logging line would do: the loss's value. Planted in the
    loss, which every training path runs (the graph-safe step has no torch.optim.SGD.step)."""
    cross_entropy = F.cross_entropy

    def logged(*args, **kwargs):  # type: ignore[no-untyped-def]
        loss = cross_entropy(*args, **kwargs)
        float(loss.detach())
        return loss

    monkeypatch.setattr(F, "cross_entropy", logged)


def _mask_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A boolean mask in the loss (the earlier FedNTD / FedCME terms had these)."""
    cross_entropy = F.cross_entropy

    def masked(logits, y, *args, **kwargs):  # type: ignore[no-untyped-def]
        keep = y >= 0
        return cross_entropy(logits[keep], y[keep], *args, **kwargs)

    monkeypatch.setattr(F, "cross_entropy", masked)


@pytest.mark.parametrize("plant", [_item_per_step, _mask_per_step], ids=["item", "mask"])
def test_the_check_catches_a_planted_per_step_sync(
    plant, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    plant(monkeypatch)
    short, long = sync_counts(cpu_syncs, SYNC_CASES["fedavg-augment"], "cpu", tmp_path)
    assert waits_per_step(short, long), (short, long)
    assert long - short >= 4 * ALLOWED  # about one per step: 2 x 2 x 2 epochs x 11 steps
