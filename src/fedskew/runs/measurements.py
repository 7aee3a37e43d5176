"""Metrics a run measures on request besides accuracy, scheduled for the run loop.

* ``feature_metrics_every`` N: every N rounds and the last, the feature quality of the global
  model (the model the server logic says to score) as FedFM's Table IV measures it:
  ``feature_nmi`` and ``feature_silhouette`` of the body features of a fixed, seeded test
  subsample (``fedskew.metrics.features``), with ``feature_seconds``.
* ``tsne``: at the end, ``tsne.png`` (and the points, ``tsne.npz``) in the run folder: a
  t-SNE of the final global model's features of the same subsample, coloured by class.
* ``local_risk_every`` N: every N rounds and the last, ``local_risk``: the mean over the
  round's local models of their risk over client distributions (FedACD's adaptability,
  Eq. 3), with ``local_risk_models`` (how many were scored) and ``local_risk_seconds``.

Where the local models come from: the run loop sees only messages. On a round whose local
risk is due, the channel the server logic plays over is wrapped (:class:`LocalModels`):
each reply whose arrays hold the whole model state (every state-dict entry of the model,
with its shape and dtype) is copied, a client's later reply replacing its earlier one, and
the copies are scored after the round. FedAvg-like methods upload their trained model that
way, with or without extra arrays. Methods whose replies do not carry a whole model get no
``local_risk`` (logged once per run): FedNH (its frozen prototypes stay on the server),
FedFM-Lite in rounds without model upload, and FedNova, whose replies are named like the
model but hold normalised updates (it says so with
``Algorithm.replies_carry_local_models = False``). A skipped round scores nothing.

None of this changes training: the computations use their own model copies and their own
seeded generators, and the metrics lines of runs that leave the options off are unchanged.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedskew.assembly.prepare import Prepared
from fedskew.core.durable import replace_durably
from fedskew.metrics.features import (
    body_features,
    feature_quality,
    feature_sample,
    local_model_risk,
    tsne_embedding,
)
from fedskew.training.interface import ServerLogic
from fedskew.training.local import set_arrays
from fedskew.training.protocol import Channel, Expected, Message

log = logging.getLogger("fedskew")

# Summary entries taken from the last metrics line that has them (when any has).
FINAL_KEYS = ("personal_accuracy", "feature_nmi", "feature_silhouette", "local_risk")


def due(every: int, rnd: int, rounds: int) -> bool:
    """Whether a metric asked for every ``every`` rounds (0: never) is measured after round
    ``rnd`` (0-based): every ``every``-th round and the last."""
    return every > 0 and ((rnd + 1) % every == 0 or rnd + 1 == rounds)


class LocalModels:
    """A channel that keeps a copy of every reply's local model (see the module docstring)."""

    def __init__(
        self,
        channel: Channel,
        reference: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        kept: dict[int, dict[str, torch.Tensor]],
    ) -> None:
        self.channel = channel
        self.reference = reference
        self.kept = kept

    def exchange(
        self, messages: Mapping[int, Message], expect: Expected | None = None
    ) -> dict[int, Message]:
        replies = self.channel.exchange(messages, expect)
        for cid, reply in replies.items():
            model = whole_model(reply.arrays, self.reference)
            if model is not None:
                self.kept[cid] = model
        return replies


def whole_model(
    arrays: Mapping[str, torch.Tensor],
    reference: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
) -> dict[str, torch.Tensor] | None:
    """A copy of the model state in ``arrays`` when they hold every entry of ``reference``
    with its shape and dtype (other arrays besides are ignored); None otherwise."""
    for name, (shape, dtype) in reference.items():
        t = arrays.get(name)
        if t is None or tuple(t.shape) != shape or t.dtype != dtype:
            return None
    return {name: arrays[name].detach().clone() for name in reference}


class Measurements:
    """The requested metrics of one run. ``eval_model`` is the run loop's evaluation model;
    its arrays are set here before each use (the run loop sets them again before its own)."""

    def __init__(self, prep: Prepared, eval_model: torch.nn.Module) -> None:
        self.prep = prep
        self.cfg = prep.cfg
        self.eval_model = eval_model
        self.reference = {k: (tuple(v.shape), v.dtype) for k, v in eval_model.state_dict().items()}
        self.local_models: dict[int, dict[str, torch.Tensor]] = {}
        self._scratch: torch.nn.Module | None = None
        self._said: set[str] = set()
        self._features_of: tuple[int, np.ndarray] | None = None  # (round, features) cache

    @cached_property
    def sample(self) -> np.ndarray:
        """The test indices whose features are scored: the same every round."""
        return feature_sample(len(self.prep.dataset.y_test), self.cfg.seed)

    @cached_property
    def labels(self) -> np.ndarray:
        """The labels of :attr:`sample`."""
        return self.prep.dataset.y_test[torch.from_numpy(self.sample)].cpu().numpy()

    def channel(self, rnd: int, channel: Channel) -> Channel:
        """``channel``, wrapped to keep the local models when round ``rnd`` scores them."""
        self.local_models = {}
        if not due(self.cfg.local_risk_every, rnd, self.cfg.rounds):
            return channel
        if self.prep.privacy is not None:
            self._say_once(
                "private",
                "local risk: under secure aggregation or DP the replies carry updates, not the "
                "clients' trained models; local_risk is not reported",
            )
            return channel
        if not self.prep.algorithm.replies_carry_local_models:
            self._say_once(
                "no-models",
                f"local risk: {self.prep.algorithm.name}'s replies do not carry the clients' "
                "trained models; local_risk is not reported",
            )
            return channel
        return LocalModels(channel, self.reference, self.local_models)

    def measure(self, rnd: int, server: ServerLogic, skipped: bool) -> dict[str, Any]:
        """The requested metrics due after round ``rnd``, for its metrics line; the global
        model is the one ``server`` says to score."""
        out: dict[str, Any] = {}
        if due(self.cfg.feature_metrics_every, rnd, self.cfg.rounds):
            t0 = time.perf_counter()
            features = self.global_features(rnd, server)
            labels = self.labels
            quality = feature_quality(
                features, labels, self.prep.dataset.num_classes, self.cfg.seed
            )
            out["feature_nmi"] = _number(quality.nmi)
            out["feature_silhouette"] = _number(quality.silhouette)
            out["feature_seconds"] = round(time.perf_counter() - t0, 4)
        if due(self.cfg.local_risk_every, rnd, self.cfg.rounds) and not skipped:
            out.update(self.local_risk(rnd))
        self.local_models = {}
        return out

    def global_features(self, rnd: int, server: ServerLogic) -> np.ndarray:
        """Body features of the subsample under the global model after round ``rnd``."""
        if self._features_of is not None and self._features_of[0] == rnd:
            return self._features_of[1]
        set_arrays(self.eval_model, server.eval_arrays())
        # The test set already on the device, indexed there: no host-to-device copy.
        x = self.prep.x_test[torch.from_numpy(self.sample).to(self.prep.x_test.device)]
        features = body_features(self.eval_model, x, precision=self.prep.train.precision)
        self._features_of = (rnd, features)
        return features

    def local_risk(self, rnd: int) -> dict[str, Any]:
        if not self.local_models:
            if self.prep.algorithm.replies_carry_local_models:
                self._say_once(
                    "no-whole-model",
                    f"local risk: no reply of round {rnd + 1} carried a whole model "
                    f"({self.prep.algorithm.name}); local_risk is reported only for rounds "
                    "whose replies do",
                )
            return {}
        t0 = time.perf_counter()
        if self._scratch is None:
            self._scratch = copy.deepcopy(self.eval_model)
        data = self.prep.dataset
        counts = self.prep.fed.class_counts()
        risks = []
        for cid in sorted(self.local_models):
            set_arrays(self._scratch, self.local_models[cid])
            risks.append(
                local_model_risk(
                    self._scratch,
                    self.prep.x_test,
                    self.prep.y_test,
                    data.num_classes,
                    counts,
                    precision=self.prep.train.precision,
                )
            )
        return {
            "local_risk": float(np.mean(risks)),
            "local_risk_models": len(risks),
            "local_risk_seconds": round(time.perf_counter() - t0, 4),
        }

    def write_tsne(self, rnd: int, server: ServerLogic, folder: Path) -> None:
        """``tsne.png`` and ``tsne.npz`` (coordinates, labels, test indices) in ``folder``,
        for the global model after round ``rnd`` (0-based)."""
        from fedskew.report.tsne_plot import plot_tsne

        t0 = time.perf_counter()
        features = self.global_features(rnd, server)
        labels = self.labels
        coords = tsne_embedding(features, self.cfg.seed)
        data = self.prep.dataset
        title = (
            f"{self.prep.algorithm.name} on {self.cfg.dataset}, round {rnd + 1}: t-SNE of "
            f"{len(labels)} test features"
        )
        plot_tsne(coords, labels, data.num_classes, folder / "tsne.png", title, data.class_names)
        replace_durably(
            folder / "tsne.npz",
            lambda fh: np.savez(fh, coords=coords, labels=labels, indices=self.sample),
        )
        log.info("t-SNE of %d test features in %.1f s", len(labels), time.perf_counter() - t0)

    def _say_once(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            log.warning(message)


def _number(value: float) -> float | None:
    """A metric for a JSON line: NaN (undefined) becomes null."""
    return None if np.isnan(value) else float(value)


def final_values(history: list[dict[str, Any]]) -> dict[str, Any]:
    """``final_<key>`` for each of FINAL_KEYS some metrics line has: its last value."""
    out: dict[str, Any] = {}
    for key in FINAL_KEYS:
        values = [r[key] for r in history if key in r]
        if values:
            out[f"final_{key}"] = values[-1]
    return out
