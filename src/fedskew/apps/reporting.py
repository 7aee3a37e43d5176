"""``fedskew report RUN_OR_GRID_DIR``: a Markdown and a self-contained HTML report, rebuilt
from run folders alone.

It holds the configuration, the partition heatmap of each setting, accuracy and loss curves
(all methods in one plot, mean over seeds with a min-max band), the comparison and cost
tables, the other metrics the runs logged (personal accuracy, feature quality, ... when
present), the t-SNE pictures the runs wrote (``*tsne*.png`` in a run folder), and which
machine, device, versions, data source and git commit produced each run. A fact a run
folder does not record is printed as "not recorded".

The partition heatmap needs the class labels of the training set: the run's partition.npz
(or, where the folder lacks it, the partition rebuilt from the run's configuration, which
is a pure function of it) is counted against the dataset's labels, read from local files
only. Where the dataset is not available here the heatmap is left out, with the reason.
"""

from __future__ import annotations

import dataclasses
import shlex
import time
from pathlib import Path
from typing import Any

import numpy as np

from fedskew.apps.class_counts import (
    COUNT_ERRORS,
    PartitionCounts,
    class_names_of,
    first_line,
    partition_counts,
)
from fedskew.apps.compare import collect, options_from_manifest
from fedskew.assembly.prepare import load_experiment_data
from fedskew.report.client_spread import client_spread_blocks
from fedskew.report.document import Block, Heading, Image, Mono, Para, write_report
from fedskew.report.latex import write_latex
from fedskew.report.per_class import per_class_section
from fedskew.report.plots import curves_png, partition_png
from fedskew.report.runs import RunRecord
from fedskew.report.tables import (
    Options,
    comparison_blocks,
    configuration_blocks,
    explanation,
    per_run_table,
    provenance_table,
)
from fedskew.runs.folder import saved_config
from fedskew.version import __version__


def _by_setting(records: list[RunRecord]) -> dict[str, list[RunRecord]]:
    out: dict[str, list[RunRecord]] = {}
    for rec in records:
        out.setdefault(rec.setting, []).append(rec)
    return out


def _title(setting: str) -> str:
    return f"setting {setting}" if setting else "all runs"


class _Datasets:
    """Datasets loaded for partition counts, once each, from local files only."""

    def __init__(self) -> None:
        self.cache: dict[str, Any] = {}

    def load(self, cfg) -> Any:
        key = repr((cfg.dataset, cfg.data_dir, cfg.num_clients, cfg.seed,
                    cfg.synthetic_alpha, cfg.synthetic_beta))  # fmt: skip
        if key not in self.cache:
            self.cache[key] = load_experiment_data(dataclasses.replace(cfg, download=False))
        return self.cache[key]


def partition_block(rec: RunRecord, datasets: _Datasets) -> list[Block]:
    """The heatmap of one run's partition, or a line saying why it is not drawn."""
    try:
        counts, where = partition_counts(rec, datasets.load)
        cfg = saved_config(rec.folder)
        class_names = datasets.load(cfg).class_names
    except COUNT_ERRORS as exc:
        return [Para(f"Partition heatmap not drawn: {first_line(exc)}")]
    sizes = counts.sum(axis=1)
    held = (counts > 0).sum(axis=1)
    params = " ".join(f"{k}={v}" for k, v in cfg.partition_params.items())
    title = f"{cfg.dataset}: {cfg.partition}{' ' + params if params else ''}, seed {cfg.seed}"
    png = partition_png(counts, title, class_names)
    name = f"partition-{rec.setting or 'all'}-s{rec.seed}.png".replace("/", "_")
    caption = (
        f"Partition of seed {rec.seed} ({where}), {len(counts)} clients: samples per client "
        f"{sizes.min()}-{sizes.max()} (median {int(np.median(sizes))}), classes per client "
        f"{held.min()}-{held.max()} (mean {held.mean():.2f})."
    )
    return [Image(name, png, caption)]


def tsne_blocks(records: list[RunRecord]) -> list[Block]:
    """The t-SNE pictures of the first seed of each method that has them."""
    blocks: list[Block] = []
    shown: set[tuple[str, str]] = set()
    for rec in records:
        if not rec.images or (rec.setting, rec.method) in shown:
            continue
        shown.add((rec.setting, rec.method))
        for path in rec.images:
            rel = path.relative_to(rec.folder)
            name = f"{rec.setting}_{rec.method}-s{rec.seed}_{rel.as_posix()}"
            caption = f"{rec.method}, seed {rec.seed}" + (
                f", setting {rec.setting}" if rec.setting else ""
            )
            blocks.append(Image(name.lstrip("_"), path.read_bytes(), f"{caption}: {rel}"))
    return blocks


def report_blocks(root: Path, records: list[RunRecord], options: Options) -> list[Block]:
    finished = sum(r.finished for r in records)
    settings = _by_setting(records)
    methods = list(dict.fromkeys(r.method for r in records))
    seeds = sorted({r.seed for r in records})
    blocks: list[Block] = [
        Heading(1, f"fedskew report: {root.resolve().name}"),
        Para(
            [
                f"{len(methods)} method(s) ({', '.join(methods)}) x {len(settings)} setting(s) "
                f"x seeds {', '.join(map(str, seeds))}: {len(records)} run folder(s) under ",
                Mono(str(root)),
                f", {finished} finished. Rebuilt from the run folders' files alone by fedskew "
                f"{__version__} on {time.strftime('%Y-%m-%d %H:%M %Z')}; rebuild with ",
                Mono(shlex.join(["fedskew", "report", str(root)])),
                ".",
            ]
        ),
        Heading(2, "Results"),
        Para(explanation(options)),
    ]
    blocks += comparison_blocks(records, options, heading_level=3)
    blocks.append(Heading(2, "Curves"))
    for setting, recs in settings.items():
        png = curves_png(recs, title=_title(setting) if len(settings) > 1 else "")
        if png is None:
            blocks.append(Para(f"No evaluated round yet ({_title(setting)})."))
            continue
        name = f"curves-{setting or 'all'}.png".replace("/", "_")
        blocks.append(
            Image(
                name,
                png,
                "Test accuracy and loss of the global model per round: mean over each "
                "method's seeds, band from the lowest to the highest seed.",
            )
        )
    datasets = _Datasets()
    counts = PartitionCounts(datasets.load)
    blocks += per_class_section(settings, counts, class_names_of, options.last, _title)
    blocks += client_spread_blocks(settings, _title)
    tsne = tsne_blocks(records)
    if tsne:
        blocks.append(Heading(2, "t-SNE of test features"))
        blocks += tsne
    blocks.append(Heading(2, "Partition"))
    for setting, recs in settings.items():
        if len(settings) > 1:
            blocks.append(Heading(3, _title(setting)))
        first = min(recs, key=lambda r: r.seed)
        blocks += partition_block(first, datasets)
    blocks += configuration_blocks(records)
    blocks.append(Heading(2, "Runs"))
    blocks.append(per_run_table(records, options))
    blocks.append(Heading(2, "Where each run's numbers came from"))
    blocks.append(
        Para(
            "From each run's processes.jsonl (one line per process that computed rounds) and "
            'config.json; "not recorded" where the run folder does not say.'
        )
    )
    blocks.append(provenance_table(records))
    return blocks


def make_report(
    root: Path, out: Path | None = None, latex: bool = False, latex_paired: bool = False
) -> tuple[Path, Path]:
    """Write ``report.md`` (pictures in ``report_files/``) and ``report.html`` into ``out``
    (default: the folder itself); returns their paths. With ``latex`` also ``report.tex``
    beside them (``fedskew.report.latex.latex_path``), the paired differences to the
    reference in it with ``latex_paired``."""
    root = Path(root)
    folder = Path(out) if out else root
    records = collect(root)
    options = options_from_manifest(root, Options())
    if len({r.method for r in records}) < 2:
        options = dataclasses.replace(options, reference=None)
    blocks = report_blocks(root, records, options)
    paths = write_report(blocks, folder, "report", f"fedskew report: {root}")
    if latex:
        write_latex(records, options, folder, "report", paired=latex_paired)
    return paths
