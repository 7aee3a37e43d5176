"""The ``fedskew`` command line: run, list, partition."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from fedskew.errors import FedskewError, UsageError


def _key_value(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got '{text}'")
    key, value = text.split("=", 1)
    return key.strip().replace("-", "_"), value.strip()


def _pairs(items: list[tuple[str, str]] | None) -> dict[str, Any] | None:
    if not items:
        return None
    from fedskew.config import parse_scalar

    return {k: parse_scalar(v) for k, v in items}


def add_experiment_options(p: argparse.ArgumentParser) -> None:
    """Options shared by ``run`` and ``partition``.

    All default to None, so that a config file can set what the command line leaves out.
    """
    p.add_argument("-c", "--config", help="experiment file (.toml or .yaml); options override it")
    p.add_argument("-a", "--algorithm", help="algorithm name (see `fedskew list`)")
    p.add_argument("-d", "--dataset", help="dataset name (default: digits, embedded)")
    p.add_argument("--data-dir", help="where datasets are looked for and downloaded to")
    p.add_argument(
        "--no-download",
        dest="download",
        action="store_const",
        const=False,
        help="never download; use local files only",
    )
    p.add_argument("-n", "--num-clients", type=int, help="number of clients (default 20)")
    p.add_argument("--partition", help="partition scheme (default dirichlet)")
    p.add_argument("--beta", type=float, help="Dirichlet concentration (dirichlet, quantity)")
    p.add_argument("--min-size", type=int, help="minimum samples per client (dirichlet, quantity)")
    p.add_argument(
        "-P",
        "--partition-param",
        action="append",
        type=_key_value,
        metavar="KEY=VALUE",
        help="other partition parameter, e.g. classes_per_client=2 (repeatable)",
    )
    p.add_argument(
        "--partition-file",
        metavar="FILE",
        help="use this partition (.npz as fedskew saves it, or .json index lists per client)",
    )
    p.add_argument(
        "--partition-overlap",
        action="store_const",
        const=True,
        help="allow clients of --partition-file to share samples",
    )
    p.add_argument("--seed", type=int, help="experiment seed (default 0)")
    p.add_argument("--synthetic-alpha", type=float, help="synthetic dataset alpha")
    p.add_argument("--synthetic-beta", type=float, help="synthetic dataset beta")


def add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", help="model name, or auto for the dataset's default")
    p.add_argument(
        "--model-option",
        action="append",
        type=_key_value,
        metavar="KEY=VALUE",
        help="model option, e.g. stem=imagenet (repeatable)",
    )
    part = p.add_mutually_exclusive_group()
    part.add_argument(
        "--participation", type=float, help="fraction of clients per round, in (0, 1] (default 0.4)"
    )
    part.add_argument("--clients-per-round", type=int, help="number of clients per round")
    p.add_argument("-r", "--rounds", type=int, help="communication rounds (default 30)")
    p.add_argument("-e", "--local-epochs", type=int, help="local epochs per round (default 2)")
    p.add_argument("-b", "--batch-size", type=int, help="local batch size (default 32)")
    p.add_argument("--lr", type=float, help="local learning rate (default 0.05)")
    p.add_argument("--momentum", type=float, help="local SGD momentum (default 0.9)")
    p.add_argument("--weight-decay", type=float, help="local weight decay (default 1e-5)")
    p.add_argument(
        "--grad-clip", type=float, help="clip each local step's gradient norm (default 0: off)"
    )
    p.add_argument(
        "--augment",
        action="store_const",
        const=True,
        help="random crop and flip on image batches (off by default)",
    )
    p.add_argument(
        "-p",
        "--param",
        action="append",
        type=_key_value,
        metavar="KEY=VALUE",
        help="algorithm hyper-parameter, e.g. mu=0.01 (repeatable)",
    )
    p.add_argument(
        "--feature-matching",
        action="store_const",
        const=True,
        help="add FedFM's anchor feature matching to the algorithm (plug-in)",
    )
    p.add_argument("--eval-every", type=int, help="evaluate every N rounds (default 1)")
    p.add_argument(
        "--feature-metrics-every",
        type=int,
        metavar="N",
        help="every N rounds and the last: NMI of k-means clusters and silhouette of the "
        "global model's test features (FedFM Table IV; default 0: off)",
    )
    p.add_argument(
        "--local-risk-every",
        type=int,
        metavar="N",
        help="every N rounds and the last: risk of the round's local models over client "
        "distributions (FedACD; default 0: off)",
    )
    p.add_argument(
        "--tsne",
        action="store_const",
        const=True,
        help="write tsne.png into the run folder: t-SNE of the final global model's test "
        "features, coloured by class",
    )
    p.add_argument(
        "--memory-format",
        choices=["auto", "channels_last", "contiguous"],
        help="tensor layout (default auto: channels_last for convolutional models)",
    )
    p.add_argument(
        "--precision",
        metavar="fp32|bf16",
        help="forward passes in fp32 (default) or under bf16 autocast; weights stay fp32",
    )
    p.add_argument(
        "--device",
        metavar="auto|cpu|cuda|cuda:N",
        help="where clients train and the model is evaluated (default auto: CUDA when "
        "available, else the CPU)",
    )
    p.add_argument(
        "--tf32",
        metavar="on|off",
        help="CUDA: let fp32 products use TF32 tensor cores (default off: fp32 is fp32)",
    )
    p.add_argument(
        "--deterministic",
        action="store_const",
        const=True,
        help="PyTorch's deterministic algorithms (and the cuBLAS workspace setting): the same "
        "metrics on every repeat of a CUDA run, somewhat slower",
    )
    p.add_argument(
        "--clients-together",
        metavar="auto|off|vmap",
        help="train a round's clients together with stacked parameters (vmap) where the "
        "algorithm's local step is plain cross-entropy; off: one after another (default auto: "
        "vmap on CUDA, off on the CPU)",
    )
    p.add_argument(
        "--checkpoint-every", type=int, help="rounds between checkpoints (default 1; 0: none)"
    )
    p.add_argument(
        "--engine",
        choices=["inprocess", "flower-sim"],
        help="inprocess (default) or flower-sim: Flower's simulation engine (needs .[flower])",
    )
    p.add_argument(
        "--reply-timeout",
        type=float,
        help="seconds a Flower round waits for client replies (default 0: no limit)",
    )
    p.add_argument(
        "--workers",
        metavar="N|auto",
        help="run clients in N worker processes, one torch thread each; 0: in-process "
        "(default auto: one per core with --precision bf16, in-process with fp32, as measured "
        "in BENCHMARKS.md; results are the same either way)",
    )
    p.add_argument(
        "--on-divergence",
        choices=["stop", "drop"],
        help="a client reply with NaN or Inf: stop the run (default) or leave the reply out",
    )
    p.add_argument(
        "--track",
        action="append",
        metavar="tensorboard|mlflow|wandb",
        help="also log each round's metrics, the config and the summary to this experiment "
        "tracker (repeatable; needs pip install 'fedskew[NAME]')",
    )
    p.add_argument("--resume", metavar="RUN_DIR", help="continue an unfinished run folder")
    p.add_argument("-o", "--out-dir", help="where run folders go (default ./runs)")
    p.add_argument(
        "--name", help="run folder name (default: algorithm-dataset-partition-seed-time)"
    )
    p.add_argument(
        "-q", "--quiet", action="store_const", const=True, help="no progress bar or summary"
    )


def cli_values(args: argparse.Namespace) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for key in (
        "algorithm",
        "dataset",
        "data_dir",
        "download",
        "num_clients",
        "partition",
        "partition_file",
        "partition_overlap",
        "seed",
        "synthetic_alpha",
        "synthetic_beta",
        "model",
        "participation",
        "clients_per_round",
        "rounds",
        "local_epochs",
        "batch_size",
        "lr",
        "momentum",
        "weight_decay",
        "augment",
        "grad_clip",
        "feature_matching",
        "eval_every",
        "feature_metrics_every",
        "local_risk_every",
        "tsne",
        "checkpoint_every",
        "memory_format",
        "precision",
        "device",
        "tf32",
        "deterministic",
        "clients_together",
        "engine",
        "reply_timeout",
        "workers",
        "on_divergence",
        "track",
        "out_dir",
        "name",
        "quiet",
    ):
        if hasattr(args, key):
            values[key] = getattr(args, key)
    partition_params = _pairs(getattr(args, "partition_param", None)) or {}
    if args.beta is not None:
        partition_params["beta"] = args.beta
    if args.min_size is not None:
        partition_params["min_size"] = args.min_size
    values["partition_params"] = partition_params or None
    values["params"] = _pairs(getattr(args, "param", None))
    values["model_options"] = _pairs(getattr(args, "model_option", None))
    return values


def load_config(args: argparse.Namespace):
    from fedskew.config import build_config, read_config_file

    file_values = read_config_file(args.config) if args.config is not None else {}
    if getattr(args, "participation", None) is not None:
        file_values.pop("clients_per_round", None)
    if getattr(args, "clients_per_round", None) is not None:
        file_values.pop("participation", None)
    return build_config(file_values, cli_values(args))


def cmd_run(args: argparse.Namespace) -> int:
    from fedskew.experiment import run
    from fedskew.progress import RoundProgress

    resume = None
    if args.resume is not None:  # also --resume "": an error, never a new run
        cfg, resume = resume_config(args)
        if cfg.engine == "flower":
            raise UsageError(
                "this run was deployed on a Flower federation: continue it there with "
                f"flwr run flower <connection> --run-config 'resume=\"{resume}\"'"
            )
    else:
        cfg = load_config(args)
    progress = RoundProgress(cfg.rounds, f"{cfg.algorithm} on {cfg.dataset}", disable=cfg.quiet)
    try:
        if cfg.engine == "flower-sim":
            run_flower = flower_simulation()
            folder, summary = run_flower(
                cfg, on_round=progress.update, on_start=progress.start, resume=resume
            )
        else:
            folder, summary = run(
                cfg, on_round=progress.update, resume=resume, on_start=progress.start
            )
    finally:
        progress.close()
    if not cfg.quiet:
        print(format_summary(summary, folder))
    return 0


def flower_simulation():
    """The Flower simulation entry point, or a one-line error when Flower is missing."""
    try:
        from fedskew.flower_app import run_simulation
    except ImportError as exc:
        raise UsageError(
            f"--engine flower-sim needs Flower: pip install 'fedskew[flower]' ({exc})"
        ) from None
    return run_simulation


def resume_config(args: argparse.Namespace):
    """The configuration saved in an unfinished run folder, with only the execution options
    of RESUME_MAY_CHANGE taken from the command line."""
    from fedskew.config import RESUME_MAY_CHANGE
    from fedskew.runfolder import RunFolder, saved_config

    values = {k: v for k, v in cli_values(args).items() if v is not None}
    given = sorted(k for k in values if k not in RESUME_MAY_CHANGE)
    if given or args.config is not None:
        names = ", ".join(given) or "config"
        raise UsageError(f"--resume takes its configuration from the run folder; drop: {names}")
    folder = RunFolder.reopen(Path(args.resume))
    return saved_config(folder.path, values, "--resume"), folder.path


def format_summary(summary: dict[str, Any], folder: Path) -> str:
    def pct(v: float | None) -> str:
        return "n/a" if v is None else f"{100 * v:.2f} %"

    mb = 1024 * 1024
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
            f"  run folder: {folder}",
        ]
    )


def cmd_list(args: argparse.Namespace) -> int:
    from fedskew.algorithms import ALGORITHMS
    from fedskew.data.datasets import DATASETS
    from fedskew.data.partition import PARTITIONS
    from fedskew.models import MODELS

    sections = [
        ("algorithms", {n: a.description for n, a in ALGORITHMS.items()}),
        ("datasets", {n: d.description for n, d in DATASETS.items()}),
        ("models", {n: m.description for n, m in MODELS.items()}),
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

    from fedskew.building import build_partition, check_names, load_experiment_data
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
        "--threads", type=int, help="torch threads per run (default cores / jobs; jobs x threads "
        "<= cores)"
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
    from fedskew.grid_executors.options import add_executor_options

    add_executor_options(p)


def cmd_compare(args: argparse.Namespace) -> int:
    from fedskew import compare
    from fedskew.grid_executors import dispatch
    from fedskew.grid_executors.options import executor_overrides

    if args.resume or args.name:
        raise UsageError("compare names and resumes its runs itself; drop --resume and --name")
    command = compare.command_line(getattr(args, "argv", []))
    overrides = {
        "seeds": args.seeds, "reference": args.reference, "last": args.last,
        "target": args.target, "jobs": args.jobs, "threads": args.threads,
        "out_dir": args.out_dir, **executor_overrides(args),
    }  # fmt: skip
    failed = 0
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
            outcomes = dispatch.execute(grid, planned, runs, executor, args.dry_run)
            if outcomes is None:  # submitted to Slurm: its last job writes the tables
                return 0
            failed = sum(o.status == "failed" for o in outcomes)
    md = compare.write_tables(root, compare.collect(root), options, command)
    print(f"tables: {md}, {root / 'comparison.csv'}, {root / 'runs.csv'}")
    print(f"full report (curves, partition, provenance): fedskew report {root}")
    return 1 if failed else 0


def cmd_grid_task(args: argparse.Namespace) -> int:
    from fedskew.grid_executors.slurm_array import run_array_task

    return run_array_task(Path(args.runs), args.index)


def cmd_report(args: argparse.Namespace) -> int:
    from fedskew.reporting import make_report

    md, page = make_report(Path(args.folder), Path(args.out) if args.out else None)
    print(f"report: {md} and {page} (self-contained)")
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


class Terminated(KeyboardInterrupt):
    """The interrupt a SIGTERM raises; the exit status says which signal it was."""


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
        # A run that has a folder says which one to resume (fedskew.experiment.RunInterrupted).
        text = one_line(str(exc))
        print(f"fedskew: {text}" if text else "fedskew: interrupted", file=sys.stderr)
        by_sigterm = isinstance(exc, Terminated) or isinstance(exc.__context__, Terminated)
        return 128 + signal.SIGTERM if by_sigterm else 130
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
