"""Per-class results of a comparison: which classes each method gets right, and how the
classes that are rare in the partition fare against the common ones.

Per setting: a methods x classes heatmap of the global model's per-class test accuracy
(each run's value at the report's statistic, by default its mean over its last N evaluated
rounds, then the mean over the method's finished seeds), the same as a table with the
spread over seeds (``fedskew.report.per_class_table``: Markdown, CSV and LaTeX), and a table
of the mean accuracy over the minority half and the majority half of the classes. The
halves come from each run's partition:

* classes are ranked by their share of the training data in the partition when the
  partition's class totals differ (the largest at least ``SAMPLES_DIFFER`` times the
  smallest, or a class left out), else by how many clients hold the class (a Dirichlet
  split of a balanced dataset hands out every sample, so only the spread over clients
  differs); ties go by the other count, then by class index;
* the minority half is the floor(C/2) classes ranked lowest, the majority half the floor(C/2)
  ranked highest (with C odd the middle class is in neither); a class the test set lacks has
  no accuracy and is left out of its half's mean.

Where the partition's class counts come from (config.json's resolved facts, partition.npz
with the dataset's labels, or the partition rebuilt from the configuration) is the caller's
business: it passes them in as :class:`ClassCounts`, or a reason why there are none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from fedskew.metrics.per_class import mean_of_last
from fedskew.report.class_halves_table import (
    MethodHalves,
    RunHalves,
    halves_csv,
    halves_latex,
    halves_table,
)
from fedskew.report.document import Attachment, Block, Bold, Bullets, Heading, Image, Para, Table
from fedskew.report.latex_style import TableStyle
from fedskew.report.per_class_plot import per_class_png
from fedskew.report.per_class_table import (
    MethodClasses,
    per_class_csv,
    per_class_latex,
    per_class_table,
    rounds_used,
)
from fedskew.report.runs import NOT_RECORDED, RunRecord
from fedskew.report.statistic import Statistic, list_at, rounds_at

# Class totals within 10 % of each other are taken as equal: ranking classes by a few
# samples more or less (a natural dataset's mild imbalance) would call noise a minority.
SAMPLES_DIFFER = 1.1
BY_SAMPLES = "share of the training data in the run's partition"
BY_CLIENTS = "number of clients holding the class in the run's partition"


@dataclass(frozen=True)
class ClassCounts:
    """Per class, the training samples a run's partition holds and how many clients hold
    any; ``where`` says where they were read."""

    samples: list[int]
    clients: list[int]
    where: str


@dataclass(frozen=True)
class Ranking:
    rule: str  # BY_SAMPLES or BY_CLIENTS
    minority: list[int]  # class indices, rarest first
    majority: list[int]  # most common last


def class_ranking(counts: ClassCounts) -> Ranking | str:
    """The minority and majority halves of the classes, or why there are none."""
    samples = np.asarray(counts.samples, dtype=float)
    clients = np.asarray(counts.clients, dtype=float)
    if samples.size < 2:
        return "fewer than two classes"
    top, low = samples.max(), samples.min()
    if top > 0 and (low == 0 or top >= SAMPLES_DIFFER * low):
        rule, first, second = BY_SAMPLES, samples, clients
    elif clients.max() > clients.min():
        rule, first, second = BY_CLIENTS, clients, samples
    else:
        return (
            f"the classes are balanced in the partition (totals within "
            f"{100 * (SAMPLES_DIFFER - 1):.0f} % of each other, each held by as many clients)"
        )
    order = sorted(range(samples.size), key=lambda c: (first[c], second[c], c))
    half = samples.size // 2
    return Ranking(rule, order[:half], order[-half:])


def run_per_class(record: RunRecord, last: int) -> list[float | None] | None:
    """The run's per-class accuracy (fractions), mean of its last ``last`` evaluated rounds:
    summary.json's ``last_k_per_class_accuracy`` where it averaged as many rounds, else
    computed from metrics.jsonl; None when neither records per-class accuracy."""
    found = mean_of_last(record.metrics, last)
    if found is None:
        return None
    summary = record.summary or {}
    stored = summary.get("last_k_per_class_accuracy")
    if isinstance(stored, list) and summary.get("per_class_last_k") == found[1]:
        return stored
    return found[0]


def run_per_class_at(record: RunRecord, statistic: Statistic) -> list[float | None] | None:
    """The run's per-class accuracy (fractions) at ``statistic``; None when the lines it
    reads hold none."""
    if statistic.kind == "last":
        return run_per_class(record, statistic.last)
    found = list_at(record.metrics, statistic, "per_class_accuracy")
    return None if found is None else found[0]


def _as_statistic(last: int | Statistic) -> Statistic:
    return last if isinstance(last, Statistic) else Statistic("last", last)


def _mean(values: list[float | None], classes: list[int]) -> float | None:
    scored = [values[c] for c in classes if c < len(values) and values[c] is not None]
    return 100 * sum(scored) / len(scored) if scored else None


def _name(names: list[str] | None, c: int) -> str:
    return names[c] if names is not None and c < len(names) else str(c)


@dataclass
class _Method:
    name: str
    runs: dict[int, list[float | None]]  # seed -> per-class accuracy (fractions)
    records: dict[int, RunRecord]  # seed -> its run
    rounds: dict[int, int] = field(default_factory=dict)  # seed -> evaluated rounds read


def _methods(records: list[RunRecord], statistic: Statistic) -> tuple[list[_Method], list[str]]:
    """Finished runs with per-class accuracy at ``statistic``, by method; and the finished
    runs without."""
    methods: dict[str, _Method] = {}
    missing: list[str] = []
    for rec in records:
        if not rec.finished:
            continue
        values = run_per_class_at(rec, statistic)
        if values is None:
            missing.append(f"{rec.method} seed {rec.seed}")
            continue
        method = methods.setdefault(rec.method, _Method(rec.method, {}, {}))
        if rec.seed not in method.runs:  # a second folder of the same seed: the first counts
            method.runs[rec.seed] = values
            method.records[rec.seed] = rec
            method.rounds[rec.seed] = rounds_at(rec.metrics, statistic, "per_class_accuracy")
    return list(methods.values()), missing


def method_classes(methods: list[_Method]) -> list[MethodClasses]:
    return [MethodClasses(m.name, dict(m.runs), dict(m.rounds)) for m in methods]


def heatmap_values(methods: list[_Method]) -> np.ndarray:
    """(methods, classes) accuracies in %: each method's mean over seeds, NaN where no seed
    scored the class."""
    classes = max(len(v) for m in methods for v in m.runs.values())
    out = np.full((len(methods), classes), np.nan)
    for i, m in enumerate(methods):
        for c in range(classes):
            scored = [v[c] for v in m.runs.values() if c < len(v) and v[c] is not None]
            if scored:
                out[i, c] = 100 * float(np.mean(scored))
    return out


# Per (method, seed): the run's ranking, or why it has none; and where its counts came from.
Found = dict[tuple[str, int], "Ranking | str"]


def method_halves(methods: list[_Method], found: Found) -> tuple[list[MethodHalves], list[str]]:
    """Per method, its seeds that have a ranking with their split; and the runs without."""
    out, unranked = [], []
    for m in methods:
        halves = MethodHalves(m.name)
        for seed, values in sorted(m.runs.items()):
            ranking = found.get((m.name, seed))
            if not isinstance(ranking, Ranking):
                unranked.append(f"{m.name} seed {seed}")
                continue
            a, b = _mean(values, ranking.minority), _mean(values, ranking.majority)
            if a is None or b is None:
                continue
            lowest = 100 * min(v for v in values if v is not None)
            halves.runs.append(RunHalves(seed, ranking.rule, m.rounds.get(seed, 0), a, b, lowest))
        out.append(halves)
    return out, unranked


def ranking_lines(
    found: Found, where: dict[tuple[str, int], str], names: list[str] | None
) -> list[str]:
    """Per seed, which ranking its runs used and which classes fell in each half; runs of one
    seed that share the partition (a grid's do) share a line, others get their own."""
    by_seed: dict[int, dict[str, tuple[list[str], set[str]]]] = {}
    for (method, seed), ranking in sorted(found.items(), key=lambda kv: kv[0][1]):
        if isinstance(ranking, str):
            text = f"no split: {ranking}"
        else:
            text = (
                f"ranked by the {ranking.rule}; minority half: "
                f"{', '.join(_name(names, c) for c in ranking.minority)}; majority half: "
                f"{', '.join(_name(names, c) for c in ranking.majority)}"
            )
        methods, sources = by_seed.setdefault(seed, {}).setdefault(text, ([], set()))
        methods.append(method)
        if where.get((method, seed)):
            sources.add(where[method, seed])
    lines = []
    for seed, texts in by_seed.items():
        for text, (methods, sources) in texts.items():
            who = f" ({', '.join(methods)})" if len(texts) > 1 else ""
            came = f" (counts from {', '.join(sorted(sources))})" if sources else ""
            lines.append(f"seed {seed}{who}: {text}{came}")
    return lines


CountsOf = Callable[[RunRecord], "ClassCounts | str"]


def per_class_blocks(
    records: list[RunRecord],
    counts_of: CountsOf,
    class_names: list[str] | None,
    last: int | Statistic,
    setting_title: str = "",
    heading_level: int = 3,
    style: TableStyle | None = None,
) -> list[Block]:
    """The heatmap, the per-class table (and its LaTeX file) and the minority / majority
    table (and its LaTeX file) of one setting's runs, each run's per-class accuracy at
    ``last`` (a statistic, or the number of last rounds averaged)."""
    return _setting_blocks(
        records, counts_of, class_names, last, setting_title, heading_level, style
    )[0]


def _setting_blocks(
    records: list[RunRecord],
    counts_of: CountsOf,
    class_names: list[str] | None,
    last: int | Statistic,
    setting_title: str,
    heading_level: int,
    style: TableStyle | None,
) -> tuple[list[Block], Split | None]:
    statistic = _as_statistic(last)
    blocks: list[Block] = []
    if setting_title:
        blocks.append(Heading(heading_level, setting_title))
    methods, missing = _methods(records, statistic)
    if not methods:
        return blocks + [Para(f"Per-class accuracy {NOT_RECORDED} in any finished run.")], None
    values = heatmap_values(methods)
    classes = [_name(class_names, c) for c in range(values.shape[1])]
    labels = [f"{m.name} ({len(m.runs)} seed{'s' if len(m.runs) != 1 else ''})" for m in methods]
    stem = f"per-class-{records[0].setting or 'all'}".replace("/", "_")
    table = method_classes(methods)
    blocks.append(
        Image(
            f"{stem}.png",
            per_class_png(values, labels, classes, setting_title),
            f"Per-class test accuracy (%) of the global model: each run's value at "
            f"{statistic.phrase(rounds_used(table))}, then the mean over the method's "
            "finished seeds.",
        )
    )
    if missing:
        blocks.append(Para(f"Per-class accuracy {NOT_RECORDED} in: {', '.join(missing)}."))
    blocks.append(
        Para(
            "The same, mean ± sample standard deviation over seeds (a value without ± rests "
            "on one seed; the best method of each class in bold):"
        )
    )
    blocks.append(per_class_table(table, class_names))
    style = style if style is not None else TableStyle(statistic=statistic)
    tex = per_class_latex(table, class_names, records[0].setting, style)
    blocks.append(Attachment(f"{stem}.tex", tex, "As a LaTeX table (booktabs)"))
    split = _split(methods, counts_of, class_names)
    blocks.append(Para([Bold("Minority and majority classes."), " " + SPLIT_TEXT]))
    blocks.append(Bullets(split.lines))
    if split.table is not None:
        blocks.append(split.table)
        tex = halves_latex(split.halves, records[0].setting, style)
        blocks.append(
            Attachment(f"{stem.replace('per-class', 'class-halves')}.tex", tex,
                       "As a LaTeX table (booktabs)")
        )  # fmt: skip
        if split.unranked:
            blocks.append(Para(f"Left out of the table (no ranking): {', '.join(split.unranked)}."))
    return blocks, split


@dataclass
class Split:
    """The minority / majority table of a setting, which ranking each partition used, and
    the runs left out for want of one."""

    table: Table | None  # None when no partition has a ranking
    lines: list[str]
    unranked: list[str]
    halves: list[MethodHalves] = field(default_factory=list)  # the table's numbers


def minority_majority(
    records: list[RunRecord],
    last: int | Statistic,
    counts_of: CountsOf,
    class_names: list[str] | None,
) -> Split:
    """The minority / majority split of one setting's runs, each run's per-class accuracy
    at ``last`` (a statistic, or the number of last evaluated rounds averaged)."""
    return _split(_methods(records, _as_statistic(last))[0], counts_of, class_names)


def _split(methods: list[_Method], counts_of: CountsOf, class_names: list[str] | None) -> Split:
    found: Found = {}
    where: dict[tuple[str, int], str] = {}
    for m in methods:
        for seed, rec in m.records.items():
            counts = counts_of(rec)
            if isinstance(counts, str):
                found[m.name, seed] = counts
                continue
            found[m.name, seed] = class_ranking(counts)
            where[m.name, seed] = counts.where
    lines = ranking_lines(found, where, class_names)
    if not any(isinstance(r, Ranking) for r in found.values()):
        return Split(None, lines, [])
    halves, unranked = method_halves(methods, found)
    return Split(halves_table(halves), lines, unranked, halves)


SPLIT_TEXT = (
    "Each seed's classes are ranked by their share of the training data in the run's "
    f"partition when the class totals differ (the largest at least {SAMPLES_DIFFER:g} times "
    "the smallest, or a class left out), otherwise by how many clients hold the class; "
    "ties go by the other count, then by class index. The minority half is the floor(C/2) "
    "classes ranked lowest, the majority half the floor(C/2) ranked highest (with C odd "
    "the middle class is in neither). Each cell: per run, the mean accuracy over the "
    "half's classes (each class's value at the report's statistic, as in the heatmap; "
    "a class without test samples left out), then mean ± std over seeds; the gap is taken "
    "per seed. Rankings, per seed (a grid's runs of one seed share the partition):"
)


def per_class_section(
    settings: dict[str, list[RunRecord]],
    counts_of: CountsOf,
    names_of: Callable[[list[RunRecord]], list[str] | None],
    last: int | Statistic,
    title: Callable[[str], str],
    heading_level: int = 2,
    style: TableStyle | None = None,
) -> list[Block]:
    """The report's per-class section: for each setting its heatmap, per-class table and
    split table; then the per-class table of every setting as one CSV file."""
    statistic = _as_statistic(last)
    blocks: list[Block] = [Heading(heading_level, "Per-class accuracy")]
    tables: dict[str, tuple[list[MethodClasses], list[str] | None]] = {}
    halves: dict[str, list[MethodHalves]] = {}
    for setting, recs in settings.items():
        names = names_of(recs)
        found, split = _setting_blocks(
            recs, counts_of, names, statistic,
            title(setting) if len(settings) > 1 else "", heading_level + 1, style,
        )  # fmt: skip
        blocks += found
        methods = _methods(recs, statistic)[0]
        if methods:
            tables[setting] = (method_classes(methods), names)
        if split is not None and split.halves:
            halves[setting] = split.halves
    if tables:
        text = per_class_csv(tables, statistic)
        blocks.append(
            Attachment(
                "per-class.csv",
                text,
                "Per-class accuracy of every setting as CSV (a line per setting, method and "
                "class: mean, std and each seed's value in %)",
            )
        )
    if halves:
        blocks.append(
            Attachment(
                "class-halves.csv",
                halves_csv(halves, statistic),
                "The minority / majority split of every setting as CSV (a line per setting "
                "and run: both halves, their gap and the lowest class in %, and the ranking)",
            )
        )
    return blocks
