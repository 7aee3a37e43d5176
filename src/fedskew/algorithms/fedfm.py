"""FedFM (Ye et al., IEEE TSP 2023): FedAvg plus anchor-based feature matching.

Every round has the paper's two steps (Fig. 3), one exchange each:

1. Anchor updating (message kind ``fm_anchors``): every sampled client receives the global
   model and replies with its local anchors under it: the class means of the body features
   over all of its samples, in eval mode, each sample counted once, plus the per-class counts
   under weighted aggregation. The server aggregates them into the global anchors.
2. Model updating (message kind ``train``): every client trains E local epochs from the global
   model of step 1 with CE + lam * l_FM against the global anchors (from the launching round
   ``start_round`` on; before it, plain CE), and the server FedAvg-averages the trained models.

Step 2 does not send the model again: the client kept the one of step 1 in its client state.
The message carries the global anchors (from the launching round on) and the one-byte string
``fm.reused`` = "*", "train from the model of this round's anchor exchange". Per client and
round FedFM therefore costs, on top of FedAvg: C x d anchor floats and one byte down; C x d
anchors and C counts (int64) up (anchors only under uniform aggregation).

Losses (on L2-normalised features h and anchors a, the anchors are constants):
- ``fm_loss=cg`` (contrastive guiding, default): cross-entropy of the similarities
  <h, a_n> / cg_tau over the C anchors with the true class; mean over the batch.
- ``fm_loss=l2``: mean squared error between h and a_y, mean over batch x dimension.

Anchor aggregation:
- ``anchor_agg=weighted`` (default): a_c = sum_k n_kc a_kc / sum_k n_kc.
- ``anchor_agg=uniform``: a_c = mean over the sampled clients of a_kc, where a client that has
  no sample of c contributes the previous global anchor of c. Clients then upload no class
  counts (that is the variant's point); a class the client lacks is an all-zero row.

Parameters: ``lam`` (lambda, 50), ``cg_tau`` (the CG temperature alpha, 0.1; not ``tau``,
which MOON already uses), ``start_round`` (T_s, 20), ``fm_loss`` (cg|l2), ``anchor_agg``
(weighted|uniform) and FedAvg's ``server_lr`` (1.0). The defaults are the official code's,
which the paper's sweeps found best.

Not in the paper: two candidate remedies for the launching round, ``lam_warmup`` (0: off)
and ``match_on`` (features|pre_relu; FedFM only). Both live in
``fedskew.algorithms.fedfm_remedies``, off by default, and enter here only through its
parameter mixins and three calls: ``lam_in_round`` (the round's lam), ``anchor_features``
and ``matching_loss`` (what the client matches on).

Choices the paper leaves open, marked [PROPOSAL]:
- An anchor is *undefined* while it is all zero (a class no sampled client has held yet; the
  global anchors start at zero as in the official code). An undefined anchor is left out of the
  CG softmax, and samples of that class add nothing to either loss (the batch mean still divides
  by the full batch size). No mask travels: the client reads it off the zero rows.
- Under weighted aggregation a class that no client of this round holds keeps its previous
  global anchor (zero if it never had one); under partial participation the alternative,
  dropping it, would remove it from the softmax of every client that round.
- Under uniform aggregation a client's all-zero row (a class it lacks, or a feature mean that is
  exactly zero and so has no direction) is the signal to fill in the previous global anchor.
- Before the launching round (rounds are 0-based; FM is on when ``round >= start_round``) the
  anchors are still computed and aggregated every round, but not broadcast: the round then
  trains and aggregates exactly as FedAvg does.
- A client whose anchor reply does not arrive is left out of the anchor aggregation and of the
  model updating step (which addresses only the clients that replied in step 1): the server
  cannot tell a rejected reply from a dead node.

Client state: the model of step 1 is kept (as a copy) only until step 2 has loaded it; nothing
is left after the round.

The pieces here (parameters, anchors, losses, the two exchanges' client halves) are what
``fedskew.algorithms.feature_matching`` reuses to add feature matching to other algorithms, and
what FedFM-Lite (``fedskew.algorithms.fedfm_lite``) is built from.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from fedskew.algorithms import fedfm_remedies as remedies
from fedskew.algorithms.fedavg import FedAvgParams
from fedskew.algorithms.fedfm_remedies import LamWarmupParams, MatchOnParams
from fedskew.core.errors import UsageError
from fedskew.core.precision import in_fp32
from fedskew.training.aggregation import apply_server_lr, weighted_average
from fedskew.training.interface import (
    Algorithm,
    ClientContext,
    ClientLogic,
    InactiveMechanism,
    RunShape,
    ServerLogic,
    ServerSetup,
    check_one_of,
    starts_too_late,
)
from fedskew.training.local import (
    FeatureFn,
    LossFn,
    LossOutput,
    LossTerm,
    PlainTraining,
    class_feature_means,
    run_plain,
    set_arrays,
    trained_needs,
    trained_reply,
)
from fedskew.training.protocol import (
    ArraySpec,
    Channel,
    ClientState,
    Message,
    Needs,
    arrived,
    needs,
)
from fedskew.training.state_spec import OrNone, Spec, StatePart, model_part

ANCHOR_KIND = "fm_anchors"  # step 1, server -> client: the global model
LOCAL_ANCHOR_KIND = "fm_local_anchors"  # step 1, client -> server
ANCHORS = "fm.anchors"  # message array: (C, d) anchors, global (down) or local (up)
COUNTS = "fm.counts"  # message array: (C,) int64 class counts (up, weighted aggregation)
REUSED = "fm.reused"  # message string: "*" (or names): arrays step 1 delivered, not sent again

FM_LOSSES = ("cg", "l2")
ANCHOR_AGGS = ("weighted", "uniform")

_KEPT = "fm.kept/"  # client state prefix: the arrays of step 1 until step 2 loads them


# --- parameters -----------------------------------------------------------------------------


@dataclass
class PaperFMParams:
    """The paper's feature-matching parameters."""

    lam: float = 50.0
    cg_tau: float = 0.1
    start_round: int = 20
    fm_loss: str = "cg"
    anchor_agg: str = "weighted"


@dataclass
class FeatureMatchingParams(LamWarmupParams, PaperFMParams):
    """The paper's parameters, then the ``lam_warmup`` remedy; FedFM-Lite and the plug-in
    take them too. (A dataclass takes its last base's fields first: this order is the one
    the run folders record.)"""

    def validate(self) -> None:
        settings_of(self).validate()


@dataclass
class FedFMParams(MatchOnParams, FeatureMatchingParams, FedAvgParams):
    """FedAvg's ``server_lr`` first, then the feature-matching parameters, then the
    ``match_on`` remedy."""

    algorithm: ClassVar[str] = "fedfm"

    def validate(self) -> None:
        FedAvgParams.validate(self)
        FeatureMatchingParams.validate(self)
        MatchOnParams.validate(self)


@dataclass(frozen=True)
class FMSettings:
    lam: float
    tau: float
    start_round: int
    loss: str
    agg: str
    warmup: int = 0  # the lam_warmup remedy; 0 is the paper's constant lam

    def lam_in(self, rnd: int) -> float:
        """lam in round ``rnd`` (0-based)."""
        return remedies.lam_in_round(self.lam, self.start_round, self.warmup, rnd)

    def validate(self, names: Mapping[str, str] | None = None) -> None:
        """``names`` maps a parameter to the name the user sees (the plug-in renames)."""
        n = dict(names or {})

        def name(key: str) -> str:
            return n.get(key, key)

        if self.lam < 0:
            raise UsageError(f"feature matching: {name('lam')} must be >= 0, got {self.lam}")
        if self.tau <= 0:
            raise UsageError(f"feature matching: {name('cg_tau')} must be > 0, got {self.tau}")
        if self.start_round < 0:
            raise UsageError(
                f"feature matching: {name('start_round')} must be >= 0, got {self.start_round}"
            )
        remedies.check_lam_warmup(self.warmup, name("lam_warmup"))
        check_one_of("feature matching", name("fm_loss"), self.loss, FM_LOSSES)
        check_one_of("feature matching", name("anchor_agg"), self.agg, ANCHOR_AGGS)


def settings_of(params: Any) -> FMSettings:
    """The FM settings of a params object, through its (possibly renamed) fields: a params
    class the plug-in built maps each name to the field's in ``fm_field_names``."""
    names: Mapping[str, str] = getattr(type(params), "fm_field_names", {})

    def get(key: str) -> Any:
        return getattr(params, names.get(key, key))

    return FMSettings(
        lam=float(get("lam")),
        tau=float(get("cg_tau")),
        start_round=int(get("start_round")),
        loss=str(get("fm_loss")),
        agg=str(get("anchor_agg")),
        warmup=int(get("lam_warmup")),
    )


def matching_inactive(
    params: Any, shape: RunShape, consequence: str, first_round: int | None = None
) -> list[InactiveMechanism]:
    """Feature matching, when it launches after the run's last round (``first_round``: the
    first round it can act in, 0-based; default ``start_round``). The option is named as
    the user sees it (the plug-in may rename it ``fm_start_round``); ``lam`` = 0 is matching
    switched off on purpose, not listed."""
    s = settings_of(params)
    if s.lam == 0:
        return []
    option = getattr(type(params), "fm_field_names", {}).get("start_round", "start_round")
    first = s.start_round if first_round is None else first_round
    return starts_too_late("feature matching", first, shape, {option: s.start_round}, consequence)


# --- anchors --------------------------------------------------------------------------------


def defined_rows(anchors: torch.Tensor) -> torch.Tensor:
    """(C,) bool: the anchors that have a direction (not all zero)."""
    return anchors.abs().sum(dim=1) > 0


def anchor_reply_arrays(model: torch.nn.Module, num_classes: int) -> dict[str, ArraySpec]:
    """What ``local_anchor_arrays`` uploads: (C, d) class means and (C,) int64 counts."""
    return {
        ANCHORS: ArraySpec((num_classes, model.feature_dim)),
        COUNTS: ArraySpec((num_classes,), torch.int64, sample_counts=True),
    }


def anchor_fields(model: torch.nn.Module, num_classes: int) -> dict[str, Spec]:
    """The server's ``fm_anchors`` at a checkpoint: None before the first anchors, then
    (C, d) like the clients' local anchors."""
    return {"fm_anchors": OrNone(ArraySpec((num_classes, model.feature_dim)))}


def kept_part(model: torch.nn.Module) -> StatePart:
    """Step 1's model kept in a client's state until step 2: gone by the end of a round,
    except for a client whose step-1 reply was dropped (``--on-divergence drop``)."""
    return model_part(_KEPT, model)


def local_anchor_arrays(
    model: torch.nn.Module, ctx: ClientContext, agg: str, features: FeatureFn | None = None
) -> dict[str, torch.Tensor]:
    """A client's upload: its class means under ``model`` (of ``features``, default the body
    output) and, when weighting, its counts."""
    means, counts = class_feature_means(model, ctx.data, ctx.data.num_classes, features=features)
    if agg == "weighted":
        return {ANCHORS: means, COUNTS: counts}
    return {ANCHORS: means}


def anchor_needs(agg: str) -> Needs:
    """What the server reads from the arrays of ``local_anchor_arrays``."""
    return needs((ANCHORS, COUNTS) if agg == "weighted" else (ANCHORS,))


def weighted_anchors(
    anchors: torch.Tensor, counts: torch.Tensor, previous: torch.Tensor | None
) -> torch.Tensor:
    """(K, C, d) local anchors and (K, C) counts -> (C, d): count-weighted class means.

    A class no client holds keeps ``previous`` (zero when there is none) [PROPOSAL].
    """
    a = anchors.to(torch.float64)
    n = counts.to(torch.float64)
    total = n.sum(dim=0)  # (C,)
    out = (n.unsqueeze(2) * a).sum(dim=0) / total.clamp(min=1).unsqueeze(1)
    fill = torch.zeros_like(out) if previous is None else previous.to(torch.float64)
    out = torch.where((total > 0).unsqueeze(1), out, fill)
    return out.to(anchors.dtype)


def uniform_anchors(anchors: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
    """(K, C, d) local anchors -> (C, d): plain mean over clients, where a client's all-zero
    row (a class it lacks) counts as the previous global anchor."""
    a = anchors.to(torch.float64)
    fill = torch.zeros_like(a[0]) if previous is None else previous.to(torch.float64)
    present = (a.abs().sum(dim=2) > 0).unsqueeze(2)  # (K, C, 1)
    filled = torch.where(present, a, fill.unsqueeze(0))
    return filled.mean(dim=0).to(anchors.dtype)


def aggregate_anchors(
    replies: Sequence[Message], previous: torch.Tensor | None, agg: str
) -> torch.Tensor:
    anchors = torch.stack([r.arrays[ANCHORS] for r in replies])
    if agg == "weighted":
        return weighted_anchors(anchors, torch.stack([r.arrays[COUNTS] for r in replies]), previous)
    return uniform_anchors(anchors, previous)


def anchor_metrics(active: bool, anchors: torch.Tensor, tau: float) -> dict[str, float]:
    """The round's FM metrics: whether the term was on, how many anchors are defined, and
    how well the global anchors can be told apart: the largest cosine between two of them
    and the CG floor, the mean CG loss of a feature lying exactly on its own class's anchor
    (0 for well separated anchors; log(classes) when they all point the same way). A high
    floor means lam x CG cannot shrink without moving features off their anchors."""
    valid = defined_rows(anchors)
    defined = int(valid.sum())
    out = {"fm_active": float(active), "fm_anchor_classes": float(defined)}
    if defined >= 2:
        a = F.normalize(anchors[valid].float(), dim=1)
        cos = a @ a.t()
        cos.fill_diagonal_(-1.0)
        out["fm_anchor_cos_max"] = float(cos.max())
        classes = torch.nonzero(valid).flatten()
        out["fm_cg_floor"] = float(cg_loss(anchors[valid].float(), classes, anchors.float(), tau))
    return out


# --- the matching loss ----------------------------------------------------------------------


@in_fp32
def cg_loss(
    features: torch.Tensor, y: torch.Tensor, anchors: torch.Tensor, tau: float
) -> torch.Tensor:
    """Contrastive guiding: CE over <h/|h|, a_n/|a_n|> / tau, undefined anchors left out."""
    valid = defined_rows(anchors)
    sims = F.normalize(features, dim=1) @ F.normalize(anchors, dim=1).t() / tau
    logp = sims.masked_fill(~valid, float("-inf")).log_softmax(dim=1)
    picked = logp.gather(1, y.unsqueeze(1)).squeeze(1)
    # torch.where, not a product: the -inf of an undefined target must not reach the sum.
    per_sample = torch.where(valid[y], -picked, torch.zeros_like(picked))
    return per_sample.sum() / y.numel()


@in_fp32
def l2_loss(features: torch.Tensor, y: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """MSE between h/|h| and a_y/|a_y| (mean over batch x dimension), undefined anchors out."""
    valid = defined_rows(anchors)
    diff = F.normalize(features, dim=1) - F.normalize(anchors, dim=1)[y]
    per_sample = diff.pow(2).mean(dim=1) * valid[y].to(diff.dtype)
    return per_sample.sum() / y.numel()


def matching_term(anchors: torch.Tensor, settings: FMSettings, rnd: int) -> LossTerm | None:
    """The ``(features, logits, y) -> lam * l_FM`` loss term of round ``rnd``, or None when it
    would be void."""
    lam, tau = settings.lam_in(rnd), settings.tau
    if lam == 0 or not bool(defined_rows(anchors).any()):
        return None
    target = anchors.detach()

    if settings.loss == "cg":

        def term(features: torch.Tensor, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return lam * cg_loss(features, y, target.to(features.dtype), tau)

    else:

        def term(features: torch.Tensor, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return lam * l2_loss(features, y, target.to(features.dtype))

    return term


@contextmanager
def loss_term_installed(ctx: ClientContext, term: LossTerm | None) -> Iterator[None]:
    """``term`` in ``ctx.loss_terms`` for the duration of the block (nothing if None).

    ``train_client`` adds it to the loss the algorithm's ``loss_fn`` returns as ``LossOutput``.
    """
    if term is None:
        yield
        return
    ctx.loss_terms.append(term)
    try:
        yield
    finally:
        ctx.loss_terms.remove(term)


@dataclass(frozen=True)
class AnchorMatchingLoss:
    """A ``PlainTraining`` loss: ``base`` (the local loss, whose features the term sees) plus
    ``lam * l_FM`` against the anchors among the loss's tensors, where they are (no anchors:
    ``base`` alone). The same term as ``matching_term``'s, added as ``train_client`` adds a
    context's loss terms. Equal for every client of an exchange (one base, one round's lam),
    which training clients together needs."""

    base: LossFn
    lam: float
    settings: FMSettings

    def __call__(
        self,
        model: torch.nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        tensors: Mapping[str, torch.Tensor],
    ) -> LossOutput:
        out = self.base(model, x, y)
        assert isinstance(out, LossOutput) and out.features is not None
        if ANCHORS not in tensors:
            return out
        term = scaled_matching_loss(out.features, y, tensors[ANCHORS], self.lam, self.settings)
        return LossOutput(out.loss + term, out.features, out.logits)


def scaled_matching_loss(
    features: torch.Tensor, y: torch.Tensor, anchors: torch.Tensor, lam: float, s: FMSettings
) -> torch.Tensor:
    """``lam * l_FM`` against ``anchors`` (in the features' dtype): ``matching_term``'s term,
    for the losses that take the anchors among their tensors."""
    target = anchors.to(features.dtype)
    if s.loss == "cg":
        return lam * cg_loss(features, y, target, s.tau)
    return lam * l2_loss(features, y, target)


def received_anchors(msg: Message, params: Any, rnd: int) -> dict[str, torch.Tensor]:
    """The global anchors ``msg`` carries as an ``AnchorMatchingLoss``'s tensors; none where
    ``received_anchor_term`` gives no term (before the launching round, lam 0, no anchor
    defined)."""
    if ANCHORS not in msg.arrays:
        return {}
    anchors = msg.arrays[ANCHORS]
    if settings_of(params).lam_in(rnd) == 0 or not bool(defined_rows(anchors).any()):
        return {}
    return {ANCHORS: anchors.detach()}


def received_anchor_term(msg: Message, params: Any, rnd: int) -> LossTerm | None:
    """The matching term for the global anchors ``msg`` carries (None without anchors)."""
    if ANCHORS not in msg.arrays:
        return None  # before the launching round
    return matching_term(msg.arrays[ANCHORS], settings_of(params), rnd)


# --- the anchor exchange (step 1) -----------------------------------------------------------


def anchor_exchange(
    channel: Channel,
    clients: list[int],
    model: dict[str, torch.Tensor],
    previous: torch.Tensor | None,
    agg: str,
) -> tuple[list[int], torch.Tensor]:
    """Server side of step 1: send ``model``, aggregate the local anchors that come back.

    Returns the clients whose reply arrived (in sampled order) and the new global anchors.
    """
    expect = {LOCAL_ANCHOR_KIND: anchor_needs(agg)}
    replies = channel.exchange({c: Message(ANCHOR_KIND, arrays=model) for c in clients}, expect)
    clients = arrived(clients, replies)
    return clients, aggregate_anchors([replies[c] for c in clients], previous, agg)


def reply_local_anchors(
    msg: Message, ctx: ClientContext, agg: str, features: FeatureFn | None = None
) -> Message:
    """Client side of step 1: load the received model's own entries, keep everything that
    was received for step 2, and reply with the local anchors under the received model."""
    model_keys = ctx.model.state_dict().keys()
    set_arrays(ctx.model, {k: v for k, v in msg.arrays.items() if k in model_keys})
    keep_received(ctx.state, msg.arrays)
    return Message(LOCAL_ANCHOR_KIND, arrays=local_anchor_arrays(ctx.model, ctx, agg, features))


def keep_received(state: ClientState, arrays: Mapping[str, torch.Tensor]) -> None:
    """Keep copies of step 1's arrays (replacing any left over from an earlier round)."""
    take_received(state)
    for key, value in arrays.items():
        state.arrays[_KEPT + key] = value.detach().clone()


def take_received(state: ClientState) -> dict[str, torch.Tensor]:
    """Step 1's arrays, removed from the client state."""
    kept = [k for k in state.arrays if k.startswith(_KEPT)]
    return {k[len(_KEPT) :]: state.arrays.pop(k) for k in kept}


# --- FedFM ----------------------------------------------------------------------------------


class FedFMServer(ServerLogic):
    # Resuming a run needs the anchors: uniform aggregation fills in previous ones.
    checkpoint_fields = ("fm_anchors",)

    def __init__(self, params: FedFMParams, setup: ServerSetup) -> None:
        super().__init__(params, setup)
        self.fm_anchors: torch.Tensor | None = None  # global anchors, None before any

    def round(self, rnd: int, clients: list[int], channel: Channel) -> dict[str, float]:
        p = self.params
        # 1. Anchor updating: local anchors under the global model, aggregated.
        clients, self.fm_anchors = anchor_exchange(
            channel, clients, self.global_arrays, self.fm_anchors, p.anchor_agg
        )
        # 2. Model updating: CE + lam * l_FM from the launching round on, FedAvg aggregation.
        active = rnd >= p.start_round
        msg = Message(
            "train",
            arrays={ANCHORS: self.fm_anchors} if active else {},
            strings={REUSED: "*"},  # the model: the one of step 1
        )
        expect = trained_needs(self.global_arrays, "num_samples")
        replies = channel.exchange({c: msg for c in clients}, expect)
        clients = arrived(clients, replies)
        states = [replies[c].arrays for c in clients]
        weights = [replies[c].scalars["num_samples"] for c in clients]
        self.global_arrays = apply_server_lr(
            self.global_arrays, weighted_average(states, weights), p.server_lr
        )
        return {
            "train_loss": self.mean_train_loss(replies, clients),
            **anchor_metrics(active, self.fm_anchors, p.cg_tau),
        }


class FedFMClient(ClientLogic):
    def on_fm_anchors(self, msg: Message, ctx: ClientContext) -> Message:
        """Step 1: the local anchors under the global model, which is kept for step 2."""
        features = remedies.anchor_features(self.params, ctx.model)
        return reply_local_anchors(msg, ctx, self.params.anchor_agg, features)

    def __init__(self, params: FedFMParams) -> None:
        super().__init__(params)
        self._base: LossFn | None = None

    def on_train(self, msg: Message, ctx: ClientContext) -> Message:
        return run_plain(self.plain_train(msg, ctx), ctx)

    def plain_train(self, msg: Message, ctx: ClientContext) -> PlainTraining:
        """Step 2: E epochs of CE + lam * l_FM from the model of step 1; FedAvg's reply."""
        model = take_received(ctx.state)
        if msg.strings.get(REUSED) != "*" or not model:
            raise RuntimeError(
                f"fedfm: client {ctx.client_id} was sent no model and keeps none from this "
                "round's anchor exchange"
            )
        set_arrays(ctx.model, model)
        if self._base is None:  # one per client logic: the same function for every client
            self._base = remedies.matching_loss(self.params, ctx.model)
        loss = AnchorMatchingLoss(
            self._base, settings_of(self.params).lam_in(ctx.round), settings_of(self.params)
        )
        return PlainTraining(
            lambda result: trained_reply(ctx, result.mean_loss),
            loss=loss,
            tensors=received_anchors(msg, self.params, ctx.round),
        )


class FedFM(Algorithm):
    name = "fedfm"
    description = "FedFM: FedAvg + anchor feature matching (contrastive guiding or l2)"
    Params = FedFMParams
    Server = FedFMServer
    Client = FedFMClient
    privacy = {
        "secure_aggregation": "weighs each client's class anchors by its class counts, per "
        "class (one weight per client is all a secure sum carries)",
        "dp": "sends class anchors (feature means per class), outside the clip norm",
    }
    feature_matching = True  # --feature-matching leaves it as it is

    @classmethod
    def adapt_model(cls, params: Any, model: torch.nn.Module) -> torch.nn.Module:
        """The model is unchanged; a remedy it cannot take is refused up front."""
        remedies.check_model(params, model)
        return model

    @classmethod
    def reply_arrays(
        cls, params: Any, model: torch.nn.Module, num_classes: int
    ) -> dict[str, ArraySpec]:
        return anchor_reply_arrays(model, num_classes)

    @classmethod
    def checkpoint_specs(
        cls, params: Any, model: torch.nn.Module, num_classes: int
    ) -> dict[str, Spec]:
        return anchor_fields(model, num_classes)

    @classmethod
    def client_state(
        cls, params: Any, model: torch.nn.Module, num_classes: int
    ) -> tuple[StatePart, ...]:
        return (kept_part(model),)

    @classmethod
    def inactive_mechanisms(cls, params: Any, shape: RunShape) -> list[InactiveMechanism]:
        return matching_inactive(params, shape, "every round trains and aggregates as FedAvg")
