"""Paper tables: the comparison as booktabs LaTeX, methods down and settings across.

Each cell is the mean ± sample standard deviation over seeds of the mean of the last
evaluated rounds, the value the Markdown tables show; the best of each column is in bold,
decided as they decide it (``fedskew.report.tables.best_of``). Optionally each setting gets
a second column: the paired difference to the reference method with its 95 % Student-t
interval. Rows of runs whose method had a mechanism that never acted get a footnote dagger.
The file is a fragment to ``\\input`` (preamble: ``\\usepackage{booktabs}``).
"""

from __future__ import annotations

from pathlib import Path

from fedskew.core.durable import write_bytes_durably
from fedskew.report.document import one_line
from fedskew.report.inactive import Marks
from fedskew.report.run_status import MEANS_POLICY
from fedskew.report.runs import RunRecord
from fedskew.report.tables import (
    MethodRow,
    Options,
    beside_mean,
    best_of,
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


def _number(x: float, sign: bool = False) -> str:
    return f"{x:+.2f}" if sign else f"{x:.2f}"


def _accuracy_cell(row: MethodRow, bold: bool) -> str:
    values = row.column("last")
    body = _number(values.mean())
    if values.size > 1:
        body += rf" \pm {values.std(ddof=1):.2f}"
    return f"$\\mathbf{{{body}}}$" if bold else f"${body}$"


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


def _paired_cell(row: MethodRow, reference: str) -> str:
    if row.method == reference:
        return "---"
    summary = row.paired_summary()
    if summary is None:
        return "n/a"
    if summary.low is None or summary.high is None:
        return f"${_number(summary.mean, sign=True)}$ {{\\scriptsize (1 seed)}}"
    low, high = _number(summary.low, sign=True), _number(summary.high, sign=True)
    return f"${_number(summary.mean, sign=True)}$ {{\\scriptsize $[{low}, {high}]$}}"


def comparison_latex(records: list[RunRecord], options: Options, paired: bool = False) -> str:
    """The booktabs table (a ``table`` float) of every method and setting in ``records``."""
    grouped = group(records, options)
    settings = list(grouped)
    methods = list(dict.fromkeys(r.method for rows in grouped.values() for r in rows))
    with_paired = paired and bool(options.reference)
    per_setting = 2 if with_paired else 1
    marks = Marks(latex=True)
    best = {setting: best_of(rows) for setting, rows in grouped.items()}
    lines = [
        "% fedskew: booktabs table; needs \\usepackage{booktabs}. Rebuilt from the run folders.",
        "\\begin{table}[t]",
        "\\centering",
        f"\\caption{{{_caption(grouped, options, with_paired)}}}",
        "\\label{tab:fedskew-comparison}",
        "\\begin{tabular}{l" + "c" * (per_setting * len(settings)) + "}",
        "\\toprule",
    ]
    names = [escape(s) if s else "Accuracy (\\%)" for s in settings]
    if with_paired:
        reference = escape(options.reference)
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
        cells = [escape(method)]
        for setting in settings:
            row = next((r for r in grouped[setting] if r.method == method), None)
            if row is None or not row.seeds:
                empty = "---" if row is None else _no_result_cell(row)
                cells += [empty] + ["---"] * (per_setting - 1)
                continue
            label = f"{method} ({setting})" if setting else method
            symbols = marks.mark(row.row_notes(), label)
            cell = _accuracy_cell(row, method in best[setting])
            cells.append(cell + (f"$^{{{symbols}}}$" if symbols else "") + _beside_cell(row))
            if with_paired:
                cells.append(_paired_cell(row, str(options.reference)))
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


def _caption(grouped: dict[str, list[MethodRow]], options: Options, paired: bool) -> str:
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
        f"{over} of the mean of the {escape(overview_window(grouped, options).phrase())}; "
        "a value without $\\pm$ rests on one seed; the best of each column in bold."
    )
    if paired:
        text += (
            f" $\\Delta$: the mean over seeds of the paired difference to "
            f"{escape(options.reference or '')} (points), with its 95\\,\\% Student-t interval "
            "over the seeds both ran; none with 1 seed."
        )
    return text


def write_latex(
    records: list[RunRecord], options: Options, folder: Path, stem: str, paired: bool = False
) -> Path:
    """``folder/<stem>.tex``; returns its path."""
    path = latex_path(folder, stem)
    write_bytes_durably(path, comparison_latex(records, options, paired).encode("utf-8"))
    return path
