"""``fedskew report RUN_OR_GRID_DIR``: a Markdown and a self-contained HTML report, rebuilt
from run folders alone.

It holds the configuration, the partition heatmap of each setting, accuracy and loss curves
(all methods in one plot, mean over seeds with a min-max band), the comparison and cost
tables, the per-class accuracy (heatmap and table, the global minority / majority split),
the accuracy on each client's local-majority, local-minority and absent classes, the
accuracy across clients (table and box plot), the other metrics the runs logged (personal
accuracy, feature quality, ... when present), the t-SNE pictures the runs wrote
(``*tsne*.png`` in a run folder), and which machine, device, versions, data source and git
commit produced each run. A fact a run folder does not record is printed as "not recorded".
The per-class, per-client and LaTeX tables show each run's value at one statistic (the
final round, the best round, or the mean of the last rounds: ``--statistic``); their CSV
and LaTeX files go beside the pictures, in ``report_files/``.

The partition heatmap needs the class labels of the training set: the run's partition.npz
(or, where the folder lacks it, the partition rebuilt from the run's configuration, which
is a pure function of it) is counted against the dataset's labels, read from local files
only. Where the dataset is not available here the heatmap is left out, with the reason.

The folder may come from someone else and the report goes to others: only regular files
inside the folder are read (``fedskew.report.files``), a run with a damaged file is left out
and named at the top ("Left out") and on stderr, every name is escaped for the format it is
written in (``fedskew.report.document``, ``fedskew.report.latex``), and no code the folder
names is imported (``fedskew.apps.class_counts.partition_counts``).
"""

from __future__ import annotations

import dataclasses
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedskew.apps.class_counts import (
    COUNT_ERRORS,
    ClientCounts,
    PartitionCounts,
    class_names_of,
    first_line,
    partition_counts,
)
from fedskew.assembly.prepare import load_experiment_data
from fedskew.core.errors import FedskewError
from fedskew.grid.tables import gather, manifest_options
from fedskew.report.client_spread import client_spread_blocks
from fedskew.report.document import Block, Bullets, Heading, Image, Mono, Para, write_report
from fedskew.report.files import Damaged
from fedskew.report.latex import write_latex
from fedskew.report.latex_style import TableStyle
from fedskew.report.local_split import local_split_section
from fedskew.report.per_class import per_class_section
from fedskew.report.plots import curves_png, partition_png
from fedskew.report.run_status import count_line
from fedskew.report.runs import RunRecord
from fedskew.report.statistic import Statistic
from fedskew.report.tables import (
    Options,
    comparison_blocks,
    configuration_blocks,
    explanation,
    per_run_table,
    provenance_table,
)
from fedskew.runs.folder import config_from_saved
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
        cfg = config_from_saved(rec.config, rec.folder)
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


def tsne_blocks(records: list[RunRecord], left_out: list[str]) -> list[Block]:
    """The t-SNE pictures of the first seed of each method that has them; a picture that
    may not be read (a link out of the folder, not a regular file, not a PNG) is named in
    its place and in ``left_out``."""
    blocks: list[Block] = []
    shown: set[tuple[str, str]] = set()
    for rec in records:
        if not rec.images or (rec.setting, rec.method) in shown:
            continue
        shown.add((rec.setting, rec.method))
        for path in rec.images:
            rel = path.relative_to(rec.folder)
            try:
                png = rec.reader.picture(path)
            except Damaged as exc:
                left_out.append(str(exc))
                blocks.append(Para(f"Not embedded: {exc}."))
                continue
            name = f"{rec.setting}_{rec.method}-s{rec.seed}_{rel.as_posix()}"
            caption = f"{rec.method}, seed {rec.seed}" + (
                f", setting {rec.setting}" if rec.setting else ""
            )
            blocks.append(Image(name.lstrip("_"), png, f"{caption}: {rel}"))
    return blocks


def left_out_blocks(left_out: list[str]) -> list[Block]:
    if not left_out:
        return []
    return [
        Heading(2, "Left out"),
        Para(
            "Not read, or read and not used: the report is made of the other runs and files "
            "(only regular files inside the folder are read, a run with a damaged file is "
            "left out whole)."
        ),
        Bullets(list(left_out)),
    ]


def report_blocks(
    root: Path,
    records: list[RunRecord],
    options: Options,
    left_out: list[str] | None = None,
    style: TableStyle | None = None,
) -> list[Block]:
    """The report's blocks; ``left_out`` (what was not read or used, one line each) gets
    its section at the top, and the pictures not embedded are added to it. ``style``: the
    statistic of the per-class and per-client tables and how the LaTeX tables are written
    (default: the mean of the last ``options.last`` rounds)."""
    left_out = [] if left_out is None else left_out
    states = count_line([r.status for r in records])
    style = style if style is not None else TableStyle(statistic=Statistic("last", options.last))
    statistic = style.statistic
    settings = _by_setting(records)
    methods = list(dict.fromkeys(r.method for r in records))
    seeds = sorted({r.seed for r in records})
    intro: list[Block] = [
        Heading(1, f"fedskew report: {root.resolve().name}"),
        Para(
            [
                f"{len(methods)} method(s) ({', '.join(methods)}) x {len(settings)} setting(s) "
                f"x seeds {', '.join(map(str, seeds))}: {len(records)} run folder(s) under ",
                Mono(str(root)),
                f": {states}. Rebuilt from the run folders' files alone by fedskew "
                f"{__version__} on {time.strftime('%Y-%m-%d %H:%M %Z')}; rebuild with ",
                Mono(shlex.join(["fedskew", "report", str(root)])),
                ".",
            ]
        ),
    ]
    blocks: list[Block] = [Heading(2, "Results"), Para(explanation(options))]
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
                "method's seeds, band from the lowest to the highest seed; runs that diverged "
                "or failed are left out of the mean and counted in the legend.",
            )
        )
    datasets = _Datasets()
    counts = PartitionCounts(datasets.load)
    blocks += per_class_section(settings, counts, class_names_of, statistic, _title, style=style)
    blocks += local_split_section(
        settings, ClientCounts(datasets.load), statistic, _title, style=style
    )
    blocks += client_spread_blocks(settings, _title, statistic=statistic, style=style)
    tsne = tsne_blocks(records, left_out)
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
    return intro + left_out_blocks(left_out) + blocks


@dataclass
class Written:
    """What ``fedskew report`` wrote, and what it left out (one line each)."""

    md: Path
    page: Path
    left_out: list[str]


@dataclass
class TableChoices:
    """What the command line chose for the per-class, per-client and LaTeX tables; None:
    the grid's (compare.json) or the default."""

    statistic: str | None = None  # final, best or last
    last: int | None = None  # rounds averaged by "last" (default: compare.json's, else 10)
    names: dict[str, str] | None = None  # display names, over compare.json's
    digits: int = 2
    bold: bool = True


def table_style(
    choices: TableChoices, options: Options, manifest: dict[str, Any] | None
) -> TableStyle:
    """The style of ``choices`` over the grid's display names; ``options.last`` is the
    window of "last" (already ``choices.last`` where given)."""
    names = dict(manifest_display_names(manifest))
    names.update(choices.names or {})
    statistic = Statistic(choices.statistic or "last", options.last)
    return TableStyle(names, statistic, choices.digits, choices.bold)


def manifest_display_names(manifest: dict[str, Any] | None) -> dict[str, str]:
    """The display names compare.json records (its [compare] display_names; checked when
    it was read, ``fedskew.report.checks``)."""
    return dict((manifest or {}).get("display_names") or {})


def make_report(
    root: Path,
    out: Path | None = None,
    latex: bool = False,
    latex_paired: bool = False,
    choices: TableChoices | None = None,
) -> Written:
    """Write ``report.md`` (pictures, CSV and LaTeX tables in ``report_files/``) and
    ``report.html`` into ``out`` (default: the folder itself). With ``latex`` also
    ``report.tex`` beside them (``fedskew.report.latex.latex_path``), the paired differences
    to the reference in it with ``latex_paired``. ``choices``: the statistic and the LaTeX
    style. Runs with a damaged file are left out (named in the report and in
    ``Written.left_out``); a one-line error when no run is left."""
    choices = choices or TableChoices()
    root = Path(root)
    folder = Path(out) if out else root
    scan = gather(root)
    if not scan.records:
        more = f" (and {len(scan.left_out) - 1} more)" if len(scan.left_out) > 1 else ""
        raise FedskewError(f"no usable run in {root}: {scan.left_out[0]}{more}")
    options = manifest_options(scan.manifest, Options())
    if choices.last is not None:
        options = dataclasses.replace(options, last=choices.last)
    if len({r.method for r in scan.records}) < 2:
        options = dataclasses.replace(options, reference=None)
    style = table_style(choices, options, scan.manifest)
    blocks = report_blocks(root, scan.records, options, scan.left_out, style)
    md, page = write_report(blocks, folder, "report", f"fedskew report: {root}")
    if latex:
        write_latex(scan.records, options, folder, "report", paired=latex_paired, style=style)
    return Written(md, page, scan.left_out)
