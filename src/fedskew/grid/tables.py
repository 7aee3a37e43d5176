"""What a grid folder records: its plan (``compare.json``, which ``fedskew report`` reads)
and the tables of its finished runs (``comparison.md``/.html/.csv, ``runs.csv``)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from fedskew.core.durable import remove_stale_temps, write_bytes_durably
from fedskew.core.errors import FedskewError
from fedskew.grid.plan import Grid, PlannedRun
from fedskew.report.document import Block, Heading, Mono, Para, write_report
from fedskew.report.files import FolderFiles
from fedskew.report.latex import write_latex
from fedskew.report.latex_style import TableStyle
from fedskew.report.runs import MANIFEST, MANIFEST_FORMAT, RunRecord, Scan, read_manifest, scan_runs
from fedskew.report.tables import (
    Options,
    comparison_blocks,
    comparison_csv,
    configuration_blocks,
    explanation,
    per_run_table,
    provenance_table,
    runs_csv,
)
from fedskew.runs.checkpoint import read_checkpoint
from fedskew.training.protocol import largest_state


def manifest(grid: Grid, runs: list[PlannedRun], command: str) -> dict[str, Any]:
    return {
        "format": MANIFEST_FORMAT,
        "command": command,
        "source": grid.source,
        "seeds": grid.seeds,
        "reference": grid.options.reference,
        "last": grid.options.last,
        "target": grid.options.target,
        "display_names": grid.display_names,
        "base": grid.base,
        "settings": grid.settings,
        "methods": grid.methods,
        "runs": [
            {"setting": r.setting, "method": r.method, "seed": r.seed, "folder": r.folder}
            for r in runs
        ],
    }


def client_state_memory(folder: Path, files: FolderFiles | None = None) -> tuple[int, int] | None:
    """(largest client's state in bytes, clients with state) in the folder's checkpoint,
    or None when it has no checkpoint; read only where ``files`` (default: the folder's own)
    may read it, a one-line error otherwise."""
    path = folder / "checkpoint.npz"
    files = files if files is not None else FolderFiles(folder)
    if not files.exists(path):
        return None
    files.check(path, "checkpoint")
    return largest_state(read_checkpoint(path).clients)


def recorded_client_state(rec: RunRecord) -> tuple[int, int] | None:
    """The same pair from the finished run's summary, which holds it from the end of the run
    without loading the checkpoint's arrays; else from the checkpoint (runs whose summary
    predates the record); else None."""
    summary = rec.summary or {}
    size, count = summary.get("client_state_bytes_max"), summary.get("clients_with_state")
    if isinstance(size, int) and isinstance(count, int):
        return size, count
    return client_state_memory(rec.folder, rec.reader)


def gather(root: Path) -> Scan:
    """The run folders under ``root`` read back (``fedskew.report.runs.scan_runs``), each
    with its largest client state; a run whose checkpoint cannot be read is left out."""
    scan = scan_runs(root)
    for rec in list(scan.records):
        try:
            memory = recorded_client_state(rec)
        except FedskewError as exc:
            scan.leave_out(rec, str(exc))
            continue
        if memory is not None:
            rec.client_state_bytes, rec.client_state_clients = memory
    return scan


def collect(root: Path) -> list[RunRecord]:
    """The grid's run folders read back, with each run's largest client state; the tables
    of a grid need every run, so what :func:`gather` leaves out is a one-line error."""
    scan = gather(root)
    if scan.left_out:
        raise FedskewError(scan.left_out[0])
    return scan.records


def table_blocks(records: list[RunRecord], options: Options, command: str) -> list[Block]:
    blocks: list[Block] = [
        Heading(1, "Comparison"),
        Para(
            [
                "Computed from the run folders by ",
                Mono(command),
                ": every number below comes from their config.json, metrics.jsonl, "
                "summary.json, processes.jsonl, partition.npz and checkpoint.npz.",
            ]
        ),
        Para(explanation(options)),
    ]
    blocks += comparison_blocks(records, options)
    blocks += configuration_blocks(records)
    blocks += [Heading(2, "Every run"), per_run_table(records, options)]
    blocks += [Heading(2, "Where each run's numbers came from"), provenance_table(records)]
    return blocks


def write_tables(
    root: Path,
    records: list[RunRecord],
    options: Options,
    command: str,
    latex: bool = False,
    latex_paired: bool = False,
    style: TableStyle | None = None,
) -> Path:
    """``comparison.md`` (+ .html), ``comparison.csv`` and ``runs.csv`` in the grid folder;
    with ``latex`` also ``comparison.tex`` (booktabs; the paired differences in it with
    ``latex_paired``; names, statistic, digits and bold as ``style`` says)."""
    md, _ = write_report(table_blocks(records, options, command), root, "comparison", "Comparison")
    write_bytes_durably(root / "comparison.csv", comparison_csv(records, options).encode())
    write_bytes_durably(root / "runs.csv", runs_csv(records, options).encode())
    if latex:
        write_latex(records, options, root, "comparison", paired=latex_paired, style=style)
    return md


def options_from_manifest(root: Path, fallback: Options) -> Options:
    """The summary options the grid was planned with (its compare.json, checked), else
    ``fallback``."""
    return manifest_options(read_manifest(root), fallback)


def display_names_from_manifest(root: Path) -> dict[str, str]:
    """The display names the grid's compare.json records (none where it has none)."""
    manifest = read_manifest(root)
    return dict((manifest or {}).get("display_names") or {})


def manifest_options(manifest: dict[str, Any] | None, fallback: Options) -> Options:
    if manifest is None:
        return fallback
    return Options(
        reference=manifest.get("reference"),
        last=manifest.get("last", 10),
        target=manifest.get("target"),
    )


def command_line(argv: list[str]) -> str:
    """The command as typed (``argv`` from the subcommand on)."""
    return shlex.join(["fedskew", *argv])


def write_manifest(root: Path, plan_record: dict[str, Any]) -> None:
    remove_stale_temps(root)  # of a compare killed mid-write; another compare's live ones stay
    text = json.dumps(plan_record, indent=2, default=str) + "\n"
    write_bytes_durably(root / MANIFEST, text.encode("utf-8"))
