"""FedFM (Ye et al., IEEE TSP 2023): FedAvg plus anchor-based feature matching.

Every round the sampled clients first compute local anchors (class means of body features)
with the new global model; the server aggregates them into global anchors and broadcasts them
with the usual FedAvg round, in which the local loss is CE + lam * l_FM. From the launching
round ``start_round`` on, l_FM is contrastive guiding (``fm_loss=cg``, default) or the l2
distance to the class anchor (``fm_loss=l2``); anchors are aggregated count-weighted
(``anchor_agg=weighted``, default) or uniformly (``anchor_agg=uniform``). FedFM is exactly
``with_feature_matching(FedAvg)``: the mechanism, its defaults and the choices marked
[PROPOSAL] are documented in ``fedskew.algorithms.feature_matching``.

Parameters: ``lam`` 50, ``cg_tau`` 0.1, ``start_round`` 20, ``fm_loss`` cg, ``anchor_agg``
weighted, and FedAvg's ``server_lr`` 1.0.
"""

from __future__ import annotations

from fedskew.algorithms.feature_matching import with_feature_matching
from fedskew.algorithms.fedavg import FedAvg


class FedFM(with_feature_matching(FedAvg)):  # type: ignore[misc]
    name = "fedfm"
    description = "FedFM: FedAvg + anchor feature matching (contrastive guiding or l2)"
