"""How evenly each method's global model serves the clients: per setting, the mean, spread,
worst 10 %, worst and best client and the best-worst gap of the clients' accuracy on their
own local test samples, each run's at the report's statistic (``fedskew.report.statistic``:
the final evaluated round, the round of the best test accuracy, or each client's mean over
the last k evaluated rounds), each mean ± std over seeds; a box plot of every client's
accuracy per method; the table as LaTeX, and every run's clients as one CSV file.

The numbers come from runs made with ``--local-test-fraction F > 0``: their metrics lines
hold ``client_accuracy`` (per client id, None for a client not evaluated) and its statistics
``client_accuracy_mean``, ``_std``, ``_worst10`` and ``_gap`` (and the same under
``client_personal_accuracy`` for methods with a personal model part), summary.json their
final values as ``final_client_accuracy_mean`` and so on. The statistics are computed here
from the lists (``fedskew.metrics.client_spread``, as the run does); at the final round a
run whose lines lack the list gives the four it recorded (and no worst or best client).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedskew.metrics.client_spread import CLIENT_SERIES, SPREAD_KEYS, client_spread
from fedskew.report.client_plot import client_accuracy_png
from fedskew.report.document import Attachment, Block, Heading, Image, Para, Table
from fedskew.report.latex import escape
from fedskew.report.latex_style import TableStyle, best_keys, booktabs, label_of
from fedskew.report.runs import RunRecord
from fedskew.report.statistic import Statistic, list_at
from fedskew.report.tables import mean_std

GLOBAL, PERSONAL = CLIENT_SERIES
# (statistic, column title, higher is better): accuracies in %, spreads in points.
COLUMNS = (
    ("mean", "client mean (%)", True),
    ("std", "client std (points)", False),
    ("worst10", "worst 10 % (%)", True),
    ("worst", "worst client (%)", True),
    ("best", "best client (%)", True),
    ("gap", "best - worst 10 % (points)", False),
)
LATEX_TITLES = {"mean": "Mean", "std": "Std", "worst10": "Worst 10\\%", "worst": "Worst",
                "best": "Best", "gap": "Gap"}  # fmt: skip
NO_SPLIT = "No per-client test split: run with --local-test-fraction."


def final_spread(record: RunRecord, prefix: str) -> dict[str, float]:
    """The statistics of ``prefix`` at the run's final evaluated round: summary.json's
    ``final_<prefix>_<stat>``, else the last metrics line's ``<prefix>_<stat>``, else computed
    from that line's list; empty when the run has none."""
    summary = record.summary or {}
    stored = {k: summary.get(f"final_{prefix}_{k}") for k in SPREAD_KEYS}
    if all(isinstance(v, (int, float)) for v in stored.values()):
        return {k: float(v) for k, v in stored.items()}  # type: ignore[arg-type]
    line: dict[str, Any] | None = next(
        (r for r in reversed(record.metrics) if prefix in r or f"{prefix}_mean" in r), None
    )
    if line is None:
        return {}
    found = {k: line.get(f"{prefix}_{k}") for k in SPREAD_KEYS}
    if all(isinstance(v, (int, float)) for v in found.values()):
        return {k: float(v) for k, v in found.items()}  # type: ignore[arg-type]
    values = line.get(prefix)
    return client_spread(values) if isinstance(values, list) else {}


def has_local_split(record: RunRecord) -> bool:
    return bool(final_spread(record, GLOBAL))


@dataclass
class RunClients:
    """One run's clients at the statistic: their accuracies (fractions, by client id; None
    where the list is not recorded) and the spread statistics."""

    record: RunRecord
    values: list[float | None] | None
    spread: dict[str, float]
    rounds: int  # evaluated rounds the values average


def run_clients(record: RunRecord, prefix: str, statistic: Statistic) -> RunClients | None:
    """The run's ``prefix`` series at the statistic; None when the run has none there."""
    found = list_at(record.metrics, statistic, prefix)
    if found is not None:
        values, rounds = found
        spread = client_spread(values)
        if not spread:
            return None
        present = [v for v in values if v is not None]
        extremes = {"worst": min(present), "best": max(present)}
        return RunClients(record, values, {**spread, **extremes}, rounds)
    if statistic.kind == "final":
        recorded = final_spread(record, prefix)
        return RunClients(record, None, recorded, 1) if recorded else None
    return None


def _used(series: dict[str, dict[str, list[RunClients]]]) -> list[tuple[str, int]]:
    return [(f"{m} seed {r.record.seed}", r.rounds) for m, rs in series[GLOBAL].items() for r in rs]


def _series(
    records: list[RunRecord], statistic: Statistic
) -> dict[str, dict[str, list[RunClients]]]:
    """prefix -> method -> its finished runs' clients (the first folder of a seed), for the
    global series and, where a run has it, the personal one."""
    out: dict[str, dict[str, list[RunClients]]] = {}
    for prefix in CLIENT_SERIES:
        by_method: dict[str, list[RunClients]] = {}
        seen: set[tuple[str, int]] = set()
        for rec in records:
            if not rec.finished or (rec.method, rec.seed) in seen:
                continue
            seen.add((rec.method, rec.seed))
            got = run_clients(rec, prefix, statistic)
            by_method.setdefault(rec.method, [])
            if got is not None:
                by_method[rec.method].append(got)
        if prefix == GLOBAL or any(by_method.values()):
            out[prefix] = by_method
    return out


def _column(runs: list[RunClients], key: str) -> list[float]:
    return [100 * r.spread[key] for r in runs if key in r.spread]


def spread_table(records: list[RunRecord], statistic: Statistic | None = None) -> Table:
    """Methods down; the six statistics of the global model across, then of the personal
    models where a run of the setting has them. Default statistic: the final round."""
    series = _series(records, statistic or Statistic("final"))
    header = ["method", "seeds"]
    for prefix in series:
        header += [("personalised " if prefix == PERSONAL else "") + t for _, t, _ in COLUMNS]
    rows = []
    for method, runs in series[GLOBAL].items():
        if not runs:
            rows.append([method, "0", "no per-client test split"] + [""] * (len(header) - 3))
            continue
        cells = [method, str(len(runs))]
        for prefix in series:
            got = series[prefix].get(method, [])
            cells += [mean_std(_column(got, k)) if _column(got, k) else "-" for k, _, _ in COLUMNS]
        rows.append(cells)
    return Table(header, rows)


def spread_latex(records: list[RunRecord], setting: str, style: TableStyle) -> str:
    """The global model's six statistics, methods down, in the style's names, digits and
    bold (the highest of each accuracy column, the lowest std and gap)."""
    series = _series(records, style.statistic)
    runs = {m: r for m, r in series[GLOBAL].items() if r}
    best = {
        key: best_keys(
            {m: float(np.mean(_column(r, key))) for m, r in runs.items() if _column(r, key)},
            style.digits,
            higher,
        )  # fmt: skip
        for key, _, higher in COLUMNS
    }
    rows = [
        [escape(style.name(m)),
         *(style.cell(_column(r, key), bold=m in best[key]) for key, _, _ in COLUMNS)]
        for m, r in runs.items()
    ]  # fmt: skip
    caption = (
        "Test accuracy (\\%) of the global model on each client's own local test samples"
        + (f", setting {escape(setting)}" if setting else "")
        + f", at {escape(style.statistic.phrase(_used(series)))}: the mean over clients, "
        "their standard "
        "deviation, the mean of the lowest 10\\,\\% of clients, the lowest and the highest "
        "client, and the gap between the highest and the lowest 10\\,\\% (points); each "
        "mean $\\pm$ sample standard deviation over seeds"
        + ("; the best of each column in bold (the lowest std and gap)." if style.bold else ".")
    )
    header = ["Method", *(LATEX_TITLES[k] for k, _, _ in COLUMNS)]
    label = f"tab:fedskew-clients-{label_of(setting)}"
    return booktabs(caption, label, header, rows, "l" + "c" * len(COLUMNS))


CSV_HEADER = [
    "setting", "method", "seed", "statistic", "rounds", "series", "clients", "mean", "std",
    "worst10", "worst", "best", "gap", "values",
]  # fmt: skip


def spread_csv(settings: dict[str, list[RunRecord]], statistic: Statistic) -> str:
    """One line per (setting, run, series): the evaluated rounds read, the statistics in %
    and every client's accuracy (``;``-joined by client id, empty for a client without a
    value; no list where the run recorded only the statistics)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_HEADER)
    for setting, records in settings.items():
        for prefix, by_method in _series(records, statistic).items():
            for method, runs in by_method.items():
                for run in sorted(runs, key=lambda r: r.record.seed):
                    values = run.values or []
                    w.writerow(
                        [
                            setting, method, run.record.seed, statistic.kind, run.rounds,
                            "personal" if prefix == PERSONAL else "global",
                            sum(v is not None for v in values) or "",
                            *(f"{100 * run.spread[k]:.4f}" if k in run.spread else ""
                              for k in ("mean", "std", "worst10", "worst", "best", "gap")),
                            ";".join("" if v is None else f"{100 * v:.4f}" for v in values),
                        ]
                    )  # fmt: skip
    return buf.getvalue()


def _plot(records: list[RunRecord], statistic: Statistic, setting: str, title: str) -> Image | None:
    series = _series(records, statistic)
    runs = series[GLOBAL]
    values = {
        m: [100 * v for r in rs for v in (r.values or []) if v is not None]
        for m, rs in runs.items()
    }
    values = {m: v for m, v in values.items() if v}
    if not values:
        return None
    name = f"clients-{setting or 'all'}.png".replace("/", "_")
    png = client_accuracy_png(values, title, "client test accuracy (%)")
    return Image(
        name,
        png,
        f"The global model's accuracy on each client's local test samples at "
        f"{statistic.phrase(_used(series))}: a box per method over every client of every "
        "seed (median, quartiles, whiskers within 1.5 IQR), each client a point; in brackets "
        "the points.",
    )


def client_spread_blocks(
    settings: dict[str, list[RunRecord]],
    title: Callable[[str], str],
    heading_level: int = 2,
    statistic: Statistic | None = None,
    style: TableStyle | None = None,
) -> list[Block]:
    """The section: per setting the table, the plot and the LaTeX table; one CSV of every
    run; or one line when no run has a local split. Default statistic: the final round."""
    statistic = statistic or Statistic("final")
    style = style if style is not None else TableStyle(statistic=statistic)
    blocks: list[Block] = [Heading(heading_level, "Accuracy across clients")]
    if not any(has_local_split(r) for recs in settings.values() for r in recs if r.finished):
        return blocks + [Para(NO_SPLIT)]
    used = [u for recs in settings.values() for u in _used(_series(recs, statistic))]
    own = "; each client's own mean over those rounds" if statistic.kind == "last" else ""
    blocks.append(
        Para(
            "The global model's accuracy on each client's own local test samples, each "
            f"run's at {statistic.phrase(used)}{own}: the unweighted mean over the "
            "evaluated clients, their population "
            "standard deviation, the mean of the lowest ceil(0.1 n) clients, the lowest and "
            "the highest client, and the gap between the means of the highest and the "
            "lowest ceil(0.1 n); then mean ± std over seeds. Personalised: the same for the "
            "clients' personal models, where a method has them."
        )
    )
    shown: dict[str, list[RunRecord]] = {}
    for setting, recs in settings.items():
        if len(settings) > 1:
            blocks.append(Heading(heading_level + 1, title(setting)))
        if not any(has_local_split(r) for r in recs if r.finished):
            blocks.append(Para(NO_SPLIT))
            continue
        shown[setting] = recs
        blocks.append(spread_table(recs, statistic))
        picture = _plot(recs, statistic, setting, title(setting) if len(settings) > 1 else "")
        if picture is not None:
            blocks.append(picture)
        stem = f"clients-{setting or 'all'}".replace("/", "_")
        tex = spread_latex(recs, setting, style)
        blocks.append(Attachment(f"{stem}.tex", tex, "As a LaTeX table (booktabs)"))
    text = spread_csv(shown, statistic)
    blocks.append(
        Attachment(
            "clients.csv",
            text,
            "Every run's clients as CSV (a line per setting, run and series: the statistics "
            "and each client's accuracy in %)",
        )
    )
    return blocks
