"""A one-run report (report.md with its curves, and a self-contained report.html) for the
trackers to keep with their run, made from the run folder's files as ``fedskew report``
makes its reports."""

from __future__ import annotations

from pathlib import Path

from fedskew.report.document import Block, Heading, Image, Mono, Para, write_report
from fedskew.report.plots import curves_png
from fedskew.report.runs import read_run
from fedskew.report.tables import Options, configuration_blocks, per_run_table, provenance_table


def write_run_report(folder: Path, out: Path) -> tuple[Path, Path]:
    record = read_run(folder)
    blocks: list[Block] = [
        Heading(1, f"fedskew run {folder.name}"),
        Para(
            [
                "From the run folder ",
                Mono(str(folder)),
                " (its config.json, metrics.jsonl, summary.json and processes.jsonl); the "
                "full report: ",
                Mono(f"fedskew report {folder}"),
                ".",
            ]
        ),
    ]
    png = curves_png([record])
    if png is not None:
        blocks.append(Image("curves.png", png, "Test accuracy and loss of the global model."))
    blocks += [Heading(2, "Result"), per_run_table([record], Options(reference=None))]
    blocks += configuration_blocks([record])
    blocks += [Heading(2, "Where the numbers came from"), provenance_table([record])]
    return write_report(blocks, out, "report", f"fedskew run {folder.name}")
