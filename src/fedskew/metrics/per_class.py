"""The global model's per-class test accuracy over a run, from its metrics lines: at the
final evaluated round and averaged over the last k evaluated rounds.

A class without test samples has no accuracy (None in ``per_class_accuracy``) and stays
None; a class's mean over the last rounds is taken over the rounds that scored it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

LAST_K = 10  # evaluated rounds averaged in summary.json, fewer when the run has fewer


def per_class_rows(rows: Sequence[dict[str, Any]]) -> list[list[float | None]]:
    """The ``per_class_accuracy`` list of every metrics line that has one, in order."""
    return [list(r["per_class_accuracy"]) for r in rows if r.get("per_class_accuracy")]


def mean_of_last(
    rows: Sequence[dict[str, Any]], last: int
) -> tuple[list[float | None], int] | None:
    """Each class's mean accuracy over the last ``last`` evaluated rounds (fewer when the
    run has fewer) and how many rounds that is; None when no line has per-class accuracy."""
    lists = per_class_rows(rows)[-last:]
    if not lists:
        return None
    means: list[float | None] = []
    for values in zip(*lists, strict=True):
        scored = [v for v in values if v is not None]
        means.append(sum(scored) / len(scored) if scored else None)
    return means, len(lists)


def per_class_summary(rows: Sequence[dict[str, Any]], last: int = LAST_K) -> dict[str, Any]:
    """summary.json's per-class entries: ``final_per_class_accuracy`` (the last evaluated
    round), ``last_k_per_class_accuracy`` (mean of the last k evaluated rounds) and
    ``per_class_last_k`` (k = min(``last``, evaluated rounds)); empty without any."""
    found = mean_of_last(rows, last)
    if found is None:
        return {}
    means, k = found
    return {
        "final_per_class_accuracy": per_class_rows(rows)[-1],
        "last_k_per_class_accuracy": [None if m is None else round(m, 6) for m in means],
        "per_class_last_k": k,
    }
