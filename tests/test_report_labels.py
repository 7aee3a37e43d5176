"""What the comparison tables say about their numbers: the rounds the "last" column really
averages, the bold best, the paired intervals, and the marks of runs whose method had a
mechanism that never acted. Built from run records made here (no training)."""

from __future__ import annotations

import csv
import io

from fake_runs import FM_OFF, record

from fedskew.report.document import Para, Table, markdown_text, plain_text, to_markdown
from fedskew.report.tables import (
    Options,
    comparison_blocks,
    comparison_csv,
    comparison_table,
    conclusions,
    group,
    per_run_table,
    runs_csv,
)


def test_labels_name_the_rounds_averaged():
    short = [record(m, 0, [40, 50]) for m in ("fedavg", "fedfm")]
    options = Options(last=10)
    table = comparison_table(group(short, options)[""], options)
    assert "mean of last 2 (%)" in table.header
    assert any(h.startswith("last 2 vs fedavg, paired") for h in table.header)
    assert "last 10" not in " ".join(table.header)
    assert "Highest mean of the last 2 evaluated rounds" in plain_text(
        conclusions(group(short, options)[""], options)[0]
    )

    mixed = [record("fedavg", 0, [50] * 12), record("fedfm", 0, [60] * 6)]
    rows = group(mixed, options)[""]
    table = comparison_table(rows, options)
    assert "mean of last 10 (6 for fedfm) (%)" in table.header
    assert "last 10 evaluated rounds (6 for fedfm)" in plain_text(conclusions(rows, options)[0])
    runs = per_run_table(mixed, options)
    assert "last 10 (%)" in runs.header
    assert runs.rows[1][5] == "60.00 (last 6)" and runs.rows[0][5] == "50.00"

    # Seeds of one method that averaged different numbers of rounds are named one by one.
    seeds = [record("fedavg", 0, [50] * 12), record("fedavg", 1, [50] * 4)]
    table = comparison_table(group(seeds, options)[""], Options(last=10, reference=None))
    assert "mean of last 10 (4 for fedavg seed 1) (%)" in table.header


def test_bold_best_and_paired_interval_cells():
    records = []
    for seed, (ref, fm) in enumerate(((50, 51), (52, 54), (54, 53))):
        records.append(record("fedavg", seed, [ref] * 3))
        records.append(record("fedfm", seed, [fm] * 3))
    options = Options(last=10)
    table = comparison_table(group(records, options)[""], options)
    by_method = {r[0]: r for r in table.rows}
    assert markdown_text(by_method["fedfm"][3]) == "**52.67 ± 1.53**"
    assert by_method["fedavg"][3] == "52.00 ± 2.00"
    # diffs +1, +2, -1 -> mean 0.67, interval 0.67 ± 4.3027 * 1.5275 / sqrt(3)
    assert by_method["fedfm"][-1] == "+0.67 [-3.13, +4.46]; ahead in 2/3 seeds"
    assert by_method["fedavg"][-1] == "reference"
    sentences = conclusions(group(records, options)[""], options)
    assert "entirely above 0: none" in sentences[2]

    one_seed = [record("fedavg", 0, [50]), record("fedfm", 0, [50.5])]
    table = comparison_table(group(one_seed, options)[""], options)
    assert table.rows[1][-1] == "+0.50 (1 seed: no interval); ahead in 1/1 seed"
    assert "1 seed, no interval: fedfm" in conclusions(group(one_seed, options)[""], options)[2]


def test_rows_of_runs_with_an_inactive_mechanism_are_marked():
    records = [
        record("fedavg", 0, [50] * 6, setting="short"),
        record("fedfm", 0, [50] * 6, setting="short", inactive=[FM_OFF]),
        record("fedavg", 0, [50] * 30, setting="long"),
        record("fedfm", 0, [55] * 30, setting="long", inactive=[]),
    ]
    options = Options(last=10)
    blocks = comparison_blocks(records, options)
    text, _ = to_markdown(blocks, "files")
    tables = [b for b in blocks if isinstance(b, Table)]
    overview = tables[0]
    fedfm = next(r for r in overview.rows if r[0] == "fedfm")
    # short: never launched; tied best, both bold. long: recorded, nothing inactive.
    assert [markdown_text(c) for c in fedfm[1:]] == ["**50.00 (1 seed)** †", "**55.00 (1 seed)**"]
    accuracy = next(t for t in tables if t.header[0] == "method" and "seeds" in t.header)
    assert [r[0] for r in accuracy.rows] == ["fedavg", "fedfm †"]
    footnote = "† fedfm: feature matching never acted (start_round=20, rounds=6): it first acts"
    assert footnote in text
    assert "† fedfm (short): feature matching never acted" in text
    paras = [b.text for b in blocks if isinstance(b, Para)]
    assert sum(p.startswith("†") for p in paras) == 2  # under the overview and under short
    csv_rows = list(csv.DictReader(io.StringIO(comparison_csv(records, options))))
    marked = {(r["setting"], r["method"]): r["inactive_mechanisms"] for r in csv_rows}
    assert marked["short", "fedfm"].startswith("feature matching never acted")
    assert marked["long", "fedfm"] == "" and marked["short", "fedavg"] == ""


def test_csv_columns_say_what_they_average():
    records = [record("fedavg", 0, [50] * 12), record("fedavg", 1, [52] * 4)]
    records += [record("fedfm", 0, [51] * 12), record("fedfm", 1, [54] * 4)]
    rows = list(csv.DictReader(io.StringIO(comparison_csv(records, Options(last=10)))))
    fedfm = next(r for r in rows if r["method"] == "fedfm")
    assert fedfm["last_rounds"] == "4;10"
    assert float(fedfm["last_mean"]) == 52.5
    assert float(fedfm["paired_mean"]) == 1.5
    # diffs 1 and 2: mean 1.5, s = sqrt(0.5), t(0.975, 1) = 12.7062
    half = 12.7062 * 0.5**0.5 / 2**0.5
    assert abs(float(fedfm["paired_ci95_low"]) - (1.5 - half)) < 1e-3
    assert abs(float(fedfm["paired_ci95_high"]) - (1.5 + half)) < 1e-3
    assert "last10_mean" not in rows[0]
    per_run = list(csv.DictReader(io.StringIO(runs_csv(records, Options(last=10)))))
    assert [r["last_rounds"] for r in per_run] == ["10", "4", "10", "4"]


def test_log_axes_label_their_ticks_as_plain_numbers():
    """Pictures take text literally (literal_text), so a log axis must not get Matplotlib's
    mathtext tick labels ('$\\mathdefault{10^{-2}}$' was printed as written)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from fedskew.report.figures import literal_text, log_scale

    @literal_text
    def ticks() -> list[str]:
        fig = Figure()
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        ax.plot([0.001, 0.1], [1, 2])
        log_scale(ax, "x")
        fig.canvas.draw()
        return [t.get_text() for t in ax.get_xticklabels() if t.get_text()]

    shown = ticks()
    assert shown and not any("$" in t or "mathdefault" in t for t in shown), shown
    assert "0.01" in shown
