"""``fedskew tune -c FILE``: each method of a compare file tuned with Optuna over its
``[methods.NAME.search]`` table, the same budget for all, on the [tune] table's seeds; then
the tuned methods written as a compare file for ``fedskew compare`` (see docs/tuning.md and
:mod:`fedskew.grid.tune`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from fedskew.apps.options import add_experiment_options, add_run_options, cli_values
from fedskew.core.errors import FedskewError, UsageError


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
        help="local (default): trials in this process (or --jobs processes); ray: --tasks "
        "Ray tasks work on the study together",
    )  # fmt: skip
    x.add_argument(
        "--jobs", type=int, metavar="N",
        help="local: N processes share the study, each running one trial at a time with 1 "
        "torch thread ([compare] threads if set); the trials are those of one process",
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
    try:
        return _cmd_tune(args)
    except Exception as exc:
        fault = storage_fault(exc)
        if fault is None:
            raise
        raise FedskewError(
            f"the study's storage failed: {fault}; a damaged study.db can be moved away to "
            "start the study again (its trials' run folders stay)"
        ) from None


def storage_fault(exc: BaseException) -> str | None:
    """The first line of a database fault (a damaged or foreign study.db surfaces as
    sqlite3's, SQLAlchemy's or Optuna's storage error wherever the study is read), else
    None."""
    import sqlite3

    kinds: tuple[type[BaseException], ...] = (sqlite3.DatabaseError,)
    try:
        import optuna
        import sqlalchemy.exc

        kinds += (optuna.exceptions.StorageInternalError, sqlalchemy.exc.SQLAlchemyError)
    except ImportError:
        pass
    seen: BaseException | None = exc
    while seen is not None:  # Optuna wraps SQLAlchemy's error, which wraps sqlite3's
        if isinstance(seen, kinds):
            inner = seen.__cause__ or seen.__context__
            shown = inner if isinstance(inner, sqlite3.DatabaseError) else seen
            return (
                str(shown).strip().splitlines()[0] if str(shown).strip() else type(shown).__name__
            )
        seen = seen.__cause__ or seen.__context__
    return None


def _cmd_tune(args: argparse.Namespace) -> int:
    if args.resume or args.name:
        raise UsageError("tune names and resumes its trials' runs itself; drop --resume and --name")
    if not args.config:
        raise UsageError("fedskew tune needs its file: -c FILE (a compare file with [tune])")
    if args.seed is not None:
        raise UsageError("tune runs its trials on [tune] seeds and tuned.json on [compare] seeds; "
                         "drop --seed (the sampler's seed is [tune] sampler_seed)")  # fmt: skip
    require_optuna()
    import optuna
    import torch

    from fedskew.core.progress import LiveLine
    from fedskew.grid.plan import read_file
    from fedskew.grid.tune import slot_of, studies_of, tune_all, tune_from
    from fedskew.grid.tune_results import (
        TUNED_FILE,
        best_trial,
        budget_lines,
        why_none,
        write_results,
    )

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
    jobs = 1 if args.jobs is None else args.jobs
    if isinstance(jobs, bool) or jobs < 1:
        raise UsageError(f"--jobs must be an integer >= 1, got {jobs!r}")
    if executor != "local" and args.jobs is not None:
        raise UsageError("--jobs is for local trials; with --executor ray give --tasks")
    if args.results_only and args.jobs is not None:
        raise UsageError("--results-only runs no trial; drop --jobs")
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
                if jobs > 1:
                    from fedskew.grid.tune_jobs import tune_in_processes

                    if jobs > tune.batch:
                        print(
                            f"note: [tune] batch is {tune.batch}: at most {tune.batch} of the "
                            f"{jobs} jobs run a trial at once (set batch = {jobs} for all)"
                        )

                    absolute = {**overrides, "out_dir": str(tune.out_dir.resolve())}
                    tune_in_processes(args.config, base, args.methods, absolute, jobs,
                                      tune.grid.threads or 1)  # fmt: skip
                    studies = studies_of(tune)
                else:
                    line = LiveLine()
                    studies = tune_all(tune, line.print, line)
                    line.clear()
            except KeyboardInterrupt:
                raise KeyboardInterrupt(
                    f"interrupted; the study and the trials' run folders are in {tune.out_dir}: "
                    "run the same command again to continue"
                ) from None
    finally:
        torch.set_num_threads(threads)
    empty = [m for m, study in studies.items() if best_trial(study) is None]
    paths = write_results(tune, studies, tuned=not empty)
    for method, study in studies.items():
        best = best_trial(study)
        if best is None:
            print(f"{method}: no trial completed ({why_none(study)})")
            continue
        shown = ", ".join(f"{k}={v}" for k, v in best.params.items())
        print(f"{method}: best {best.value:.2f} % (trial {slot_of(best)}): {shown}")
    print(f"budget and search space: {paths[0]}; report: {paths[-2]}")
    if empty:
        raise FedskewError(
            f"no trial of {', '.join(empty)} completed, so there is nothing tuned to evaluate: "
            f"{TUNED_FILE} not written (see {paths[-2]})"
        )
    print(f"evaluate the tuned methods: fedskew compare -c {Path(paths[1])}")
    return 0
