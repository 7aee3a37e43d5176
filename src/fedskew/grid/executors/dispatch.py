"""The planned runs of ``fedskew compare`` handed to the executor its options name."""

from __future__ import annotations

from collections.abc import Callable

from fedskew.core.errors import UsageError
from fedskew.grid import launch
from fedskew.grid.executors.options import ExecutorSettings, settings_of
from fedskew.grid.launch import Outcome
from fedskew.grid.plan import Grid, PlannedRun


def executor_settings(grid: Grid, dry_run: bool) -> ExecutorSettings:
    """The checked settings, before compare writes anything: a missing Ray or sbatch is one
    line of error, not a half-started grid."""
    settings = settings_of(grid.executor, grid.threads)
    given = grid.executor.get("cpus_per_run") is not None
    if given and grid.threads is not None and settings.cpus_per_run != grid.threads:
        # A run's CPUs are its torch threads on every executor: two counts would be one
        # silently ignored.
        raise UsageError(
            f"cpus-per-run {settings.cpus_per_run} and threads {grid.threads} disagree: a "
            "run's CPUs are its torch threads; give one of them"
        )
    if settings.executor == "local" and given:
        grid.threads = settings.cpus_per_run
    if settings.executor == "local":  # jobs x threads <= cores, before anything is written
        launch.threads_per_run(grid.jobs, grid.threads, launch.available_cores())
    if dry_run and settings.executor != "slurm":
        raise UsageError("--dry-run writes Slurm job scripts: it goes with --executor slurm")
    if settings.executor == "ray":
        from fedskew.grid.executors.ray_executor import import_ray

        import_ray()
    elif settings.executor == "slurm":
        from fedskew.grid.executors.slurm_array import check_sbatch

        check_sbatch(dry_run)
    return settings


def describe(grid: Grid, settings: ExecutorSettings) -> str:
    if settings.executor == "ray":
        where = settings.ray_address or "a Ray cluster of this machine"
        gpus = f" and {settings.gpus_per_run:g} GPU" if settings.gpus_per_run else ""
        return f"Ray tasks on {where}, {settings.cpus_per_run} CPU{gpus} each"
    if settings.executor == "slurm":
        return f"a Slurm job array, {settings.slurm_cpus} CPU(s) per run"
    return f"{grid.jobs} at once"


def execute(
    grid: Grid,
    planned: list[PlannedRun],
    runs: list[PlannedRun],
    settings: ExecutorSettings,
    dry_run: bool = False,
    print_line: Callable[[str], None] = print,
    progress_every: float = 60.0,
) -> list[Outcome] | None:
    """Outcomes of ``runs`` (of the grid's ``planned`` runs) in the order they completed;
    None when they went to Slurm and end later."""
    if settings.executor in ("ray", "slurm"):
        # As the local executor does: a missing tracker package stops the grid up front, and
        # MLflow's database is made once here, before runs on other processes open it.
        root = grid.out_dir.resolve()
        todo = [r for r in runs if not (root / r.folder / "summary.json").is_file()]
        launch.prepare_tracking([r.cfg for r in todo])
    if settings.executor == "ray":
        from fedskew.grid.executors.ray_executor import run_grid_on_ray

        return run_grid_on_ray(grid, runs, settings, print_line, progress_every)
    if settings.executor == "slurm":
        from fedskew.grid.executors.slurm_array import submit_grid

        submitted = submit_grid(grid, planned, runs, settings, dry_run, print_line)
        return None if submitted else []
    return launch.run_grid(grid, runs, print_line, progress_every)
