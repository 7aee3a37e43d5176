"""``fedskew compare``: a grid of methods x settings x seeds, run, skipped or resumed, then
tables in the papers' form.

A compare file (TOML, YAML or JSON) has up to five tables::

    [compare]                  # how the grid runs and is summarised (all optional)
    out_dir = "runs/methods"   # the grid folder (default runs/<file name>)
    seeds = [0, 1, 2]
    reference = "fedavg"       # paired differences are taken against this method
    last = 10                  # evaluated rounds averaged in the "last rounds" column
    target = 80                # rounds to reach 80 % accuracy (optional)
    jobs = 2                   # runs at once; jobs x threads <= cores
    threads = 1                # torch threads per run
    track = ["mlflow"]         # experiment trackers of every run (fedskew.runs.tracking)

    [experiment]               # the base experiment: keys of `fedskew run` config files
    dataset = "fmnist"
    [experiment.partition_params]
    beta = 0.1

    [methods.fedavg]           # one table per method; `algorithm` defaults to its name
    [methods.fedfm-lam10]
    algorithm = "fedfm"
    params = { lam = 10 }

    [settings.cifar100]        # optional named settings: overrides of the experiment
    dataset = "cifar100"

    [axes]                     # optional: settings as the product of these values
    "partition_params.beta" = [0.3, 0.1]

Every (setting, method, seed) is one run folder, ``<out_dir>/<setting>/<method>-s<seed>``
(``<out_dir>/<method>-s<seed>`` when there are no settings). Methods may not change what
decides the partition and the clients of each round (dataset, clients, partition,
participation, seed): those belong to settings, so every method of a (setting, seed) has the
same partition and the same client stream. Each run is its own ``fedskew run`` process, so a
crash of one leaves the others running; a finished run with the planned configuration is
skipped, an unfinished one resumes from its checkpoint, one with another configuration is
refused. ``compare.json`` in the grid folder records the plan, so ``fedskew report`` knows
the grid from the folder alone.
"""

from __future__ import annotations

# The parts live in fedskew.grid; this module keeps the names that the command line,
# fedskew.grid.executors, fedskew.apps.reporting, the benchmarks and the tests import from here.
# A name patched here does not reach the code in fedskew.grid: patch it where it is used.
from fedskew.grid.launch import (
    OUTCOME_KINDS,
    SLOTS,
    Children,
    Outcome,
    available_cores,
    closing_line,
    launch,
    log_of,
    prefetch,
    prepare_tracking,
    run_grid,
    run_one,
    saved_hash,
    slot_of,
    threads_per_run,
)
from fedskew.grid.plan import (
    COMPARE_KEYS,
    DEFAULT_PARTITION,
    RUN_KEYS,
    SECTIONS,
    SHARED_KEYS,
    Grid,
    PlannedRun,
    folder_of,
    grid_from,
    merge,
    plan,
    read_file,
    setting_name,
)
from fedskew.grid.status import status_lines
from fedskew.grid.tables import (
    client_state_memory,
    collect,
    command_line,
    display_names_from_manifest,
    manifest,
    options_from_manifest,
    recorded_client_state,
    table_blocks,
    write_manifest,
    write_tables,
)
from fedskew.report.tables import Options

__all__ = [
    "COMPARE_KEYS",
    "OUTCOME_KINDS",
    "DEFAULT_PARTITION",
    "RUN_KEYS",
    "SECTIONS",
    "SHARED_KEYS",
    "SLOTS",
    "Children",
    "Grid",
    "Options",
    "Outcome",
    "PlannedRun",
    "available_cores",
    "client_state_memory",
    "closing_line",
    "collect",
    "command_line",
    "folder_of",
    "grid_from",
    "launch",
    "log_of",
    "manifest",
    "merge",
    "options_from_manifest",
    "display_names_from_manifest",
    "plan",
    "prefetch",
    "prepare_tracking",
    "read_file",
    "recorded_client_state",
    "run_grid",
    "run_one",
    "saved_hash",
    "setting_name",
    "slot_of",
    "status_lines",
    "table_blocks",
    "threads_per_run",
    "write_manifest",
    "write_tables",
]
