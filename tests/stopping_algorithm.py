"""FedAvg that stops its run at a chosen round through the run loop's own paths, for the tests
of how a stop is recorded, tabled and counted. Named by reference with tests/ on the path
(``stopping_algorithm:CrashAt``, ``stopping_algorithm:NaNAt``), so that ``fedskew compare``'s
run processes find them too.

- ``CrashAt``: the server raises an error in round ``at_round`` (a crash, not divergence).
- ``NaNAt``: the global model holds NaN after round ``at_round``'s aggregation; the run loop's
  check of the global model finds it, as after a real blow-up, and the run diverges there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from fedskew.algorithms.fedavg import FedAvg, FedAvgParams, FedAvgServer
from fedskew.training.protocol import Channel


@dataclass
class StopParams(FedAvgParams):
    algorithm: ClassVar[str] = "stopping"
    at_round: int = 2


class CrashServer(FedAvgServer):
    def round(self, rnd: int, clients: list[int], channel: Channel) -> dict[str, float]:
        if rnd + 1 == self.params.at_round:
            raise RuntimeError(f"simulated crash in round {rnd + 1}")
        return super().round(rnd, clients, channel)


class NaNServer(FedAvgServer):
    def round(self, rnd: int, clients: list[int], channel: Channel) -> dict[str, float]:
        metrics = super().round(rnd, clients, channel)
        if rnd + 1 == self.params.at_round:
            self.global_arrays = {
                k: torch.full_like(v, float("nan")) if v.is_floating_point() else v
                for k, v in self.global_arrays.items()
            }
        return metrics


class CrashAt(FedAvg):
    name = "crash-at"
    description = "FedAvg whose server crashes in round at_round (tests)"
    Params = StopParams
    Server = CrashServer


class NaNAt(FedAvg):
    name = "nan-at"
    description = "FedAvg whose global model turns NaN in round at_round (tests)"
    Params = StopParams
    Server = NaNServer
