"""SCAFFOLD details beyond tests/test_baselines_opt.py: the correction under momentum and
weight decay, and the ``weighting`` option (sample-weighted mean of the clients' models).

Expected values come from a hand-written momentum-SGD loop and explicit weighted sums.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fedskew.algorithms.scaffold import Scaffold
from fedskew.apps.cli import main
from fedskew.core.errors import UsageError
from fedskew.data.federated import ClientData
from fedskew.models import build_model
from fedskew.models.base import BodyHeadModel
from fedskew.training.interface import ClientContext, LocalTrainConfig, ServerSetup
from fedskew.training.protocol import SCALAR_BYTES, ClientState, Message

D, C = 3, 2  # input features, classes of the tiny linear model


def tiny_model() -> BodyHeadModel:
    gen = torch.Generator().manual_seed(0)
    model = BodyHeadModel(torch.nn.Identity(), torch.nn.Linear(D, C), feature_dim=D)
    with torch.no_grad():
        model.head.weight.copy_(torch.randn(C, D, generator=gen))
        model.head.bias.copy_(torch.randn(C, generator=gen))
    return model


def tiny_data(n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, D, generator=torch.Generator().manual_seed(1))
    return x, torch.tensor([0, 1] * (n // 2))


def context(x, y, *, epochs, lr, momentum, weight_decay, state) -> ClientContext:
    """One client holding all of (x, y), full batch, so each epoch is one step."""
    return ClientContext(
        client_id=0,
        round=0,
        seed=0,
        data=ClientData(x, y, torch.arange(len(y)), num_classes=C),
        model=tiny_model(),
        state=state,
        train=LocalTrainConfig(
            epochs=epochs,
            batch_size=len(y),
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
        ),
    )


def ce_grads(w: torch.Tensor, b: torch.Tensor, x: torch.Tensor, y: torch.Tensor):
    w = w.detach().clone().requires_grad_(True)
    b = b.detach().clone().requires_grad_(True)
    F.cross_entropy(x @ w.T + b, y).backward()
    return w.grad, b.grad


def test_correction_goes_through_momentum_and_c_k_is_the_decayed_gradient_mean():
    x, y = tiny_data()
    model = tiny_model()
    w0, b0 = model.head.weight.detach().clone(), model.head.bias.detach().clone()
    c = {"head.weight": torch.full((C, D), 0.3), "head.bias": torch.tensor([-0.2, 0.1])}
    ck = {"head.weight": torch.full((C, D), 0.1), "head.bias": torch.tensor([0.4, 0.0])}
    state = ClientState(arrays={f"scaffold.c_k/{k}": v.clone() for k, v in ck.items()})
    msg = Message(
        "train",
        arrays={"head.weight": w0, "head.bias": b0, **{f"c/{k}": v for k, v in c.items()}},
    )
    K, lr, rho, wd = 3, 0.2, 0.5, 0.1
    reply = Scaffold.Client(Scaffold.make_params({})).handle(
        msg, context(x, y, epochs=K, lr=lr, momentum=rho, weight_decay=wd, state=state)
    )
    # heavy-ball SGD by hand: direction = CE gradient + decay + (c - c_k), all through momentum
    w, b = w0.clone(), b0.clone()
    buf_w = buf_b = None
    decayed_w, decayed_b = [], []  # the local objective's gradients seen at each step
    for _ in range(K):
        gw, gb = ce_grads(w, b, x, y)
        gw, gb = gw + wd * w, gb + wd * b
        decayed_w.append(gw)
        decayed_b.append(gb)
        dw = gw + c["head.weight"] - ck["head.weight"]
        db = gb + c["head.bias"] - ck["head.bias"]
        buf_w = dw if buf_w is None else rho * buf_w + dw
        buf_b = db if buf_b is None else rho * buf_b + db
        w, b = w - lr * buf_w, b - lr * buf_b
    assert torch.allclose(reply.arrays["head.weight"], w, atol=1e-5)
    assert torch.allclose(reply.arrays["head.bias"], b, atol=1e-5)
    # step s's direction is applied with 1 + rho + ... + rho^(K-s); c_k+ is their weighted
    # mean of the decayed gradients (the correction cancels out exactly)
    coef = [sum(rho**j for j in range(K - s)) for s in range(K)]  # 1.75, 1.5, 1
    a = sum(coef)
    mean_w = sum(cs * g for cs, g in zip(coef, decayed_w, strict=True)) / a
    mean_b = sum(cs * g for cs, g in zip(coef, decayed_b, strict=True)) / a
    assert torch.allclose(state.arrays["scaffold.c_k/head.weight"], mean_w, atol=1e-5)
    assert torch.allclose(state.arrays["scaffold.c_k/head.bias"], mean_b, atol=1e-5)
    assert torch.allclose(reply.arrays["dc/head.weight"], mean_w - ck["head.weight"], atol=1e-5)
    assert torch.allclose(reply.arrays["dc/head.bias"], mean_b - ck["head.bias"], atol=1e-5)


@pytest.mark.parametrize("weighting", ["uniform", "samples"])
def test_client_sends_its_sample_count_only_when_the_server_weights_by_it(weighting):
    x, y = tiny_data(8)
    model = tiny_model()
    msg = Message(
        "train",
        arrays={
            **{k: v.detach().clone() for k, v in model.state_dict().items()},
            "c/head.weight": torch.zeros(C, D),
            "c/head.bias": torch.zeros(C),
        },
    )
    reply = Scaffold.Client(Scaffold.make_params({"weighting": weighting})).handle(
        msg, context(x, y, epochs=1, lr=0.1, momentum=0.0, weight_decay=0.0, state=ClientState())
    )
    if weighting == "samples":
        assert reply.scalars["num_samples"] == 8.0
    else:
        assert "num_samples" not in reply.scalars
    assert "loss" in reply.scalars


class FixedReplies:
    def __init__(self, replies: dict[int, Message]) -> None:
        self.replies = replies

    def exchange(self, messages, expect=None):
        return {c: self.replies[c] for c in messages}


@pytest.mark.parametrize("weighting, expected", [("uniform", [2.0, 1.0]), ("samples", [1.5, 0.5])])
def test_server_mean_of_models_by_weighting_and_c_always_over_all_clients(weighting, expected):
    init = {"w": torch.tensor([1.0, 2.0])}
    setup = ServerSetup(
        init, num_clients=4, num_classes=C, client_sizes=[1, 1, 3, 1], seed=0,
        train=LocalTrainConfig(),
    )  # fmt: skip
    server = Scaffold.Server(Scaffold.make_params({"weighting": weighting}), setup)
    replies = {
        0: Message(
            "trained",
            arrays={"w": torch.tensor([3.0, 2.0]), "dc/w": torch.tensor([0.4, 0.0])},
            scalars={"loss": 1.0, "num_samples": 1.0},
        ),
        2: Message(
            "trained",
            arrays={"w": torch.tensor([1.0, 0.0]), "dc/w": torch.tensor([0.0, -0.8])},
            scalars={"loss": 3.0, "num_samples": 3.0},
        ),
    }
    server.round(0, [0, 2], FixedReplies(replies))
    # uniform: ([3, 2] + [1, 0]) / 2; samples: (1 * [3, 2] + 3 * [1, 0]) / 4
    assert torch.allclose(server.global_arrays["w"], torch.tensor(expected))
    # c + (1/N) sum dc with N = 4, whatever the weighting of the models
    assert torch.allclose(server.c["w"], torch.tensor([0.1, -0.2]))


def test_bad_weighting_is_refused():
    with pytest.raises(UsageError, match="weighting"):
        Scaffold.make_params({"weighting": "bogus"})
    assert Scaffold.make_params({}).weighting == "uniform"


FAST = ["--rounds", "3", "--local-epochs", "1", "-q"]
PER_ROUND = 8  # 40 % of the 20 default clients


def run_cli(tmp: Path, name: str, *args: str) -> list[dict]:
    assert main(["run", *args, "-o", str(tmp), "--name", name, *FAST]) == 0
    lines = (tmp / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_sample_weighting_end_to_end_traffic_and_first_round_equals_fedavg(tmp_path):
    records = run_cli(tmp_path, "s", "-a", "scaffold", "-p", "weighting=samples")
    fedavg = run_cli(tmp_path, "f", "-a", "fedavg")
    assert [r["round"] for r in records] == [1, 2, 3]
    model = build_model("mlp", (1, 8, 8), 10)
    state = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    # down: w and c; up: y_k, delta c_k, loss and num_samples
    assert all(r["bytes_down"] == PER_ROUND * (state + params) for r in records)
    assert all(r["bytes_up"] == PER_ROUND * (state + params + 2 * SCALAR_BYTES) for r in records)
    # round 1 has c = c_k = 0: no correction, so sample-weighted SCAFFOLD is FedAvg there
    assert records[0]["accuracy"] == fedavg[0]["accuracy"]
    assert records[0]["loss"] == pytest.approx(fedavg[0]["loss"], rel=1e-6)
