"""Paper tables: `fedskew report --latex` and compare's comparison.tex, read back by parsing
the booktabs table (and compiled where pdflatex is installed)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from fake_runs import FM_OFF, record, write_run

from fedskew.apps.cli import main
from fedskew.report.latex import comparison_latex, escape, write_latex
from fedskew.report.latex_style import TableStyle
from fedskew.report.statistic import Statistic
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


def test_style_names_statistic_digits_and_bold():
    """Display names (escaped), the final or the best accuracy instead of the last rounds,
    the digits, and bold decided on the means as printed with those digits."""
    recs = [
        record("fedavg", 0, [40, 60, 50]),
        record("fedavg", 1, [44, 62, 52]),
        record("fedfm", 0, [41, 58, 56]),
        record("fedfm", 1, [45, 59, 54]),
    ]
    names = {"fedfm": "FedFM_v2", "fedavg": "FedAvg"}
    final = comparison_latex(recs, Options(), style=TableStyle(names, Statistic("final"), 1))
    rows = {r[0]: r[1] for r in body_rows(final)}
    assert rows == {"FedAvg": "$51.0 \\pm 1.4$", "FedFM\\_v2": "$\\mathbf{55.0 \\pm 1.4}$"}
    assert "accuracy at the final evaluated round" in final
    best = comparison_latex(recs, Options(), style=TableStyle(names, Statistic("best"), 3))
    rows = {r[0]: r[1] for r in body_rows(best)}
    assert rows == {"FedAvg": "$\\mathbf{61.000 \\pm 1.414}$", "FedFM\\_v2": "$58.500 \\pm 0.707$"}
    assert "the best accuracy over the evaluated rounds" in best
    # The last 2 rounds: fedavg 55.0 and 57.0 (56.0), fedfm 57.0 and 56.5 (56.75).
    last = comparison_latex(recs, Options(), style=TableStyle(statistic=Statistic("last", 2)))
    assert {r[0]: r[1] for r in body_rows(last)}["fedfm"] == "$\\mathbf{56.75 \\pm 0.35}$"
    assert "mean of the last 2 evaluated rounds" in last
    # With no digits both print 56 and 57: 57 alone bold; at the final round 51 vs 55.
    tied = comparison_latex(
        recs, Options(), style=TableStyle(statistic=Statistic("last", 2), digits=0)
    )
    assert {r[0]: r[1] for r in body_rows(tied)} == {"fedavg": "$56 \\pm 1$",
                                                     "fedfm": "$\\mathbf{57 \\pm 0}$"}  # fmt: skip
    plain = comparison_latex(recs, Options(), style=TableStyle(bold=False))
    assert "\\mathbf" not in plain and "in bold" not in plain


def test_ties_as_printed_are_bold_together():
    recs = [record("a", 0, [50.004]), record("b", 0, [49.996]), record("c", 0, [49.9])]
    tex = comparison_latex(recs, Options(reference=None), style=TableStyle(digits=2))
    rows = {r[0]: r[1] for r in body_rows(tex)}
    assert rows == {"a": "$\\mathbf{50.00}$", "b": "$\\mathbf{50.00}$", "c": "$49.90$"}
    tex = comparison_latex(recs, Options(reference=None), style=TableStyle(digits=3))
    assert [r[0] for r in body_rows(tex) if "mathbf" in r[1]] == ["a"]


def test_paired_column_of_the_statistic():
    recs = []
    for seed, (ref, other) in enumerate(((50, 53), (52, 53), (54, 58))):
        recs.append(record("fedavg", seed, [ref, ref - 10]))
        recs.append(record("fedfm", seed, [other, other - 11]))
    style = TableStyle({"fedavg": "FedAvg"}, Statistic("best"), digits=1)
    tex = comparison_latex(recs, Options(), paired=True, style=style)
    # best-accuracy differences +3, +1, +4: mean +2.67; interval as tests/test_intervals.py
    rows = {r[0]: r for r in body_rows(tex)}
    assert rows["fedfm"][2].startswith("$+2.7$ {\\scriptsize $[")
    assert "$\\Delta$ FedAvg" in tex and "paired difference to FedAvg" in tex
    final = comparison_latex(
        recs, Options(), paired=True, style=TableStyle(statistic=Statistic("final"))
    )
    # final accuracies 40, 42, 44 against 42, 42, 47: differences +2, 0, +3, mean +1.67
    assert {r[0]: r for r in body_rows(final)}["fedfm"][2].startswith("$+1.67$")


def test_style_options_on_the_command_line(tmp_path, capsys):
    grid = tmp_path / "grid"
    write_run(grid / "fedavg-s0", "fedavg", [40, 50, 45])
    write_run(grid / "fed_prox-s0", "fedprox", [45, 55, 44])
    out = tmp_path / "out"
    args = ["report", str(grid), "-o", str(out), "--latex", "--statistic", "best",
            "--digits", "1", "--display-name", "fed_prox=FedProx", "--no-bold"]  # fmt: skip
    assert main(args) == 0
    rows = {r[0]: r[1] for r in body_rows((out / "report.tex").read_text())}
    assert rows == {"fedavg": "$50.0$", "FedProx": "$55.0$"}
    # --last on the report: the mean of the last 2 rounds.
    assert main(["report", str(grid), "-o", str(out), "--latex", "--last", "2"]) == 0
    rows = {r[0]: r[1] for r in body_rows((out / "report.tex").read_text())}
    assert rows == {"fedavg": "$47.50$", "fed\\_prox": "$\\mathbf{49.50}$"}
    # compare: a LaTeX style option writes comparison.tex without --latex.
    capsys.readouterr()
    args = ["compare", "--report-only", "-o", str(grid), "--statistic", "final", "--digits", "3",
            "--display-name", "fedavg=FedAvg"]  # fmt: skip
    assert main(args) == 0
    assert f"LaTeX table (booktabs): {grid / 'comparison.tex'}" in capsys.readouterr().out
    rows = {r[0]: r[1] for r in body_rows((grid / "comparison.tex").read_text())}
    assert rows == {"FedAvg": "$\\mathbf{45.000}$", "fed\\_prox": "$44.000$"}


def test_display_names_of_the_compare_file_reach_the_report(tmp_path):
    grid = tmp_path / "grid"
    write_run(grid / "fedavg-s0", "fedavg", [40, 50])
    write_run(grid / "fed_prox-s0", "fedprox", [45, 55])
    spec = tmp_path / "cmp.toml"
    spec.write_text(
        '[compare]\ndisplay_names = {fed_prox = "FedProx (mu 0.01)", fedavg = "FedAvg"}\n'
        '[methods.fedavg]\n[methods.fed_prox]\nalgorithm = "fedprox"\n'
    )
    assert main(["compare", "-c", str(spec), "--report-only", "-o", str(grid), "--latex"]) == 0
    manifest = json.loads((grid / "compare.json").read_text())
    assert manifest["display_names"] == {"fed_prox": "FedProx (mu 0.01)", "fedavg": "FedAvg"}
    assert {r[0] for r in body_rows((grid / "comparison.tex").read_text())} == {
        "FedAvg", "FedProx (mu 0.01)"
    }  # fmt: skip
    out = tmp_path / "out"
    # The command line's name wins over the file's, for that method only.
    assert main(["report", str(grid), "-o", str(out), "--latex", "--display-name",
                 "fedavg=Avg"]) == 0  # fmt: skip
    assert {r[0] for r in body_rows((out / "report.tex").read_text())} == {
        "Avg", "FedProx (mu 0.01)"
    }  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--display-name", "fedfm"],
            "--display-name takes NAME=LABEL (e.g. fedfm=FedFM), got 'fedfm'",
        ),
        (["--display-name", "=FedFM"], "--display-name takes NAME=LABEL"),
        (["--digits", "9"], "digits must be between 0 and 6, got 9"),
        (["--last", "0"], "last must be a positive integer, got 0"),
    ],
)
def test_bad_style_options_are_one_line_errors(tmp_path, capsys, args, message):
    grid = tmp_path / "grid"
    write_run(grid / "fedavg-s0", "fedavg", [40, 50])
    assert main(["report", str(grid), "-o", str(tmp_path / "o"), "--latex", *args]) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedskew: error: ") and message in err and "\n" not in err


def test_bad_display_names_in_a_compare_file(tmp_path, capsys):
    spec = tmp_path / "cmp.toml"
    spec.write_text("[compare]\ndisplay_names = {fedavg = 3}\n[methods.fedavg]\n")
    assert main(["compare", "-c", str(spec), "--report-only", "-o", str(tmp_path / "g")]) != 0
    err = capsys.readouterr().err.strip()
    assert "display_names maps method names to labels (strings)" in err and "\n" not in err
