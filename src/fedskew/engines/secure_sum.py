"""SecAgg+'s arithmetic, for the engines whose clients' replies reach the server in one
process (in-process, worker processes) and for Flower's clients' random rounding.

On Flower, each client's ``secaggplus_mod`` scales its summand by its weight, quantises it
with random rounding, adds a private mask and pairwise masks, and the server sums the masked
vectors and removes the masks (``fedskew.engines.flower_secagg``). Here the same functions
of Flower (``flwr.common.secure_aggregation``) compute the same thing from the replies,
masks included (each client's private mask and pairwise masks with its ring neighbours,
which cancel in the sum as Flower's do), so that a run has the same numbers on every engine.
What it does not simulate is the secrecy: in one process the server could read the replies.

The random rounding is Flower's (``quantize`` draws from NumPy's global generator): it is
addressed by (seed, round, client) here and, through the ClientApp, on every Flower node.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from fedskew.core.errors import UsageError
from fedskew.core.rng import derive_seed, numpy_rng
from fedskew.training.protocol import Message, Summed, SumRequest, arrived


def flower_arithmetic() -> Any:
    """Flower's SecAgg+ utilities, or a one-line UsageError without the flower extra."""
    try:
        from flwr.common.secure_aggregation import ndarrays_arithmetic, quantization
        from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen
    except ImportError:
        raise UsageError(
            "secure aggregation uses Flower's SecAgg+ arithmetic: pip install 'fedskew[flower]'"
        ) from None

    class Arithmetic:
        nd = ndarrays_arithmetic
        quantize = staticmethod(quantization.quantize)
        dequantize = staticmethod(quantization.dequantize)
        masks = staticmethod(pseudo_rand_gen)

    return Arithmetic


def rounding_seed(seed: int, rnd: int, client: int) -> int:
    """The 32-bit seed of NumPy's global generator for a client's random rounding."""
    return derive_seed(seed, rnd, client, "secagg-rounding") % 2**32


@contextmanager
def numpy_global_seeded(value: int) -> Iterator[None]:
    """NumPy's global generator seeded with ``value`` in the block, put back after it."""
    state = np.random.get_state()
    np.random.seed(value)
    try:
        yield
    finally:
        np.random.set_state(state)


def summand_arrays(reply: Message, request: SumRequest) -> list[np.ndarray]:
    """A reply's summands as host arrays, in the order they are summed."""
    return [reply.arrays[name].detach().cpu().numpy() for name in request.names()]


def weighted_quantised(
    arrays: list[np.ndarray], weight: float, request: SumRequest
) -> list[np.ndarray]:
    """What ``secaggplus_mod`` makes of a client's summand before masking it (its
    ``_collect_masked_vectors``): the values times the quantised weight, clipped, quantised
    with random rounding from NumPy's global generator (seed it first), the quantised
    weight in front. Integer arrays."""
    ar = flower_arithmetic()
    q_ratio = round(weight / request.max_weight * request.quantization)
    scaled = ar.nd.parameters_multiply(arrays, q_ratio / request.quantization)
    quantised = ar.quantize(scaled, request.clip_range, request.quantization)
    combined: list[np.ndarray] = ar.nd.factor_combine(q_ratio, quantised)
    return combined


def unmasked_mean(
    total: list[np.ndarray], count: int, request: SumRequest
) -> tuple[list[np.ndarray], float]:
    """(the weighted mean, the total weight) from the unmasked sum of ``count`` clients'
    quantised vectors, as ``SecAggPlusWorkflow``'s unmask stage computes it."""
    ar = flower_arithmetic()
    recon = ar.nd.parameters_mod(total, request.modulus)
    q_total, recon = ar.nd.factor_extract(recon)
    vectors = ar.dequantize(recon, request.clip_range, request.quantization)
    offset = -(count - 1) * request.clip_range
    scale = request.quantization / q_total
    for vec in vectors:
        vec += offset
        vec *= scale
    return vectors, float(q_total) / request.quantization * request.max_weight


def mask_seed(request: SumRequest, client: int, purpose: str) -> bytes:
    """32 bytes addressing one of the simulated masks."""
    return numpy_rng(request.seed, request.round, client, purpose).bytes(32)


def simulated_secure_mean(
    replies: Mapping[int, Message], request: SumRequest
) -> tuple[Summed, int]:
    """(the SecAgg+ mean of the replies' summands, the bytes its masked vectors take beyond
    the replies' float arrays). The clients are the replies' in sorted order."""
    ar = flower_arithmetic()
    clients = sorted(arrived(list(replies), replies))
    modulus = request.modulus
    total: list[np.ndarray] | None = None
    private: dict[int, list[np.ndarray]] = {}
    extra_bytes = 0
    for i, cid in enumerate(clients):
        reply = replies[cid]
        arrays = summand_arrays(reply, request)
        extra_bytes += request.masked_nbytes() - sum(a.nbytes for a in arrays)
        with numpy_global_seeded(rounding_seed(request.seed, request.round, cid)):
            vector = weighted_quantised(arrays, request.weight(reply), request)
        shapes = [a.shape for a in vector]
        private[cid] = ar.masks(mask_seed(request, cid, "secagg-private-mask"), modulus, shapes)
        vector = ar.nd.parameters_addition(vector, private[cid])
        # Pairwise masks with the ring neighbours: the larger id adds, the smaller subtracts,
        # as secaggplus_mod does, so that they cancel in the sum.
        for j in {clients[i - 1], clients[(i + 1) % len(clients)]} - {cid}:
            low, high = min(cid, j), max(cid, j)
            pair = ar.masks(mask_seed(request, low, f"secagg-pair-{high}"), modulus, shapes)
            op = ar.nd.parameters_addition if cid > j else ar.nd.parameters_subtraction
            vector = op(vector, pair)
        vector = ar.nd.parameters_mod(vector, modulus)
        total = vector if total is None else ar.nd.parameters_addition(total, vector)
    assert total is not None  # arrived() raised when no reply arrived
    total = ar.nd.parameters_mod(total, modulus)
    for cid in clients:  # the server rebuilds each private mask from its shares
        total = ar.nd.parameters_subtraction(total, private[cid])
    vectors, weight = unmasked_mean(total, len(clients), request)
    mean = {
        name: torch.from_numpy(np.asarray(v, dtype=np.float64)).reshape(request.shapes[name])
        for name, v in zip(request.names(), vectors, strict=True)
    }
    clear = {c: Message(replies[c].kind, scalars=dict(replies[c].scalars)) for c in clients}
    return Summed(mean, weight, clear), extra_bytes
