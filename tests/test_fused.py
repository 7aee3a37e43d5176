"""A round's clients as one fused model with native BatchNorm (``--clients-together fused``,
engines/fused.py) against one after another: float64 equality for every model of the zoo and
every algorithm that trains together, ragged rounds included; algorithms with a loss of their
own train by vmap with the reason logged; the operators of a fused ResNet-18 step do not grow
with the number of clients and stay within 1.1x one client's step."""

from __future__ import annotations

import logging
import sys
from collections import Counter
from functools import partial
from pathlib import Path

import pytest
import torch
from test_together import (
    F32_WEIGHTS,
    SEAMS,
    _assert_float64_equal,
    _chunks_seen,
    _compare,
    _fm_options,
    _rounds,
)
from tiny_bn import NAME as TINY_BN
from torch import nn

from fedskew.algorithms.feddyn import GRAD, SERVER, dynamic_loss
from fedskew.algorithms.fednh import PrototypeHead
from fedskew.algorithms.fedprox import proximal_loss
from fedskew.config import ExperimentConfig
from fedskew.core.errors import UsageError
from fedskew.data.federated import ClientData
from fedskew.engines import together
from fedskew.engines.fused import fused_obstacle
from fedskew.engines.together import fused_why_not, resolve_mode, train_together
from fedskew.models import BodyHeadModel, build_model
from fedskew.training.interface import LocalTrainConfig
from fedskew.training.local import cross_entropy_loss, local_train

# The operator counting of benchmarks/fused_op_count.py (every algorithm through real runs):
# aten operators cut into steps, and the views that launch no kernel on a GPU.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from fused_op_count import StepOps as _Steps  # noqa: E402
from fused_op_count import non_view as _kernels  # noqa: E402

sys.path.pop(0)

# Every model of the zoo with each of its normalisations, at tiny widths.
ZOO = {
    "mlp": ("mlp", {"hidden": 16}, (1, 16, 16)),
    "simple-cnn": ("simple-cnn", {}, (1, 16, 16)),
    "simple-cnn-bn": ("simple-cnn", {"norm": "bn"}, (1, 16, 16)),
    "simple-cnn-gn": ("simple-cnn", {"norm": "gn"}, (1, 16, 16)),
    "fedavg-cnn": ("fedavg-cnn", {}, (1, 16, 16)),
    "cnn-cifar": ("cnn-cifar", {}, (3, 16, 16)),
    "resnet18-bn": ("resnet18", {"width": 4}, (3, 8, 8)),
    "resnet18-gn": ("resnet18", {"width": 4, "norm": "gn"}, (3, 8, 8)),
    "resnet18-bn-imagenet-stem": ("resnet18", {"width": 4, "stem": "imagenet"}, (3, 16, 16)),
    "tiny-bn-cnn": (TINY_BN, {}, (1, 8, 8)),
    # FedNH's head, which fuses itself (fused_forward), on simple-cnn with BatchNorm.
    "fednh-prototype-head": ("simple-cnn", {"norm": "bn"}, (1, 16, 16)),
}
# Ragged: 20 samples in batches of 8 are 8, 8, 4 an epoch; 13 are 8, 5; 11 are 8, 3; and one
# client trains one epoch where the others train two, so later steps hold fewer clients.
SIZES = [20, 20, 13, 11]
EPOCHS = [2, 1, 2, 2]


def _clients_per_call(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """The number of clients of each call train_together makes of its fused forward
    ``name`` (``fused_logits``: a cross-entropy step's; ``fused_body``: a loss's bodies)."""
    seen: list[int] = []
    real = getattr(together, name)

    def spy(module, params, buffers, x):  # type: ignore[no-untyped-def]
        seen.append(x.shape[0])
        return real(module, params, buffers, x)

    monkeypatch.setattr(together, name, spy)
    return seen


@pytest.mark.parametrize("case", sorted(ZOO))
def test_fused_model_is_one_after_another_in_float64(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each client's weights, BatchNorm buffers (running statistics and batch counter) and
    mean loss after a ragged round of clipped momentum SGD with weight decay (and crops and
    flips for images) equal that client trained alone, to 1e-10 in float64."""
    name, options, shape = ZOO[case]
    generator = torch.Generator().manual_seed(0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = build_model(name, shape, 10, **options)
        if case == "fednh-prototype-head":
            model.head = PrototypeHead(torch.randn(10, model.feature_dim), 3.0)
        model = model.double()
    x = torch.randn(sum(SIZES), *shape, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 10, (sum(SIZES),), generator=generator)
    offsets = [sum(SIZES[:k]) for k in range(len(SIZES))]
    datas = [
        ClientData(x, y, torch.arange(o, o + n), 10) for o, n in zip(offsets, SIZES, strict=True)
    ]
    cfg = LocalTrainConfig(
        epochs=2, batch_size=8, lr=0.05, momentum=0.9, weight_decay=1e-3, grad_clip=1.0,
        augment=True,
    )  # fmt: skip
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    calls = _clients_per_call(monkeypatch, "fused_logits")
    gens = [torch.Generator().manual_seed(k) for k in range(len(SIZES))]
    results, finals = train_together(model, datas, cfg, gens, [start] * 4, EPOCHS, fused=True)
    # Fused every step: whole stacks, prefixes and one forward per batch size (3 clients
    # end an epoch with 4, 5 and 3 samples at the same step).
    assert len(calls) >= max(EPOCHS[k] * -(-SIZES[k] // 8) for k in range(4))
    assert set(calls) > {4}
    for k in range(len(SIZES)):
        model.load_state_dict(start)
        alone = local_train(
            model, datas[k], LocalTrainConfig(**{**vars(cfg), "epochs": EPOCHS[k]}),
            torch.Generator().manual_seed(k),
        )  # fmt: skip
        assert results[k].steps == alone.steps
        # Both loops sum the losses in a float32 accumulator.
        assert results[k].mean_loss == pytest.approx(alone.mean_loss, rel=1e-6)
        for key, value in model.state_dict().items():
            if value.is_floating_point():
                torch.testing.assert_close(finals[k][key], value, rtol=0, atol=1e-10, msg=key)
            else:  # BatchNorm's batch counter
                assert torch.equal(finals[k][key], value), key


# Algorithms that train together today with cross-entropy (no loss of their own): fused.
FUSED = {
    "fedavg": {"algorithm": "fedavg", "model": TINY_BN, "augment": True, "grad_clip": 0.5},
    "fedavg-resnet18-gn": {"model": "resnet18", "model_options": {"width": 4, "norm": "gn"}},
    "fednova": SEAMS["fednova"],
    "scaffold": SEAMS["scaffold"],  # its correction as the gradient shift of the fused step
}


@pytest.mark.parametrize("case", sorted(FUSED))
def test_cross_entropy_algorithms_train_fused_as_one_after_another_in_float64(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the whole run loop: every training exchange's clients in one stack, every
    step fused, the global models, client states and round records equal one after
    another's to 1e-10 in float64."""
    expected, alone = _rounds("off", dtype=torch.float64, **FUSED[case])
    sizes = _chunks_seen(monkeypatch)
    calls = _clients_per_call(monkeypatch, "fused_logits")
    got, fused = _rounds("fused", dtype=torch.float64, **FUSED[case])
    assert sum(sizes) == 4 * len(expected) and calls
    _assert_float64_equal(case, expected, alone, got, fused)


# Cross-entropy algorithms whose servers do not run in float64 (one after another either):
# CReFF's re-training mixes float32 synthetic features with the model, FedNH's prototype
# sums are float32.
FP32_ONLY = {
    "creff": {"algorithm": "creff", "params": {"match_epochs": 3, "crt_epochs": 5}},
    "fednh": {"algorithm": "fednh", "model": TINY_BN},
}


@pytest.mark.parametrize("case", sorted(FP32_ONLY))
def test_fp32_servers_train_fused_as_one_after_another(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Their clients train with cross-entropy, fused; compared in fp32, to test_together's
    fp32 tolerances (grouped kernels round differently)."""
    options = FP32_ONLY[case]
    expected, alone = _rounds("off", **options)
    calls = _clients_per_call(monkeypatch, "fused_logits")
    got, fused = _rounds("fused", **options)
    assert calls and fused.engine.clients_together == "fused"
    _compare(expected, alone, got, fused, {**F32_WEIGHTS, "metrics": 1 / 360 + 1e-9})


# Algorithms with a loss of their own (issue 47): the loss runs under vmap, the body fused.
MOON_RESNET = {"params": {"mu": 1.0, "out_dim": 16}, "model": "resnet18"}
LOSSES = {
    **{case: SEAMS[case] for case in sorted(set(SEAMS) - set(FUSED))},
    "fedacd-mixup-margins": {"algorithm": "fedacd", "model": TINY_BN, "augment": True},
    **{case: _fm_options(case) for case in ("fedprox+fm-l2", "moon+fm-warmup", "fedacd+fm")},
    "fedprox-resnet18-gn": {"algorithm": "fedprox", "params": {"mu": 0.1},
                            "model": "resnet18", "model_options": {"width": 8, "norm": "gn"}},
    # MOON's frozen global and previous models (eval-mode BatchNorm, by running statistics)
    # beside the student's BatchNorm, in rounds that mix clients with and without a previous
    # model. At lr 0.01: at the default 0.05, three rounds of this ResNet-18 (1x1 in its last
    # stage on 8x8 digits) amplify float64 rounding to 1e-8 (MOON) and 1e-7 (FedAvg), as far
    # as one after another moves from itself with each batch's rows reversed; at 0.01 both
    # stay near 5e-13 (benchmarks/results/fused_float64_drift.md).
    "moon-resnet18-bn": {"algorithm": "moon", "rounds": 3, "lr": 0.01, **MOON_RESNET,
                         "model_options": {"width": 8}},
    "moon-resnet18-gn": {"algorithm": "moon", "rounds": 3, **MOON_RESNET,
                         "model_options": {"width": 8, "norm": "gn"}},
    "fedntd-mlp": {"algorithm": "fedntd", "params": {"tau": 2.0}, "model": "mlp"},
}  # fmt: skip
FAST_LOSSES = {"fedprox", "moon", "fedacd-mixup-margins"}


@pytest.mark.parametrize(
    "case",
    [c if c in FAST_LOSSES else pytest.param(c, marks=pytest.mark.slow) for c in sorted(LOSSES)],
)
def test_algorithms_with_their_own_loss_train_fused_as_one_after_another_in_float64(
    case: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An algorithm's own loss runs per client under vmap while every call of the model's
    body (on the batch, on FedACD's mixup, MOON's frozen models, FedNTD's teacher) runs as
    one fused forward with torch's own BatchNorm: as one after another in float64, ragged
    steps included, and the log does not say vmap."""
    expected, alone = _rounds("off", dtype=torch.float64, **LOSSES[case])
    bodies = _clients_per_call(monkeypatch, "fused_body")
    with caplog.at_level(logging.INFO, logger="fedskew"):
        got, stacked = _rounds("fused", dtype=torch.float64, **LOSSES[case])
    assert bodies and set(bodies) > {1}
    assert "not fused" not in caplog.text
    assert stacked.engine.clients_together == "fused"
    _assert_float64_equal(case, expected, alone, got, stacked)


class _Tanh(BodyHeadModel):
    pass


def test_a_model_with_a_layer_it_does_not_fuse_trains_by_vmap() -> None:
    """A layer the fused model does not know (Tanh) or a subclass whose forward it would not
    follow: the reason names it, and train_together(fused=True) trains by vmap."""
    model = build_model("mlp", (4,), 3, hidden=8)
    model.body.relu1 = nn.Tanh()
    assert "body.relu1 is a Tanh" in fused_obstacle(model)
    other = _Tanh(nn.Sequential(nn.Flatten()), nn.Linear(4, 3), 4)
    assert "the model is a _Tanh" in fused_obstacle(other)
    assert fused_why_not(build_model("resnet18", (3, 8, 8), 10, width=4), None) == ""
    assert fused_why_not(build_model("mlp", (4,), 3), cross_entropy_loss) == ""
    x, y = torch.randn(12, 4), torch.randint(0, 3, (12,))
    datas = [ClientData(x, y, torch.arange(6 * k, 6 * k + 6), 3) for k in range(2)]
    start = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = LocalTrainConfig(epochs=1, batch_size=4)
    args = (model, datas, cfg)
    _, by_vmap = train_together(*args, [torch.Generator().manual_seed(k) for k in range(2)],
                                [start] * 2, [1, 1])  # fmt: skip
    _, asked = train_together(*args, [torch.Generator().manual_seed(k) for k in range(2)],
                              [start] * 2, [1, 1], fused=True)  # fmt: skip
    for a, b in zip(by_vmap, asked, strict=True):
        for key in a:
            assert torch.equal(a[key], b[key]), key


def test_the_option_takes_fused() -> None:
    assert ExperimentConfig(clients_together="fused").clients_together == "fused"
    assert resolve_mode("fused", torch.device("cpu")) == "fused"
    assert resolve_mode("auto", torch.device("cpu")) == "off"  # the default is unchanged
    with pytest.raises(UsageError, match="auto, off, vmap, fused"):
        ExperimentConfig(clients_together="fuse").validate()


# ---------------------------------------------------------------------------- operators

SHAPE, BATCH, STEPS = (3, 8, 8), 4, 3


def _data(clients: int) -> list[ClientData]:
    n = BATCH * STEPS
    x, y = torch.randn(n * clients, *SHAPE), torch.randint(0, 10, (n * clients,))
    return [ClientData(x, y, torch.arange(k * n, (k + 1) * n), 10) for k in range(clients)]


CFG = LocalTrainConfig(
    epochs=1, batch_size=BATCH, lr=0.01, momentum=0.9, weight_decay=1e-5, augment=True
)


def _anchor(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in model.named_parameters()}


def _dyn_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """FedDyn's per-client tensors: g_k (made up: its value changes no operator) and theta."""
    anchor = _anchor(model)
    return {
        **{GRAD + k: torch.full_like(p, 0.01) for k, p in anchor.items()},
        **{SERVER + k: p for k, p in anchor.items()},
    }


def _prox_of_tensors(model, x, y, tensors):  # type: ignore[no-untyped-def]
    return proximal_loss(model, x, y, list(tensors.values()), 0.1)


def _dyn_of_tensors(model, x, y, tensors):  # type: ignore[no-untyped-def]
    variables = [(p, tensors[GRAD + k], tensors[SERVER + k]) for k, p in model.named_parameters()]
    return dynamic_loss(model, x, y, variables, 0.1)


def _ce_of_tensors(model, x, y, tensors):  # type: ignore[no-untyped-def]
    return cross_entropy_loss(model, x, y)


# An algorithm's loss of (model, x, y, tensors) and its per-client tensors, by name.
COUNTED_LOSSES = {
    "cross-entropy": (_ce_of_tensors, _anchor),
    "fedprox": (_prox_of_tensors, _anchor),
    "feddyn": (_dyn_of_tensors, _dyn_tensors),
}


def _one_client_steps(loss: str | None = None) -> list[Counter[str]]:
    """One client's steps of ResNet-18 (local_train, with the multi-tensor SGD torch uses
    on CUDA), each from the end of one optimiser step to the end of the next; ``loss``: one
    of COUNTED_LOSSES (None: local_train's own cross-entropy)."""
    torch.manual_seed(0)
    model = build_model("resnet18", SHAPE, 10, width=8)
    mode = _Steps()

    class Counted(torch.optim.SGD):
        def step(self, closure=None):  # type: ignore[no-untyped-def]
            out = super().step(closure)
            mode.cut()
            return out

    opt = Counted(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-5, foreach=True)
    loss_fn = cross_entropy_loss
    if loss is not None:
        of_tensors, make = COUNTED_LOSSES[loss]
        loss_fn = partial(_with_tensors, of_tensors, make(model))
    with mode:
        local_train(
            model, _data(1)[0], CFG, torch.Generator().manual_seed(0), optimizer=opt,
            loss_fn=loss_fn,
        )  # fmt: skip
    return mode.steps[1:]  # the first holds the epoch's drawing


def _with_tensors(of_tensors, tensors, model, x, y):  # type: ignore[no-untyped-def]
    return of_tensors(model, x, y, tensors)


def _fused_steps(
    clients: int, monkeypatch: pytest.MonkeyPatch, loss: str | None = None
) -> list[Counter[str]]:
    """Fused steps of ``clients`` ResNet-18 clients, cut as ``_one_client_steps``; ``loss``:
    one of COUNTED_LOSSES, under vmap with the body fused (None: the fused cross-entropy step)."""
    torch.manual_seed(0)
    model = build_model("resnet18", SHAPE, 10, width=8)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    mode = _Steps()
    real = together._sgd_step

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        real(*args, **kwargs)
        mode.cut()

    monkeypatch.setattr(together, "_sgd_step", counted)
    gens = [torch.Generator().manual_seed(k) for k in range(clients)]
    of_tensors, make = COUNTED_LOSSES[loss] if loss is not None else (None, None)
    with mode:
        train_together(
            model, _data(clients), CFG, gens, [start] * clients, [1] * clients, fused=True,
            loss=of_tensors, tensors=[make(model)] * clients if make is not None else (),
        )  # fmt: skip
    return mode.steps[1:]  # the first holds the stacking and the drawing of batches


def test_a_fused_resnet18_step_costs_what_one_clients_step_costs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 47: a fused step issues the same operators for 2 clients as for 5 (no work per
    client) and at most 1.1x the non-view operators of one client's step (the vmap step
    issued about 4.6x: BatchNorm computed from its formula)."""
    one = _one_client_steps()
    two, five = _fused_steps(2, monkeypatch), _fused_steps(5, monkeypatch)
    assert len(one) == len(two) == len(five) == STEPS - 1
    assert two == five
    alone, fused = _kernels(one[-1]), _kernels(five[-1])
    print(f"non-view operators per step: one client {alone}, fused {fused}")
    assert fused <= 1.1 * alone
    assert five[-1]["native_batch_norm"] == 20 and five[-1]["convolution"] == 20


def test_fused_bf16_is_bf16_autocast_one_after_another() -> None:
    """Under --precision bf16 the fused model's layers are torch's own, which autocast
    reaches (no explicit casts as inside vmap): the losses and weights of each client are
    those of bf16 one after another up to the grouped kernels' rounding."""
    torch.manual_seed(0)
    model = build_model("simple-cnn", (1, 16, 16), 10, norm="bn")
    x, y = torch.randn(55, 1, 16, 16), torch.randint(0, 10, (55,))
    datas = [ClientData(x, y, torch.arange(o, o + n), 10) for o, n in ((0, 20), (20, 15), (35, 20))]
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cfg = LocalTrainConfig(epochs=1, batch_size=8, lr=0.05, momentum=0.9, precision="bf16")
    gens = [torch.Generator().manual_seed(k) for k in range(3)]
    results, finals = train_together(model, datas, cfg, gens, [start] * 3, [1] * 3, fused=True)
    worst = 0.0
    for k in range(3):
        model.load_state_dict(start)
        alone = local_train(model, datas[k], cfg, torch.Generator().manual_seed(k))
        assert results[k].mean_loss == pytest.approx(alone.mean_loss, rel=1e-3)
        for key, value in model.state_dict().items():
            worst = max(worst, float((finals[k][key].double() - value.double()).abs().max()))
    print(f"bf16: fused against one after another, largest weight difference {worst:.2e}")
    assert worst < 1e-3  # by vmap: 0.15 here (its explicit casts round elsewhere)


@pytest.mark.parametrize("loss", sorted(COUNTED_LOSSES))
def test_a_fused_loss_steps_resnet18_costs_what_one_clients_step_costs(
    loss: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 47 for an algorithm's own loss (run under vmap, the body fused): the same
    operators for 2 clients as for 5, and at most 1.1x one client's step with the same loss
    (vmap with BatchNorm from its formula: several times). FedProx's and FedDyn's terms over
    all parameter tensors cost a few operators whatever the number of tensors (written per
    tensor, FedProx's cost about three a tensor alone and four under vmap, a fused step 1.16x
    one client's, and FedDyn's more): beyond cross-entropy, one client's step adds one
    operator per tensor (its gradient summed with the cross-entropy's) and a few dozen more
    at most."""
    ce_alone = _kernels(_one_client_steps()[-1])
    one = _one_client_steps(loss)
    two, five = _fused_steps(2, monkeypatch, loss), _fused_steps(5, monkeypatch, loss)
    assert len(one) == len(two) == len(five) == STEPS - 1
    assert two == five
    alone, fused, fused_two = _kernels(one[-1]), _kernels(five[-1]), _kernels(two[-1])
    print(f"{loss}, non-view operators per step: one client {alone}, fused {fused_two} for 2 "
          f"clients and {fused} for 5 (cross-entropy alone: one client {ce_alone})")  # fmt: skip
    assert fused <= 1.1 * alone
    assert five[-1]["native_batch_norm"] == 20 and five[-1]["convolution"] == 20
    tensors = len(list(build_model("resnet18", SHAPE, 10, width=8).parameters()))
    assert alone - ce_alone <= tensors + 24
