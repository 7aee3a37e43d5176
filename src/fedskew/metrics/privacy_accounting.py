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

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

import numpy as np

from fedskew.core.errors import UsageError

# How the privacy spent is accounted (``--dp-accounting``): fedskew's own mechanism
# (replace-one adjacency, sampling without replacement), or the convention of DP-FL papers
# (Poisson sampling of rate m/N, add-or-remove adjacency), for comparing with them.
REPLACE_ONE = "replace-one"
POISSON = "poisson-add-remove"
ACCOUNTING = (REPLACE_ONE, POISSON)
# Above this epsilon a guarantee bounds little: an adversary's odds of telling two
# federations apart may grow by e**10 (about 22000-fold). Runs warn beyond it.
MEANINGFUL_EPSILON = 10.0
# The noise multipliers --dp-target-epsilon searches between: below the lower one epsilon
# is in the thousands for any run, above the upper one it is 0 at any useful delta.
NOISE_BRACKET = (1e-2, 1e6)


def accountant() -> Any:
    """The ``dp_accounting`` package, or a one-line UsageError naming the extra."""
    try:
        import dp_accounting
    except ImportError:
        raise UsageError(
            "dp needs the privacy accountant: pip install 'fedskew[privacy]' (dp-accounting)"
        ) from None
    return dp_accounting


@contextmanager
def quiet_accountant() -> Iterator[None]:
    """The accountant logs through absl a line per RDP order it drops at extreme settings
    (hundreds of lines for one epsilon, Poisson sampling at ordinary ones too); what it
    returns is still an upper bound, so the lines are noise to a user. Nothing it does to
    the logging configuration outlasts the call."""
    logger = logging.getLogger("absl")
    level = logger.level
    # A warning logged before any handler exists makes logging configure the root logger
    # (basicConfig): every later fedskew line would then print twice, in Python's format.
    root_handlers = logging.root.handlers[:]
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
        logging.root.handlers[:] = root_handlers


def _event(method: str, noise: float, num_clients: int, per_round: int) -> Any:
    """One round's DpEvent (see the module docstring)."""
    dpa = accountant()
    if method == POISSON:
        event = dpa.GaussianDpEvent(noise)
        if per_round < num_clients:
            event = dpa.PoissonSampledDpEvent(per_round / num_clients, event)
        return event
    event = dpa.GaussianDpEvent(noise / 2)
    if per_round < num_clients:
        event = dpa.SampledWithoutReplacementDpEvent(num_clients, per_round, event)
    return event


def _new_accountant(method: str) -> Any:
    dpa = accountant()
    relation = (
        dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
        if method == POISSON
        else dpa.NeighboringRelation.REPLACE_ONE
    )
    return dpa.rdp.RdpAccountant(neighboring_relation=relation)


@lru_cache(maxsize=64)
def _round_rdp(
    method: str, noise: float, num_clients: int, per_round: int
) -> tuple[np.ndarray, np.ndarray]:
    """(orders, the RDP of one round at each order), computed once per mechanism: the RDP of
    sampling without replacement takes seconds per call, and a run asks after every round.

    At extreme noise the accountant's subsampling bounds fail in its arithmetic (a math
    domain error at z = 1e9); sampling only adds privacy, so the round's bound without
    amplification (the Gaussian mechanism alone, exact at any noise) holds there."""
    acc = _new_accountant(method)
    with quiet_accountant():
        try:
            acc.compose(_event(method, noise, num_clients, per_round), 1)
        except (ValueError, OverflowError, ZeroDivisionError, FloatingPointError):
            acc = _new_accountant(method)
            acc.compose(_event(method, noise, 1, 1), 1)
    orders, rdp = getattr(acc, "_orders", None), getattr(acc, "_rdp", None)
    if orders is None or rdp is None:  # not public API: fail loudly if it ever moves
        raise RuntimeError("dp-accounting's RdpAccountant no longer exposes _orders/_rdp")
    return np.array(orders, dtype=float), np.array(rdp, dtype=float)


def _epsilon(
    method: str, noise: float, num_clients: int, per_round: int, count: int, delta: float
) -> float:
    """Epsilon at ``delta`` of ``count`` rounds of the mechanism: RDP composes by adding."""
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

    orders, rdp = _round_rdp(method, noise, num_clients, per_round)
    with quiet_accountant():
        eps, _ = compute_epsilon(orders, count * rdp, delta)
    return float(eps)


def central_epsilon(
    noise: float,
    num_clients: int,
    per_round: int,
    rounds: int,
    delta: float,
    method: str = REPLACE_ONE,
) -> float | None:
    """Epsilon at ``delta`` after ``rounds`` rounds of central DP, amplified by the
    sampling; None without noise (no finite epsilon), 0 before the first round."""
    if rounds <= 0:
        return 0.0
    if noise <= 0:
        return None
    return _epsilon(method, float(noise), int(num_clients), int(per_round), int(rounds), delta)


def local_epsilon(
    noise: float, participations: int, delta: float, method: str = REPLACE_ONE
) -> float | None:
    """Epsilon at ``delta`` of one client's updates after it took part ``participations``
    times (local DP, or central DP for a reader who knows who took part); None without
    noise, 0 before it took part."""
    if participations <= 0:
        return 0.0
    if noise <= 0:
        return None
    # One client, always "sampled": the Gaussian mechanism without amplification.
    return _epsilon(method, float(noise), 1, 1, int(participations), delta)


def reported_epsilon(
    noise: float,
    *,
    local: bool,
    num_clients: int,
    per_round: int,
    rounds: int,
    most_participations: int,
    delta: float,
    method: str = REPLACE_ONE,
) -> float | None:
    """The ``dp_epsilon`` a run reports after ``rounds`` rounds (fedskew.runs.privacy):
    local DP and full participation, the most-sampled client's; central replace-one, the
    smaller of the amplified bound and that (both hold); central Poisson add-remove, the
    amplified bound as the papers state it."""
    known = local_epsilon(noise, most_participations, delta, method)
    if local or per_round >= num_clients:
        return known
    amplified = central_epsilon(noise, num_clients, per_round, rounds, delta, method)
    if amplified is None or known is None:
        return None
    return amplified if method == POISSON else min(amplified, known)


def noise_for_epsilon(
    target: float,
    *,
    local: bool,
    num_clients: int,
    per_round: int,
    rounds: int,
    most_participations: int,
    delta: float,
    method: str = REPLACE_ONE,
) -> float:
    """The smallest noise multiplier whose reported epsilon after the run's last round is at
    most ``target`` at ``delta``, found by dp-accounting's ``calibrate_dp_mechanism``
    (Brent's method on the accountant's epsilon, the returned value on the safe side).
    Where the report is the smaller of two bounds, the smaller of their two noises."""
    dpa = accountant()
    lo, hi = NOISE_BRACKET

    def calibrate(method_events: Any, high: float = hi) -> float:
        def make_accountant() -> Any:
            return _new_accountant(method)

        with quiet_accountant():
            loosest = make_accountant().compose(method_events(lo)).get_epsilon(delta)
            if loosest <= target:
                raise UsageError(
                    f"dp-target-epsilon {target:g}: even noise {lo:g} spends only "
                    f"{loosest:.3g} at delta {delta:g}; such a target protects nothing "
                    "(give dp-noise instead)"
                )
            return float(
                dpa.calibrate_dp_mechanism(
                    make_accountant, method_events, target, delta,
                    dpa.ExplicitBracketInterval(lo, high), tol=1e-4,
                )  # fmt: skip
            )

    def known(z: float) -> Any:
        return dpa.SelfComposedDpEvent(_event(method, z, 1, 1), most_participations)

    def amplified(z: float) -> Any:
        return dpa.SelfComposedDpEvent(_event(method, z, num_clients, per_round), rounds)

    if local or per_round >= num_clients:
        return calibrate(known)
    if method == POISSON:
        return calibrate(amplified)
    # The report is the smaller bound: below the known bound's noise only the amplified one
    # can meet the target, and only if it already does at that noise (one evaluation).
    noise = calibrate(known)
    with quiet_accountant():
        at_noise = _new_accountant(method).compose(amplified(noise)).get_epsilon(delta)
    return calibrate(amplified, noise) if at_noise < target else noise
