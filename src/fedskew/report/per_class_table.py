"""The per-class accuracy of a setting as a table: methods x classes, each cell the mean ±
sample standard deviation over the method's seeds of the run's per-class test accuracy at
the report's statistic (``fedskew.report.statistic``), in Markdown (report.md), CSV (one
file for every setting, a line per method and class) and LaTeX (one table per setting).

With more than :data:`CLASSES_ACROSS` classes the Markdown and LaTeX tables turn: classes
down, methods across, so that CIFAR-100 reads as 100 rows rather than 100 columns. The best
method of each class is bold (ties as printed bold together); a class no seed of a method
scored (no test samples) is empty.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field

import numpy as np

from fedskew.report.document import Bold, Table, Text
from fedskew.report.latex import escape
from fedskew.report.latex_style import TableStyle, best_keys, booktabs, label_of
from fedskew.report.statistic import Statistic

CLASSES_ACROSS = 12
MARKDOWN_DIGITS = 2


@dataclass
class MethodClasses:
    """One method's per-class accuracy: seed -> per-class accuracy (fractions, None for a
    class the run did not score)."""

    method: str
    runs: dict[int, list[float | None]]
    rounds: dict[int, int] = field(default_factory=dict)  # seed -> evaluated rounds read

    def seeds(self) -> list[int]:
        return sorted(self.runs)

    def values(self, c: int) -> np.ndarray:
        """Class ``c``'s accuracy in % over the seeds that scored it, in seed order."""
        got = [self.runs[s][c] for s in self.seeds() if c < len(self.runs[s])]
        return np.array([100 * float(v) for v in got if v is not None], dtype=float)


def rounds_used(methods: list[MethodClasses]) -> list[tuple[str, int]]:
    """(run, evaluated rounds its values average), for the caption's statistic."""
    return [(f"{m.method} seed {s}", k) for m in methods for s, k in sorted(m.rounds.items())]


def class_count(methods: list[MethodClasses]) -> int:
    return max((len(v) for m in methods for v in m.runs.values()), default=0)


def class_name(names: list[str] | None, c: int) -> str:
    return names[c] if names is not None and c < len(names) else str(c)


def _markdown_cell(values: np.ndarray) -> str:
    if values.size == 0:
        return ""
    text = f"{values.mean():.{MARKDOWN_DIGITS}f}"
    return text + (f" ± {values.std(ddof=1):.{MARKDOWN_DIGITS}f}" if values.size > 1 else "")


def _best(methods: list[MethodClasses], c: int, digits: int) -> set[str]:
    means = {m.method: float(m.values(c).mean()) for m in methods if m.values(c).size}
    return {str(k) for k in best_keys(means, digits)}


def per_class_table(methods: list[MethodClasses], names: list[str] | None) -> Table:
    """The Markdown table: methods x classes (classes x methods beyond CLASSES_ACROSS)."""
    classes = class_count(methods)
    cells: dict[tuple[str, int], Text] = {}
    for c in range(classes):
        best = _best(methods, c, MARKDOWN_DIGITS)
        for m in methods:
            text = _markdown_cell(m.values(c))
            cells[m.method, c] = Bold(text) if text and m.method in best else text
    if classes <= CLASSES_ACROSS:
        header: list[Text] = ["method", "seeds", *(class_name(names, c) for c in range(classes))]
        rows = [
            [m.method, str(len(m.runs)), *(cells[m.method, c] for c in range(classes))]
            for m in methods
        ]
        return Table(header, rows)
    header = ["class", *(f"{m.method} ({len(m.runs)} seeds)" for m in methods)]
    rows = [[class_name(names, c), *(cells[m.method, c] for m in methods)] for c in range(classes)]
    return Table(header, rows)


def per_class_latex(
    methods: list[MethodClasses], names: list[str] | None, setting: str, style: TableStyle
) -> str:
    """The LaTeX table of one setting, in the style's names, digits and bold."""
    classes = class_count(methods)
    best = {c: _best(methods, c, style.digits) for c in range(classes)}
    cell = {
        (m.method, c): style.cell(m.values(c), bold=m.method in best[c])
        for m in methods
        for c in range(classes)
    }
    seeds = sorted({len(m.runs) for m in methods})
    over = f"{seeds[0]}" if len(seeds) == 1 else f"{seeds[0]} to {seeds[-1]}"
    caption = (
        "Per-class test accuracy (\\%) of the global model"
        + (f", setting {escape(setting)}" if setting else "")
        + f", each run's value at {escape(style.statistic.phrase(rounds_used(methods)))}: "
        "mean $\\pm$ sample "
        f"standard deviation over {over} seed(s); a value without $\\pm$ rests on one seed"
        + ("; the best method of each class in bold." if style.bold else ".")
    )
    label = f"tab:fedskew-per-class-{label_of(setting)}"
    if classes <= CLASSES_ACROSS:
        header = ["Method", *(escape(class_name(names, c)) for c in range(classes))]
        rows = [
            [escape(style.name(m.method)), *(cell[m.method, c] for c in range(classes))]
            for m in methods
        ]
        return booktabs(caption, label, header, rows, "l" + "c" * classes)
    header = ["Class", *(escape(style.name(m.method)) for m in methods)]
    rows = [
        [escape(class_name(names, c)), *(cell[m.method, c] for m in methods)]
        for c in range(classes)
    ]
    return booktabs(caption, label, header, rows, "l" + "c" * len(methods))


CSV_HEADER = [
    "setting", "method", "statistic", "class", "class_name", "seeds", "rounds", "n_seeds",
    "mean", "std", "values",
]  # fmt: skip


def per_class_csv(
    settings: dict[str, tuple[list[MethodClasses], list[str] | None]], statistic: Statistic
) -> str:
    """One line per (setting, method, class): accuracy in % over the seeds that scored the
    class, mean and sample std (empty with one seed), and each seed's value and the
    evaluated rounds it averages (``;``-joined, in the order of ``seeds``)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_HEADER)
    for setting, (methods, names) in settings.items():
        for m in methods:
            for c in range(class_count(methods)):
                scored = [s for s in m.seeds() if c < len(m.runs[s]) and m.runs[s][c] is not None]
                values = m.values(c)
                w.writerow(
                    [
                        setting, m.method, statistic.kind, c, class_name(names, c),
                        ";".join(map(str, scored)),
                        ";".join(str(m.rounds.get(s, "")) for s in scored), values.size,
                        f"{values.mean():.4f}" if values.size else "",
                        f"{values.std(ddof=1):.4f}" if values.size > 1 else "",
                        ";".join(f"{v:.4f}" for v in values),
                    ]
                )  # fmt: skip
    return buf.getvalue()
