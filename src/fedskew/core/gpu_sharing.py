"""How many of a ``fedskew compare``'s runs share a GPU: compare tells each run process it
starts on CUDA, through its environment, and the run records it in processes.jsonl, so
that a throughput read from the run folder says whether the GPU was its own."""

from __future__ import annotations

import os
from collections.abc import Mapping

# The most runs compare places on one GPU (group) at once: ceil(jobs / GPU groups).
RUNS_PER_GPU_VARIABLE = "FEDSKEW_COMPARE_RUNS_PER_GPU"
# How many of compare's runs, this one included, were on its GPU (group) when it started.
RUNS_ON_GPU_VARIABLE = "FEDSKEW_COMPARE_RUNS_ON_GPU"
FACTS = {RUNS_PER_GPU_VARIABLE: "compare_runs_per_gpu", RUNS_ON_GPU_VARIABLE: "compare_runs_on_gpu"}


def gpu_sharing_env(runs_per_gpu: int, runs_on_gpu: int) -> dict[str, str]:
    """The variables compare sets for a run it starts on a GPU it shares out."""
    return {RUNS_PER_GPU_VARIABLE: str(runs_per_gpu), RUNS_ON_GPU_VARIABLE: str(runs_on_gpu)}


def gpu_sharing_facts(environ: Mapping[str, str] | None = None) -> dict[str, int]:
    """processes.jsonl's record of those variables: only those set to a positive whole
    number (anything else did not come from compare and is not provenance)."""
    environ = os.environ if environ is None else environ
    facts = {}
    for variable, key in FACTS.items():
        value = environ.get(variable, "").strip()
        if value.isdigit() and int(value) > 0:
            facts[key] = int(value)
    return facts
