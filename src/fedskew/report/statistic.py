"""Which value of a run a table shows: the final evaluated round, the evaluated round of the
best test accuracy, or the mean of the last k evaluated rounds.

The same three the comparison tables print side by side (``final``, ``best`` and ``last``
of :class:`fedskew.report.tables.RunValues`); the per-class, per-client and LaTeX tables
show one of them, chosen with ``--statistic``. For a list a metrics line holds per class or
per client (``per_class_accuracy``, ``client_accuracy``), the statistic picks lines:

* ``final``: the last line that holds the list;
* ``best``: the evaluated line of the highest test accuracy (the first of equal ones): the
  per-class or per-client values of the model that scored best overall, not each entry's
  own best round, which would pick a different model per entry;
* ``last``: the last k lines that hold the list (all of them in a run that has fewer),
  each entry averaged over the lines that scored it (None in a line: a class without test
  samples, a client not evaluated).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import zip_longest
from typing import Any

from fedskew.core.errors import UsageError
from fedskew.report.windows import window

KINDS = ("final", "best", "last")


@dataclass(frozen=True)
class Statistic:
    kind: str = "last"
    last: int = 10  # k of "last"; ignored by the others

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UsageError(f"statistic must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if isinstance(self.last, bool) or not isinstance(self.last, int) or self.last < 1:
            raise UsageError(f"last must be a positive integer, got {self.last!r}")

    @property
    def column(self) -> str:
        """The :class:`fedskew.report.tables.RunValues` field of this statistic."""
        return self.kind

    def phrase(self, used: Iterable[tuple[str, int]] = ()) -> str:
        """What each run's value is, for captions; ``used``: (run or row name, evaluated
        rounds its value averages), so that "last" says the rounds the runs really
        averaged ("the mean of the last 4 evaluated rounds (2 for fedfm seed 1)")."""
        if self.kind == "final":
            return "the final evaluated round"
        if self.kind == "best":
            return "the evaluated round of the run's best test accuracy"
        return f"the mean of the {window(used, self.last).phrase()}"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def lines_at(rows: Sequence[dict[str, Any]], statistic: Statistic, key: str) -> list[dict]:
    """The metrics lines whose ``key`` list the statistic reads (empty when none has it)."""
    holding = [r for r in rows if isinstance(r.get(key), list) and r.get(key)]
    if statistic.kind == "final":
        return holding[-1:]
    if statistic.kind == "last":
        return holding[-statistic.last :]
    scored = [r for r in rows if _is_number(r.get("accuracy"))]
    if not scored:
        return []
    top = max(float(r["accuracy"]) for r in scored)
    best = next(r for r in scored if float(r["accuracy"]) == top)
    return [best] if isinstance(best.get(key), list) and best.get(key) else []


def list_at(
    rows: Sequence[dict[str, Any]], statistic: Statistic, key: str
) -> tuple[list[float | None], int] | None:
    """Each entry of the ``key`` lists at the statistic and how many lines it read; None
    when no line the statistic reads holds the list."""
    lines = lines_at(rows, statistic, key)
    if not lines:
        return None
    means: list[float | None] = []
    for values in zip_longest(*(r[key] for r in lines), fillvalue=None):
        scored = [float(v) for v in values if v is not None]
        means.append(sum(scored) / len(scored) if scored else None)
    return means, len(lines)


def rounds_at(rows: Sequence[dict[str, Any]], statistic: Statistic, key: str) -> int:
    """How many lines the statistic reads for ``key`` (1, or k for "last"; 0 for none)."""
    return len(lines_at(rows, statistic, key))
