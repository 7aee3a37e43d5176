"""A run's peak GPU memory per round (metrics.jsonl) and over the run (the summary).

What a user sizing clients per GPU needs: the most memory this process's tensors took during
the round (``gpu_peak_mib``, PyTorch's allocated bytes) and the most its caching allocator held
from the driver (``gpu_reserved_peak_mib``, closer to what nvidia-smi shows). Only this
process's device is measured: with ``--workers`` on several GPUs the workers' training is not
in it. On the CPU there is nothing to report and the keys are absent.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

PEAK_KEYS = ("gpu_peak_mib", "gpu_reserved_peak_mib")


def reset_peaks(device: torch.device) -> None:
    """Start measuring the peaks afresh (at the start of a round)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def memory_peaks(device: torch.device) -> dict[str, float]:
    """The peaks since :func:`reset_peaks`, in MiB; empty on the CPU."""
    if device.type != "cuda":
        return {}
    return {
        "gpu_peak_mib": round(torch.cuda.max_memory_allocated(device) / 2**20, 1),
        "gpu_reserved_peak_mib": round(torch.cuda.max_memory_reserved(device) / 2**20, 1),
    }


def run_peaks(history: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """The largest of each round's peaks (the summary's); empty where no round had any."""
    out: dict[str, float] = {}
    for record in history:
        for key in PEAK_KEYS:
            if record.get(key) is not None:
                out[key] = max(out.get(key, 0.0), float(record[key]))
    return out
