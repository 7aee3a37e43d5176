"""The check that local training steps do not wait for the host, and two ways to count.

The check compares two short runs that differ only in local epochs (SHORT against LONG, both
at least 2: FedCME adds its mid-round exchange from 2 epochs on, so fewer would be another
protocol with other messages). Per-message and per-client syncs (replies moved to the host,
a client's mean loss read once) are the same in both; only the steps differ, about 11 more
per client, round and extra epoch. A run may add one sync per extra epoch (ALLOWED), not
one per step.

Two counters, one check:

* ``cuda_syncs``: what PyTorch reports under ``torch.cuda.set_sync_debug_mode("warn")``
  (tests/test_device.py, on a GPU);
* ``cpu_syncs``: a proxy for machines without one (tests/test_host_syncs.py): the
  operators that make a CUDA stream wait for the host (a value read back, a boolean mask,
  ``bincount``, ``unique``, ...) counted as they are dispatched, on the CPU. It sees no
  copies (on the CPU nothing is copied) and not ``.tolist()`` or ``.numpy()``, which read
  host memory directly: a lower bound of what CUDA reports. A tensor made from Python values
  (``lift_fresh``) stands for its copy from the host.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tiny_bn import NAME as TINY_BN
from torch.utils._python_dispatch import TorchDispatchMode

from fedskew.config import ExperimentConfig
from fedskew.runs.loop import run

SHORT, LONG = 2, 4  # local epochs of the two runs
ROUNDS, CLIENTS = 2, 2  # rounds, clients per round
ALLOWED = ROUNDS * CLIENTS * (LONG - SHORT)  # at most one more sync per extra epoch

# Local steps that must not wait for the host: augmentation (one client and stacked),
# FedACD's mixup and margins, the loss terms of FedCME, FedNTD and FedDecorr.
SYNC_CASES: dict[str, dict[str, Any]] = {
    "fedavg-augment": {"augment": True},
    "fedavg-augment-together": {"augment": True, "clients_together": "vmap"},
    "fedacd-mixup": {"algorithm": "fedacd", "params": {"mixup": True}},
    "fedcme": {"algorithm": "fedcme"},
    "fedntd": {"algorithm": "fedntd"},
    "feddecorr": {"algorithm": "feddecorr"},
}

Counter = Callable[[ExperimentConfig], int]


def config(options: dict[str, Any], epochs: int, device: str, out: Path) -> ExperimentConfig:
    return ExperimentConfig(
        **{"model": TINY_BN, "clients_together": "off", **options}, rounds=ROUNDS,
        num_clients=4, clients_per_round=CLIENTS, local_epochs=epochs, workers=0,
        device=device, out_dir=str(out), name=f"sync-{epochs}", quiet=True, checkpoint_every=0,
    )  # fmt: skip


def sync_counts(count: Counter, options: dict[str, Any], device: str, tmp: Path) -> tuple[int, int]:
    """The syncs ``count`` sees in the SHORT run and in the LONG one."""
    return tuple(  # type: ignore[return-value]
        count(config(options, epochs, device, tmp / f"e{epochs}")) for epochs in (SHORT, LONG)
    )


def waits_per_step(short: int, long: int) -> bool:
    """The check: more syncs in the long run than one per extra epoch."""
    return long - short > ALLOWED


def cuda_syncs(cfg: ExperimentConfig) -> int:
    """Host syncs PyTorch reports (``set_sync_debug_mode``) over the run."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run(cfg)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


# Operators whose CUDA kernels make the host wait: a value read back (item, bool, float),
# an output whose size depends on the data, a boolean mask used as an index, or a tensor
# made from Python values (torch.tensor: lift_fresh), on CUDA a copy from the host. The last
# was seen on an H200: a step's torch.tensor(count, device=...) added one sync per step.
WAITING_OPS = {
    "_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "bincount",
    "_unique", "_unique2", "unique_dim", "unique_consecutive", "repeat_interleave",
    "masked_scatter_", "lift_fresh",
}  # fmt: skip


class HostWaits(TorchDispatchMode):
    """Counts the dispatched operators that would wait for the host on CUDA."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.seen: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func._overloadpacket.__name__
        if name in WAITING_OPS or (
            name in ("index", "index_put_", "index_put") and _bool_index(args)
        ):
            self.count += 1
            self.seen[name] = self.seen.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool
        for i in (indices if isinstance(indices, (list, tuple)) else ())
    )


def cpu_syncs(cfg: ExperimentConfig) -> int:
    """The CPU proxy of :func:`cuda_syncs` (a lower bound; see the module docstring)."""
    with HostWaits() as mode:
        run(cfg)
    return mode.count
