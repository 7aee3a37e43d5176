"""``fedskew tune --jobs N``: N local processes work on the study together, each as one
more ``tune`` process would (:func:`fedskew.grid.tune.tune_all`), with its own torch threads.
The study's locks, slots and batches make the trials the same as one process's."""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

from fedskew.core.errors import FedskewError


def tune_job(
    source: str, base: dict[str, Any], methods: list[str] | None, overrides: dict[str, Any],
    threads: int, index: int,
) -> None:  # fmt: skip
    """One tune process: plain data in (nothing pickled but these values); prints its lines
    prefixed with its job number."""
    import optuna
    import torch

    from fedskew.core.progress import LiveLine
    from fedskew.grid.plan import read_file
    from fedskew.grid.tune import tune_all, tune_from

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # each trial is printed by fedskew
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(threads)
    tune = tune_from(read_file(source), source, base, methods, overrides)
    line = LiveLine()
    line.live = False  # several processes share the terminal: plain lines

    def tagged(text: str) -> None:
        line(f"[job {index}] {text}")

    tune_all(tune, tagged, tagged)


def tune_in_processes(
    source: str, base: dict[str, Any], methods: list[str] | None, overrides: dict[str, Any],
    jobs: int, threads: int,
) -> None:  # fmt: skip
    """Start ``jobs`` tune processes and wait for them; ``overrides`` name the tune folder
    absolutely. Ctrl-C stops them (the same command continues the study)."""
    context = multiprocessing.get_context("spawn")  # no forked torch state
    procs = [
        context.Process(target=tune_job, args=(source, base, methods, overrides, threads, i))
        for i in range(jobs)
    ]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join()
    except KeyboardInterrupt:
        for p in procs:
            p.terminate()
        for p in procs:
            p.join()
        raise
    failed = [i for i, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        raise FedskewError(
            f"tune job(s) {', '.join(map(str, failed))} of {jobs} stopped with an error (above); "
            "run the same command again to continue the study"
        )
