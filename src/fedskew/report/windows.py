"""What the "mean of the last N rounds" column really averages, said in its label.

A run with fewer evaluated rounds than N averages all of them, so the column averages
k = min(N, evaluated rounds) per run. A table names the k most of its runs used and the
runs that used another: "last 10 (6 for fedfm)".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Window:
    """The rounds a table's "last" column averages: ``main`` for most runs, ``others``
    (k -> the names of the runs or rows that averaged k instead)."""

    main: int
    others: dict[int, list[str]] = field(default_factory=dict)

    @property
    def uniform(self) -> bool:
        return not self.others

    def _exceptions(self) -> str:
        return "; ".join(
            f"{k} for {', '.join(names)}" for k, names in sorted(self.others.items(), reverse=True)
        )

    def header(self) -> str:
        """``last 10`` or ``last 10 (6 for fedfm)``."""
        return f"last {self.main}" + (f" ({self._exceptions()})" if self.others else "")

    def phrase(self) -> str:
        """``last 10 evaluated rounds`` or ``last 10 evaluated rounds (6 for fedfm)``."""
        text = f"last {self.main} evaluated round{'s' if self.main != 1 else ''}"
        return text + (f" ({self._exceptions()})" if self.others else "")


def window(used: Iterable[tuple[str, int]], asked: int) -> Window:
    """The window of (name, rounds averaged) pairs: the most common k (the larger on a
    tie) as ``main``; ``asked`` (Options.last) when there is no run yet."""
    pairs = list(used)
    if not pairs:
        return Window(asked)
    counts = Counter(k for _, k in pairs)
    main = max(counts, key=lambda k: (counts[k], k))
    others: dict[int, list[str]] = {}
    for name, k in pairs:
        if k != main and name not in others.setdefault(k, []):
            others[k].append(name)
    return Window(main, others)
