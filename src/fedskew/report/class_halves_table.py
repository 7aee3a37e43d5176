"""The minority / majority split of a setting's classes (``fedskew.report.per_class``) as
numbers: per method and seed, the mean accuracy over the minority half and the majority half
of the classes, their gap and the lowest class; rendered as Markdown (report.md), LaTeX (one
table per setting) and CSV (one file for every setting, a line per run)."""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field

import numpy as np

from fedskew.report.document import Table
from fedskew.report.latex import escape
from fedskew.report.latex_style import TableStyle, best_keys, booktabs, label_of
from fedskew.report.statistic import Statistic
from fedskew.report.tables import mean_std

COLUMNS = ("minority", "majority", "gap", "lowest")


@dataclass(frozen=True)
class RunHalves:
    """One run's split, in %: the halves' mean accuracies, majority minus minority, and the
    accuracy of its lowest-scoring class."""

    seed: int
    rule: str  # how the run's classes were ranked
    rounds: int  # evaluated rounds its per-class accuracy averages
    minority: float
    majority: float
    lowest: float

    @property
    def gap(self) -> float:
        return self.majority - self.minority

    def value(self, column: str) -> float:
        return float(getattr(self, column))


@dataclass
class MethodHalves:
    method: str
    runs: list[RunHalves] = field(default_factory=list)  # ranked seeds, in seed order

    def values(self, column: str) -> list[float]:
        return [r.value(column) for r in self.runs]


def halves_table(methods: list[MethodHalves]) -> Table:
    """Per method, each column's mean ± std over its ranked seeds."""
    rows = []
    for m in methods:
        if not m.runs:
            rows.append([m.method, "0", "no ranked seed", "", "", ""])
            continue
        rows.append(
            [m.method, str(len(m.runs)), mean_std(m.values("minority")),
             mean_std(m.values("majority")), mean_std(m.values("gap"), sign=True),
             mean_std(m.values("lowest"))]
        )  # fmt: skip
    header = ["method", "seeds", "minority half (%)", "majority half (%)",
              "majority - minority (points)", "lowest class (%)"]  # fmt: skip
    return Table(header, rows)


def _used(methods: list[MethodHalves]) -> list[tuple[str, int]]:
    return [(f"{m.method} seed {r.seed}", r.rounds) for m in methods for r in m.runs]


def halves_latex(methods: list[MethodHalves], setting: str, style: TableStyle) -> str:
    """Methods down; minority half, majority half, gap and lowest class across, in the
    style's names, digits and bold (the smallest gap is the best one)."""
    ranked = [m for m in methods if m.runs]
    best = {
        c: best_keys(
            {m.method: float(np.mean(m.values(c))) for m in ranked}, style.digits,
            higher=c != "gap",
        )
        for c in COLUMNS
    }  # fmt: skip
    rows = [
        [
            escape(style.name(m.method)),
            *(style.cell(m.values(c), bold=m.method in best[c], sign=c == "gap") for c in COLUMNS),
        ]
        for m in ranked
    ]
    caption = (
        "Test accuracy (\\%) of the global model on the minority half and the majority half "
        "of the classes (ranked by their share of the training data in the run's partition, "
        "or by how many clients hold them where the shares are equal), the gap in points and "
        f"the lowest class, each run's value at {escape(style.statistic.phrase(_used(ranked)))}"
        + (f", setting {escape(setting)}" if setting else "")
        + ": mean $\\pm$ sample standard deviation over seeds; a value without $\\pm$ rests "
        "on one seed"
        + ("; the best of each column in bold (the smallest gap)." if style.bold else ".")
    )
    header = ["Method", "Minority half", "Majority half", "Gap", "Lowest class"]
    label = f"tab:fedskew-class-halves-{label_of(setting)}"
    return booktabs(caption, label, header, rows, "lcccc")


CSV_HEADER = [
    "setting", "method", "seed", "statistic", "rounds", "ranking", "minority", "majority",
    "gap", "lowest_class",
]  # fmt: skip


def halves_csv(settings: dict[str, list[MethodHalves]], statistic: Statistic) -> str:
    """One line per (setting, ranked run): the split's numbers in %, the evaluated rounds
    they average and how the run's classes were ranked."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_HEADER)
    for setting, methods in settings.items():
        for m in methods:
            for r in m.runs:
                w.writerow(
                    [setting, m.method, r.seed, statistic.kind, r.rounds, r.rule,
                     *(f"{r.value(c):.4f}" for c in COLUMNS)]
                )  # fmt: skip
    return buf.getvalue()
