"""How evenly the global model serves the clients: statistics of a list of per-client
accuracies (one per client id, None for a client not evaluated or without local test
samples).

* ``mean``: the unweighted mean over the clients that have a value;
* ``std``: their population standard deviation (divided by n, not n - 1: the clients are
  the whole federation, not a sample of one);
* ``worst10``: the mean of the ceil(0.1 n) lowest values (at least one client);
* ``gap``: the mean of the ceil(0.1 n) highest minus that of the ceil(0.1 n) lowest.
"""

from __future__ import annotations

import math

SPREAD_KEYS = ("mean", "std", "worst10", "gap")

# The metrics keys of local evaluation (--local-test-fraction), named once for the run loop
# (a round's evaluation results), the local evaluation that writes them and the report (a
# table of their own): the per-client lists, the global model's and, for a method with a
# personal part, the personal models' (each with ``<list>_<stat>`` for SPREAD_KEYS), and
# the prefix of its bookkeeping (clients missing, bytes carried).
GLOBAL_LIST, PERSONAL_LIST = "client_accuracy", "client_personal_accuracy"
CLIENT_SERIES = (GLOBAL_LIST, PERSONAL_LIST)
BOOKKEEPING_PREFIX = "local_eval_"
LOCAL_EVALUATION_PREFIXES = (*CLIENT_SERIES, BOOKKEEPING_PREFIX)


def is_local_evaluation_key(key: str) -> bool:
    return key.startswith(LOCAL_EVALUATION_PREFIXES)


def client_spread(values: list[float | None]) -> dict[str, float]:
    """``mean``, ``std``, ``worst10`` and ``gap`` of the clients' values, None left out;
    empty when no client has a value."""
    present = sorted(float(v) for v in values if v is not None)
    n = len(present)
    if n == 0:
        return {}
    mean = sum(present) / n
    tenth = math.ceil(0.1 * n)
    worst = sum(present[:tenth]) / tenth
    best = sum(present[-tenth:]) / tenth
    return {
        "mean": mean,
        "std": math.sqrt(sum((v - mean) ** 2 for v in present) / n),
        "worst10": worst,
        "gap": best - worst,
    }
