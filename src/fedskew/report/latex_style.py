"""How the LaTeX tables are written: the methods' display names, the statistic of each run
they show, the digits, and whether the best of each column is bold; with the pieces every
LaTeX table of the report shares (cells, the best of a column, the booktabs frame).

Display names are plain text, escaped like every name (``FedFM`` prints as itself;
``Fed$\\alpha$`` prints those characters, not a Greek letter). The best of a column is
decided on the means as printed with the table's digits, so that cells equal on the page
are bold together; a column whose lower values are better (a spread, a gap) is said so by
its caller.
"""

from __future__ import annotations

import math
import re
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from fedskew.core.errors import UsageError
from fedskew.report.statistic import Statistic

MAX_DIGITS = 6


@dataclass
class TableStyle:
    names: dict[str, str] = field(default_factory=dict)  # method -> display name
    statistic: Statistic = field(default_factory=Statistic)
    digits: int = 2
    bold: bool = True  # the best of each column in bold

    def __post_init__(self) -> None:
        if isinstance(self.digits, bool) or not isinstance(self.digits, int):
            raise UsageError(f"digits must be an integer, got {self.digits!r}")
        if not 0 <= self.digits <= MAX_DIGITS:
            raise UsageError(f"digits must be between 0 and {MAX_DIGITS}, got {self.digits}")

    def name(self, method: str) -> str:
        """The method's display name (its own name where none is given)."""
        return self.names.get(method, method)

    def number(self, x: float, sign: bool = False) -> str:
        return f"{x:{'+' if sign else ''}.{self.digits}f}"

    def cell(
        self, values: Sequence[float] | np.ndarray, bold: bool = False, sign: bool = False
    ) -> str:
        """``$mean \\pm std$`` over the values (sample std; a lone value without it), in
        bold where ``bold``; ``---`` without values."""
        a = np.asarray(values, dtype=float)
        if a.size == 0:
            return "---"
        body = self.number(float(a.mean()), sign)
        if a.size > 1:
            body += rf" \pm {self.number(float(a.std(ddof=1)))}"
        return f"$\\mathbf{{{body}}}$" if bold and self.bold else f"${body}$"


def parse_display_names(
    items: Iterable[str] | None, where: str = "--display-name"
) -> dict[str, str]:
    """``NAME=LABEL`` items as a mapping (a later item for a name wins); a one-line error
    for an item without ``=``, or with an empty name or label."""
    names: dict[str, str] = {}
    for item in items or []:
        name, eq, label = item.partition("=")
        if not eq or not name.strip() or not label.strip():
            raise UsageError(f"{where} takes NAME=LABEL (e.g. fedfm=FedFM), got {item!r}")
        names[name.strip()] = label.strip()
    return names


def check_display_names(value: object, where: str) -> dict[str, str]:
    """A mapping of method names to display names read from a file: strings only."""
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) and k and v.strip() for k, v in value.items()
    ):
        raise UsageError(f"{where}: display_names maps method names to labels (strings)")
    return {k: v.strip() for k, v in value.items()}


def best_keys(means: Mapping[Hashable, float], digits: int, higher: bool = True) -> set[Hashable]:
    """The keys whose mean, rounded to ``digits`` as printed, is the highest (``higher``)
    or the lowest: every key tied on the page; none for NaN means."""
    shown = {k: round(float(v), digits) for k, v in means.items() if math.isfinite(float(v))}
    if not shown:
        return set()
    top = max(shown.values()) if higher else min(shown.values())
    return {k for k, v in shown.items() if v == top}


def label_of(text: str) -> str:
    """A ``\\label`` key from a name: letters, digits and ``-`` only."""
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-") or "all"


def booktabs(
    caption: str,
    label: str,
    header: list[str],
    rows: list[list[str]],
    align: str,
    notes: Sequence[str] = (),
) -> str:
    """A booktabs ``table`` float of already escaped cells (a fragment to ``\\input``)."""
    lines = [
        "% fedskew: booktabs table; needs \\usepackage{booktabs}. Rebuilt from the run folders.",
        "\\begin{table}[t]",
        "\\centering",
        f"\\caption{{{caption}}}",
        f"\\label{{{label}}}",
        f"\\begin{{tabular}}{{{align}}}",
        "\\toprule",
        " & ".join(header) + " \\\\",
        "\\midrule",
        *(" & ".join(row) + " \\\\" for row in rows),
        "\\bottomrule",
        "\\end{tabular}",
        *(f"\\par\\smallskip{{\\footnotesize {note}}}" for note in notes),
        "\\end{table}",
    ]
    return "\n".join(lines) + "\n"
