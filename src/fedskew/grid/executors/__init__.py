"""Where the runs of ``fedskew compare`` execute: ``local`` (processes on this machine, the
``--jobs`` pool of fedskew.apps.compare), ``ray`` (one Ray task per run on a Ray cluster) or
``slurm`` (one Slurm job array task per run). Every executor starts the same ``fedskew run``
process per run through ``fedskew.grid.launch.run_one``, so a finished run is skipped and
an unfinished one resumes from its checkpoint wherever it lands.

This module stays free of heavy imports: the command line reads the names below to build
its parser on every call.
"""

from __future__ import annotations

EXECUTORS = ("local", "ray", "slurm")

# Keys of a compare file's [compare] table (and command-line options) that configure the
# executor rather than the grid; fedskew.apps.compare passes them through unread.
EXECUTOR_KEYS = (
    "executor", "cpus_per_run", "gpus_per_run", "ray_address", "retries",
    "slurm_partition", "slurm_time", "slurm_cpus", "slurm_gpus", "slurm_mem", "slurm_extra",
)  # fmt: skip
