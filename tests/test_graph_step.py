"""The graph-safe local step (fedskew.training.graph_step) against local_train.

``run_plain`` trains with the graph-safe step by default; ``local_step_path("loop")`` gives
the reference, ``local_train`` with ``torch.optim.SGD``. Every algorithm (each trains through
``run_plain``), the feature-matching plug-in and FedACD's step tensors and carried state,
with momentum, weight decay, clipping, augmentation and ragged last batches, must give the
same bits in fp32 and in float64: global models, every client's state and the round records.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from capture_check import recorded as _recorded
from test_together import CASES, SEAMS, _fm_options, _rounds, _seam_plan
from tiny_bn import NAME as TINY_BN

from fedskew.apps.cli import main
from fedskew.assembly.prepare import new_model, prepare
from fedskew.config import ExperimentConfig
from fedskew.data.federated import ClientData
from fedskew.models import build_model
from fedskew.training.graph_replay import GraphReplay
from fedskew.training.graph_step import LocalStep, resolve_graphs
from fedskew.training.interface import ClientContext, LocalTrainConfig
from fedskew.training.local import (
    LossOutput,
    batch_bounds,
    cross_entropy_loss,
    draw_augmentation,
    local_step_path,
    make_optimizer,
    run_plain,
    set_arrays,
)
from fedskew.training.protocol import ClientState

FM = ("fedavg+fm", "scaffold+fm-uniform", "fedrod+fm", "fedacd+fm", "fedcme+fm")
ALGORITHMS = {**CASES, **SEAMS, **{k: _fm_options(k) for k in FM}}
# CReFF's and FedNH's server-side features are fp32 whatever the model's dtype: they do not run
# in float64 on either path (their local step is cross-entropy, fedavg's in float64 here).
FP32_ONLY = {"creff", "fednh-bn"}


def _same_bits(a_state, b_state, a_records, b_records) -> None:  # type: ignore[no-untyped-def]
    for name, value in a_state.server.global_arrays.items():
        assert torch.equal(b_state.server.global_arrays[name], value), name
    states, other = a_state.engine.client_states, b_state.engine.client_states
    assert sorted(states) == sorted(other)
    for cid, state in states.items():
        assert sorted(state.arrays) == sorted(other[cid].arrays), cid
        for name, value in state.arrays.items():
            assert torch.equal(other[cid].arrays[name], value), (cid, name)
        assert state.scalars == other[cid].scalars, cid
    assert a_records == b_records


# float64 repeats fp32's bit-for-bit check in another dtype (the same operators, so it adds
# little): every algorithm with -m slow, these in the default run (BatchNorm, augmentation and
# clipping; a gradient shift; step tensors and carried state; a tensor trained beside the
# model; the plug-in's loss terms).
FLOAT64_DEFAULT = {"fedavg-bn-augment-clip", "scaffold", "fedacd-bn-augment", "fedrod", "fedacd+fm"}
CASES_BY_DTYPE = [
    pytest.param(case, torch.float32, id=f"{case}-fp32") for case in sorted(ALGORITHMS)
]
CASES_BY_DTYPE += [
    pytest.param(
        case,
        torch.float64,
        id=f"{case}-float64",
        marks=() if case in FLOAT64_DEFAULT else pytest.mark.slow,
    )
    for case in sorted(ALGORITHMS)
]


@pytest.mark.parametrize("case, dtype", CASES_BY_DTYPE)
def test_the_graph_safe_step_is_local_train_bit_for_bit(case: str, dtype: torch.dtype) -> None:
    if dtype == torch.float64 and case in FP32_ONLY:
        pytest.skip("the algorithm's server side is fp32 only")
    options = {"rounds": 2, **ALGORITHMS[case]}
    with local_step_path("loop"):
        want, reference = _rounds("off", dtype=dtype, **options)
    got, graph_safe = _rounds("off", dtype=dtype, **options)
    _same_bits(reference, graph_safe, want, got)


# ---------------------------------------------------------------- what capture needs
#
# A CUDA graph replays the kernels recorded once, on the memory they used then. On the CPU
# that is checked by what a capture would see: two consecutive steps dispatch the same aten
# operators on the same shapes and dtypes (no Python branch on a value, no shape that
# changes), every tensor the step reads or changes across steps keeps its memory (parameters,
# buffers, momentum, loss sum, the static batch buffers, carried state), and no tensor made
# during a step outlives it except in that memory: state rebound to a new tensor (as
# torch.optim.SGD's loop leaves fresh gradients in p.grad every step) is invisible to a
# replay, and the check below flags it for that loop.


def _counting_loss(model, x, y, t):  # type: ignore[no-untyped-def]
    out = cross_entropy_loss(model, x, y)
    aux = {"seen": torch.ones_like(y, dtype=torch.float32).sum()}
    return LossOutput(out.loss * t["scale"], out.features, out.logits, aux)


def _count(carried, aux):  # type: ignore[no-untyped-def]
    return {"seen": carried["seen"] + aux["seen"]}


def _client(n: int = 40, seed: int = 0) -> tuple[torch.nn.Module, ClientData]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    torch.manual_seed(seed)
    model = build_model(TINY_BN, (1, 8, 8), 10)
    return model, ClientData(x, y, torch.arange(n), 10)


def _static(step: LocalStep) -> list[torch.Tensor]:
    model = step.model
    return [
        *model.parameters(),
        *model.buffers(),
        *step.momentum,
        step.loss_sum,
        *step.rows.values(),
        *step.draws.values(),
        *step.carried.values(),
        *step.step_rows.values(),
        *step.tensors.values(),
        *step.shifts_given,
    ]


def test_two_steps_issue_the_same_operators_with_no_new_memory() -> None:
    """BatchNorm (running statistics in place), augmentation, clipping, a gradient shift,
    momentum, weight decay, a step tensor's row and carried state: steps 3 and 4 dispatch
    the same operators on the same shapes, and leave nothing new alive."""
    model, data = _client()
    cfg = LocalTrainConfig(batch_size=16, lr=0.05, momentum=0.9, weight_decay=1e-3,
                           augment=True, grad_clip=0.5)  # fmt: skip
    shift = {name: torch.full_like(p, 1e-3) for name, p in model.named_parameters()}
    step = LocalStep(
        model, data, cfg, loss=_counting_loss, grad_shift=shift,
        step_tensors={"scale": 1 + torch.arange(8.0) / 10},
        carried={"seen": torch.zeros(())}, after_step=_count,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    perm = torch.randperm(len(data), generator=gen)
    draws = draw_augmentation(gen, [16] * 4)
    before = None
    sequences, lefts = [], []
    for s in range(4):
        size = step.load(perm[:16], draws[:, 16 * s : 16 * (s + 1)], s)
        if s < 2:  # the warm-up: the first step starts momentum as SGD does (a copy)
            step.body(size)
            continue
        if before is None:
            before = [t.data_ptr() for t in _static(step)]
        ops, left = _recorded(functools.partial(step.body, size), _static(step))
        sequences.append(ops)
        lefts.append(left)
    assert sequences[0] == sequences[1]
    assert lefts == [[], []], lefts
    assert [t.data_ptr() for t in _static(step)] == before
    assert float(step.carried["seen"]) == 64.0  # the carried state did change, in place
    # Sanity: the sequences hold the step (convolution backward, the foreach update).
    names = {name for name, _ in sequences[0]}
    assert "aten.convolution_backward.default" in names
    assert any("_foreach_add_" in name for name in names)


def test_the_check_flags_a_loop_that_rebinds_state() -> None:
    """The same record over torch.optim.SGD's loop (local_train's step): the gradients it
    leaves in p.grad are new tensors every step, which a replay would not see."""
    model, data = _client()
    cfg = LocalTrainConfig(batch_size=16, momentum=0.9, weight_decay=1e-3)
    opt = make_optimizer(model, cfg)
    rows = torch.arange(16)

    def loop_step() -> None:
        x, y = data.batch(rows)
        loss = cross_entropy_loss(model, x, y).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(2):
        loop_step()
    static = [*model.parameters(), *model.buffers()]
    static += [opt.state[p]["momentum_buffer"] for p in model.parameters()]
    _, left = _recorded(loop_step, static)
    assert len(left) == len(list(model.parameters()))  # one new gradient per parameter


# ---------------------------------------------------------------- --cuda-graphs


def test_cuda_graphs_is_recorded_with_why_not(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """On the CPU the step runs eagerly whatever the option says, and processes.jsonl says
    so; a bad value is one line and exit 2."""
    for mode in ("auto", "on", "off"):
        out = tmp_path / mode
        argv = ["run", "-q", "--rounds", "1", "-n", "4", "--clients-per-round", "2",
                "--device", "cpu", "--cuda-graphs", mode,
                "--out-dir", str(out), "--name", "r"]  # fmt: skip
        assert main(argv) == 0
        process = json.loads((out / "r" / "processes.jsonl").read_text().splitlines()[0])
        assert process["cuda_graphs"] == "off"
        want = "cuda-graphs off" if mode == "off" else "no CUDA graphs on cpu"
        assert process["cuda_graphs_reason"].startswith(want)
        assert json.loads((out / "r" / "config.json").read_text())["cuda_graphs"] == mode
    capsys.readouterr()
    assert main(["run", "-q", "--cuda-graphs", "maybe", "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("cuda-graphs must be one of auto, on, off, got 'maybe'"), err
    assert len(err.splitlines()) == 1


def test_graphs_where_the_step_is_graph_safe() -> None:
    cuda = torch.device("cuda", 0)
    model, _ = _client()
    assert resolve_graphs("auto", cuda, model) == (True, "")
    assert resolve_graphs("on", cuda, model) == (True, "")
    assert resolve_graphs("off", cuda, model) == (False, "cuda-graphs off")
    assert resolve_graphs("auto", torch.device("cpu"), model)[0] is False
    dropout = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    assert "dropout" in resolve_graphs("auto", cuda, dropout)[1]
    cumulative = torch.nn.Sequential(torch.nn.BatchNorm1d(4, momentum=None))
    assert "cumulatively" in resolve_graphs("on", cuda, cumulative)[1]


@pytest.mark.parametrize("case", ["fedavg-bn-augment-clip", "moon", "fedacd-bn-augment"])
def test_the_graph_safe_step_is_local_train_bit_for_bit_in_bf16(case: str) -> None:
    """Under bf16 autocast (fp32 weights): the same casts, so the same bits."""
    options = {"rounds": 2, **ALGORITHMS[case], "precision": "bf16"}
    with local_step_path("loop"):
        want, reference = _rounds("off", **options)
    got, graph_safe = _rounds("off", **options)
    _same_bits(reference, graph_safe, want, got)


class _FakeGraph:
    """A stand-in for torch.cuda.CUDAGraph on the CPU: 'replay' runs the captured body."""

    def __init__(self, body) -> None:  # type: ignore[no-untyped-def]
        self.body = body

    def replay(self) -> None:
        self.body()


def test_the_graph_schedule_warms_up_captures_once_and_replays(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The driver on the CPU with capture and replay stood in (they run the step eagerly):
    per client, two full-size warm-up steps on the side stream, one capture, replays for
    every later full-size step, the short last batch of each epoch eager; the numbers are
    those of the plain eager loop."""
    kinds: list[str] = []

    def side(self, size):  # type: ignore[no-untyped-def]
        kinds.append("warm-up")
        self.body(size)

    def capture(self, size):  # type: ignore[no-untyped-def]
        kinds.append("capture")
        self.graphs[size] = _FakeGraph(functools.partial(self.body, size))
        self.graphs[size].replay()  # a capture records; the step itself is its first replay

    body = LocalStep.body

    def traced(self, size):  # type: ignore[no-untyped-def]
        kinds.append("body" if size == self.cfg.batch_size else f"eager {size}")
        return body(self, size)

    cfg = LocalTrainConfig(epochs=2, batch_size=8, momentum=0.9, weight_decay=1e-3)
    results = {}
    for graphs in (False, True):
        model, data = _client(n=37)  # 4 batches of 8 and one of 5 per epoch
        if graphs:
            monkeypatch.setattr(GraphReplay, "on_side_stream", side)
            monkeypatch.setattr(GraphReplay, "capture", capture)
            monkeypatch.setattr(LocalStep, "body", traced)
        step = LocalStep(model, data, cfg, graphs=graphs)
        result = step.train(torch.Generator().manual_seed(5))
        results[graphs] = (result, {k: v.clone() for k, v in model.state_dict().items()})
    assert results[True][0] == results[False][0]
    for name, value in results[False][1].items():
        assert torch.equal(results[True][1][name], value), name
    compact = [k for k in kinds if k != "body"]
    assert compact == ["warm-up", "warm-up", "capture", "eager 5", "eager 5"], kinds
    assert kinds.count("body") == 8  # each full-size step once: 2 warm-up, capture, 5 replays
    assert kinds[:6] == ["warm-up", "body", "warm-up", "body", "capture", "body"], kinds


def test_carried_updates_that_reuse_old_values_are_applied_as_meant() -> None:
    """An epoch update that moves one carried value into another while resetting it
    (``last_epoch = seen; seen = 0``) must give what the loop gives: the in-place copies of
    the graph-safe step first wrote the new ``seen`` and then copied it into ``last_epoch``
    (found by test_together's seam test)."""
    cfg = ExperimentConfig(num_clients=4, workers=0, device="cpu")
    prep = prepare(cfg)
    train = LocalTrainConfig(epochs=2, batch_size=8, lr=0.05, momentum=0.9, weight_decay=1e-3)
    data = prep.fed.client(0)
    data.indices = data.indices[:33]
    sizes = [b - a for a, b in batch_bounds(len(data), 8)] * 2
    model = new_model(prep)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    carried = {}
    for path in ("loop", "graph-safe"):
        plan = _seam_plan(sizes, [])
        set_arrays(model, start)
        with local_step_path(path):
            run_plain(plan, ClientContext(0, 0, 7, data, model, ClientState(), train))
        carried[path] = {n: float(v) for n, v in plan.carried.items()}
    assert carried["graph-safe"] == carried["loop"]
    assert carried["loop"]["last_epoch"] == 33.0
