"""Comparison and cost tables in the papers' form, computed from run records.

Per (setting, method), over the finished seeds: mean ± sample standard deviation of the final
accuracy, of the mean of the last N evaluated rounds (all of them in a run that has fewer;
the labels say how many: ``fedskew.report.windows``) and of the best accuracy; the rounds
to reach a target accuracy; the difference to a reference method taken per seed (the same
seed gives every method the same partition and the same clients each round), averaged, with
its 95 % Student-t interval over the seeds (``fedskew.report.intervals``); bytes per round;
the largest per-client state. Rows of runs whose method had a mechanism that never acted
are marked (``fedskew.report.inactive``). Every number is computed here from the run
folders' files; the sentences that draw conclusions are computed too.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from fedskew.config import EXECUTION_ONLY, LEGACY, ExperimentConfig
from fedskew.report.document import Block, Bold, Bullets, Heading, Para, Span, Table, Text
from fedskew.report.inactive import Marks, Note, recorded_notes
from fedskew.report.intervals import PairedSummary, paired_summary
from fedskew.report.run_status import DIVERGED, FAILED, MEANS_POLICY, RunStatus
from fedskew.report.runs import NOT_RECORDED, RunRecord, machines, provenance
from fedskew.report.windows import Window, window

MIB = 2**20


@dataclass
class Options:
    reference: str | None = "fedavg"  # method the paired differences are taken against
    last: int = 10  # evaluated rounds averaged in the "last rounds" column
    target: float | None = None  # accuracy in percent for the rounds-to-target column


@dataclass
class RunValues:
    """The numbers of one finished run (accuracies in percent)."""

    final: float
    last: float
    best: float
    reached: int | None  # first round at or above the target, None if never (or no target)
    bytes_down: float  # per round
    bytes_up: float
    seconds: float  # training plus evaluation, per round
    client_state_bytes: int | None
    machines: list[str] = field(default_factory=list)  # that computed its rounds
    last_rounds: int = 0  # evaluated rounds ``last`` averages: min(Options.last, evaluated)


def run_values(record: RunRecord, options: Options) -> RunValues | None:
    """The numbers of one run, or None when it has no evaluated round."""
    acc = record.series("accuracy")
    if not acc:
        return None
    values = np.array([100 * a for _, a in acc])
    reached = None
    if options.target is not None:
        reached = next((r for r, a in acc if 100 * a >= options.target - 1e-9), None)
    rows = record.metrics
    n = max(len(rows), 1)
    return RunValues(
        final=float(values[-1]),
        last=float(values[-options.last :].mean()),
        best=float(values.max()),
        reached=reached,
        bytes_down=sum(float(r.get("bytes_down", 0)) for r in rows) / n,
        bytes_up=sum(float(r.get("bytes_up", 0)) for r in rows) / n,
        seconds=sum(float(r.get("seconds", 0)) + float(r.get("eval_seconds", 0)) for r in rows) / n,
        client_state_bytes=record.client_state_bytes,
        machines=machines(record),
        last_rounds=min(options.last, len(values)),
    )


@dataclass
class MethodRow:
    setting: str
    method: str
    seeds: list[int] = field(default_factory=list)  # finished seeds
    runs: dict[int, RunValues] = field(default_factory=dict)
    unfinished: list[int] = field(default_factory=list)  # running, or stopped without error
    diverged: dict[int, RunStatus] = field(default_factory=dict)  # seed -> where it diverged
    failed: dict[int, RunStatus] = field(default_factory=dict)  # seed -> where and why
    paired: dict[int, float] = field(default_factory=dict)  # seed -> last-N difference
    notes: dict[int, list[Note]] = field(default_factory=dict)  # seed -> inactive mechanisms

    def column(self, name: str) -> np.ndarray:
        return np.array([getattr(self.runs[s], name) for s in self.seeds], dtype=float)

    def paired_summary(self) -> PairedSummary | None:
        return paired_summary([self.paired[s] for s in sorted(self.paired)])

    def row_notes(self) -> list[Note]:
        """The inactive mechanisms of its finished seeds, each once."""
        return list(dict.fromkeys(n for s in self.seeds for n in self.notes.get(s, [])))

    def windows(self, name: str | None = None) -> list[tuple[str, int]]:
        """(name, rounds averaged) for the row, or per seed where its seeds differ."""
        name = name or self.method
        used = {s: self.runs[s].last_rounds for s in self.seeds}
        if len(set(used.values())) == 1:
            return [(name, next(iter(used.values())))]
        return [(f"{name} seed {s}", k) for s, k in used.items()]


def group(records: list[RunRecord], options: Options) -> dict[str, list[MethodRow]]:
    """Setting -> its methods' rows, in the records' order, paired differences filled in."""
    rows: dict[str, dict[str, MethodRow]] = {}
    for rec in records:
        row = rows.setdefault(rec.setting, {}).setdefault(
            rec.method, MethodRow(rec.setting, rec.method)
        )
        status = rec.status
        if status.kind in (DIVERGED, FAILED):
            stopped = row.diverged if status.kind == DIVERGED else row.failed
            stopped.setdefault(rec.seed, status)
            continue
        values = run_values(rec, options) if rec.finished else None
        if values is None:
            row.unfinished.append(rec.seed)
            continue
        if rec.seed in row.runs:
            continue  # a second folder of the same seed: the first one counts
        row.seeds.append(rec.seed)
        row.runs[rec.seed] = values
        row.notes[rec.seed] = recorded_notes(rec)
    for methods in rows.values():
        ref = methods.get(options.reference or "")
        for row in methods.values():
            row.seeds.sort()
            for s in row.seeds:
                if ref is not None and row is not ref and s in ref.runs:
                    row.paired[s] = row.runs[s].last - ref.runs[s].last
    return {setting: list(methods.values()) for setting, methods in rows.items()}


def mean_std(values: np.ndarray | list[float], digits: int = 2, sign: bool = False) -> str:
    a = np.asarray(values, dtype=float)
    if a.size == 0:
        return "n/a"
    fmt = f"{{:{'+' if sign else ''}.{digits}f}}"
    if a.size == 1:
        return fmt.format(a[0]) + " (1 seed)"
    return f"{fmt.format(a.mean())} ± {a.std(ddof=1):.{digits}f}"


def _std(a: np.ndarray) -> float | None:
    return float(a.std(ddof=1)) if a.size > 1 else None


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return NOT_RECORDED
    if n >= MIB:
        return f"{n / MIB:.2f} MiB"
    if n >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{int(n)} B"


def _reached_cell(row: MethodRow) -> str:
    reached = [row.runs[s].reached for s in row.seeds]
    hit = np.array([r for r in reached if r is not None], dtype=float)
    if hit.size == 0:
        return f"not reached (0/{len(reached)})"
    return f"{mean_std(hit, digits=1).replace(' (1 seed)', '')} ({hit.size}/{len(reached)})"


def _seeds_at(stopped: dict[int, RunStatus]) -> str:
    return ", ".join(f"seed {s}{stopped[s].at()}" for s in sorted(stopped))


def beside_mean(row: MethodRow, detail: bool = True) -> list[str]:
    """The row's runs that are not in its means, as counted beside them (MEANS_POLICY):
    "+1 diverged: seed 1 at round 9", "+1 failed: seed 0 at round 3", "+2 unfinished";
    without ``detail`` only the counts."""
    parts = []
    for kind, stopped in ((DIVERGED, row.diverged), (FAILED, row.failed)):
        if stopped:
            parts.append(f"+{len(stopped)} {kind}" + (f": {_seeds_at(stopped)}" if detail else ""))
    if row.unfinished:
        parts.append(f"+{len(row.unfinished)} unfinished")
    return parts


def seeds_cell(row: MethodRow) -> str:
    """The finished seeds the means rest on, and beside them those that are not."""
    parts = beside_mean(row)
    return f"{len(row.seeds)}" + (f" ({'; '.join(parts)})" if parts else "")


def no_result(row: MethodRow) -> str:
    """The accuracy cell of a row without a finished seed."""
    if row.diverged and not (row.failed or row.unfinished):
        return "none: every seed diverged"
    return "no finished run"


def not_in_means(rows: list[MethodRow], reasons: bool = True) -> list[str]:
    """Each run the rows' means leave out, named: "fedfm seed 1 diverged at round 9",
    "prox seed 0 failed at round 3: <its error>" (without the error unless ``reasons``),
    "fedavg seeds 2, 3 unfinished"."""
    named = []
    for row in rows:
        for stopped in (row.diverged, row.failed):
            for s in sorted(stopped):
                status = stopped[s]
                text = status.label() if reasons else f"{status.kind}{status.at()}"
                named.append(f"{row.method} seed {s} {text}")
        if row.unfinished:
            seeds = ", ".join(map(str, sorted(row.unfinished)))
            named.append(f"{row.method} seed{'s' if len(row.unfinished) > 1 else ''} {seeds} "
                         "unfinished")  # fmt: skip
    return named


def empty_cell(row: MethodRow) -> str:
    """A short cell for a row without a finished seed: "diverged (2 seeds)" where every seed
    diverged, else "no finished run (+1 failed; +1 unfinished)"."""
    if no_result(row).endswith("diverged"):
        n = len(row.diverged)
        return f"diverged ({n} seed{'s' if n != 1 else ''})"
    beside = beside_mean(row, detail=False)
    return "no finished run" + (f" ({'; '.join(beside)})" if beside else "")


def stop_note(rows: list[MethodRow]) -> list[Block]:
    """Under a table: the runs its means leave out, named with their round, and the policy
    (nothing when every run finished)."""
    named = not_in_means(rows)
    if not named:
        return []
    return [Para(f"Not in the means: {'; '.join(named)}. {MEANS_POLICY}")]


def _paired_cell(row: MethodRow, options: Options) -> str:
    if row.method == options.reference:
        return "reference"
    summary = row.paired_summary()
    if summary is None:
        return "n/a (no common seed)"
    return summary.markdown()


def table_window(rows: list[MethodRow], options: Options) -> Window:
    """What the rows' "last" values average (rows without a finished run say nothing)."""
    return window([w for r in rows if r.seeds for w in r.windows()], options.last)


def best_of(rows: list[MethodRow]) -> set[str]:
    """The methods with the highest mean of the last rounds, as printed (2 decimals), so
    that rows equal on the page are bold together; the LaTeX tables decide the same way."""
    means = {r.method: round(float(r.column("last").mean()), 2) for r in rows if r.seeds}
    means = {m: v for m, v in means.items() if math.isfinite(v)}
    top = max(means.values(), default=None)
    return {m for m, v in means.items() if v == top}


def _bold(text: str) -> Bold:
    return Bold(text)


def comparison_table(rows: list[MethodRow], options: Options, marks: Marks | None = None) -> Table:
    """The accuracy table of one setting; ``marks`` collects the footnotes of rows whose
    method had a mechanism that never acted (printed by the caller)."""
    marks = Marks() if marks is None else marks
    last = table_window(rows, options).header()
    header = [
        "method", "seeds", "final accuracy (%)", f"mean of {last} (%)", "best accuracy (%)",
    ]  # fmt: skip
    if options.target is not None:
        header.append(f"rounds to {options.target:g} % (seeds reaching it)")
    if options.reference:
        header.append(f"{last} vs {options.reference}, paired: mean [95 % interval] (points)")
    best = best_of(rows)
    body = []
    for row in rows:
        seeds = seeds_cell(row)
        if not row.seeds:
            cells = [row.method, seeds, no_result(row), "", ""]
            cells += [""] * (len(header) - len(cells))
            body.append(cells)
            continue
        symbols = marks.mark(row.row_notes(), row.method)
        last_cell = mean_std(row.column("last"))
        cells = [
            row.method + (f" {symbols}" if symbols else ""),
            seeds,
            mean_std(row.column("final")),
            _bold(last_cell) if row.method in best else last_cell,
            mean_std(row.column("best")),
        ]
        if options.target is not None:
            cells.append(_reached_cell(row))
        if options.reference:
            cells.append(_paired_cell(row, options))
        body.append(cells)
    return Table(header, body)


def cost_table(rows: list[MethodRow]) -> Table:
    header = [
        "method", "down per round", "up per round", "total per round",
        "client state (largest client)", "seconds per round (train + eval), machine",
    ]  # fmt: skip
    body = []
    for row in rows:
        if not row.seeds:
            body.append([row.method] + [no_result(row)] + [""] * 4)
            continue
        states = [v for v in (row.runs[s].client_state_bytes for s in row.seeds) if v is not None]
        unknown = f"{NOT_RECORDED} (in no checkpoint.npz or summary.json)"
        body.append(
            [
                row.method,
                fmt_bytes(row.column("bytes_down").mean()),
                fmt_bytes(row.column("bytes_up").mean()),
                fmt_bytes((row.column("bytes_down") + row.column("bytes_up")).mean()),
                fmt_bytes(max(states)) if states else unknown,
                f"{row.column('seconds').mean():.2f} ({_machines_of(row)})",
            ]
        )
    return Table(header, body)


def _machines_of(row: MethodRow) -> str:
    """Which machines the row's seconds come from: speeds measured on different machines
    are not comparable, so a row that mixes them says so."""
    found = _row_machines(row)
    return found[0] if len(found) == 1 else "mixed: " + ", ".join(found)


def _row_machines(row: MethodRow) -> list[str]:
    return list(dict.fromkeys(m for s in row.seeds for m in row.runs[s].machines))


def overview_window(grouped: dict[str, list[MethodRow]], options: Options) -> Window:
    """What the overview's cells average, rows named with their setting."""
    return window(
        [
            w
            for setting, rows in grouped.items()
            for r in rows
            if r.seeds
            for w in r.windows(f"{r.method} ({setting})" if setting else r.method)
        ],
        options.last,
    )


def overview_table(
    grouped: dict[str, list[MethodRow]], options: Options, marks: Marks | None = None
) -> Table:
    """Methods down, settings across: mean of the last N rounds, as papers print them; the
    best of each column in bold, marks on the cells of runs whose mechanism never acted."""
    marks = Marks() if marks is None else marks
    settings = list(grouped)
    methods = list(dict.fromkeys(r.method for rows in grouped.values() for r in rows))
    best = {setting: best_of(rows) for setting, rows in grouped.items()}
    body = []
    for method in methods:
        cells = [method]
        for setting in settings:
            row = next((r for r in grouped[setting] if r.method == method), None)
            if row is None:
                cells.append("")
                continue
            beside = beside_mean(row, detail=False)
            if not row.seeds:
                cells.append(empty_cell(row))
                continue
            text = mean_std(row.column("last"))
            cell: Span = _bold(text) if method in best[setting] else text
            symbols = marks.mark(row.row_notes(), f"{method} ({setting})" if setting else method)
            pieces: list[Span] = [cell, f" {symbols}"] if symbols else [cell]
            if beside:
                pieces.append(f" ({'; '.join(beside)})")
            cells.append(pieces if len(pieces) > 1 else cell)
        body.append(cells)
    return Table(["method", *settings], body)


def conclusions(rows: list[MethodRow], options: Options) -> list[Text]:
    """Sentences computed from the rows: the highest mean of the last N rounds, which
    methods beat the reference on every seed they share with it, and whose paired
    interval lies on one side of zero; each names the seeds it rests on."""
    done = [r for r in rows if r.seeds]
    if not done:
        return ["No finished run yet."]
    best = max(done, key=lambda r: r.column("last").mean())
    out: list[Text] = [
        [
            f"Highest mean of the {table_window(rows, options).phrase()}: ",
            Bold(best.method),
            f" ({best.column('last').mean():.2f} % over {len(best.seeds)} seed(s)).",
        ]
    ]
    if options.reference and any(r.method == options.reference for r in done):

        def seeds(r: MethodRow) -> str:
            return f"{r.method} ({len(r.paired)} seed{'s' if len(r.paired) != 1 else ''})"

        up = [seeds(r) for r in done if r.paired and all(d > 0 for d in r.paired.values())]
        down = [seeds(r) for r in done if r.paired and all(d < 0 for d in r.paired.values())]
        out.append(
            f"Above {options.reference} on every seed both ran: {', '.join(up) or 'none'}; "
            f"below it on every such seed: {', '.join(down) or 'none'}."
        )
        summaries = [(r, r.paired_summary()) for r in done if r.method != options.reference]
        above = [seeds(r) for r, p in summaries if p and p.excludes_zero and p.mean > 0]
        below = [seeds(r) for r, p in summaries if p and p.excludes_zero and p.mean < 0]
        single = [r.method for r, p in summaries if p and p.n == 1]
        sentence = (
            f"95 % interval of the paired difference entirely above 0: "
            f"{', '.join(above) or 'none'}; entirely below 0: {', '.join(below) or 'none'}"
        )
        if single:
            sentence += f"; 1 seed, no interval: {', '.join(single)}"
        out.append(sentence + ".")
    return out


def shared_data_checks(records: list[RunRecord]) -> list[str]:
    """Whether the methods of each (setting, seed) had the same partition (the digest of
    partition.npz or, without it, the one config.json recorded) and the same clients in
    every round (metrics.jsonl), as the seed guarantees."""
    by_key: dict[tuple[str, int], list[RunRecord]] = defaultdict(list)
    for rec in records:
        by_key[rec.setting, rec.seed].append(rec)
    groups = [g for g in by_key.values() if len(g) > 1]
    if not groups:
        return ["Only one method per (setting, seed): nothing to check across methods."]
    same_part, diff_part, unknown = 0, [], 0
    partly, unrecorded_runs = 0, 0
    same_clients, diff_clients = 0, []
    for g in groups:
        digests = {r.partition_digest for r in g if r.partition_digest is not None}
        missing = sum(r.partition_digest is None for r in g)
        if len(digests) == 0:
            unknown += 1
        elif len(digests) == 1 and missing:
            partly += 1
            unrecorded_runs += missing
        elif len(digests) == 1:
            same_part += 1
        else:
            diff_part.append(f"{g[0].setting or 'the setting'} seed {g[0].seed}")
        streams = []
        for r in g:
            streams.append([tuple(m.get("clients", ())) for m in r.metrics])
        n = min(len(s) for s in streams)
        if all(s[:n] == streams[0][:n] for s in streams):
            same_clients += 1
        else:
            diff_clients.append(f"{g[0].setting or 'the setting'} seed {g[0].seed}")
    lines = []
    part = (
        "Partition (partition.npz, else the digest config.json recorded): identical across "
        f"methods in {same_part} of {len(groups)} (setting, seed) groups"
    )
    if partly:
        part += (
            f"; in {partly} other group(s), identical among the runs that record it "
            f"({unrecorded_runs} run(s) {NOT_RECORDED})"
        )
    if unknown:
        part += f"; {unknown} group(s) {NOT_RECORDED} (no partition.npz or recorded digest)"
    if diff_part:
        part += f"; DIFFERENT in {', '.join(diff_part)}"
    lines.append(part + ".")
    clients = (
        f"Clients of each round (metrics.jsonl): identical across methods in {same_clients} "
        f"of {len(groups)} groups, over the rounds all of them finished"
    )
    if diff_clients:
        clients += f"; DIFFERENT in {', '.join(diff_clients)}"
    lines.append(clients + ".")
    return lines


def scored_values(record: RunRecord, options: Options) -> RunValues | None:
    """:func:`run_values` of a run that has a model to score: none for one that diverged or
    failed (the rounds before the stop were not its end)."""
    if record.status.kind in (DIVERGED, FAILED):
        return None
    return run_values(record, options)


def per_run_table(records: list[RunRecord], options: Options) -> Table:
    """One row per run folder, its rounds with its status where it did not finish (diverged
    or failed at round N, running, unfinished); a run whose "last" value averages other than
    the header's number of rounds says how many beside it."""
    values = [scored_values(rec, options) for rec in records]
    main = window([("", v.last_rounds) for v in values if v], options.last).main
    header = [
        "setting", "method", "seed", "rounds", "final (%)", f"last {main} (%)",
        "best (%)", "computed on",
    ]  # fmt: skip
    body = []
    for rec, v in zip(records, values, strict=True):
        status = rec.status
        done = f"{len(rec.metrics)}/{rec.rounds_planned}" + (
            "" if status.kind == "finished" else f" ({status.label()})"
        )
        nums = ["", "", ""]
        if v:
            last = f"{v.last:.2f}" + (f" (last {v.last_rounds})" if v.last_rounds != main else "")
            nums = [f"{v.final:.2f}", last, f"{v.best:.2f}"]
        body.append(
            [rec.setting or "-", rec.method, str(rec.seed), done, *nums,
             provenance(rec)["machine"]]
        )  # fmt: skip
    return Table(header, body)


def provenance_table(records: list[RunRecord]) -> Table:
    keys = [k for k in (provenance(records[0]) if records else {}) if k != "machine"]
    body = []
    for rec in records:
        p = provenance(rec)
        body.append([rec.setting or "-", rec.method, str(rec.seed), *(p[k] for k in keys)])
    return Table(["setting", "method", "seed", *keys], body)


def comparison_blocks(
    records: list[RunRecord], options: Options, heading_level: int = 2
) -> list[Block]:
    """The comparison and cost tables of every setting, with the checks and conclusions."""
    grouped = group(records, options)
    h = heading_level
    blocks: list[Block] = []
    multi = len(grouped) > 1 or any(s for s in grouped)
    if multi:
        last = overview_window(grouped, options).phrase()
        blocks.append(Heading(h, f"Overview: mean of the {last} (%)"))
        marks = Marks()
        blocks.append(overview_table(grouped, options, marks))
        blocks += [Para(line) for line in marks.markdown_lines()]
        blocks += stop_note([r for rows in grouped.values() for r in rows])
    for setting, rows in grouped.items():
        if multi:
            blocks.append(Heading(h, f"Setting {setting}"))
        blocks.append(Heading(h + (1 if multi else 0), "Accuracy"))
        marks = Marks()
        blocks.append(comparison_table(rows, options, marks))
        blocks += [Para(line) for line in marks.markdown_lines()]
        blocks += stop_note(rows)
        blocks.append(Bullets(conclusions(rows, options)))
        blocks.append(Heading(h + (1 if multi else 0), "Cost"))
        blocks.append(cost_table(rows))
        table = metrics_table([r for r in records if r.setting == setting])
        if table is not None:
            blocks.append(Heading(h + (1 if multi else 0), "Other metrics the runs logged"))
            blocks.append(
                Para("The last logged value of each finished run, mean ± std over seeds.")
            )
            blocks.append(table)
    blocks.append(Heading(h, "Same partition and clients across methods"))
    blocks.append(Bullets(shared_data_checks(records)))
    return blocks


def explanation(options: Options) -> str:
    text = (
        "Mean ± sample standard deviation over each row's finished seeds (accuracy of the "
        f"global model on the test set, in %). {MEANS_POLICY} The mean of the last "
        f"{options.last} evaluated rounds (all of them in a run that has fewer; each label "
        "says how many its values average) is steadier than the final accuracy under strong "
        "skew; the highest is in bold."
    )
    if options.reference:
        text += (
            f" The difference to {options.reference} is taken per seed (the same seed gives "
            "every method the same partition and the same clients each round) and then "
            "averaged; the brackets hold its 95 % Student-t interval over the n seeds both "
            "ran (mean ± t(0.975, n - 1) s / sqrt(n)), none with 1 seed, and 'ahead in a/n' "
            "counts the seeds where the method is above the reference."
        )
    text += (
        " A mark (†, ‡, ...) on a method says that a mechanism of it never acted within the "
        "run (a launch round after the last round, a period longer than the run), so that "
        "the run trained as a plainer method; the footnote under the table names it."
    )
    text += (
        " Bytes are those the engine carried (metrics.jsonl), averaged over rounds; the client "
        "state is the largest client's state at the end of the run (its last checkpoint, or "
        "its summary.json where the checkpoint is gone); seconds are the "
        "run's own wall time per round on the machine that computed it, named beside them "
        "('mixed' where a row's seeds ran on different machines, whose seconds do not "
        "compare; the runs table has each run's)."
    )
    return text


# ---------------------------------------------------------------------- other metrics

# Metrics the papers report besides global accuracy, when a run logged them: (key, label,
# scale). Personal accuracy (FedROD), FedFM's feature quality, FedACD's risk of local models.
PAPER_METRICS = (
    ("client_dist_accuracy", "accuracy on the clients' label distributions (%)", 100.0),
    ("personal_accuracy", "personalised accuracy (%)", 100.0),
    ("feature_nmi", "feature NMI", 1.0),
    ("feature_silhouette", "feature silhouette", 1.0),
    ("local_risk", "risk of local models", 1.0),
    # DP runs: the accountant's epsilon at the run's delta after the last round
    # (docs/privacy.md; dp_delta is in the configuration table).
    ("dp_epsilon", "privacy spent (DP epsilon)", 1.0),
)
# Bookkeeping rather than results: left out of the diagnostics column.
_BOOKKEEPING = re.compile(r"(_seconds|_models)$")


def _last_values(recs: list[RunRecord], key: str, scale: float) -> list[float]:
    return [scale * r.series(key)[-1][1] for r in recs if r.series(key)]


def _without_noise(rec: RunRecord) -> bool:
    """A DP run with ``dp_noise`` 0: clipping only, its epsilon infinite, so its metrics
    lines carry no number under ``dp_epsilon`` (null) and summary.json says
    ``dp_guarantee`` "none"; the report must say so rather than leave the column out."""
    if str((rec.summary or {}).get("dp_guarantee", "")).startswith("none"):
        return True
    dp, noise = rec.config.get("dp", "off"), rec.config.get("dp_noise")
    return dp not in (None, "off") and isinstance(noise, (int, float)) and noise == 0


def _epsilon_cell(recs: list[RunRecord]) -> str:
    """The privacy column's cell: the mean ± std of the epsilons, or infinity where a seed
    ran without noise (the mean of anything with an infinite epsilon is infinite)."""
    unbounded = sum(_without_noise(r) for r in recs)
    if not unbounded:
        return mean_std(_last_values(recs, "dp_epsilon", 1.0), digits=4)
    if unbounded == len(recs):
        return "∞ (noise 0)"
    return f"∞ (noise 0 in {unbounded} of {len(recs)} seeds)"


def metrics_table(records: list[RunRecord]) -> Table | None:
    """Per method, the last logged value (mean ± std over finished seeds) of the papers'
    other metrics present in the runs, and of the algorithm's own diagnostics; None when
    the runs logged none."""
    by_method: dict[str, list[RunRecord]] = {}
    for rec in records:
        if rec.finished:
            by_method.setdefault(rec.method, []).append(rec)
    present = [
        (k, label, scale)
        for k, label, scale in PAPER_METRICS
        if any(r.series(k) for rs in by_method.values() for r in rs)
        or (k == "dp_epsilon" and any(_without_noise(r) for rs in by_method.values() for r in rs))
    ]
    known = {k for k, _, _ in PAPER_METRICS}
    diagnostics = {
        method: [
            n
            for n in dict.fromkeys(n for r in recs for n in r.extra_metric_names())
            if n not in known and not _BOOKKEEPING.search(n)
        ]
        for method, recs in by_method.items()
    }
    has_diag = any(diagnostics.values())
    if not present and not has_diag:
        return None
    rows = []
    for method, recs in by_method.items():
        cells = [method]
        for key, _, scale in present:
            if key == "dp_epsilon":
                cells.append(_epsilon_cell(recs))
                continue
            cells.append(mean_std(_last_values(recs, key, scale), digits=2 if scale > 1 else 4))
        if has_diag:
            cells.append(
                "; ".join(
                    f"{n} {mean_std(_last_values(recs, n, 1.0), digits=4)}"
                    for n in diagnostics[method]
                )
                or "-"
            )
        rows.append(cells)
    header = ["method", *(label for _, label, _ in present)]
    if has_diag:
        header.append("the algorithm's own diagnostics")
    return Table(header, rows)


# ----------------------------------------------------------------------- configuration

# How and where a run executed, not what it computed; and what compare sets per run.
HIDDEN_KEYS = frozenset(EXECUTION_ONLY) | {"seed", "checkpoint_every"}


def _value(v: object) -> str:
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}={_value(x)}" for k, x in v.items()) + "}"
    return json.dumps(v) if v is None or isinstance(v, bool) else str(v)


def columns(pairs: list[tuple[str, str]], names: tuple[str, str], per_row: int) -> Table:
    """Key-value pairs laid out ``per_row`` pairs to a row (a short, wide table)."""
    header = [h for _ in range(per_row) for h in names]
    rows = []
    for i in range(0, len(pairs), per_row):
        chunk = pairs[i : i + per_row]
        row = [c for pair in chunk for c in pair]
        rows.append(row + [""] * (len(header) - len(row)))
    return Table(header, rows)


def configuration_blocks(records: list[RunRecord], heading_level: int = 2) -> list[Block]:
    """The configuration every run shares, then what differs per (setting, method), with the
    algorithms' full hyper-parameters as the runs resolved them."""
    if not records:
        return []
    h = heading_level
    # A key a run folder lacks (written before the option existed) had the value such
    # folders ran with (config.LEGACY: partition_version 1, IEEE denormals), else its default.
    defaults = {**ExperimentConfig().to_dict(), **LEGACY}
    configs = [{**defaults, **r.config} for r in records]
    keys = list(dict.fromkeys(k for c in configs for k in c if k not in HIDDEN_KEYS))
    common = [
        k for k in keys
        if len({json.dumps(c.get(k), sort_keys=True, default=str) for c in configs}) == 1
    ]  # fmt: skip
    varying = [k for k in keys if k not in common]
    blocks: list[Block] = [Heading(h, "Configuration")]
    seeds = sorted({r.seed for r in records})
    blocks.append(
        Para(
            f"From the runs' config.json; seeds {', '.join(map(str, seeds))}. Shared by every run:"
        )
    )
    pairs = [(k, _value(configs[0][k])) for k in common]
    blocks.append(columns(pairs, ("option", "value"), per_row=3))
    resolved_keys = ("model", "num_clients", "clients_per_round", "num_classes",
                     "train_samples", "test_samples")  # fmt: skip
    facts = [
        [k, _value(records[0].resolved[k])]
        for k in resolved_keys
        if k in records[0].resolved and len({json.dumps(r.resolved.get(k)) for r in records}) == 1
    ]
    if facts:
        blocks.append(Para("As the runs resolved them:"))
        blocks.append(columns([(k, v) for k, v in facts], ("fact", "value"), per_row=3))
    rows, seen = [], set()
    for r, c in zip(records, configs, strict=True):
        if (r.setting, r.method) in seen:
            continue
        seen.add((r.setting, r.method))
        diff = "; ".join(f"{k}={_value(c.get(k))}" for k in varying) or "-"
        params = r.resolved.get("algorithm_params")
        rows.append(
            [
                r.setting or "-",
                r.method,
                diff,
                NOT_RECORDED if params is None else _value(params)[1:-1] or "none",
            ]
        )
    blocks.append(Para("Per setting and method:"))
    blocks.append(
        Table(["setting", "method", "options that differ", "algorithm parameters (resolved)"], rows)
    )
    return blocks


# ------------------------------------------------------------------------------ CSV


def _num(x: float | None, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return ""
    return f"{x:.{digits}f}"


def _rounds_at(stopped: dict[int, RunStatus]) -> str:
    """``seed:round`` of each run, ``;`` between them (the round empty where unknown)."""
    return ";".join(
        f"{s}:{'' if stopped[s].round is None else stopped[s].round}" for s in sorted(stopped)
    )


def comparison_csv(records: list[RunRecord], options: Options) -> str:
    """One line per (setting, method): the comparison and cost numbers, unformatted.
    ``last_rounds``: the evaluated rounds the last_* values average (``6;10`` where the
    row's seeds differ); ``paired_ci95_*``: the Student-t interval of the paired mean (empty
    with one seed); ``inactive_mechanisms``: those that never acted in the row's runs;
    ``diverged``/``failed``: the row's runs left out of its means for that reason, and
    ``*_at`` their ``seed:round``; ``unfinished``: those running or stopped without an
    error."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    header = [
        "setting", "method", "seeds", "unfinished", "final_mean", "final_std",
        "last_mean", "last_std", "last_rounds", "best_mean", "best_std",
        "target", "rounds_to_target_mean", "seeds_reaching_target", "reference",
        "paired_mean", "paired_std", "paired_ci95_low", "paired_ci95_high", "paired_seeds",
        "paired_seeds_up", "bytes_down_per_round", "bytes_up_per_round",
        "client_state_bytes_max", "seconds_per_round", "machines", "inactive_mechanisms",
        "diverged", "diverged_at", "failed", "failed_at",
    ]  # fmt: skip
    w.writerow(header)
    for setting, rows in group(records, options).items():
        for row in rows:
            stops = [len(row.diverged), _rounds_at(row.diverged), len(row.failed),
                     _rounds_at(row.failed)]  # fmt: skip
            if not row.seeds:
                blank = [""] * (len(header) - 4 - len(stops))
                w.writerow([setting, row.method, 0, len(row.unfinished), *blank, *stops])
                continue
            final, last, best = row.column("final"), row.column("last"), row.column("best")
            reached = [row.runs[s].reached for s in row.seeds if row.runs[s].reached is not None]
            d = np.array(list(row.paired.values()))
            paired = row.paired_summary()
            states = [row.runs[s].client_state_bytes for s in row.seeds]
            states = [s for s in states if s is not None]
            windows = sorted({row.runs[s].last_rounds for s in row.seeds})
            w.writerow(
                [
                    setting, row.method, len(row.seeds), len(row.unfinished),
                    _num(final.mean()), _num(_std(final)), _num(last.mean()), _num(_std(last)),
                    ";".join(map(str, windows)), _num(best.mean()), _num(_std(best)),
                    "" if options.target is None else options.target,
                    _num(float(np.mean(reached)) if reached else None, 2),
                    len(reached) if options.target is not None else "",
                    options.reference or "",
                    _num(d.mean() if d.size else None), _num(_std(d) if d.size else None),
                    _num(paired.low if paired else None), _num(paired.high if paired else None),
                    d.size, int((d > 0).sum()),
                    _num(row.column("bytes_down").mean(), 1),
                    _num(row.column("bytes_up").mean(), 1),
                    max(states) if states else "",
                    _num(row.column("seconds").mean(), 3),
                    "; ".join(_row_machines(row)),
                    "; ".join(n.text() for n in row.row_notes()),
                    *stops,
                ]
            )  # fmt: skip
    return buf.getvalue()


def runs_csv(records: list[RunRecord], options: Options) -> str:
    """One line per run folder: its numbers and where they came from."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    prov_keys = list(provenance(records[0])) if records else []
    w.writerow(
        ["setting", "method", "seed", "folder", "finished", "rounds_done", "final", "last",
         "last_rounds", "best", "rounds_to_target", "bytes_down_per_round", "bytes_up_per_round",
         "client_state_bytes_max", "seconds_per_round", *prov_keys,
         "status", "stopped_round", "stop_reason"]
    )  # fmt: skip
    for rec in records:
        v = scored_values(rec, options)
        p = provenance(rec)
        status = rec.status
        w.writerow(
            [
                rec.setting, rec.method, rec.seed, rec.folder.name, rec.finished,
                len(rec.metrics),
                _num(v.final if v else None), _num(v.last if v else None),
                v.last_rounds if v else "",
                _num(v.best if v else None), "" if not v or v.reached is None else v.reached,
                _num(v.bytes_down if v else None, 1), _num(v.bytes_up if v else None, 1),
                "" if rec.client_state_bytes is None else rec.client_state_bytes,
                _num(v.seconds if v else None, 3),
                *(p[k] for k in prov_keys),
                status.kind, "" if status.round is None else status.round, status.reason,
            ]
        )  # fmt: skip
    return buf.getvalue()
