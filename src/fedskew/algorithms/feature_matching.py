"""FedFM's anchor-based feature matching (Ye et al., IEEE TSP 2023), as a plug-in.

``with_feature_matching(Inner)`` turns any algorithm whose clients train through
``train_client`` with a loss that returns ``Forward`` into ``<inner>+fm``. Each round then has
two parts:

1. Anchor exchange (message kind ``fm_anchors``): every sampled client receives the global
   model, computes its local anchors with it (class means of the body features over all of its
   samples, in eval mode, each sample counted once) and replies with them, plus the per-class
   counts under weighted aggregation. The server aggregates the global anchors.
2. The inner algorithm's own round, unchanged, through a channel wrapper that adds the global
   anchors to the first message each client receives and drops from it every array the client
   already received in step 1 (same name, identical values), so the model is not sent twice.
   The client restores the dropped arrays from what it kept in ``ctx.state`` during step 1 and,
   while the inner handler runs, adds ``lam * l_FM(features, y)`` to the local loss through
   ``ctx.loss_terms``.

Per client and round this costs, on top of the inner algorithm: C x d anchor floats down
(from the launching round on) plus the string ``fm.reused`` (one byte, "*", when the inner
message repeated all of step 1); C x d anchors and C counts (int64) up (anchors only under
uniform aggregation).

Losses (on L2-normalised features h and anchors a, the anchors are constants):
- ``fm_loss=cg`` (contrastive guiding, default): cross-entropy of the similarities
  <h, a_n> / cg_tau over the C anchors with the true class; mean over the batch.
- ``fm_loss=l2``: mean squared error between h and a_y, mean over batch x dimension.

Anchor aggregation:
- ``anchor_agg=weighted`` (default): a_c = sum_k n_kc a_kc / sum_k n_kc.
- ``anchor_agg=uniform``: a_c = mean over the sampled clients of a_kc, where a client that has
  no sample of c contributes the previous global anchor of c. Clients then upload no class
  counts (that is the variant's point); a class the client lacks is an all-zero row.

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
  anchors are still computed and aggregated every round, but not broadcast: the round is then
  exactly the inner algorithm's.
- A client whose anchor reply does not arrive is left out of the anchor aggregation and of the
  inner round (which addresses only the clients that replied in step 1): the server cannot
  tell a rejected reply from a dead node.
- The plug-in's own parameters are ``lam`` (lambda, 50), ``cg_tau`` (the CG temperature
  alpha, 0.1; not ``tau``, which MOON already uses), ``start_round`` (T_s, 20), ``fm_loss``
  (cg|l2) and ``anchor_agg`` (weighted|uniform). If the inner algorithm already has a
  parameter of one of these names, the plug-in's is renamed ``fm_<name>`` (FedACD has ``lam``,
  so FedACD + FM takes ``fm_lam``).

Client state: the step-1 arrays are kept (as copies) only until the inner round's first
message has restored them. The global anchors of the round are kept with their round number,
so that an inner algorithm that trains in a later exchange of its round still sees them; as a
client cannot tell when a multi-exchange round is over, they are removed at its next anchor
exchange.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from fedskew.algorithm_interface import Algorithm, ClientContext, ServerSetup
from fedskew.algorithms.local import LossTerm, class_feature_means, set_arrays
from fedskew.errors import UsageError
from fedskew.precision import in_fp32
from fedskew.protocol import Channel, Message, arrived

ANCHOR_KIND = "fm_anchors"  # step 1, server -> client: the global model
LOCAL_ANCHOR_KIND = "fm_local_anchors"  # step 1, client -> server
ANCHORS = "fm.anchors"  # message array: (C, d) anchors, global (down) or local (up)
COUNTS = "fm.counts"  # message array: (C,) int64 class counts (up, weighted aggregation)
REUSED = "fm.reused"  # message string: arrays dropped because step 1 delivered them

FM_LOSSES = ("cg", "l2")
ANCHOR_AGGS = ("weighted", "uniform")

_KEPT = "fm.kept/"  # client state prefix: step-1 arrays until the inner round uses them
_STATE_ANCHORS = "fm.anchors"  # client state: this round's global anchors
_STATE_ROUND = "fm.anchors_round"


@dataclass
class FeatureMatchingParams:
    """FedFM's defaults: the official code's, which the paper's sweeps found best."""

    lam: float = 50.0
    cg_tau: float = 0.1
    start_round: int = 20
    fm_loss: str = "cg"
    anchor_agg: str = "weighted"

    def validate(self) -> None:
        settings_of(self).validate()


@dataclass(frozen=True)
class FMSettings:
    lam: float
    tau: float
    start_round: int
    loss: str
    agg: str

    def validate(self, names: Mapping[str, str] | None = None) -> None:
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
        if self.loss not in FM_LOSSES:
            raise UsageError(
                f"feature matching: {name('fm_loss')} must be one of {', '.join(FM_LOSSES)}, "
                f"got '{self.loss}'"
            )
        if self.agg not in ANCHOR_AGGS:
            raise UsageError(
                f"feature matching: {name('anchor_agg')} must be one of "
                f"{', '.join(ANCHOR_AGGS)}, got '{self.agg}'"
            )


_FM_FIELDS = {f.name: f for f in dataclasses.fields(FeatureMatchingParams)}


def settings_of(params: Any) -> FMSettings:
    """The FM settings of a params object, through the plug-in's (possibly renamed) fields."""
    names: Mapping[str, str] = getattr(type(params), "fm_field_names", {})

    def get(key: str) -> Any:
        return getattr(params, names.get(key, key))

    return FMSettings(
        lam=float(get("lam")),
        tau=float(get("cg_tau")),
        start_round=int(get("start_round")),
        loss=str(get("fm_loss")),
        agg=str(get("anchor_agg")),
    )


# --- anchors --------------------------------------------------------------------------------


def defined_rows(anchors: torch.Tensor) -> torch.Tensor:
    """(C,) bool: the anchors that have a direction (not all zero)."""
    return anchors.abs().sum(dim=1) > 0


def local_anchor_arrays(
    model: torch.nn.Module, ctx: ClientContext, agg: str
) -> dict[str, torch.Tensor]:
    """A client's upload: its class means under ``model`` and, when weighting, its counts."""
    means, counts = class_feature_means(model, ctx.data, ctx.data.num_classes)
    if agg == "weighted":
        return {ANCHORS: means, COUNTS: counts}
    return {ANCHORS: means}


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


# --- the loss term --------------------------------------------------------------------------


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


def matching_term(anchors: torch.Tensor, settings: FMSettings) -> LossTerm | None:
    """The ``(features, logits, y) -> lam * l_FM`` loss term, or None when it would be void."""
    if settings.lam == 0 or not bool(defined_rows(anchors).any()):
        return None
    target = anchors.detach()
    lam, tau = settings.lam, settings.tau

    if settings.loss == "cg":

        def term(features: torch.Tensor, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return lam * cg_loss(features, y, target.to(features.dtype), tau)

    else:

        def term(features: torch.Tensor, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return lam * l2_loss(features, y, target.to(features.dtype))

    return term


@contextmanager
def loss_term_installed(ctx: ClientContext, term: LossTerm | None) -> Iterator[None]:
    """``term`` in ``ctx.loss_terms`` for the duration of the block (nothing if None)."""
    if term is None:
        yield
        return
    ctx.loss_terms.append(term)
    try:
        yield
    finally:
        ctx.loss_terms.remove(term)


# --- the channel wrapper --------------------------------------------------------------------


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    # The same tensor object first: a diverged model (NaN) is never equal to itself by value.
    if a is b:
        return True
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


class AnchorChannel:
    """The channel the inner round talks to: it adds the anchors to, and removes the step-1
    arrays from, the first message each client gets; later exchanges pass unchanged."""

    def __init__(
        self,
        channel: Channel,
        delivered: Mapping[str, torch.Tensor],
        recipients: Sequence[int],
        anchors: torch.Tensor | None,
    ) -> None:
        self.channel = channel
        self.delivered = delivered
        self.pending = set(recipients)  # clients whose first inner message is still to come
        self.anchors = anchors

    def exchange(self, messages: Mapping[int, Message]) -> dict[int, Message]:
        out: dict[int, Message] = {}
        for cid, msg in messages.items():
            if cid not in self.pending:
                out[cid] = msg
                continue
            self.pending.discard(cid)
            arrays: dict[str, torch.Tensor] = {}
            dropped: list[str] = []
            for key, value in msg.arrays.items():
                sent = self.delivered.get(key)
                if sent is not None and _same(value, sent):
                    dropped.append(key)
                else:
                    arrays[key] = value
            strings = dict(msg.strings)
            # One byte in the usual case; the name list only when the inner message keeps
            # some step-1 arrays back (then the client must not restore those).
            strings[REUSED] = "*" if len(dropped) == len(self.delivered) else ",".join(dropped)
            if self.anchors is not None:
                arrays[ANCHORS] = self.anchors
            out[cid] = Message(msg.kind, arrays=arrays, scalars=dict(msg.scalars), strings=strings)
        return self.channel.exchange(out)


# --- the plug-in ----------------------------------------------------------------------------

_WRAPPED: dict[type[Algorithm], type[Algorithm]] = {}


def _combined_params(inner: type) -> type:
    """The inner Params plus the FM fields (renamed ``fm_<name>`` where they would clash)."""
    inner_fields = {f.name for f in dataclasses.fields(inner)}
    names = {k: (f"fm_{k}" if k in inner_fields else k) for k in _FM_FIELDS}
    fields = [
        (names[k], f.type, dataclasses.field(default=f.default)) for k, f in _FM_FIELDS.items()
    ]
    inner_validate = getattr(inner, "validate", None)

    def validate(self: Any) -> None:
        if inner_validate is not None:
            inner_validate(self)
        settings_of(self).validate(names)

    frozen = bool(inner.__dataclass_params__.frozen)
    return dataclasses.make_dataclass(
        f"{inner.__name__}FM",
        fields,
        bases=(inner,),
        namespace={"validate": validate, "fm_field_names": names},
        frozen=frozen,
    )


def with_feature_matching(cls: type[Algorithm]) -> type[Algorithm]:
    """``cls`` with FedFM's anchor feature matching added (see the module docstring)."""
    if getattr(cls, "feature_matching", False):
        return cls  # FedFM, FedFM-Lite or an already wrapped algorithm: match only once
    cached = _WRAPPED.get(cls)
    if cached is not None:
        return cached

    class FMServer(cls.Server):  # type: ignore[name-defined, misc]
        # Resuming a run needs the anchors: uniform aggregation fills in previous ones.
        checkpoint_fields = (*cls.Server.checkpoint_fields, "fm_anchors")

        def __init__(self, params: Any, setup: ServerSetup) -> None:
            super().__init__(params, setup)
            self.fm_anchors: torch.Tensor | None = None  # global anchors, None before any

        def round(self, rnd: int, clients: list[int], channel: Channel) -> dict[str, float]:
            s = settings_of(self.params)
            # A snapshot: what step 1 delivered, to recognise it in the inner messages even
            # if the inner server later rebinds or rebuilds its arrays.
            delivered = {k: v.detach().clone() for k, v in self.global_arrays.items()}
            replies = channel.exchange({c: Message(ANCHOR_KIND, arrays=delivered) for c in clients})
            clients = arrived(clients, replies)  # the inner round runs with these only
            self.fm_anchors = aggregate_anchors(
                [replies[c] for c in clients], self.fm_anchors, s.agg
            )
            active = rnd >= s.start_round
            wrapped = AnchorChannel(
                channel, delivered, clients, self.fm_anchors if active else None
            )
            metrics = dict(super().round(rnd, clients, wrapped))
            metrics["fm_active"] = float(active)
            metrics["fm_anchor_classes"] = float(defined_rows(self.fm_anchors).sum())
            return metrics

    class FMClient(cls.Client):  # type: ignore[name-defined, misc]
        def handle(self, msg: Message, ctx: ClientContext) -> Message:
            if msg.kind == ANCHOR_KIND:
                return self._fm_local_anchors(msg, ctx)
            msg = self._fm_unwrap(msg, ctx)
            term = None
            if ctx.state.scalars.get(_STATE_ROUND) == float(ctx.round):
                term = matching_term(ctx.state.arrays[_STATE_ANCHORS], settings_of(self.params))
            with loss_term_installed(ctx, term):
                return super().handle(msg, ctx)

        def _fm_local_anchors(self, msg: Message, ctx: ClientContext) -> Message:
            state = ctx.state
            # Left over from an earlier round (the client cannot tell when an inner round
            # with several exchanges is over, so the anchors live until this point).
            for key in [k for k in state.arrays if k.startswith(_KEPT)]:
                del state.arrays[key]
            state.arrays.pop(_STATE_ANCHORS, None)
            state.scalars.pop(_STATE_ROUND, None)
            # Only the model's own entries: an inner server may keep more in global_arrays.
            model_keys = ctx.model.state_dict().keys()
            set_arrays(ctx.model, {k: v for k, v in msg.arrays.items() if k in model_keys})
            for key, value in msg.arrays.items():
                state.arrays[_KEPT + key] = value.detach().clone()
            arrays = local_anchor_arrays(ctx.model, ctx, settings_of(self.params).agg)
            return Message(LOCAL_ANCHOR_KIND, arrays=arrays)

        def _fm_unwrap(self, msg: Message, ctx: ClientContext) -> Message:
            """The inner algorithm's message as it was before the wrapper touched it."""
            state = ctx.state
            if REUSED not in msg.strings:
                return msg  # a later exchange of the round
            reused = msg.strings[REUSED]
            kept = {k[len(_KEPT) :]: k for k in state.arrays if k.startswith(_KEPT)}
            names = list(kept) if reused == "*" else [n for n in reused.split(",") if n]
            missing = [n for n in names if n not in kept]
            if missing:
                raise RuntimeError(
                    f"feature matching: client {ctx.client_id} was not sent '{missing[0]}' "
                    "in this round's anchor exchange"
                )
            arrays = {n: state.arrays[kept[n]] for n in names}
            arrays.update({k: v for k, v in msg.arrays.items() if k != ANCHORS})
            for key in kept.values():
                del state.arrays[key]
            if ANCHORS in msg.arrays:
                state.arrays[_STATE_ANCHORS] = msg.arrays[ANCHORS].detach().clone()
                state.scalars[_STATE_ROUND] = float(ctx.round)
            else:
                state.arrays.pop(_STATE_ANCHORS, None)
                state.scalars.pop(_STATE_ROUND, None)
            strings = {k: v for k, v in msg.strings.items() if k != REUSED}
            return Message(msg.kind, arrays=arrays, scalars=dict(msg.scalars), strings=strings)

    FMServer.__name__ = FMServer.__qualname__ = f"{cls.Server.__name__}FM"
    FMClient.__name__ = FMClient.__qualname__ = f"{cls.Client.__name__}FM"

    class WithFM(cls):  # type: ignore[valid-type, misc]
        name = f"{cls.name}+fm"
        description = f"{cls.description}; + FedFM anchor feature matching"
        Params = _combined_params(cls.Params)
        Server = FMServer
        Client = FMClient
        feature_matching: ClassVar[bool] = True
        inner: ClassVar[type[Algorithm]] = cls

    WithFM.__name__ = WithFM.__qualname__ = f"{cls.__name__}FM"
    _WRAPPED[cls] = WithFM
    return WithFM
