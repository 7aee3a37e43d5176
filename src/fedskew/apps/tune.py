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
    x = p.add_argument_group("executor (where the trials run; docs/tuning.md)")
    x.add_argument(
        "--executor", choices=("local", "ray"),
        help="local (default): trials one after another in this process; ray: --tasks Ray "
        "tasks work on the study together",
    )  # fmt: skip
    x.add_argument(
        "--tasks", type=int, metavar="N",
        help="ray: tune tasks at once, each running one trial at a time (default: [compare] "
        "jobs, else 1)",
    )  # fmt: skip
    x.add_argument(
        "--cpus-per-run", type=int, metavar="N",
        help="ray: CPUs a task takes, also its torch threads (default: [compare] threads, else 1)",
    )  # fmt: skip
    x.add_argument("--gpus-per-run", type=float, metavar="F", help="ray: GPUs a task takes")
    x.add_argument(
        "--ray-address", metavar="ADDR",
        help="ray: the cluster, HOST:PORT or auto (default: start one on this machine)",
    )  # fmt: skip
    x.add_argument(
        "--retries", type=int, metavar="N",
        help="ray: attempts after a task's worker died, each resuming its trial (default 3)",
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
    executor = args.executor or "local"
    if executor == "local" and any(
        getattr(args, k) is not None
        for k in ("tasks", "cpus_per_run", "gpus_per_run", "ray_address", "retries")
    ):
        raise UsageError("--tasks, --cpus-per-run, --gpus-per-run, --ray-address and --retries "
                         "are for --executor ray")  # fmt: skip
    print("\n".join(budget_lines(tune)))
    threads = torch.get_num_threads()
    if tune.grid.threads is not None:  # [compare] threads: as compare's runs would have
        torch.set_num_threads(tune.grid.threads)
    try:
        if args.results_only:
            studies = studies_of(tune)
        elif executor == "ray":
            from fedskew.grid.executors.options import settings_of
            from fedskew.grid.executors.ray_tune import tune_on_ray

            keys = ("cpus_per_run", "gpus_per_run", "ray_address", "retries")
            settings = settings_of({k: getattr(args, k) for k in keys}, tune.grid.threads)
            tasks = args.tasks if args.tasks is not None else (tune.grid.jobs or 1)
            if isinstance(tasks, bool) or not isinstance(tasks, int) or tasks < 1:
                raise UsageError(f"--tasks must be an integer >= 1, got {tasks!r}")
            # The tasks start elsewhere: the tune folder goes absolute, as this process
            # resolved it.
            absolute = {**overrides, "out_dir": str(tune.out_dir.resolve())}
            tune_on_ray(args.config, base, args.methods, absolute, tasks, settings)
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
