"""Evaluation of a model on the uniform test set and on clients' label distributions."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from fedskew.core.precision import autocast


@dataclass
class EvalResult:
    accuracy: float
    loss: float
    per_class_accuracy: np.ndarray  # nan for classes absent from the test set
    class_counts: np.ndarray
    correct: int = 0  # samples classified correctly (accuracy = correct / class_counts.sum())


@torch.inference_mode()
def evaluate(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    num_classes: int,
    batch_size: int = 1024,
    precision: str = "fp32",
) -> EvalResult:
    """Accuracy, mean loss and per-class accuracy in one batched pass without autograd.

    The forward pass runs under ``precision`` (see fedskew.core.precision); the loss, the
    arg-max and the per-class counts are taken from the logits in fp32. The model and the
    test tensors share a device; the loss (summed in float64) and the counts (integers:
    deterministic on CUDA too) are accumulated there and read back once, after the last
    batch. (``bincount`` and boolean masks would each read a size back per batch.)
    """
    was_training = model.training
    model.eval()
    correct = torch.zeros(num_classes, dtype=torch.int64, device=y.device)
    total = torch.zeros(num_classes, dtype=torch.int64, device=y.device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=y.device)
    for start in range(0, len(y), batch_size):
        xb, yb = x[start : start + batch_size], y[start : start + batch_size]
        with autocast(precision, xb.device.type):
            logits = model(xb)
        logits = logits.float()  # a no-op in fp32
        loss_sum += F.cross_entropy(logits, yb, reduction="sum").double()
        hit = logits.argmax(dim=1) == yb
        correct.index_add_(0, yb, hit.long())
        total.index_add_(0, yb, torch.ones_like(yb))
    model.train(was_training)
    n = int(total.sum())
    hits = int(correct.sum())
    counts = total.cpu().numpy()
    with np.errstate(invalid="ignore", divide="ignore"):
        per_class = np.where(counts > 0, correct.cpu().numpy() / np.maximum(counts, 1), np.nan)
    return EvalResult(
        accuracy=hits / max(n, 1),
        loss=float(loss_sum) / max(n, 1),
        per_class_accuracy=per_class,
        class_counts=counts,
        correct=hits,
    )


def client_distribution_accuracy(
    per_class_accuracy: np.ndarray, client_counts: np.ndarray
) -> float:
    """Mean over clients of the test accuracy per class weighted by the client's class
    proportions: the accuracy each client would see on a test set shaped like its data."""
    acc = np.nan_to_num(per_class_accuracy, nan=0.0)
    sizes = client_counts.sum(axis=1, keepdims=True)
    props = client_counts / np.maximum(sizes, 1)
    per_client = props @ acc
    return float(per_client[sizes[:, 0] > 0].mean())
