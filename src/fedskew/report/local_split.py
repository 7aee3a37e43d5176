"""The report's "Local majority, minority and absent classes" section: per method, the
global model's test accuracy on the classes each client holds many of, few of and none of,
split by the client's own training counts (``fedskew.metrics.local_split``, where the
groups and the accuracy are defined), averaged over the clients, then mean ± sample std
over seeds; per seed, how many classes of each group a client has on average. In Markdown,
CSV (every run's values, all settings in one file) and LaTeX (one table per setting).

Where each client's counts come from (the run's partition.npz or its partition rebuilt from
config.json, less the local test split, counted against the dataset's labels) is the
caller's business: it passes them in as :class:`ClientClassCounts`, or why there are none.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fedskew.metrics.local_split import GROUPS, GroupAccuracy, group_accuracy
from fedskew.report.document import Attachment, Block, Bullets, Heading, Para, Table
from fedskew.report.latex import escape
from fedskew.report.latex_style import TableStyle, best_keys, booktabs, label_of
from fedskew.report.per_class import run_per_class_at
from fedskew.report.runs import RunRecord
from fedskew.report.statistic import Statistic, rounds_at
from fedskew.report.tables import mean_std


@dataclass(frozen=True)
class ClientClassCounts:
    """Every client's training samples per class, the test set's samples per class, and
    where the partition came from."""

    train: np.ndarray  # (clients, classes)
    test: list[int]
    where: str


ClientCountsOf = Callable[[RunRecord], "ClientClassCounts | str"]

TITLES = {"majority": "local-majority", "minority": "local-minority", "absent": "absent"}


@dataclass
class RunSplit:
    """One run's accuracy on each group, and the partition's facts behind it."""

    method: str
    seed: int
    groups: dict[str, GroupAccuracy]
    clients: int
    where: str
    rounds: int  # evaluated rounds the per-class accuracy averages

    def percent(self, group: str) -> float | None:
        value = self.groups[group].accuracy
        return None if value is None else 100 * value


def run_splits(
    records: list[RunRecord], counts_of: ClientCountsOf, statistic: Statistic
) -> tuple[list[RunSplit], list[str]]:
    """Per finished run (the first folder of a (method, seed)), its groups' accuracy; and
    a line for each run left out, with the reason."""
    found: dict[tuple[str, int], RunSplit] = {}
    left: list[str] = []
    for rec in records:
        if not rec.finished or (rec.method, rec.seed) in found:
            continue
        name = f"{rec.method} seed {rec.seed}"
        per_class = run_per_class_at(rec, statistic)
        if per_class is None:
            left.append(f"{name}: no per-class accuracy at the statistic")
            continue
        counts = counts_of(rec)
        if isinstance(counts, str):
            left.append(f"{name}: {counts}")
            continue
        classes = counts.train.shape[1]
        if len(per_class) != classes or len(counts.test) != classes:
            left.append(
                f"{name}: {len(per_class)} classes scored, {classes} in the partition's counts"
            )
            continue
        groups = group_accuracy(counts.train, per_class, counts.test)
        rounds = rounds_at(rec.metrics, statistic, "per_class_accuracy")
        found[rec.method, rec.seed] = RunSplit(
            rec.method, rec.seed, groups, len(counts.train), counts.where, rounds
        )
    return list(found.values()), left


def _by_method(splits: list[RunSplit]) -> dict[str, list[RunSplit]]:
    out: dict[str, list[RunSplit]] = {}
    for s in splits:
        out.setdefault(s.method, []).append(s)
    return {m: sorted(runs, key=lambda r: r.seed) for m, runs in out.items()}


def _values(runs: list[RunSplit], group: str) -> list[float]:
    return [v for v in (r.percent(group) for r in runs) if v is not None]


def _gaps(runs: list[RunSplit], high: str, low: str) -> list[float]:
    out = []
    for r in runs:
        a, b = r.percent(high), r.percent(low)
        if a is not None and b is not None:
            out.append(a - b)
    return out


def split_table(splits: list[RunSplit]) -> Table:
    header = [
        "method", "seeds", *(f"{TITLES[g]} (%)" for g in GROUPS),
        "majority - minority (points)", "majority - absent (points)",
    ]  # fmt: skip
    rows = []
    for method, runs in _by_method(splits).items():
        cells = [method, str(len(runs))]
        for g in GROUPS:
            got = _values(runs, g)
            cells.append(mean_std(got) if got else "none")
        for low in ("minority", "absent"):
            got = _gaps(runs, "majority", low)
            cells.append(mean_std(got, sign=True) if got else "-")
        rows.append(cells)
    return Table(header, rows)


def split_lines(splits: list[RunSplit]) -> list[str]:
    """Per seed, the groups' mean size per client and how many clients have each (a
    grid's methods share a seed's partition and so a line; other runs get their own)."""
    by_seed: dict[int, dict[str, list[str]]] = {}
    for s in sorted(splits, key=lambda r: r.seed):
        sizes = ", ".join(f"{s.groups[g].classes:.2f} {TITLES[g]}" for g in GROUPS)
        having = ", ".join(f"{s.groups[g].clients}" for g in GROUPS)
        text = (
            f"per client {sizes} classes on average; clients whose group has test samples: "
            f"{having} of {s.clients} (counts from {s.where})"
        )
        by_seed.setdefault(s.seed, {}).setdefault(text, []).append(s.method)
    lines = []
    for seed, texts in by_seed.items():
        for text, methods in texts.items():
            who = f" ({', '.join(methods)})" if len(texts) > 1 else ""
            lines.append(f"seed {seed}{who}: {text}")
    return lines


def _used(splits: list[RunSplit]) -> list[tuple[str, int]]:
    return [(f"{s.method} seed {s.seed}", s.rounds) for s in splits]


def split_latex(splits: list[RunSplit], setting: str, style: TableStyle) -> str:
    """Methods down, the three groups across, in the style's names, digits and bold."""
    methods = _by_method(splits)
    best = {
        g: best_keys(
            {
                m: float(np.mean(_values(runs, g)))
                for m, runs in methods.items()
                if _values(runs, g)
            },
            style.digits,
        )
        for g in GROUPS
    }
    rows = [
        [escape(style.name(m)), *(style.cell(_values(runs, g), bold=m in best[g]) for g in GROUPS)]
        for m, runs in methods.items()
    ]
    caption = (
        "Test accuracy (\\%) of the global model on each client's local-majority, "
        "local-minority and absent classes (by the client's own training counts: held at "
        "least its mean count over the classes it holds, held fewer, not held), averaged "
        f"over the clients, each run's value at {escape(style.statistic.phrase(_used(splits)))}"
        + (f", setting {escape(setting)}" if setting else "")
        + ": mean $\\pm$ sample standard deviation over seeds; a value without $\\pm$ rests "
        "on one seed" + ("; the best of each column in bold." if style.bold else ".")
    )
    header = ["Method", "Local-majority", "Local-minority", "Absent"]
    label = f"tab:fedskew-local-split-{label_of(setting)}"
    return booktabs(caption, label, header, rows, "lccc")


CSV_HEADER = [
    "setting", "method", "seed", "statistic", "rounds", "group", "accuracy", "clients",
    "clients_total", "classes_per_client",
]  # fmt: skip


def split_csv(settings: dict[str, list[RunSplit]], statistic: Statistic) -> str:
    """One line per (setting, run, group): the evaluated rounds the run's per-class
    accuracy averages, the accuracy in % (empty where no client has the group with test
    samples), the clients it averages, and the group's mean size."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_HEADER)
    for setting, splits in settings.items():
        for s in sorted(splits, key=lambda r: (r.method, r.seed)):
            for g in GROUPS:
                value = s.percent(g)
                w.writerow(
                    [
                        setting, s.method, s.seed, statistic.kind, s.rounds, TITLES[g],
                        "" if value is None else f"{value:.4f}", s.groups[g].clients, s.clients,
                        f"{s.groups[g].classes:.4f}",
                    ]
                )  # fmt: skip
    return buf.getvalue()


EXPLANATION = (
    "The split FedRS and FedNTD argue with, per client from its own training class counts "
    "(its data less its local test split): its local-majority classes (held at least as "
    "often as its mean count over the classes it holds), its local-minority classes (held, "
    "fewer) and its absent classes (not held). For each client, the global model's accuracy "
    "on the test set restricted to each group's classes (the per-class accuracies weighted "
    "by the test set's class counts), then the unweighted mean over the clients whose group "
    "has test samples; then mean ± sample std over seeds, each run's per-class accuracy at "
)


def local_split_section(
    settings: dict[str, list[RunRecord]],
    counts_of: ClientCountsOf,
    statistic: Statistic,
    title: Callable[[str], str],
    heading_level: int = 2,
    style: TableStyle | None = None,
) -> list[Block]:
    """The section: per setting the table, the groups' sizes per seed and the LaTeX table;
    one CSV of every run; or one line saying why there is nothing."""
    style = style if style is not None else TableStyle(statistic=statistic)
    blocks: list[Block] = [
        Heading(heading_level, "Local majority, minority and absent classes"),
    ]
    found: dict[str, list[RunSplit]] = {}
    explained = len(blocks)
    for setting, recs in settings.items():
        if len(settings) > 1:
            blocks.append(Heading(heading_level + 1, title(setting)))
        splits, left = run_splits(recs, counts_of, statistic)
        if not splits:
            reasons = "; ".join(left) or "no finished run"
            blocks.append(Para(f"No split: {reasons}."))
            continue
        found[setting] = splits
        blocks.append(split_table(splits))
        blocks.append(Bullets(split_lines(splits)))
        if left:
            blocks.append(Para(f"Left out: {'; '.join(left)}."))
        stem = f"local-split-{setting or 'all'}".replace("/", "_")
        tex = split_latex(splits, setting, style)
        blocks.append(Attachment(f"{stem}.tex", tex, "As a LaTeX table (booktabs)"))
    every = [s for splits in found.values() for s in splits]
    blocks.insert(
        explained,
        Para(
            EXPLANATION + f"{statistic.phrase(_used(every))} (definitions: docs/metrics.md, "
            '"Local majority, minority and absent classes").'
        ),
    )
    if found:
        text = split_csv(found, statistic)
        blocks.append(
            Attachment(
                "local-split.csv",
                text,
                "Every run's accuracy on each group as CSV (a line per setting, run and group)",
            )
        )
    return blocks
