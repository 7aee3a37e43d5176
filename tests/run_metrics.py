"""A run folder's metrics.jsonl as the tests compare it."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

# Wall-clock fields: they differ between two runs that compute the same numbers.
TIMING = ("seconds", "eval_seconds")


def metrics(folder: Path, keys: Iterable[str] | None = None) -> list[dict]:
    """Every round's record; only ``keys`` (None where absent) when given."""
    records = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    if keys is None:
        return records
    wanted = tuple(keys)
    return [{k: r.get(k) for k in wanted} for r in records]


def rows(folder: Path) -> list[dict]:
    """Every round's record without its timing fields."""
    return [{k: v for k, v in r.items() if k not in TIMING} for r in metrics(folder)]
