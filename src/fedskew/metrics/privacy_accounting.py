"""The privacy a DP run has spent: epsilon at a given delta, from Google's ``dp-accounting``
(its RDP accountant; ``pip install 'fedskew[privacy]'``).

What is accounted is client-level DP under *replace-one* adjacency: two federations differ in
one client's data, replaced by any other (the number of clients is public: the server built
the partition). A client's clipped update then changes the sum by at most 2S, so a noise of
standard deviation z*S is a Gaussian mechanism of noise multiplier z/2 against that
sensitivity. Per round:

* central DP: fedskew samples exactly m of the N clients, uniformly without replacement,
  and the server noises their sum: ``SampledWithoutReplacementDpEvent(N, m,
  GaussianDpEvent(z/2))`` (Wang, Balle and Kasiviswanathan 2019, the accountant's bound for
  this sampling under replace-one), or ``GaussianDpEvent(z/2)`` when every client takes
  part; composed over the rounds played. Adaptive clipping spends the same: its count and
  the updates are together the Gaussian mechanism of multiplier z (Andrew et al. 2021).
* local DP: each client's update, as it leaves the client, is ``GaussianDpEvent(z/2)``;
  the server sees who took part, so there is no amplification by sampling. Reported for the
  client that took part in the most rounds so far.

Amplification by sampling assumes the adversary does not know which clients took part. A
fedskew run's sampling follows from its seed, independently of the data, and metrics.jsonl
lists each round's clients: for the sampling the run made, the mechanism is each client's
composition of ``GaussianDpEvent(z/2)`` over the rounds it took part in, without
amplification (``local_epsilon`` of the most-sampled client's participations). That holds
for a reader who knows who took part, and it bounds the amplified one too, which at high
sampling rates can be the looser (the run reports the smaller: ``fedskew.runs.privacy``).

Papers often report DP-FedAvg's epsilon for Poisson sampling of rate m/N and add-or-remove
adjacency (sensitivity S), which is smaller for the same z; fedskew's sampling is not
Poisson, and that number would not be this mechanism's.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np

from fedskew.core.errors import UsageError


def accountant() -> Any:
    """The ``dp_accounting`` package, or a one-line UsageError naming the extra."""
    try:
        import dp_accounting
    except ImportError:
        raise UsageError(
            "dp needs the privacy accountant: pip install 'fedskew[privacy]' (dp-accounting)"
        ) from None
    return dp_accounting


def _event(noise: float, num_clients: int, per_round: int) -> Any:
    """One round's DpEvent (see the module docstring)."""
    dpa = accountant()
    event = dpa.GaussianDpEvent(noise / 2)
    if per_round < num_clients:
        event = dpa.SampledWithoutReplacementDpEvent(num_clients, per_round, event)
    return event


def _new_accountant() -> Any:
    dpa = accountant()
    return dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)


@lru_cache(maxsize=64)
def _round_rdp(
    noise: float, num_clients: int, per_round: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """(orders, the RDP of one round at each order), computed once per mechanism: the RDP of
    sampling without replacement takes seconds per call, and a run asks after every round.
    None where the accountant does not expose them (its attributes are not public API)."""
    acc = _new_accountant()
    acc.compose(_event(noise, num_clients, per_round), 1)
    orders, rdp = getattr(acc, "_orders", None), getattr(acc, "_rdp", None)
    if orders is None or rdp is None:
        return None
    return np.array(orders, dtype=float), np.array(rdp, dtype=float)


def _epsilon(noise: float, num_clients: int, per_round: int, count: int, delta: float) -> float:
    """Epsilon at ``delta`` of ``count`` rounds of the mechanism: RDP composes by adding."""
    dpa = accountant()
    cached = _round_rdp(noise, num_clients, per_round)
    if cached is not None:
        from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

        eps, _ = compute_epsilon(cached[0], count * cached[1], delta)
        return float(eps)
    acc = _new_accountant()
    acc.compose(dpa.SelfComposedDpEvent(_event(noise, num_clients, per_round), count))
    return float(acc.get_epsilon(delta))


def central_epsilon(
    noise: float, num_clients: int, per_round: int, rounds: int, delta: float
) -> float | None:
    """Epsilon at ``delta`` after ``rounds`` rounds of central DP; None without noise (no
    finite epsilon), 0 before the first round."""
    if rounds <= 0:
        return 0.0
    if noise <= 0:
        return None
    return _epsilon(float(noise), int(num_clients), int(per_round), int(rounds), delta)


def local_epsilon(noise: float, participations: int, delta: float) -> float | None:
    """Epsilon at ``delta`` of one client's updates after it took part ``participations``
    times under local DP; None without noise, 0 before it took part."""
    if participations <= 0:
        return 0.0
    if noise <= 0:
        return None
    # One client, always "sampled": the Gaussian mechanism without amplification.
    return _epsilon(float(noise), 1, 1, int(participations), delta)
