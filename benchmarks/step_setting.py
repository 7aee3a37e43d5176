"""What graph_step_check.py's paths share: one model at one precision (:class:`Setting`), its
initial weights, random data, training options and the device helpers. A module of its own
so that the processes concurrent_paths.py starts import only this, not the whole check."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch

from fedskew.data.federated import ClientData
from fedskew.models import build_model
from fedskew.training.interface import LocalTrainConfig

LR, MOMENTUM, WEIGHT_DECAY = 0.01, 0.9, 1e-4


@dataclass(frozen=True)
class Setting:
    """One model at one precision, and the sizes of this invocation."""

    model: str
    shape: tuple[int, ...]
    options: dict[str, Any]
    precision: str
    device: torch.device
    batch: int
    steps: int  # of the bit-for-bit check (the last one short)
    timed_steps: int  # per path, after a warm-up call
    clients: int  # of the fedskew round, and the replicas of the streams path
    client_steps: int  # full batches per client per round
    rounds: int  # measured fedskew rounds, after a warm-up round

    def to_json(self) -> dict[str, Any]:
        """The setting as JSON values (what a measuring process is given on its command line)."""
        return {**asdict(self), "shape": list(self.shape), "device": str(self.device)}

    @classmethod
    def from_json(cls, values: dict[str, Any]) -> Setting:
        return cls(**{**values, "shape": tuple(values["shape"]),
                      "device": torch.device(values["device"])})  # fmt: skip


def conv_layout(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Images channels_last on CUDA, as fedskew lays out a convolutional model's data."""
    if device.type == "cuda" and t.dim() == 4:
        return t.contiguous(memory_format=torch.channels_last)
    return t


def fresh_model(s: Setting) -> torch.nn.Module:
    """The model of the setting, the same initial weights every call."""
    torch.manual_seed(0)
    model = build_model(s.model, s.shape, 10, **s.options).to(s.device)
    if s.device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    return model


def client_data(s: Setting, n: int) -> ClientData:
    gen = torch.Generator().manual_seed(1)
    x = conv_layout(torch.randn(n, *s.shape, generator=gen).to(s.device), s.device)
    y = torch.randint(0, 10, (n,), generator=gen).to(s.device)
    return ClientData(x, y, torch.arange(n, device=s.device), 10)


def train_config(s: Setting) -> LocalTrainConfig:
    return LocalTrainConfig(
        epochs=1, batch_size=s.batch, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY,
        precision=s.precision,
    )  # fmt: skip


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def peak_memory(device: torch.device, into: dict[str, Any]) -> Iterator[None]:
    """The block's peak allocated GPU memory (MiB) into ``into["peak_mib"]`` (None on the CPU)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    yield
    into["peak_mib"] = (
        round(torch.cuda.max_memory_allocated(device) / 2**20, 1) if device.type == "cuda" else None
    )
