"""The ``fedskew`` command line: run, list, partition, compare, tune, report, deploy."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from fedskew.apps.options import add_experiment_options, add_run_options, cli_values, raw_cli_values
from fedskew.core.errors import FedskewError, Terminated, UsageError
from fedskew.core.memory_exhaustion import is_memory_exhaustion, memory_line


def load_config(args: argparse.Namespace):
    from fedskew.config import build_config, read_config_file

    file_values = read_config_file(args.config) if args.config is not None else {}
    if getattr(args, "participation", None) is not None:
        file_values.pop("clients_per_round", None)
    if getattr(args, "clients_per_round", None) is not None:
        file_values.pop("participation", None)
    return build_config(file_values, cli_values(args))


def cmd_run(args: argparse.Namespace) -> int:
    from fedskew.apps.engine_choice import run_on_its_engine
    from fedskew.core.progress import RoundProgress

    resume = None
    if args.resume is not None:  # also --resume "": an error, never a new run
        cfg, resume = resume_config(args)
    else:
        cfg = load_config(args)
    progress = RoundProgress(cfg.rounds, f"{cfg.algorithm} on {cfg.dataset}", disable=cfg.quiet)
    notes = logging.getLogger("fedskew.execution")  # fedskew.runs.loop.notes
    handler = NoteHandler()
    level = notes.level
    if not cfg.quiet:
        notes.addHandler(handler)
        notes.setLevel(logging.INFO)
    try:
        folder, summary = run_on_its_engine(
            cfg, on_round=progress.update, resume=resume, on_start=progress.start
        )
    finally:
        progress.close()
        notes.removeHandler(handler)
        notes.setLevel(level)
    if not cfg.quiet:
        print(format_summary(summary, folder))
    return 0


class NoteHandler(logging.Handler):
    """Prints a run's notes (how it executes) as ``fedskew: ...`` lines on stderr, before
    the progress bar starts."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(f"fedskew: {one_line(record.getMessage())}", file=sys.stderr, flush=True)
        except Exception:
            self.handleError(record)


def cmd_deploy(args: argparse.Namespace) -> int:
    # Flower's command line does the work: this imports no Flower (a missing flwr command
    # is a one-line error there).
    from fedskew.apps.flower.submit import deploy

    app = Path(args.app) if args.app else None
    if app is not None and not (app / "pyproject.toml").is_file():
        raise UsageError(f"--app {args.app}: no Flower app there (no pyproject.toml)")
    status = deploy(args.connection, args.run_config or (), app, args.federation, torch=args.torch)
    print(f"fedskew: Flower run {status.run_id} completed", file=sys.stderr)
    return 0


def resume_config(args: argparse.Namespace):
    """The configuration saved in an unfinished run folder, with only the execution options
    of RESUME_MAY_CHANGE taken from the command line."""
    from fedskew.config import RESUME_MAY_CHANGE
    from fedskew.runs.folder import RunFolder, saved_config

    given = sorted(k for k, v in raw_cli_values(args).items() if v is not None)
    refused = [k for k in given if k not in RESUME_MAY_CHANGE]
    if refused or args.config is not None:
        names = ", ".join(refused) or "config"
        raise UsageError(f"--resume takes its configuration from the run folder; drop: {names}")
    values = {k: v for k, v in cli_values(args).items() if v is not None}
    folder = RunFolder.reopen(Path(args.resume))
    return saved_config(folder.path, values, "--resume"), folder.path


def dp_summary(summary: dict[str, Any]) -> str:
    """The DP part of the summary's privacy line: the epsilon spent (or that there is no
    guarantee), how it was accounted, and the clip norm the run ended with."""
    from fedskew.metrics.privacy_accounting import MEANINGFUL_EPSILON

    eps = summary.get("dp_epsilon")
    if eps is None:
        spent = "NO PRIVACY: epsilon infinite (dp-noise 0, clipping only)"
    else:
        spent = f"epsilon {eps:.3g} at delta {summary['dp_delta']:g}"
        if eps > MEANINGFUL_EPSILON:
            spent += f" (above {MEANINGFUL_EPSILON:g}: a weak guarantee)"
        method = summary.get("dp_accounting", "replace-one")
        spent += f", {method} accounting"
        if summary.get("dp_target_epsilon") is not None:
            spent += f", target {summary['dp_target_epsilon']:g}"
    clip = f"clip {summary['dp_clip']:g}"
    if summary.get("dp_clip_final") is not None:
        clip += f" adapted to {summary['dp_clip_final']:.3g}"
    return (
        f"{summary['dp']} DP, {spent} (noise {summary['dp_noise']:.4g}, {clip}, "
        f"{summary['dp_clipping']} clipping)"
    )


def format_summary(summary: dict[str, Any], folder: Path) -> str:
    def pct(v: float | None) -> str:
        return "n/a" if v is None else f"{100 * v:.2f} %"

    mb = 1024 * 1024
    privacy = []
    if summary.get("secure_aggregation") or summary.get("dp", "off") != "off":
        parts = ["secure aggregation"] if summary.get("secure_aggregation") else []
        if summary.get("dp", "off") != "off":
            parts.append(dp_summary(summary))
        privacy = ["  privacy: " + "; ".join(parts)]
    return "\n".join(
        [
            f"{summary['algorithm']} on {summary['dataset']} ({summary['model']}), "
            f"{summary['partition']} partition, {summary['num_clients']} clients, "
            f"{summary['clients_per_round']} per round, {summary['rounds']} rounds, "
            f"seed {summary['seed']}",
            f"  final accuracy {pct(summary['final_accuracy'])}"
            f"   best {pct(summary['best_accuracy'])}"
            f"   on clients' label distributions {pct(summary['final_client_dist_accuracy'])}",
            f"  traffic {summary['total_bytes_down'] / mb:.2f} MiB down, "
            f"{summary['total_bytes_up'] / mb:.2f} MiB up;  training "
            f"{summary['train_seconds']:.1f} s ({summary['train_samples_per_second']} samples/s);"
            f"  evaluation {summary['eval_seconds']:.1f} s",
            *privacy,
            f"  run folder: {folder}",
        ]
    )


def cmd_list(args: argparse.Namespace) -> int:
    # The catalogue reads the descriptions without importing torch (see there).
    from fedskew.apps import catalogue
    from fedskew.data.partition import PARTITIONS

    sections = [
        ("algorithms", catalogue.algorithms()),
        ("datasets", catalogue.datasets()),
        ("models", catalogue.models()),
        (
            "partitions",
            {
                n: p.description
                + (
                    " [" + ", ".join(f"{k}={v}" for k, v in p.params.items()) + "]"
                    if p.params
                    else ""
                )
                for n, p in PARTITIONS.items()
            },
        ),
    ]
    names = [s for s, _ in sections]
    unknown = [w for w in args.what if w not in names]
    if unknown:
        raise UsageError(f"nothing to list called '{unknown[0]}'; choose from: {', '.join(names)}")
    wanted = args.what or names
    for title, items in sections:
        if title not in wanted:
            continue
        print(f"{title}:")
        width = max(len(n) for n in items)
        for name in sorted(items):
            print(f"  {name.ljust(width)}  {items[name]}")
    return 0


def cmd_partition(args: argparse.Namespace) -> int:
    import numpy as np

    from fedskew.assembly.prepare import build_partition, check_names, load_experiment_data
    from fedskew.data.partition import partition_stats, save_partition

    cfg = load_config(args)
    check_names(cfg)
    if args.plot is not None:  # also "": an error, never silently no plot
        _check_output_file(args.plot)
    if args.save is not None:
        _check_output_file(args.save)
    dataset = load_experiment_data(cfg)
    partition = build_partition(cfg, dataset)
    counts = partition_stats(partition, dataset.y_train.numpy(), dataset.num_classes)
    sizes = counts.sum(axis=1)
    classes_held = (counts > 0).sum(axis=1)
    print(
        f"{cfg.partition} partition of {cfg.dataset} ({len(dataset.y_train)} training samples, "
        f"{dataset.num_classes} classes) into {len(partition)} clients, seed {cfg.seed}"
    )
    print(
        f"  samples per client: min {sizes.min()}, median {int(np.median(sizes))}, "
        f"max {sizes.max()};  classes per client: mean {classes_held.mean():.2f}, "
        f"min {classes_held.min()}, max {classes_held.max()}"
    )
    if len(partition) <= 30 and dataset.num_classes <= 20:
        header = "client " + " ".join(f"{c:>5}" for c in range(dataset.num_classes)) + "  total"
        print(header)
        for k, row in enumerate(counts):
            print(f"{k:>6} " + " ".join(f"{v:>5}" for v in row) + f"  {row.sum():>5}")
    print_class_spread(counts)
    if args.plot is not None:
        from fedskew.report.partition_plot import plot_partition

        title = f"{cfg.dataset}: {cfg.partition} {cfg.partition_params or ''}, seed {cfg.seed}"
        plot_partition(counts, Path(args.plot), title=title, class_names=dataset.class_names)
        print(f"  plot written to {args.plot}")
    if args.save is not None:
        save_partition(
            Path(args.save), partition, {"scheme": cfg.partition, **cfg.partition_params}
        )
        print(f"  partition written to {args.save}")
    return 0


def print_class_spread(counts: object) -> None:
    """Per class, how many clients hold it and the largest one's share: the view in which a
    partition can make some classes look like minority classes."""
    import numpy as np

    from fedskew.data.partition import HOLDER_SHARE, class_holders, largest_share

    holders, largest = class_holders(counts), largest_share(counts)
    num_classes = len(holders)
    print(
        f"  per class: holders = clients with >= {HOLDER_SHARE:.0%} of the class's samples, "
        "largest = the largest client's share"
    )
    if num_classes <= 20:
        print("  class   " + " ".join(f"{c:>5}" for c in range(num_classes)))
        print("  holders " + " ".join(f"{h:>5}" for h in holders))
        print("  largest " + " ".join("    -" if np.isnan(x) else f"{x:>5.2f}" for x in largest))
        return
    for name, values, form in (("holders", holders, "d"), ("largest", largest, ".2f")):
        known = np.flatnonzero(~np.isnan(values.astype(np.float64)))
        if known.size == 0:
            continue
        lo, hi = known[np.argmin(values[known])], known[np.argmax(values[known])]
        print(
            f"  {name}: min {values[lo]:{form}} (class {lo}), median "
            f"{np.median(values[known]):.2f}, max {values[hi]:{form}} (class {hi})"
        )


def _check_output_file(text: str) -> None:
    if not text or "\0" in text:
        raise UsageError(f"cannot write {text!r}: not a file name")
    path = Path(text)
    if path.is_dir():
        raise UsageError(f"cannot write {path}: it is a folder")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise FedskewError(f"cannot write {path}: folder {parent} does not exist")


def add_compare_options(p: argparse.ArgumentParser) -> None:
    """``fedskew compare``: the experiment and run options (they set the base experiment),
    then the grid's own."""
    add_experiment_options(p)
    add_run_options(p)
    for action in p._actions:
        if action.dest == "config":
            action.help = (
                "compare file (tables [compare], [experiment], [methods.NAME], [settings.NAME], "
                "[axes]) or a `fedskew run` config file as the base experiment"
            )
        elif action.dest == "out_dir":
            action.help = "the grid folder (default: [compare] out_dir, or runs/<file name>)"
    g = p.add_argument_group("grid")
    g.add_argument(
        "--methods",
        nargs="+",
        metavar="NAME",
        help="methods to run: algorithm names with their defaults, or a subset of the file's",
    )
    g.add_argument("--seeds", nargs="+", type=int, metavar="S", help="seeds (default 0)")
    g.add_argument("--reference", help="method for the paired differences (default fedavg)")
    g.add_argument("--last", type=int, help="evaluated rounds averaged (default 10)")
    g.add_argument("--target", type=float, help="accuracy in percent: rounds to reach it")
    g.add_argument("--jobs", type=int, help="runs at once, each its own process (default 1)")
    g.add_argument(
        "--threads", type=int, help="torch threads per run (default 1 on every executor, so "
        "that a grid computes the same numbers wherever it runs; jobs x threads <= cores)"
    )  # fmt: skip
    g.add_argument("--only", nargs="+", metavar="RUN", help="run only these runs (e.g. fedprox-s1)")
    g.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: rebuild the tables from the grid folder's runs",
    )
    g.add_argument(
        "--status",
        action="store_true",
        help="run and write nothing: where each run stands, who trains it, CPU time left",
    )
    g.add_argument(
        "--progress-every", type=float, default=60.0, metavar="SECONDS",
        help="where output is not a terminal: a progress line (runs done, running, left, time "
        "left) every SECONDS (default 60; 0: none); a terminal gets one line kept current",
    )  # fmt: skip
    add_latex_options(g, "comparison.tex")
    from fedskew.grid.executors.options import add_executor_options

    add_executor_options(p)


def add_latex_options(p: argparse.ArgumentParser | argparse._ArgumentGroup, name: str) -> None:
    p.add_argument(
        "--latex",
        action="store_true",
        help=f"also write {name} beside the Markdown: a booktabs table, methods x settings, "
        "mean ± std of each run's value at --statistic (default: the mean of the last rounds), "
        "best of each column in bold",
    )
    p.add_argument(
        "--latex-paired",
        action="store_true",
        help="--latex, with a column per setting with the paired difference to the reference "
        "and its 95 %% interval over seeds",
    )
    p.add_argument(
        "--statistic",
        choices=("final", "best", "last"),
        help="each run's value in the LaTeX tables (and the report's per-class and per-client "
        "tables): the final evaluated round, the round of the best test accuracy, or the mean "
        "of the last N evaluated rounds (--last; the default)",
    )
    p.add_argument("--digits", type=int, default=2, help="decimals in the LaTeX tables (default 2)")
    p.add_argument(
        "--display-name",
        action="append",
        metavar="NAME=LABEL",
        help="a method's name in the LaTeX tables (e.g. fedfm=FedFM; plain text, escaped); "
        "may repeat; over the compare file's [compare] display_names",
    )
    p.add_argument(
        "--no-bold", action="store_true", help="no bold for the best of each LaTeX column"
    )


def latex_style_chosen(args: argparse.Namespace) -> bool:
    """Whether the command line shaped the LaTeX tables (which then implies --latex)."""
    return bool(args.statistic or args.display_name or args.no_bold or args.digits != 2)


def cmd_compare(args: argparse.Namespace) -> int:
    from fedskew.apps import compare
    from fedskew.config import plural
    from fedskew.grid.executors import dispatch
    from fedskew.grid.executors.options import executor_overrides
    from fedskew.report.latex import latex_path
    from fedskew.report.run_status import count_line

    if args.resume or args.name:
        raise UsageError("compare names and resumes its runs itself; drop --resume and --name")
    command = compare.command_line(getattr(args, "argv", []))
    overrides = {
        "seeds": args.seeds, "reference": args.reference, "last": args.last,
        "target": args.target, "jobs": args.jobs, "threads": args.threads,
        "out_dir": args.out_dir, **executor_overrides(args),
    }  # fmt: skip
    outcomes = None
    if not args.progress_every >= 0:  # also NaN
        raise UsageError(f"--progress-every must be >= 0 seconds, got {args.progress_every}")
    if args.status and args.report_only:
        raise UsageError("--status and --report-only: pick one")
    if args.status and not args.config and not args.methods:
        raise UsageError("--status needs the grid: -c FILE (or --methods)")
    if args.report_only and not args.config and not args.methods:
        # The grid folder says what it holds (compare.json), or its run folders do.
        root = Path(args.out_dir or "runs/compare")
        options = compare.options_from_manifest(root, compare.Options())
        for key in ("reference", "last", "target"):
            if overrides[key] is not None:
                setattr(options, key, overrides[key])
        grid_names = compare.display_names_from_manifest(root)
    else:
        raw = compare.read_file(args.config) if args.config else {}
        base = {
            k: v
            for k, v in cli_values(args).items()
            if v is not None and k not in ("out_dir", "quiet", "name")
        }
        grid = compare.grid_from(raw, args.config or "", base, args.methods, overrides)
        planned = runs = compare.plan(grid)
        if args.only:
            by_label = {r.label: r for r in planned}
            unknown = [x for x in args.only if x not in by_label]
            if unknown:
                raise UsageError(
                    f"not a run of this grid: {unknown[0]} (runs: {', '.join(by_label)})"
                )
            runs = [by_label[x] for x in args.only]
        root, options = grid.out_dir, grid.options
        grid_names = grid.display_names
        if args.status:
            print("\n".join(compare.status_lines(grid, runs)))
            return 0
        if not args.report_only:  # checked before anything is written
            executor = dispatch.executor_settings(grid, args.dry_run)
        root.mkdir(parents=True, exist_ok=True)
        compare.write_manifest(root, compare.manifest(grid, planned, command))
        if not args.report_only:
            print(
                f"{len(runs)} runs in {root} ({len(grid.settings)} setting(s) x "
                f"{len(grid.methods)} method(s) x {len(grid.seeds)} seed(s)), "
                f"{dispatch.describe(grid, executor)}"
            )
            outcomes = dispatch.execute(
                grid, planned, runs, executor, args.dry_run, progress_every=args.progress_every
            )
            if outcomes is None:  # submitted to Slurm: its last job writes the tables
                return 0
    from fedskew.report.latex_style import TableStyle, parse_display_names
    from fedskew.report.statistic import Statistic

    names = {**grid_names, **parse_display_names(args.display_name)}
    style = TableStyle(
        names, Statistic(args.statistic or "last", options.last), args.digits, not args.no_bold
    )
    latex = args.latex or args.latex_paired or latex_style_chosen(args)
    try:
        records = compare.collect(root)
        md = compare.write_tables(root, records, options, command, latex, args.latex_paired, style)
        print(f"tables: {md}, {root / 'comparison.csv'}, {root / 'runs.csv'}")
        if latex:
            print(f"LaTeX table (booktabs): {latex_path(root, 'comparison')}")
        print(f"full report (curves, partition, provenance): fedskew report {root}")
        if outcomes is None:  # --report-only: what the tables hold
            every = ("finished", "diverged", "failed")
            print(f"{plural(len(records), 'run')} in the tables: "
                  f"{count_line([r.status for r in records], every)}")  # fmt: skip
    finally:
        # The last line, also when the tables could not be written: a diverged run is a
        # result, a failed one is not (exit status 1).
        if outcomes is not None:
            print(compare.closing_line(outcomes))
    failed = sum(compare.OUTCOME_KINDS.get(o.status, "failed") == "failed" for o in outcomes or [])
    return 1 if failed else 0


def cmd_grid_task(args: argparse.Namespace) -> int:
    from fedskew.grid.executors.slurm_array import run_array_task

    return run_array_task(Path(args.runs), args.index)


def cmd_report(args: argparse.Namespace) -> int:
    from fedskew.apps.reporting import TableChoices, make_report
    from fedskew.report.latex import latex_path
    from fedskew.report.latex_style import parse_display_names

    choices = TableChoices(
        statistic=args.statistic,
        last=args.last,
        names=parse_display_names(args.display_name),
        digits=args.digits,
        bold=not args.no_bold,
    )
    latex = args.latex or args.latex_paired
    written = make_report(
        Path(args.folder),
        Path(args.out) if args.out else None,
        latex=latex,
        latex_paired=args.latex_paired,
        choices=choices,
    )
    for line in written.left_out:  # also in the report, under "Left out"
        print(f"fedskew: warning: {one_line(line)}", file=sys.stderr)
    print(one_line(f"report: {written.md} and {written.page} (self-contained)"))
    if latex:
        print(one_line(f"LaTeX table (booktabs): {latex_path(written.md.parent, 'report')}"))
    return 0


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedskew",
        description="Federated learning under label and quantity skew.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p_run = sub.add_parser("run", help="run a federated experiment (default: FedAvg on digits)")
    add_experiment_options(p_run)
    add_run_options(p_run)
    p_run.set_defaults(func=cmd_run)

    p_list = sub.add_parser("list", help="list algorithms, datasets, models and partitions")
    p_list.add_argument(
        "what", nargs="*", help="sections to show: algorithms, datasets, models, partitions"
    )
    p_list.set_defaults(func=cmd_list)

    p_part = sub.add_parser("partition", help="make and show a partition without training")
    add_experiment_options(p_part)
    p_part.add_argument("--plot", help="write a PNG: class counts per client and client sizes")
    p_part.add_argument("--save", help="write the partition as .npz")
    p_part.set_defaults(func=cmd_partition)

    p_cmp = sub.add_parser(
        "compare", help="run methods x settings x seeds; tables in the papers' form"
    )
    add_compare_options(p_cmp)
    p_cmp.set_defaults(func=cmd_compare)

    from fedskew.apps.tune import add_tune_options, cmd_tune

    p_tune = sub.add_parser(
        "tune", help="tune each method of a compare file with Optuna, the same budget for all"
    )
    add_tune_options(p_tune)
    p_tune.set_defaults(func=cmd_tune)

    p_dep = sub.add_parser(
        "deploy",
        help="run the fedskew Flower app on a SuperLink (flwr run, its log, and exit status 1 "
        "when the run failed)",
    )
    p_dep.add_argument(
        "connection", help="a SuperLink connection of $FLWR_HOME/config.toml (flwr run's)"
    )
    p_dep.add_argument(
        "--run-config", "-c", action="append", metavar="'k=v ...'",
        help="run config, as flwr run takes it: keys of fedskew run, TOML values "
        "('algorithm=\"fedcme\" rounds=20'); may repeat",
    )  # fmt: skip
    p_dep.add_argument(
        "--app", help="the Flower app folder (default: the app this fedskew writes, the same "
        "as the repository's flower/)",
    )  # fmt: skip
    p_dep.add_argument("--federation", help="flwr run --federation (@account/name)")
    p_dep.add_argument(
        "--torch", metavar="BUILD",
        help="the torch the SuperLink installs for the run, at the version installed here: "
        "cpu, cu128 (any variant of PyTorch's index), or index (the build uv's default index "
        "serves); default: the build installed here",
    )  # fmt: skip
    p_dep.set_defaults(func=cmd_deploy)

    p_task = sub.add_parser(
        "grid-task", help="run one run of a compare grid's runs list (a Slurm array task's job)"
    )
    p_task.add_argument("runs", help="the grid's slurm/runs.json, as compare --executor slurm "
                        "writes it")  # fmt: skip
    p_task.add_argument(
        "--index", type=int, help="which run (default: $SLURM_ARRAY_TASK_ID)"
    )  # fmt: skip
    p_task.set_defaults(func=cmd_grid_task)

    p_rep = sub.add_parser(
        "report", help="Markdown and HTML report of a run or a grid folder, from its files"
    )
    p_rep.add_argument("folder", help="a run folder, or a folder of runs (fedskew compare's)")
    p_rep.add_argument("-o", "--out", help="where report.md/.html go (default: the folder)")
    p_rep.add_argument(
        "--last",
        type=int,
        help="evaluated rounds the statistic 'last' averages (default: the grid's, else 10)",
    )
    add_latex_options(p_rep, "report.tex")
    p_rep.set_defaults(func=cmd_report)
    return parser


def one_line(message: str) -> str:
    """An error message as one printable line: the names, values and paths it quotes come
    from the user and may hold newlines or other control characters (escaped here)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)


def _terminate_as_interrupt(signum: int, frame: object) -> None:
    """SIGTERM (``kill``, a batch system's time limit, a container stopping) ends a command
    the way Ctrl-C does: a run keeps its finished rounds, frees its folder and says how to
    resume; ``fedskew compare`` passes it on to the runs it started. A second SIGTERM
    kills at once, for a process stuck in its clean-up (compare, while it stops its runs,
    takes it as the word to kill them: ``compare.Children.stop``)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    # Python delivers signals to the main thread only; a caller's own handler comes back
    # afterwards (tests and notebooks call main in-process).
    if threading.current_thread() is not threading.main_thread():
        return _main(argv)
    previous = signal.signal(signal.SIGTERM, _terminate_as_interrupt)
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str] | None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args))
    except UsageError as exc:
        print(f"fedskew: error: {one_line(str(exc))}", file=sys.stderr)
        return exc.exit_code
    except FedskewError as exc:
        print(f"fedskew: error: {one_line(str(exc))}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:
        # A run that has a folder says which one to resume (fedskew.runs.loop.RunInterrupted).
        text = one_line(str(exc))
        print(f"fedskew: {text}" if text else "fedskew: interrupted", file=sys.stderr)
        by_sigterm = isinstance(exc, Terminated) or isinstance(exc.__context__, Terminated)
        return 128 + signal.SIGTERM if by_sigterm else 130
    except (MemoryError, RuntimeError) as exc:
        if not is_memory_exhaustion(exc):
            raise
        print(f"fedskew: error: {memory_line(exc)}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader (e.g. `| head`) went away: stop quietly, as command-line tools do.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except OSError as exc:
        # The file system refused a path or a write (name too long, no permission, disk
        # full, ...) wherever it happened: one line naming the file. A run folder stays
        # resumable, as after a kill.
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"fedskew: error: {one_line(where + (exc.strerror or str(exc)))}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
