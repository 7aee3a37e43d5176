"""Issue 47's fixed per-round costs: on a GPU, FedAvg's round averages the replies on the device
the clients trained on (the in-process engine leaves their arrays there) and copies the average
to the host once, instead of bringing every client's model across PCIe; the NaN/Inf checks read
one flag back per reply, not one per tensor. No CUDA here: the device boundary is exercised
with the "meta" device and spies."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fedskew.engines.client_runtime as runtime_mod
from fedskew.algorithms.fedavg import FedAvgParams, FedAvgServer
from fedskew.config import ExperimentConfig
from fedskew.engines.client_runtime import ClientRuntime
from fedskew.engines.inprocess import InProcessEngine
from fedskew.runs.loop import non_finite_array, run
from fedskew.training.protocol import ClientState, Message

META = torch.device("meta")


def runtime_on(device: torch.device, on_device: bool) -> ClientRuntime:
    rt = ClientRuntime.__new__(ClientRuntime)
    rt.device = device
    rt.replies_on_device = on_device
    return rt


@pytest.mark.parametrize("on_device", [True, False])
def test_outbound_leaves_the_reply_on_the_device_only_when_asked(monkeypatch, on_device) -> None:  # type: ignore[no-untyped-def]
    moved: list[list[str]] = []

    def to_cpu(arrays: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        moved.append(list(arrays))
        return dict(arrays)

    monkeypatch.setattr(runtime_mod, "to_cpu", to_cpu)
    reply = Message("trained", arrays={"w": torch.zeros(3, device=META)}, scalars={"loss": 1.0})
    state = ClientState(arrays={"kept": torch.zeros(2, device=META)})
    out = runtime_on(META, on_device).outbound(reply, state)
    # The client's state always comes back to the host (between rounds it takes no GPU memory).
    assert moved[0] == ["kept"]
    if on_device:
        assert moved == [["kept"]] and out.arrays["w"] is reply.arrays["w"]
    else:
        assert moved == [["kept"], ["w"]]


def fedavg_server(global_arrays: dict[str, torch.Tensor]) -> FedAvgServer:
    server = FedAvgServer.__new__(FedAvgServer)
    server.params = FedAvgParams()
    server.private = None
    server.global_arrays = global_arrays
    return server


class Replies:
    """A channel whose clients reply with the given models (no engine)."""

    def __init__(self, models: dict[int, dict[str, torch.Tensor]]) -> None:
        self.models = models

    def exchange(self, messages: Any, expect: Any = None) -> dict[int, Message]:
        return {
            c: Message("trained", arrays=self.models[c], scalars={"num_samples": 1.0 + c,
                                                                  "loss": 0.5})
            for c in messages
        }  # fmt: skip


def test_fedavg_puts_the_average_where_the_global_model_lives() -> None:
    """Replies in one place (here the host), the global model in another (here "meta", as the
    host is on a GPU run): the new global model stays where it was, one copy of the average."""
    server = fedavg_server(
        {"w": torch.zeros(2, device=META), "n": torch.zeros((), dtype=torch.long, device=META)}
    )
    models = {c: {"w": torch.full((2,), float(c)), "n": torch.tensor(c)} for c in (1, 2)}
    metrics = server.round(0, [1, 2], Replies(models))  # type: ignore[arg-type]
    assert metrics == {"train_loss": 0.5}
    assert {t.device for t in server.global_arrays.values()} == {META}
    assert server.takes_device_replies()
    server.private = object()  # type: ignore[assignment]  # secure aggregation / DP: host
    assert not server.takes_device_replies()


def test_fedavg_averages_on_the_device_of_the_replies(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import fedskew.algorithms.fedavg as fedavg_mod

    seen: list[set[torch.device]] = []
    real = fedavg_mod.weighted_average

    def spy(states: Any, weights: Any) -> dict[str, torch.Tensor]:
        seen.append({t.device for s in states for t in s.values()})
        return real(states, weights)

    monkeypatch.setattr(fedavg_mod, "weighted_average", spy)
    server = fedavg_server({"w": torch.zeros(2, device=META)})
    models = {c: {"w": torch.zeros(2, device=META)} for c in (0, 1)}
    server.round(0, [0, 1], Replies(models))  # type: ignore[arg-type]
    assert seen == [{META}]  # nothing was brought to the host to be averaged


def tiny(tmp_path: Any, algorithm: str, **extra: Any) -> ExperimentConfig:
    return ExperimentConfig(
        algorithm=algorithm, num_clients=4, clients_per_round=2, rounds=1, local_epochs=1,
        workers=0, out_dir=str(tmp_path), quiet=True, seed=0, **extra,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("algorithm", "extra", "expected"),
    [
        ("fedavg", {}, True),
        ("fedprox", {}, True),  # FedAvg's server, its own client loss
        ("scaffold", {}, False),  # its server keeps control variates on the host
        ("fedavg", {"local_risk_every": 1}, False),  # the measurement keeps host copies
    ],
)
def test_the_run_loop_asks_for_device_replies_only_for_such_servers(  # type: ignore[no-untyped-def]
    tmp_path, monkeypatch, algorithm, extra, expected
) -> None:
    during: list[Any] = []
    real = InProcessEngine.exchange

    def exchange(self: InProcessEngine, messages: Any, expect: Any = None) -> Any:
        during.append(getattr(self, "replies_on_device", None))
        return real(self, messages, expect)

    monkeypatch.setattr(InProcessEngine, "exchange", exchange)
    engines: list[InProcessEngine] = []
    real_init = InProcessEngine.__init__

    def init(self: InProcessEngine, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        engines.append(self)

    monkeypatch.setattr(InProcessEngine, "__init__", init)
    run(tiny(tmp_path, algorithm, **extra))
    assert during and all(d is expected for d in during), during
    assert engines[0].replies_on_device is False  # put back after the round


def test_non_finite_array_reads_one_flag_back(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Each bool() of a tensor is a device synchronisation on a GPU: one per check; and no
    boolean copy of every element is made (isfinite sees two extremes per tensor)."""
    arrays = {f"t{i}": torch.ones(1000) for i in range(50)}
    arrays["count"] = torch.tensor(3)
    reads = []
    sizes: list[int] = []
    real_bool, real_isfinite = torch.Tensor.__bool__, torch.isfinite

    def counted(self: torch.Tensor) -> bool:
        reads.append(1)
        return real_bool(self)

    def isfinite(t: torch.Tensor) -> torch.Tensor:
        sizes.append(t.numel())
        return real_isfinite(t)

    monkeypatch.setattr(torch.Tensor, "__bool__", counted)
    monkeypatch.setattr(torch, "isfinite", isfinite)
    assert non_finite_array(arrays) is None
    assert len(reads) == 1
    assert max(sizes) <= 2 * 50  # the extremes, not the 50,000 elements


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_non_finite_array_finds_the_first_bad_tensor(bad, dtype) -> None:  # type: ignore[no-untyped-def]
    arrays = {
        "empty": torch.zeros(0, dtype=dtype),
        "big": torch.full((5,), 1e300, dtype=torch.float64),  # finite, beyond float32
        **{f"t{i}": torch.ones(3, 4, dtype=dtype) for i in range(10)},
        "count": torch.tensor(3),
    }
    assert non_finite_array(arrays) is None
    arrays["t7"][1, 2] = bad
    arrays["t9"][0, 0] = bad
    assert non_finite_array(arrays) == "t7"
    assert non_finite_array({"count": torch.tensor(1)}) is None
    assert non_finite_array({}) is None
