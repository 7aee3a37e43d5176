"""``fedskew tune -c FILE``: each method of a compare file tuned with Optuna over its
``[methods.NAME.search]`` table, the same budget for all, on the [tune] table's seeds; then
the tuned methods written as a compare file for ``fedskew compare`` (see docs/tuning.md and
:mod:`fedskew.grid.tune`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from fedskew.apps.options import add_experiment_options, add_run_options, cli_values
from fedskew.core.errors import UsageError


def add_tune_options(p: argparse.ArgumentParser) -> None:
    """The experiment and run options (they set the base experiment), then tune's own."""
    add_experiment_options(p)
    add_run_options(p)
    for action in p._actions:
        if action.dest == "config":
            action.help = "tune file: a compare file with a [tune] table and [methods.NAME.search]"
        elif action.dest == "out_dir":
            action.help = "the tune folder (default: [tune] out_dir, or runs/tune-<study>)"
    g = p.add_argument_group("tuning")
    g.add_argument("--methods", nargs="+", metavar="NAME", help="tune only these methods")
    g.add_argument("--trials", type=int, help="trials per method (default: [tune] trials)")
    g.add_argument("--study", help="the study's name (default: [tune] study, or the file's name)")
    g.add_argument(
        "--storage", metavar="URL", help="SQLAlchemy URL of the study database (default: "
        "sqlite:///<tune folder>/study.db)"
    )  # fmt: skip
    g.add_argument(
        "--results-only", action="store_true",
        help="run no trial: write tune.json, tuned.json and the report from the study",
    )  # fmt: skip


def require_optuna() -> None:
    try:
        import optuna  # noqa: F401
    except ImportError as exc:
        raise UsageError(
            f"fedskew tune needs Optuna: pip install 'fedskew[tune]' ({exc})"
        ) from None


def cmd_tune(args: argparse.Namespace) -> int:
    if args.resume or args.name:
        raise UsageError("tune names and resumes its trials' runs itself; drop --resume and --name")
    if not args.config:
        raise UsageError("fedskew tune needs its file: -c FILE (a compare file with [tune])")
    require_optuna()
    import optuna
    import torch

    from fedskew.grid.plan import read_file
    from fedskew.grid.tune import studies_of, tune_all, tune_from
    from fedskew.grid.tune_results import best_trial, budget_lines, write_results

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # fedskew prints each trial itself
    raw = read_file(args.config)
    base = {
        k: v
        for k, v in cli_values(args).items()
        if v is not None and k not in ("out_dir", "quiet", "name")
    }
    overrides = {"trials": args.trials, "study": args.study, "storage": args.storage,
                 "out_dir": args.out_dir}  # fmt: skip
    tune = tune_from(raw, args.config, base, args.methods, overrides)
    print("\n".join(budget_lines(tune)))
    threads = torch.get_num_threads()
    if tune.grid.threads is not None:  # [compare] threads: as compare's runs would have
        torch.set_num_threads(tune.grid.threads)
    try:
        if args.results_only:
            studies = studies_of(tune)
        else:
            try:
                studies = tune_all(tune)
            except KeyboardInterrupt:
                raise KeyboardInterrupt(
                    f"interrupted; the study and the trials' run folders are in {tune.out_dir}: "
                    "run the same command again to continue"
                ) from None
    finally:
        torch.set_num_threads(threads)
    paths = write_results(tune, studies)
    record, tuned = paths[0], paths[1]
    for method, study in studies.items():
        best = best_trial(study)
        if best is None:
            print(f"{method}: no trial completed")
            continue
        shown = ", ".join(f"{k}={v}" for k, v in best.params.items())
        print(f"{method}: best {best.value:.2f} % (trial {best.number}): {shown}")
    print(f"budget and search space: {record}; report: {paths[2]}")
    print(f"evaluate the tuned methods: fedskew compare -c {Path(tuned)}")
    return 0
