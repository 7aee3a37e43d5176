"""BENCHMARKS.md is what benchmarks/make_benchmarks_md.py writes from benchmarks/results/, and it
opens with a one-screen summary whose every figure benchmarks/benchmarks_summary.py computes
from those result files, each row linked to a section of the file."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import benchmarks_summary as summary  # noqa: E402
import make_benchmarks_md  # noqa: E402

sys.path.remove(str(ROOT / "benchmarks"))

SCREEN = 30  # lines: the summary fits on one screen


def _text() -> str:
    return (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")


def _summary_block(text: str) -> list[str]:
    return text.split("\n## Summary\n", 1)[1].split("\n## ", 1)[0].strip().split("\n")


def test_benchmarks_md_is_what_the_script_writes() -> None:
    assert _text() == make_benchmarks_md.render(), (
        "BENCHMARKS.md differs from the result files: run python benchmarks/make_benchmarks_md.py"
    )


def test_it_opens_with_the_summary_on_one_screen() -> None:
    text = _text()
    headings = re.findall(r"^## .*", text, re.M)
    assert headings[0] == "## Summary"
    block = _summary_block(text)
    assert block == summary.summary_lines()[2:-1]  # without its heading and trailing blank
    assert len(block) <= SCREEN
    rows = [line for line in block if line.startswith("| ") and not line.startswith("| what")]
    topics = " ".join(row.split(" | ")[0] for row in rows)
    for needed in ("Flower", "GPU speed", "accuracy cost"):
        assert needed in topics


def test_every_summary_row_links_to_a_section_of_the_file() -> None:
    text = _text()
    anchors = {summary.slug(h) for h in re.findall(r"^#+ (.*)", text, re.M)}
    rows = [line for line in _summary_block(text) if line.startswith("| ") and "](#" in line]
    assert len(rows) >= 6
    for row in rows:
        for target in re.findall(r"\]\(#([^)]+)\)", row):
            assert target in anchors, f"no section #{target}"


def test_no_issue_numbers_in_headings_or_summary() -> None:
    text = _text()
    jargon = re.compile(r"\bissues?[ -]?\d+", re.I)
    assert not [h for h in re.findall(r"^#+ .*", text, re.M) if jargon.search(h)]
    assert not jargon.search("\n".join(_summary_block(text)))
    opening = text.split("\n## ", 3)[:3]  # the title, the summary, how the file is made
    assert not jargon.search("\n".join(opening))


def test_summary_figures_come_from_the_result_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Change one measured figure in a copy of the results: the summary must follow it.
    copy = tmp_path / "results"
    shutil.copytree(summary.RESULTS, copy, ignore=shutil.ignore_patterns("baselines", "methods"))
    side = json.loads((copy / "flower_side_by_side.json").read_text())
    first = side["comparisons"]["idle"][0]
    assert first["denominator"] == "flower-docs"
    first["ratio"] = 3.21
    (copy / "flower_side_by_side.json").write_text(json.dumps(side))
    before = "\n".join(summary.summary_lines())
    monkeypatch.setattr(summary, "RESULTS", copy)
    after = "\n".join(summary.summary_lines())
    assert "**3.21x idle**" in after and "**3.21x idle**" not in before
