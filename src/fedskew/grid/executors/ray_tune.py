"""``fedskew tune --executor ray``: ``tasks`` Ray tasks work on the study together, each as
one more ``tune`` process would (:func:`fedskew.grid.tune.tune_all`): it asks the study's
storage for a trial, runs the trial's run folders in its worker, and asks again until every
method holds its budget. So the cluster decides where trials run, and the budget, the
locks and the resumption of cut-off trials are the study's, exactly as with several local
processes. The tune folder must be on a file system every node sees (with ``flock``), and
the storage one every node reaches (the default SQLite file in that folder, or a database
URL).

A task whose worker dies (killed, out of memory, its node gone) is retried up to
``retries`` times; the trial it was running is left RUNNING with no live lock holder, and
the next task to ask marks it cut off and resumes its run folders. Ctrl-C or SIGTERM
cancels the tasks; the study and the trials' folders stay as a killed ``tune`` leaves them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fedskew.version
from fedskew.grid.executors.options import ExecutorSettings
from fedskew.grid.executors.ray_executor import (
    SigtermSeen,
    check_fits,
    connect,
    disconnect,
    import_ray,
    note_cluster,
)


def tune_task(
    source: str, base: dict[str, Any], methods: list[str] | None, overrides: dict[str, Any],
    threads: int, gpus: float,
) -> dict[str, Any]:  # fmt: skip
    """One tune worker in a Ray task: plain data in, its printed lines out."""
    import torch

    from fedskew.grid.plan import read_file
    from fedskew.grid.tune import tune_all, tune_from

    if not gpus:  # a GPU this task did not declare is another task's
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(threads)
    tune = tune_from(read_file(source), source, base, methods, overrides)
    lines: list[str] = []
    tune_all(tune, lines.append)
    return {"lines": lines, "node": os.uname().nodename, "fedskew": fedskew.version.__file__}


def tune_on_ray(
    source: str,
    base: dict[str, Any],
    methods: list[str] | None,
    overrides: dict[str, Any],
    tasks: int,
    settings: ExecutorSettings,
    print_line: Callable[[str], None] = print,
) -> None:
    """Run ``tasks`` tune workers as Ray tasks until the study holds every method's budget.
    ``overrides`` must name the tune folder absolutely: a task starts elsewhere."""
    ray = import_ray()
    threads = settings.cpus_per_run or 1
    connect(ray, settings.ray_address)
    try:
        check_fits(ray, threads, settings.gpus_per_run)
        task = ray.remote(tune_task).options(
            num_cpus=threads,
            num_gpus=settings.gpus_per_run,
            max_retries=settings.retries,
        )
        source = str(Path(source).resolve())
        refs = [
            task.remote(source, base, methods, overrides, threads, settings.gpus_per_run)
            for _ in range(tasks)
        ]
        note_cluster()
        print_line(f"{tasks} Ray task(s) tune the study, {threads} CPU each")
        waiting = list(refs)
        terms = SigtermSeen()
        try:
            while waiting:
                done, waiting = ray.wait(waiting, num_returns=1)
                for ref in done:
                    _report(ray, ref, print_line)
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (fedskew.apps.cli turns it into one)
            for ref in waiting:
                ray.cancel(ref, force=True)
            raise terms.interrupt(
                "interrupted; Ray tasks cancelled, the study and the trials' run folders stay: "
                "run the same command again to continue"
            ) from None
        finally:
            terms.restore()
    finally:
        disconnect(ray)


def _report(ray: Any, ref: Any, print_line: Callable[[str], None]) -> None:
    try:
        data = ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        last = str(exc.cause if exc.cause is not None else exc).strip().splitlines() or ["?"]
        print_line(f"a tune task failed after its retries: {last[-1]}")
        return
    except ray.exceptions.RayError as exc:  # the worker or its node died once too often
        first = str(exc).strip().splitlines() or [type(exc).__name__]
        print_line(f"a tune task failed after its retries: {first[0]}")
        return
    for line in data["lines"]:
        print_line(f"{data['node']}: {line}")
    if data["fedskew"] != fedskew.version.__file__:
        print_line(
            f"warning: a task ran on {data['node']} with fedskew from {data['fedskew']}, not "
            f"{fedskew.version.__file__} as here: install the same fedskew on every node"
        )
