"""Paper tables: the comparison as booktabs LaTeX, methods down and settings across.

Each cell is the mean ± sample standard deviation over seeds of each run's value at the
table's statistic (``fedskew.report.latex_style.TableStyle``: by default the mean of the last
evaluated rounds, the value the Markdown tables bold; or the final or the best accuracy), with
the style's digits; the best of each column is in bold, decided on the means as printed
(ties bold together), and methods go by their display names. Optionally each setting gets a
second column: the paired difference of the same statistic to the reference method with its
95 % Student-t interval. Rows of runs whose method had a mechanism that never acted get a
footnote dagger. The file is a fragment to ``\\input`` (preamble: ``\\usepackage{booktabs}``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from fedskew.core.durable import write_bytes_durably
from fedskew.report.document import one_line
from fedskew.report.inactive import Marks
from fedskew.report.intervals import PairedSummary, paired_summary
from fedskew.report.latex_style import TableStyle, best_keys
from fedskew.report.run_status import MEANS_POLICY
from fedskew.report.runs import RunRecord
from fedskew.report.statistic import Statistic
from fedskew.report.tables import (
    MethodRow,
    Options,
    beside_mean,
    group,
    no_result,
    not_in_means,
    overview_window,
)

_SPECIAL = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "±": r"$\pm$",
    "†": r"$\dagger$",
    # Not special, but printed as other glyphs in the default (OT1) font encoding.
    "<": r"\textless{}",
    ">": r"\textgreater{}",
    "|": r"\textbar{}",
    # A row that starts with [ after the previous row's \\ would be read as its
    # optional argument (the space after a row).
    "[": "{[}",
    "]": "{]}",
}


def escape(text: str) -> str:
    """``text`` as LaTeX prints it literally (method and setting names, captions, notes),
    on one line: every character TeX reads as a command, a group, math, a comment or a
    table cell is written as itself, and a newline (a blank line ends the table) or other
    control character as a space."""
    visible = one_line(text).replace("\ufffd", "?")  # pdfLaTeX has no glyph for U+FFFD
    return "".join(_SPECIAL.get(ch, ch) for ch in visible)


def latex_path(folder: Path, stem: str) -> Path:
    return Path(folder) / f"{stem}.tex"


def _paired(row: MethodRow, reference: MethodRow | None, column: str) -> PairedSummary | None:
    """The paired difference of ``column`` to the reference over the seeds both finished."""
    if reference is None:
        return None
    seeds = [s for s in row.seeds if s in reference.runs]
    diffs = [getattr(row.runs[s], column) - getattr(reference.runs[s], column) for s in seeds]
    return paired_summary(diffs)


def _beside_cell(row: MethodRow) -> str:
    """The row's runs not in its mean, counted beside it in small type ("+1 diverged")."""
    parts = beside_mean(row, detail=False)
    return f" {{\\scriptsize ({escape('; '.join(parts))})}}" if parts else ""


def _no_result_cell(row: MethodRow) -> str:
    """A cell without a finished seed: "diverged (n seeds)" where every seed diverged, else
    --- with the runs that did not finish counted beside it."""
    if no_result(row).endswith("diverged"):
        n = len(row.diverged)
        return f"diverged {{\\scriptsize ({n} seed{'s' if n != 1 else ''})}}"
    return "---" + _beside_cell(row)


def _paired_cell(row: MethodRow, reference: str, found: MethodRow | None, style: TableStyle) -> str:
    if row.method == reference:
        return "---"
    summary = _paired(row, found, style.statistic.column)
    if summary is None:
        return "n/a"
    mean = style.number(summary.mean, sign=True)
    if summary.low is None or summary.high is None:
        return f"${mean}$ {{\\scriptsize (1 seed)}}"
    low, high = style.number(summary.low, sign=True), style.number(summary.high, sign=True)
    return f"${mean}$ {{\\scriptsize $[{low}, {high}]$}}"


def _style_for(options: Options, style: TableStyle | None) -> tuple[Options, TableStyle]:
    """The style (default: the mean of the last ``options.last`` rounds, 2 digits, bold
    best) and the options whose rows compute its "last" window."""
    if style is None:
        return options, TableStyle(statistic=Statistic("last", options.last))
    if style.statistic.kind == "last" and style.statistic.last != options.last:
        options = dataclasses.replace(options, last=style.statistic.last)
    return options, style


def comparison_latex(
    records: list[RunRecord],
    options: Options,
    paired: bool = False,
    style: TableStyle | None = None,
) -> str:
    """The booktabs table (a ``table`` float) of every method and setting in ``records``."""
    options, style = _style_for(options, style)
    column = style.statistic.column
    grouped = group(records, options)
    settings = list(grouped)
    methods = list(dict.fromkeys(r.method for rows in grouped.values() for r in rows))
    with_paired = paired and bool(options.reference)
    per_setting = 2 if with_paired else 1
    marks = Marks(latex=True)
    best = {
        setting: best_keys(
            {r.method: float(r.column(column).mean()) for r in rows if r.seeds}, style.digits
        )
        for setting, rows in grouped.items()
    }
    lines = [
        "% fedskew: booktabs table; needs \\usepackage{booktabs}. Rebuilt from the run folders.",
        "\\begin{table}[t]",
        "\\centering",
        f"\\caption{{{_caption(grouped, options, with_paired, style)}}}",
        "\\label{tab:fedskew-comparison}",
        "\\begin{tabular}{l" + "c" * (per_setting * len(settings)) + "}",
        "\\toprule",
    ]
    names = [escape(s) if s else "Accuracy (\\%)" for s in settings]
    if with_paired:
        reference = escape(style.name(str(options.reference)))
        lines.append(
            " & ".join(["", *(f"\\multicolumn{{2}}{{c}}{{{n}}}" for n in names)]) + " \\\\"
        )
        lines.append(
            " ".join(f"\\cmidrule(lr){{{2 + 2 * i}-{3 + 2 * i}}}" for i in range(len(settings)))
        )
        cells = ["Method", *(c for _ in settings for c in ("Acc.", f"$\\Delta$ {reference}"))]
        lines.append(" & ".join(cells) + " \\\\")
    else:
        lines.append(" & ".join(["Method", *names]) + " \\\\")
    lines.append("\\midrule")
    for method in methods:
        shown = style.name(method)
        cells = [escape(shown)]
        for setting in settings:
            row = next((r for r in grouped[setting] if r.method == method), None)
            if row is None or not row.seeds:
                empty = "---" if row is None else _no_result_cell(row)
                cells += [empty] + ["---"] * (per_setting - 1)
                continue
            label = f"{shown} ({setting})" if setting else shown
            symbols = marks.mark(row.row_notes(), label)
            cell = style.cell(row.column(column), bold=method in best[setting])
            cells.append(cell + (f"$^{{{symbols}}}$" if symbols else "") + _beside_cell(row))
            if with_paired:
                ref = next((r for r in grouped[setting] if r.method == options.reference), None)
                cells.append(_paired_cell(row, str(options.reference), ref, style))
        lines.append(" & ".join(cells) + " \\\\")
    lines += ["\\bottomrule", "\\end{tabular}"]
    for symbol, text in marks.footnotes():
        lines.append(f"\\par\\smallskip{{\\footnotesize $^{{{symbol}}}$ {escape(text)}.}}")
    named = not_in_means([r for rows in grouped.values() for r in rows], reasons=False)
    if named:
        note = f"Not in the means: {'; '.join(named)}. {MEANS_POLICY}"
        lines.append(f"\\par\\smallskip{{\\footnotesize {escape(note)}}}")
    lines.append("\\end{table}")
    return "\n".join(lines) + "\n"


def _what(grouped: dict[str, list[MethodRow]], options: Options, style: TableStyle) -> str:
    kind = style.statistic.kind
    if kind == "final":
        return "the accuracy at the final evaluated round"
    if kind == "best":
        return "the best accuracy over the evaluated rounds"
    return f"the mean of the {escape(overview_window(grouped, options).phrase())}"


def _caption(
    grouped: dict[str, list[MethodRow]], options: Options, paired: bool, style: TableStyle
) -> str:
    seeds = sorted({len(r.seeds) for rows in grouped.values() for r in rows if r.seeds})
    over = (
        f"{seeds[0]} seed{'s' if seeds[0] != 1 else ''}"
        if len(seeds) == 1
        else f"{seeds[0]} to {seeds[-1]} seeds per cell"
        if seeds
        else "no finished seed"
    )
    text = (
        "Test accuracy (\\%) of the global model: mean $\\pm$ sample standard deviation over "
        f"{over} of {_what(grouped, options, style)}; a value without $\\pm$ rests on one seed"
    )
    text += "; the best of each column in bold." if style.bold else "."
    if paired:
        text += (
            f" $\\Delta$: the mean over seeds of the paired difference to "
            f"{escape(style.name(options.reference or ''))} (points), with its 95\\,\\% "
            "Student-t interval over the seeds both ran; none with 1 seed."
        )
    return text


def write_latex(
    records: list[RunRecord],
    options: Options,
    folder: Path,
    stem: str,
    paired: bool = False,
    style: TableStyle | None = None,
) -> Path:
    """``folder/<stem>.tex``; returns its path."""
    path = latex_path(folder, stem)
    text = comparison_latex(records, options, paired, style)
    write_bytes_durably(path, text.encode("utf-8"))
    return path
