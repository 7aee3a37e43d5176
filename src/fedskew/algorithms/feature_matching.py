"""FedFM's anchor feature matching as a plug-in: ``--feature-matching`` on any algorithm.

``with_feature_matching(Inner)`` turns any algorithm whose clients train through
``train_client`` with a loss that returns ``LossOutput`` into ``<inner>+fm``. The mechanism,
the losses, the anchor aggregation, their defaults and the choices marked [PROPOSAL] are
FedFM's, documented and implemented in ``fedskew.algorithms.fedfm``; this module only fits
them around another algorithm's round. Each round then has two parts:

1. FedFM's anchor exchange (step 1), unchanged: the server aggregates the global anchors.
2. The inner algorithm's own round, unchanged, through a channel wrapper that adds the global
   anchors (from the launching round on) to the first message each client receives and drops
   from it every array the client already received in step 1 (same name, identical values),
   so the model is not sent twice. The string ``fm.reused`` says what was dropped: "*" (one
   byte) when the inner message repeated all of step 1, else the dropped names. The client
   restores them from what it kept in ``ctx.state`` in step 1 and, while the inner handler
   runs, adds ``lam * l_FM(features, y)`` to the local loss through ``ctx.loss_terms``.

On FedAvg this is FedFM, message for message and byte for byte (FedAvg's "train" message
becomes FedFM's: no model, the anchors, "*").

Choices of the plug-in, marked [PROPOSAL] (FedFM's own are in ``fedskew.algorithms.fedfm``):
- Before the launching round the anchors are computed and aggregated but not broadcast: the
  round is then exactly the inner algorithm's.
- The inner round addresses only the clients whose anchor reply arrived.
- The plug-in's parameters are FedFM's (``lam``, ``cg_tau``, ``start_round``, ``fm_loss``,
  ``anchor_agg``, and the ``lam_warmup`` remedy of ``fedskew.algorithms.fedfm_remedies``).
  If the inner algorithm already has a parameter of one of these names, the plug-in's is
  renamed ``fm_<name>`` (FedACD has ``lam``, so FedACD + FM takes ``fm_lam``).

Client state: the step-1 arrays are kept (as copies) only until the inner round's first
message has restored them. The global anchors of the round are kept with their round number,
so that an inner algorithm that trains in a later exchange of its round still sees them; as a
client cannot tell when a multi-exchange round is over, they are removed at its next anchor
exchange.

Clients of ``<inner>+fm`` train together (``fedskew.engines.together``) where the inner
algorithm's do: the client names the inner client logic it wraps (``wraps_handlers``) and
gives ``wrapped_plain(kind, msg, ctx)``, which does what ``handle`` does around the inner
handler (restore the message, keep the anchors in ``ctx.state``) and returns the inner
``plain_<kind>`` with the term in its loss instead of on the context, which the stacked loop
does not see: ``InnerMatchingLoss``, the inner loss (None: cross-entropy) plus ``lam *
l_FM`` of the features it returns, the round's anchors among the tensors under
``MATCH_TENSOR``, hidden from the inner loss. Where ``handle`` would install no term (before
the launching round, lam 0, no anchor defined) the inner plan is returned as it is. The
anchor exchange trains nothing and goes one after another; an inner algorithm without a
plain split trains one after another with the plug-in too (its reason is logged).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from fedskew.algorithms.fedfm import (
    ANCHOR_KIND,
    ANCHORS,
    COUNTS,
    REUSED,
    FeatureMatchingParams,
    FMSettings,
    anchor_exchange,
    anchor_fields,
    anchor_metrics,
    anchor_reply_arrays,
    cg_loss,
    kept_part,
    l2_loss,
    loss_term_installed,
    matching_inactive,
    matching_term,
    reply_local_anchors,
    scaled_matching_loss,
    settings_of,
    take_received,
)
from fedskew.training.interface import (
    Algorithm,
    ClientContext,
    ClientLogic,
    InactiveMechanism,
    RunShape,
    ServerSetup,
)
from fedskew.training.local import ClientLoss, LossOutput, PlainTraining, cross_entropy_loss
from fedskew.training.protocol import ArraySpec, Channel, Expected, Message
from fedskew.training.state_spec import Spec, StatePart

# The plug-in, and FedFM's pieces that callers import from here (re-exported).
__all__ = [
    "ANCHORS",
    "COUNTS",
    "REUSED",
    "AnchorChannel",
    "cg_loss",
    "l2_loss",
    "with_feature_matching",
]

_STATE_ANCHORS = "fm.anchors"  # client state: this round's global anchors
_STATE_ROUND = "fm.anchors_round"
# The global anchors among a PlainTraining's tensors: a name no inner algorithm's tensor has
# (theirs are model entries under a prefix of their own).
MATCH_TENSOR = "fm+anchors"

_FM_FIELDS = {f.name: f for f in dataclasses.fields(FeatureMatchingParams)}


# --- the channel wrapper --------------------------------------------------------------------


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and values, NaN equal to NaN: a diverged (NaN) model is still the
    model step 1 delivered, as FedFM, which never sends it twice, assumes."""
    if a is b:
        return True
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    return a.is_floating_point() and bool(((a == b) | (a.isnan() & b.isnan())).all())


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

    def exchange(
        self, messages: Mapping[int, Message], expect: Expected | None = None
    ) -> dict[int, Message]:
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
        return self.channel.exchange(out, expect)


# --- the plug-in ----------------------------------------------------------------------------

_WRAPPED: dict[type[Algorithm], type[Algorithm]] = {}


def _round_anchors(ctx: ClientContext) -> torch.Tensor | None:
    """The global anchors the client received in this round (None before the launching
    round, or left over from an earlier one)."""
    if ctx.state.scalars.get(_STATE_ROUND) != float(ctx.round):
        return None
    return ctx.state.arrays[_STATE_ANCHORS]


@dataclasses.dataclass(frozen=True)
class InnerMatchingLoss:
    """A ``PlainTraining`` loss: the inner algorithm's (None: cross-entropy) plus
    ``lam * l_FM`` of its features against the anchors under ``MATCH_TENSOR`` among the
    tensors, which the inner loss does not see. What ``train_client`` computes with the
    plug-in's term on the context: the inner loss's ``LossOutput`` plus the term of its
    features. Equal for every client of an exchange (one inner loss, one round's lam)."""

    inner: ClientLoss | None
    lam: float
    settings: FMSettings

    def __call__(
        self,
        model: torch.nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        tensors: Mapping[str, torch.Tensor],
    ) -> LossOutput:
        own = {k: v for k, v in tensors.items() if k != MATCH_TENSOR}
        out = (
            cross_entropy_loss(model, x, y) if self.inner is None else self.inner(model, x, y, own)
        )
        if not isinstance(out, LossOutput) or out.features is None or out.logits is None:
            raise RuntimeError("feature matching needs a loss that returns features (LossOutput)")
        anchors = tensors[MATCH_TENSOR]
        term = scaled_matching_loss(out.features, y, anchors, self.lam, self.settings)
        # aux goes on: the inner algorithm's after_step reads it (FedACD's confusion sums).
        return LossOutput(out.loss + term, out.features, out.logits, out.aux)


def _with_matching(
    plan: PlainTraining, anchors: torch.Tensor, lam: float, s: FMSettings
) -> PlainTraining:
    """The inner algorithm's ``plan`` with the matching term against ``anchors`` added."""
    if MATCH_TENSOR in plan.tensors or MATCH_TENSOR in plan.trained:
        raise ValueError(f"feature matching: the inner loss already has a tensor {MATCH_TENSOR}")
    return dataclasses.replace(
        plan,
        loss=InnerMatchingLoss(plan.loss, lam, s),
        tensors={**plan.tensors, MATCH_TENSOR: anchors.detach()},
    )


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
            clients, self.fm_anchors = anchor_exchange(  # the inner round runs with these
                channel, clients, delivered, self.fm_anchors, s.agg
            )
            active = rnd >= s.start_round
            wrapped = AnchorChannel(
                channel, delivered, clients, self.fm_anchors if active else None
            )
            metrics = dict(super().round(rnd, clients, wrapped))
            metrics.update(anchor_metrics(active, self.fm_anchors, s.tau))
            return metrics

    class FMClient(cls.Client):  # type: ignore[name-defined, misc]
        # Its handle wraps these handlers; wrapped_plain is their split for clients trained
        # together (fedskew.engines.together.plain_handler).
        wraps_handlers: ClassVar[type[ClientLogic]] = cls.Client

        def handle(self, msg: Message, ctx: ClientContext) -> Message:
            if msg.kind == ANCHOR_KIND:
                # Left over from an earlier round (the client cannot tell when an inner
                # round with several exchanges is over, so the anchors live until here).
                ctx.state.arrays.pop(_STATE_ANCHORS, None)
                ctx.state.scalars.pop(_STATE_ROUND, None)
                return reply_local_anchors(msg, ctx, settings_of(self.params).agg)
            msg = self._fm_unwrap(msg, ctx)
            anchors = _round_anchors(ctx)
            term = None
            if anchors is not None:
                term = matching_term(anchors, settings_of(self.params), ctx.round)
            with loss_term_installed(ctx, term):
                return super().handle(msg, ctx)

        def wrapped_plain(self, kind: str, msg: Message, ctx: ClientContext) -> PlainTraining:
            """What ``handle`` does for a message of the inner round, split as the inner
            ``plain_<kind>`` is: the same message restored, and the same term, added by the
            plan's loss to the inner one instead of through ``ctx.loss_terms``."""
            msg = self._fm_unwrap(msg, ctx)
            plan: PlainTraining = getattr(super(), f"plain_{kind}")(msg, ctx)
            anchors = _round_anchors(ctx)
            s = settings_of(self.params)
            if anchors is None or matching_term(anchors, s, ctx.round) is None:
                return plan  # no term one after another either: the inner round as it is
            return _with_matching(plan, anchors, s.lam_in(ctx.round), s)

        def _fm_unwrap(self, msg: Message, ctx: ClientContext) -> Message:
            """The inner algorithm's message as it was before the wrapper touched it."""
            state = ctx.state
            if REUSED not in msg.strings:
                return msg  # a later exchange of the round
            reused = msg.strings[REUSED]
            kept = take_received(state)
            names = list(kept) if reused == "*" else [n for n in reused.split(",") if n]
            missing = [n for n in names if n not in kept]
            if missing or not kept:
                what = f"'{missing[0]}'" if missing else "a model"
                raise RuntimeError(
                    f"feature matching: client {ctx.client_id} was not sent {what} "
                    "in this round's anchor exchange"
                )
            arrays = {n: kept[n] for n in names}
            arrays.update({k: v for k, v in msg.arrays.items() if k != ANCHORS})
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
        privacy: ClassVar[dict[str, str | None]] = {
            "secure_aggregation": "with feature matching reads each client's class anchors",
            "dp": "with feature matching sends class anchors, outside the clip norm",
        }

        @classmethod
        def reply_arrays(
            cls, params: Any, model: torch.nn.Module, num_classes: int
        ) -> dict[str, ArraySpec] | None:
            inner = cls.inner.reply_arrays(params, model, num_classes)
            return None if inner is None else {**inner, **anchor_reply_arrays(model, num_classes)}

        @classmethod
        def checkpoint_specs(
            cls, params: Any, model: torch.nn.Module, num_classes: int
        ) -> dict[str, Spec]:
            inner = cls.inner.checkpoint_specs(params, model, num_classes)
            return {**inner, **anchor_fields(model, num_classes)}

        @classmethod
        def client_state(
            cls, params: Any, model: torch.nn.Module, num_classes: int
        ) -> tuple[StatePart, ...] | None:
            """The inner algorithm's, step 1's kept model and the round's anchors (left
            until the client's next anchor exchange)."""
            inner = cls.inner.client_state(params, model, num_classes)
            if inner is None:
                return None
            anchors = {_STATE_ANCHORS: ArraySpec((num_classes, model.feature_dim))}
            return (*inner, kept_part(model), StatePart(anchors, (_STATE_ROUND,)))

        @classmethod
        def inactive_mechanisms(cls, params: Any, shape: RunShape) -> list[InactiveMechanism]:
            """The inner algorithm's own, and the matching launched after the last round."""
            return [
                *cls.inner.inactive_mechanisms(params, shape),
                *matching_inactive(params, shape, f"every round trains as {cls.inner.name}"),
            ]

    WithFM.__name__ = WithFM.__qualname__ = f"{cls.__name__}FM"
    _WRAPPED[cls] = WithFM
    return WithFM
