"""Paper tables: `fedskew report --latex` and compare's comparison.tex, read back by parsing
the booktabs table (and compiled where pdflatex is installed)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from fake_runs import FM_OFF, record, write_run

from fedskew.apps.cli import main
from fedskew.report.latex import comparison_latex, escape, write_latex
from fedskew.report.tables import Options


def body_rows(tex: str) -> list[list[str]]:
    """The cells of the rows between \\midrule and \\bottomrule."""
    inside = tex.split("\\midrule\n", 1)[1].split("\\bottomrule", 1)[0]
    rows = []
    for line in inside.strip().splitlines():
        assert line.endswith(" \\\\"), line
        rows.append(line.removesuffix(" \\\\").split(" & "))
    return rows


def records():
    out = []
    for seed, (ref, odd, fm) in enumerate(((50, 49, 51), (52, 50, 54), (54, 51, 53))):
        out.append(record("fedavg", seed, [ref] * 3, setting="beta_0.1"))
        out.append(record("fed_x&y%", seed, [odd] * 3, setting="beta_0.1"))
        out.append(record("fedfm", seed, [fm] * 3, setting="beta_0.1", inactive=[FM_OFF]))
        out.append(record("fedavg", seed, [ref + 10] * 12, setting="b#2"))
        out.append(record("fed_x&y%", seed, [odd + 20] * 12, setting="b#2"))
    return out


def test_escape():
    assert escape("a_b&c%d$e#f{g}h~i^j\\k") == (
        r"a\_b\&c\%d\$e\#f\{g\}h\textasciitilde{}i\textasciicircum{}j\textbackslash{}k"
    )


def test_table_rows_bold_best_marks_and_escaping():
    tex = comparison_latex(records(), Options(last=10))
    assert "\\toprule" in tex and "\\begin{tabular}{lcc}" in tex
    header = tex.split("\\toprule\n", 1)[1].split("\n", 1)[0]
    assert header == "Method & beta\\_0.1 & b\\#2 \\\\"
    rows = {r[0]: r[1:] for r in body_rows(tex)}
    assert list(rows) == ["fedavg", "fed\\_x\\&y\\%", "fedfm"]
    # beta_0.1: fedfm is best (52.67), and marked; b#2: fed_x&y% (70.00) is best.
    assert rows["fedfm"][0] == "$\\mathbf{52.67 \\pm 1.53}$$^{\\dagger}$"
    assert rows["fedavg"] == ["$52.00 \\pm 2.00$", "$62.00 \\pm 2.00$"]
    assert rows["fed\\_x\\&y\\%"][1] == "$\\mathbf{70.00 \\pm 1.00}$"
    assert rows["fedfm"][1] == "---"  # no run there
    footnote = re.search(r"\$\^\{\\dagger\}\$ (.*)\.\}", tex)
    assert footnote is not None
    assert footnote.group(1).startswith("fedfm (beta\\_0.1): feature matching never acted")
    assert "start\\_round=20" in footnote.group(1)
    caption = re.search(r"\\caption\{(.*)\}", tex)
    assert caption is not None
    # Most rows (beta_0.1's three) averaged 3 rounds, the two of b#2 averaged 10.
    window = "last 3 evaluated rounds (10 for fedavg (b\\#2), fed\\_x\\&y\\% (b\\#2))"
    assert window in caption.group(1)
    assert "over 3 seeds" in caption.group(1)


def test_paired_columns(tmp_path):
    path = write_latex(records(), Options(last=10), tmp_path, "report", paired=True)
    assert path == tmp_path / "report.tex"
    tex = path.read_text()
    assert "\\begin{tabular}{lcccc}" in tex
    assert "\\multicolumn{2}{c}{beta\\_0.1} & \\multicolumn{2}{c}{b\\#2}" in tex
    assert "\\cmidrule(lr){2-3} \\cmidrule(lr){4-5}" in tex
    rows = {r[0]: r[1:] for r in body_rows(tex)}
    assert rows["fedavg"][1] == "---"  # the reference
    # diffs +1, +2, -1: mean +0.67, interval [-3.13, +4.46] (tests/test_intervals.py)
    assert rows["fedfm"][1] == "$+0.67$ {\\scriptsize $[-3.13, +4.46]$}"
    assert "Student-t interval" in tex


def test_report_and_compare_write_tex_beside_the_markdown(tmp_path, capsys):
    """The CLI's flags, on a folder of two finished runs written here."""
    grid = tmp_path / "grid"
    write_run(grid / "fedavg-s0", "fedavg", [40, 50])
    write_run(grid / "fed_prox-s0", "fedprox", [45, 55])
    out = tmp_path / "out"
    assert main(["report", str(grid), "-o", str(out), "--latex-paired"]) == 0
    said = capsys.readouterr().out
    assert f"LaTeX table (booktabs): {out / 'report.tex'}" in said
    rows = {r[0]: r for r in body_rows((out / "report.tex").read_text())}
    assert rows["fed\\_prox"][1] == "$\\mathbf{50.00}$"  # mean of the last 2, one seed
    assert rows["fed\\_prox"][2] == "$+5.00$ {\\scriptsize (1 seed)}"
    assert main(["compare", "--report-only", "-o", str(grid), "--latex"]) == 0
    assert f"LaTeX table (booktabs): {grid / 'comparison.tex'}" in capsys.readouterr().out
    assert (grid / "comparison.tex").read_text().count("\\bottomrule") == 1


@pytest.mark.skipif(shutil.which("pdflatex") is None, reason="pdflatex is not installed")
def test_the_table_compiles(tmp_path):
    write_latex(records(), Options(last=10), tmp_path, "table", paired=True)
    doc = tmp_path / "doc.tex"
    doc.write_text(
        "\\documentclass{article}\\usepackage{booktabs}\\begin{document}"
        "\\input{table.tex}\\end{document}\n"
    )
    done = subprocess.run(
        ["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "doc.tex"],
        cwd=tmp_path,
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout.decode(errors="replace")[-2000:]
    assert Path(tmp_path / "doc.pdf").is_file()
