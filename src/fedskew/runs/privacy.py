"""What a run with secure aggregation or DP records: the privacy spent after each round
(``dp_epsilon`` in metrics.jsonl, from ``fedskew.metrics.privacy_accounting``), the settings
and the final epsilon in summary.json, and how it was accounted in config.json.

The epsilon after a round depends only on the settings and on which clients the seed
sampled, so a resumed run reports what the uninterrupted one would have.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fedskew.assembly.prepare import Prepared
from fedskew.data.federated import sample_clients
from fedskew.metrics.privacy_accounting import (
    MEANINGFUL_EPSILON,
    POISSON,
    accountant,
    local_epsilon,
    reported_epsilon,
)


class PrivacyLedger:
    """The privacy a run spends, round by round (nothing for a run without DP)."""

    def __init__(self, prep: Prepared, per_round: int) -> None:
        self.privacy = prep.privacy
        self.seed = prep.cfg.seed
        self.num_clients = len(prep.partition)
        self.per_round = per_round
        if self.accounted:
            accountant()  # a missing accountant: one line, before any work

    @property
    def accounted(self) -> bool:
        return self.privacy is not None and self.privacy.dp != "off"

    def epsilons_after(self, rnd: int) -> tuple[float | None, float | None]:
        """(epsilon for an adversary who does not know which clients took part, epsilon for
        one who does) at the run's delta after round ``rnd`` (0-based); None when the noise
        is 0 (no finite epsilon).

        The second is the most-sampled client's composition, no amplification by sampling:
        for a fixed sampling (the seed fixes it, independently of the data) that is the
        mechanism's guarantee, so it bounds the first too, which takes the smaller of it and
        the amplified bound (WOR amplification can be looser at high sampling rates)."""
        p = self.privacy
        assert p is not None and p.dp != "off"
        known = local_epsilon(p.noise, self.most_participations(rnd), p.delta, p.accounting)
        reported = reported_epsilon(
            p.noise, local=p.local, num_clients=self.num_clients, per_round=self.per_round,
            rounds=rnd + 1, most_participations=self.most_participations(rnd), delta=p.delta,
            method=p.accounting,
        )  # fmt: skip
        return reported, known

    def most_participations(self, rnd: int) -> int:
        """The most rounds any one client was sampled in, up to round ``rnd``: a client's
        local-DP releases (a sampled client whose reply was lost may have sent it)."""
        counts = [0] * self.num_clients
        for r in range(rnd + 1):
            for c in sample_clients(self.seed, r, self.num_clients, self.per_round):
                counts[c] += 1
        return max(counts)

    def record(self, rnd: int) -> dict[str, Any]:
        """What the metrics line of round ``rnd`` adds: ``dp_epsilon`` and, for central DP
        with sampled clients, ``dp_epsilon_known_sampling`` (what holds for a reader who
        knows who took part: the seed and metrics.jsonl's ``clients`` say it)."""
        if not self.accounted:
            return {}
        assert self.privacy is not None
        hidden, known = self.epsilons_after(rnd)
        out: dict[str, Any] = {"dp_epsilon": hidden}
        if self.privacy.central and self.per_round < self.num_clients:
            out["dp_epsilon_known_sampling"] = known
        return out

    def warnings(self, rounds: int) -> list[str]:
        """What a run should say before it starts: a DP run without noise has no guarantee,
        and one whose last round will have spent an epsilon above MEANINGFUL_EPSILON bounds
        little (it is known in advance: it depends only on the settings and the seed)."""
        if not self.accounted:
            return []
        p = self.privacy
        assert p is not None
        if p.noise == 0:
            return [
                "dp-noise 0: clipping only, no differential privacy (epsilon is infinite); "
                "give dp-noise or dp-target-epsilon for a guarantee"
            ]
        final, _ = self.epsilons_after(rounds - 1)
        if final is not None and final > MEANINGFUL_EPSILON:
            return [
                f"{p.dp} DP will spend epsilon {final:.3g} at delta {p.delta:g} by round "
                f"{rounds}: above {MEANINGFUL_EPSILON:g} the guarantee bounds little (raise "
                "dp-noise, or give dp-target-epsilon)"
            ]
        return []

    def summary(
        self, history: list[dict[str, Any]], state: dict[str, float] | None = None
    ) -> dict[str, Any]:
        """What summary.json adds: the settings, the epsilon after the last round (null and
        ``dp_guarantee`` "none" without noise) and, under adaptive clipping, the clip norm
        the run ended with (``state``: the server's privacy_state)."""
        if self.privacy is None:
            return {}
        out = self.privacy.describe()
        if self.accounted:
            last = history[-1] if history else {}
            out["dp_epsilon"] = last.get("dp_epsilon", 0.0)
            if "dp_epsilon_known_sampling" in last:
                out["dp_epsilon_known_sampling"] = last["dp_epsilon_known_sampling"]
            if self.privacy.noise == 0:
                out["dp_guarantee"] = "none (dp-noise 0: epsilon infinite)"
            if self.privacy.adaptive and state is not None and "clip" in state:
                out["dp_clip_final"] = float(state["clip"])
        return out

    def facts(self) -> dict[str, Any]:
        """How the privacy is accounted, for config.json's resolved facts."""
        if not self.accounted:
            return {}
        assert self.privacy is not None
        try:
            package = version("dp-accounting")
        except PackageNotFoundError:  # imported from a path without its metadata
            package = "unknown"
        sampling = (
            "all clients every round"
            if self.per_round >= self.num_clients
            else f"{self.per_round} of {self.num_clients} clients per round, without replacement"
        )
        poisson = self.privacy.accounting == POISSON
        if poisson and self.privacy.central and self.per_round < self.num_clients:
            sampling += (
                f"; accounted as Poisson sampling of rate {self.per_round / self.num_clients:g} "
                "(the papers' convention, not this run's sampling)"
            )
        facts: dict[str, Any] = {
            "method": self.privacy.accounting,
            "accountant": f"dp-accounting {package}, RDP",
            "adjacency": "add or remove one client's data (client-level)"
            if poisson
            else "replace one client's data (client-level)",
            "mechanism": "central: Gaussian on the sum of clipped updates"
            if self.privacy.central
            else "local: Gaussian on each clipped update; the most-sampled client",
            "sampling": sampling,
            "noise_multiplier": self.privacy.noise,
            "delta": self.privacy.delta,
        }
        if self.privacy.target_epsilon is not None:
            facts["noise_from_target_epsilon"] = self.privacy.target_epsilon
        return {"privacy_accounting": facts}
