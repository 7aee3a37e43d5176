"""``fedskew compare --executor slurm``: the grid as one Slurm job array, one array task per
run that is not finished, written as plain scripts into ``<grid>/slurm/`` and submitted with
``sbatch`` (``--dry-run`` only writes them).

``runs.json`` lists every planned run of the grid in plan order (an array task's index is its
position there); ``array.sbatch`` runs ``fedskew grid-task <grid>/slurm/runs.json``, which
reads ``SLURM_ARRAY_TASK_ID`` and runs that one run through launch.run_grid: a finished run
is skipped, an unfinished one resumes from its checkpoint. Before the time limit Slurm sends
USR1 (``--signal``): the script passes it on as SIGTERM, on which ``fedskew run`` stops after
its finished rounds, and requeues the task, which then resumes. ``tables.sbatch`` runs after
the whole array (``--dependency=afterany``) and writes the grid's tables.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedskew.core.errors import FedskewError, UsageError
from fedskew.grid import launch
from fedskew.grid.executors.options import ExecutorSettings
from fedskew.grid.executors.plain_runs import checked_run, one_run_grid, run_data
from fedskew.grid.plan import Grid, PlannedRun

FOLDER = "slurm"
RUNS_FILE = "runs.json"
ARRAY_SCRIPT = "array.sbatch"
TABLES_SCRIPT = "tables.sbatch"
RUNS_FORMAT = 1
# Seconds before the time limit at which a run is told to stop and its task requeued: a
# round and the checkpoint written after it must fit in them.
WARN_SECONDS = 120

ARRAY_BODY = """\
# One run of the grid per array task: fedskew grid-task runs entry SLURM_ARRAY_TASK_ID of
# runs.json; a finished run is skipped, an unfinished one resumes from its checkpoint.
# USR1 comes {warn} s before the time limit (--signal above): the run is stopped with SIGTERM,
# keeps its finished rounds, and the task is requeued to resume. A plain SIGTERM (scancel)
# stops the run without requeueing.
set -u
# Job control: the task's processes get a process group of their own, so that the signal
# reaches the run itself at once, not only the grid-task process that started it.
set -m
requeue=0
child=
stop() {{ [ "$1" = USR1 ] && requeue=1; [ -n "$child" ] && kill -TERM -- "-$child" 2>/dev/null; }}
trap 'stop USR1' USR1
trap 'stop TERM' TERM
{python} -m fedskew grid-task {runs} &
child=$!
status=0
wait "$child" || status=$?
# A trapped signal ends `wait` early: wait on until the run has saved and exited.
while kill -0 "$child" 2>/dev/null; do status=0; wait "$child" || status=$?; done
if [ "$requeue" = 1 ] && [ "$status" != 0 ]; then
    task="${{SLURM_ARRAY_JOB_ID:-?}}_${{SLURM_ARRAY_TASK_ID:-?}}"
    echo "fedskew: time limit near: requeueing $task to resume its run" >&2
    scontrol requeue "$task" || exit "$status"
fi
exit "$status"
"""

TABLES_BODY = """\
# After the array: the grid's tables from its run folders (as fedskew compare writes them).
{python} -m fedskew compare --report-only -o {root}
"""


def slurm_folder(root: Path) -> Path:
    return root / FOLDER


def array_spec(indices: list[int]) -> str:
    """``0-3,5,7-9`` from [0, 1, 2, 3, 5, 7, 8, 9]."""
    parts: list[str] = []
    start = prev = indices[0]
    for i in [*indices[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(parts)


def sbatch_lines(settings: ExecutorSettings, name: str, logs: Path) -> list[str]:
    lines = [f"--job-name={name}", f"--output={logs}/%A_%a.out", "--open-mode=append"]
    if settings.slurm_partition:
        lines.append(f"--partition={settings.slurm_partition}")
    if settings.slurm_time:
        lines.append(f"--time={settings.slurm_time}")
    lines += ["--ntasks=1", f"--cpus-per-task={settings.slurm_cpus}"]
    if settings.slurm_mem:
        lines.append(f"--mem={settings.slurm_mem}")
    if settings.slurm_gpus:
        lines.append(f"--gres=gpu:{settings.slurm_gpus}")
    lines += ["--requeue", f"--signal=B:USR1@{WARN_SECONDS}", *settings.slurm_extra]
    return lines


def write_scripts(
    grid: Grid,
    planned: list[PlannedRun],
    runs: list[PlannedRun],
    settings: ExecutorSettings,
) -> tuple[Path, Path, int] | None:
    """Write runs.json, array.sbatch and tables.sbatch for the not finished ones of ``runs``
    (a subset of the grid's ``planned`` runs); returns (array script, tables script, array
    tasks), or None when every run is finished."""
    root = grid.out_dir.resolve()
    index = {r.folder: i for i, r in enumerate(planned)}
    pending = sorted(index[r.folder] for r in runs
                     if not (root / r.folder / "summary.json").is_file())  # fmt: skip
    if not pending:
        return None
    folder = slurm_folder(root)
    logs = folder / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    runs_file = folder / RUNS_FILE
    listing = {
        "format": RUNS_FORMAT,
        "grid": str(root),
        # The CPUs asked for: where Slurm does not pin a task to them, all cores look free.
        "threads": grid.threads or settings.slurm_cpus,
        "runs": [run_data(r) for r in planned],
    }
    runs_file.write_text(json.dumps(listing, indent=1) + "\n", encoding="utf-8")
    python = shlex.quote(sys.executable)
    name = f"fedskew-{root.name}"
    array_lines = sbatch_lines(settings, name, logs) + [f"--array={array_spec(pending)}"]
    array = folder / ARRAY_SCRIPT
    array.write_text(
        _script(array_lines) + ARRAY_BODY.format(
            warn=WARN_SECONDS, python=python, runs=shlex.quote(str(runs_file))
        ),
        encoding="utf-8",
    )  # fmt: skip
    tables_lines = [f"--job-name={name}-tables", f"--output={logs}/tables-%j.out", "--ntasks=1"]
    if settings.slurm_partition:
        tables_lines.append(f"--partition={settings.slurm_partition}")
    tables = folder / TABLES_SCRIPT
    tables.write_text(
        _script(tables_lines + settings.slurm_extra)
        + TABLES_BODY.format(python=python, root=shlex.quote(str(root))),
        encoding="utf-8",
    )
    for path in (array, tables):
        path.chmod(0o755)
    return array, tables, len(pending)


def _script(options: list[str]) -> str:
    for option in options:
        # A newline in a grid folder's name (or an option) would end the #SBATCH comment
        # and put the rest on a shell line of its own: a command in the generated script.
        if not option.isprintable():
            raise UsageError(
                f"cannot write a Slurm script: {option!r} holds a newline or another control "
                "character (rename the grid folder, or fix the option)"
            )
    return "#!/bin/bash\n" + "".join(f"#SBATCH {o}\n" for o in options)


def check_sbatch(dry_run: bool) -> None:
    if not dry_run and shutil.which("sbatch") is None:
        raise UsageError(
            "--executor slurm needs sbatch on PATH (a Slurm login node); --dry-run only writes "
            "the job scripts"
        )


def _sbatch(args: list[str]) -> str:
    proc = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        raise FedskewError(f"sbatch {args[-1]}: {last}")
    return proc.stdout.strip().split(";")[0]


def submit_grid(
    grid: Grid,
    planned: list[PlannedRun],
    runs: list[PlannedRun],
    settings: ExecutorSettings,
    dry_run: bool,
    print_line: Callable[[str], None] = print,
) -> bool:
    """Write the job scripts and (unless ``dry_run``) submit them; False when every run is
    finished and there is nothing to submit."""
    check_sbatch(dry_run)
    written = write_scripts(grid, planned, runs, settings)
    if written is None:
        print_line("every run is finished: nothing to submit")
        return False
    array, tables, count = written
    if dry_run:
        print_line(f"wrote {array} ({count} array tasks) and {tables}; submit them with:")
        print_line(f"  job=$(sbatch --parsable {shlex.quote(str(array))})")
        print_line(f"  sbatch --dependency=afterany:$job {shlex.quote(str(tables))}")
        return True
    job = _sbatch([str(array)])
    tables_job = _sbatch([f"--dependency=afterany:{job}", str(tables)])
    root = grid.out_dir.resolve()
    print_line(f"submitted job array {job} ({count} runs) and job {tables_job} for the tables")
    print_line(f"  where each run stands: fedskew compare ... --status; logs: {array.parent}/logs")
    print_line(f"  tables when they end: {root}/comparison.md")
    return True


def run_array_task(runs_file: Path, index: int | None) -> int:
    """``fedskew grid-task``: the run at ``index`` (default: $SLURM_ARRAY_TASK_ID) of a
    runs.json, skipped when finished, resumed when unfinished; exit 1 when it failed."""
    if index is None:
        text = os.environ.get("SLURM_ARRAY_TASK_ID")
        if text is None or not text.isdigit():
            raise UsageError("grid-task needs --index N or SLURM_ARRAY_TASK_ID")
        index = int(text)
    try:
        listing: dict[str, Any] = json.loads(runs_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read the runs list {runs_file}: {exc}") from None
    if not isinstance(listing, dict) or listing.get("format") != RUNS_FORMAT:
        raise UsageError(f"{runs_file} is not a runs list of this fedskew (format {RUNS_FORMAT})")
    entries, root, threads = listing.get("runs"), listing.get("grid"), listing.get("threads")
    if not isinstance(entries, list):
        raise UsageError(f"{runs_file}: 'runs' must be a list, got {entries!r:.80}")
    if not isinstance(root, str) or not Path(root).is_absolute() or "\x00" in root:
        raise UsageError(f"{runs_file}: 'grid' must be an absolute path, got {root!r:.80}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or threads < 1):  # fmt: skip
        raise UsageError(f"{runs_file}: 'threads' must be an integer >= 1, got {threads!r:.80}")
    if not 0 <= index < len(entries):
        raise UsageError(f"{runs_file} has runs 0 to {len(entries) - 1}, not {index}")
    run = checked_run(entries[index], Path(root), f"{runs_file} run {index}")
    grid = one_run_grid(Path(root), threads)
    [outcome] = launch.run_grid(grid, [run])
    return 1 if outcome.status == "failed" else 0
