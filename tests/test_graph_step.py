"""The graph-safe local step (fedskew.training.graph_step) against local_train.

``run_plain`` trains with the graph-safe step by default; ``local_step_path("loop")`` gives
the reference, ``local_train`` with ``torch.optim.SGD``. Every algorithm (each trains through
``run_plain``), the feature-matching plug-in and FedACD's step tensors and carried state,
with momentum, weight decay, clipping, augmentation and ragged last batches, must give the
same bits in fp32 and in float64: global models, every client's state and the round records.
"""

from __future__ import annotations

import pytest
import torch
from test_together import CASES, SEAMS, _fm_options, _rounds

from fedskew.training.local import local_step_path

FM = ("fedavg+fm", "scaffold+fm-uniform", "fedrod+fm", "fedacd+fm", "fedcme+fm")
ALGORITHMS = {**{k: v for k, v in CASES.items()}, **SEAMS, **{k: _fm_options(k) for k in FM}}


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "float64"])
@pytest.mark.parametrize("case", sorted(ALGORITHMS))
def test_the_graph_safe_step_is_local_train_bit_for_bit(case: str, dtype: torch.dtype) -> None:
    options = {"rounds": 2, **ALGORITHMS[case]}
    with local_step_path("loop"):
        want, reference = _rounds("off", dtype=dtype, **options)
    got, graph_safe = _rounds("off", dtype=dtype, **options)
    _same_bits(reference, graph_safe, want, got)
