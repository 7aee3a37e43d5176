"""The together engine's chunk step (engines/together.py, ``_ChunkStep``) as capture needs it.

A step of clients trained together whose batches are all of one size runs from static
buffers and writes its state in place, so that on CUDA it can be replayed as a graph (issue
47: "fused + graph"). On the CPU: two consecutive steps, stacked (vmap) and fused, with
cross-entropy or an algorithm's loss with step tensors and carried state, dispatch the same
operators on the same shapes, keep every state tensor's memory and leave nothing new alive
(``capture_check``); and the replay schedule (warm-up, capture, replays per shape, ragged
steps eager) gives the eager steps' numbers bit for bit.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from capture_check import recorded
from tiny_bn import NAME as TINY_BN

from fedskew.data.federated import ClientData
from fedskew.engines import together
from fedskew.engines.together import train_together
from fedskew.models import build_model
from fedskew.training.graph_replay import GraphReplay
from fedskew.training.interface import LocalTrainConfig
from fedskew.training.local import LossOutput, cross_entropy_loss

SHAPE = (1, 8, 8)
CFG = LocalTrainConfig(
    epochs=2, batch_size=8, lr=0.05, momentum=0.9, weight_decay=1e-3, augment=True,
    grad_clip=0.5,
)  # fmt: skip


def _counting_loss(model, x, y, t):  # type: ignore[no-untyped-def]
    """Cross-entropy scaled by a step tensor's row, the batch's size as aux."""
    out = cross_entropy_loss(model, x, y)
    aux = {"seen": torch.ones_like(y, dtype=x.dtype).sum()}
    return LossOutput(out.loss * t["scale"], out.features, out.logits, aux)


def _count(carried, aux):  # type: ignore[no-untyped-def]
    return {"seen": carried["seen"] + aux["seen"], "epochs": carried["epochs"]}


def _epoch_end(carried):  # type: ignore[no-untyped-def]
    """Moves one carried value into another while resetting it (as FedACD's margins do)."""
    return {"seen": torch.zeros_like(carried["seen"]), "epochs": carried["epochs"] + 1}


def _setup(sizes: list[int], loss: bool) -> tuple[Any, ...]:
    torch.manual_seed(0)
    model = build_model(TINY_BN, SHAPE, 10)
    total = sum(sizes)
    x, y = torch.randn(total, *SHAPE), torch.randint(0, 10, (total,))
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    datas = [
        ClientData(x, y, torch.arange(o, o + n), 10) for o, n in zip(starts, sizes, strict=True)
    ]
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    steps = [CFG.epochs * -(-n // CFG.batch_size) for n in sizes]
    options: dict[str, Any] = {
        "grad_shifts": [
            {n: torch.full_like(p, 1e-3 * (k + 1)) for n, p in model.named_parameters()}
            for k in range(len(sizes))
        ]
    }
    if loss:
        options.update(
            loss=_counting_loss,
            step_tensors=[{"scale": 1 + torch.arange(float(s)) / 10} for s in steps],
            carried=[{"seen": torch.zeros(()), "epochs": torch.zeros(())} for _ in sizes],
            after_step=_count,
            after_epoch=_epoch_end,
        )
    return model, datas, start, options


def _state(chunk: Any) -> list[torch.Tensor]:
    """Every tensor a chunk step reads or changes across steps."""
    return [
        *chunk.params.values(), *chunk.buffers.values(), *chunk.momentum.values(),
        chunk.loss_sums, *chunk.index.values(), *chunk.draws.values(), *chunk.rows.values(),
        *chunk.carry.values(), *chunk.extra.values(), *chunk.shifts.values(),
    ]  # fmt: skip


@pytest.mark.parametrize("fused", [False, True], ids=["vmap", "fused"])
@pytest.mark.parametrize("loss", [False, True], ids=["cross-entropy", "loss-carried"])
def test_two_chunk_steps_issue_the_same_operators_with_no_new_memory(
    fused: bool, loss: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three clients of 24 samples (every step the whole stack at batch 8), BatchNorm,
    augmentation, clipping, gradient shifts, momentum and weight decay; with a loss, a step
    tensor's row and carried state updated after each step and at each epoch's end."""
    model, datas, start, options = _setup([24, 24, 24], loss)
    real = together._ChunkStep.body
    calls: list[int] = []
    sequences, lefts, homes = [], [], []

    def body(self, key, first=False):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) not in (4, 5):
            return real(self, key, first)
        homes.append([t.data_ptr() for t in _state(self)])
        ops, left = recorded(functools.partial(real, self, key, first), _state(self))
        sequences.append(ops)
        lefts.append(left)

    monkeypatch.setattr(together._ChunkStep, "body", body)
    gens = [torch.Generator().manual_seed(k) for k in range(3)]
    train_together(model, datas, CFG, gens, [start] * 3, [2] * 3, fused=fused, **options)
    assert len(calls) == 6  # 2 epochs of 3 batches, every one a whole-stack step
    assert len(sequences) == 2 and sequences[0] == sequences[1]
    assert lefts == [[], []], lefts
    assert homes[0] == homes[1]
    names = {name for name, _ in sequences[0]}
    assert "aten.convolution_backward.default" in names
    assert any("_foreach_add_" in name for name in names)
    norm = "aten.native_batch_norm.default" if fused else "aten.var_mean.correction"
    assert norm in names  # the fused model's own BatchNorm; vmap's from its formula
    if loss:
        assert float(options["carried"][0]["seen"]) == 0.0  # reset at the last epoch's end
        assert float(options["carried"][0]["epochs"]) == 2.0


class _FakeGraph:
    """torch.cuda.CUDAGraph's stand-in on the CPU: a replay runs the captured step."""

    def __init__(self, body) -> None:  # type: ignore[no-untyped-def]
        self.body = body

    replays = 0

    def replay(self) -> None:
        _FakeGraph.replays += 1
        self.body()


@pytest.mark.parametrize("fused", [False, True], ids=["vmap", "fused"])
@pytest.mark.parametrize("loss", [False, True], ids=["cross-entropy", "loss-carried"])
def test_the_chunk_replay_schedule_gives_the_eager_steps_bits(
    fused: bool, loss: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ragged round (44, 44 and 20 samples at batch 8, two epochs) with graphs on and
    capture stood in: per shape (active clients, width) two warm-up steps, one capture and
    replays; the first step and steps where a short batch meets full ones run eagerly; the
    weights, buffers, losses and carried state are those of the eager run, bit for bit."""
    kinds: list[Any] = []
    _FakeGraph.replays = 0

    def side(self, key):  # type: ignore[no-untyped-def]
        kinds.append(("warm-up", key))
        self.body(key)

    def capture(self, key):  # type: ignore[no-untyped-def]
        kinds.append(("capture", key))
        self.graphs[key] = _FakeGraph(functools.partial(self.body, key))
        self.graphs[key].replay()

    real_ragged = together._ChunkStep.ragged

    def ragged(self, step, active):  # type: ignore[no-untyped-def]
        kinds.append(("ragged", step))
        return real_ragged(self, step, active)

    got = {}
    for graphs in (False, True):
        if graphs:
            monkeypatch.setattr(GraphReplay, "on_side_stream", side)
            monkeypatch.setattr(GraphReplay, "capture", capture)
            monkeypatch.setattr(together._ChunkStep, "ragged", ragged)
        model, datas, start, options = _setup([44, 44, 20], loss)
        gens = [torch.Generator().manual_seed(k) for k in range(3)]
        results, finals = train_together(
            model, datas, CFG, gens, [start] * 3, [2] * 3, fused=fused, graphs=graphs, **options
        )
        carried = [{n: t.clone() for n, t in c.items()} for c in options.get("carried", [])]
        got[graphs] = (results, finals, carried)
    assert got[True][0] == got[False][0]  # TrainResults: steps, samples, mean losses
    for k in range(3):
        for name, value in got[False][1][k].items():
            assert torch.equal(got[True][1][k][name], value), name
        for name, value in (got[False][2][k] if loss else {}).items():
            assert torch.equal(got[True][2][k][name], value), name
    # 6, 6 and 3 batches per epoch (the last of 4 samples): steps 0-1 all three clients at
    # 8 (0 eager: it starts momentum; 1 a warm-up); 2 ragged (8, 8, 4); 3-4 at 8 (a warm-up,
    # the capture); 5 all at 4 (a warm-up); 6-10 the first two at 8 (two warm-ups, the
    # capture, two replays); 11 the two at 4.
    assert [k for k in kinds if k[0] == "ragged"] == [("ragged", 2)]
    captured = [key for kind, key in kinds if kind == "capture"]
    assert captured == [(3, 8), (2, 8)]
    warm = [key for kind, key in kinds if kind == "warm-up"]
    assert warm == [(3, 8), (3, 8), (3, 4), (2, 8), (2, 8), (2, 4)]
    assert _FakeGraph.replays == 2 + 2  # the captures' first runs and steps 9 and 10
