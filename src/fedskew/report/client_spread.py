"""How evenly each method's global model serves the clients: per setting, the mean, spread,
worst 10 % and best-worst gap of the clients' accuracy on their own local test samples, at
the final round, each mean ± std over seeds.

The numbers come from runs made with ``--local-test-fraction F > 0``: their metrics lines
hold ``client_accuracy`` (per client id, None for a client not evaluated) and its statistics
``client_accuracy_mean``, ``_std``, ``_worst10`` and ``_gap`` (and the same under
``client_personal_accuracy`` for methods with a personal model part), summary.json their
final values as ``final_client_accuracy_mean`` and so on. A run that lacks a statistic but
has the list gets it computed here (``fedskew.metrics.client_spread``, as the run does).
"""

from __future__ import annotations

from typing import Any

from fedskew.metrics.client_spread import CLIENT_SERIES, SPREAD_KEYS, client_spread
from fedskew.report.document import Block, Heading, Para, Table
from fedskew.report.runs import RunRecord
from fedskew.report.tables import mean_std

GLOBAL, PERSONAL = CLIENT_SERIES
# (statistic, column title): accuracies in %, spreads in points.
COLUMNS = (
    ("mean", "client mean (%)"),
    ("std", "client std (points)"),
    ("worst10", "worst 10 % (%)"),
    ("gap", "best - worst 10 % (points)"),
)
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


def spread_table(records: list[RunRecord]) -> Table:
    """Methods down; the four statistics of the global model across, then of the personal
    models where a run of the setting has them."""
    finished = [r for r in records if r.finished]
    prefixes = [GLOBAL] + ([PERSONAL] if any(final_spread(r, PERSONAL) for r in finished) else [])
    header = ["method", "seeds"]
    for prefix in prefixes:
        header += [("personalised " if prefix == PERSONAL else "") + t for _, t in COLUMNS]
    by_method: dict[str, list[RunRecord]] = {}
    for rec in finished:
        by_method.setdefault(rec.method, []).append(rec)
    rows = []
    for method, recs in by_method.items():
        spreads = {p: [s for s in (final_spread(r, p) for r in recs) if s] for p in prefixes}
        if not spreads[GLOBAL]:
            rows.append([method, "0", "no per-client test split"] + [""] * (len(header) - 3))
            continue
        cells = [method, str(len(spreads[GLOBAL]))]
        for prefix in prefixes:
            got = spreads[prefix]
            cells += [mean_std([100 * s[k] for s in got]) if got else "-" for k, _ in COLUMNS]
        rows.append(cells)
    return Table(header, rows)


def client_spread_blocks(
    settings: dict[str, list[RunRecord]], title: Any, heading_level: int = 2
) -> list[Block]:
    """The section: one table per setting, or one line when no run has a local split."""
    blocks: list[Block] = [Heading(heading_level, "Accuracy across clients")]
    if not any(has_local_split(r) for recs in settings.values() for r in recs if r.finished):
        return blocks + [Para(NO_SPLIT)]
    blocks.append(
        Para(
            "The global model's accuracy on each client's own local test samples at the "
            "final round: the unweighted mean over the evaluated clients, their population "
            "standard deviation, the mean of the lowest ceil(0.1 n) clients and its gap to "
            "the mean of the highest ceil(0.1 n); then mean ± std over seeds. Personalised: "
            "the same for the clients' personal models, where a method has them."
        )
    )
    for setting, recs in settings.items():
        if len(settings) > 1:
            blocks.append(Heading(heading_level + 1, title(setting)))
        if not any(has_local_split(r) for r in recs if r.finished):
            blocks.append(Para(NO_SPLIT))
            continue
        blocks.append(spread_table(recs))
    return blocks
