"""Secure aggregation and differential privacy of the clients' updates (docs/privacy.md).

Both rest on one kind of exchange, the *summed* one: the server marks its messages (the
scalars below), each client answers with its *summand* (its update, ``ClientLogic.summand``)
instead of its reply, and the server gets the weighted mean of the summands
(:class:`~fedskew.training.protocol.Summed`), never one of them:

* **secure aggregation** (SecAgg+): the engine sums masked, quantised summands (Flower's
  ``secaggplus_mod`` on Flower, the same arithmetic simulated elsewhere:
  ``fedskew.engines.secure_sum``);
* **central DP** (DP-FedAvg, McMahan et al. 2018; adaptive clipping, Andrew et al. 2021):
  each client clips its update to the norm S, every client weighs the same, the server adds
  Gaussian noise of standard deviation z*S to the sum (the mean gets z*S/m);
* **local DP**: each client clips its update and adds the noise z*S itself.

Every draw is addressed (``fedskew.core.rng``): the clients' noise by (seed, round, client),
the server's by (seed, round), so a DP run resumes exactly and every engine adds the same
noise. Which algorithms take part, and why the others cannot, is their ``Algorithm.privacy``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fedskew.config import ExperimentConfig
from fedskew.core.errors import Diverged, FedskewError, UsageError
from fedskew.core.rng import SERVER, torch_rng
from fedskew.training.protocol import (
    ArraySpec,
    Expected,
    Message,
    Summed,
    SumRequest,
    arrived,
    needs,
)

if TYPE_CHECKING:
    from fedskew.training.interface import ClientContext, ClientLogic, ServerLogic

# Scalars of a message whose reply goes into a sum. SUMMED marks it; the others say how the
# client forms its summand.
SUMMED = "privacy.summed"
CLIP = "privacy.clip"  # clip the update to this L2 norm (0: no clipping)
LOCAL_NOISE = "privacy.local_noise"  # local DP: add noise of std this times the clip norm
WANT_BIT = "privacy.want_clip_bit"  # adaptive clipping: add the CLIP_BIT array
WANT_LOSS = "privacy.want_loss"  # secure aggregation without DP: sum the loss too
UNIFORM = "privacy.uniform"  # 1: every client weighs 1 in the sum (Flower's num_examples)
# The update is summed times this (the server divides the mean by it): a method whose updates
# are far smaller than the quantisation's range (FedNova's per-step d_i) keeps its precision.
SCALE = "privacy.scale"
# Summand arrays besides the update's: whether the update was within the clip norm (1.0)
# or not (0.0), and the client's training loss. One element each.
CLIP_BIT = "privacy.clip_bit"
LOSS = "privacy.loss"
EXTRA_SUMMANDS = (CLIP_BIT, LOSS)
# The server enforces the clip norm on summands it sees up to this relative excess, so that an
# honest client's update, rescaled to S in float32, is not rescaled again.
CLIP_SLACK = 1e-5


@dataclass(frozen=True)
class Privacy:
    """A run's privacy settings (the options of the same names, resolved)."""

    secure: bool
    dp: str  # "off", "central" or "local"
    clip: float
    noise: float
    adaptive: bool
    target_quantile: float
    clip_lr: float
    count_noise: float
    delta: float
    clip_range: float
    quantization: int
    accounting: str = "replace-one"
    target_epsilon: float | None = None

    @classmethod
    def of(cls, cfg: ExperimentConfig) -> Privacy | None:
        """The settings of ``cfg``, or None when it asks for neither mechanism."""
        if not cfg.secure_aggregation and cfg.dp == "off":
            return None
        return cls(
            secure=cfg.secure_aggregation,
            dp=cfg.dp,
            clip=cfg.dp_clip,
            noise=cfg.dp_noise,
            adaptive=cfg.dp_clipping == "adaptive",
            target_quantile=cfg.dp_target_quantile,
            clip_lr=cfg.dp_clip_lr,
            count_noise=cfg.count_noise(),
            delta=cfg.dp_delta,
            clip_range=cfg.secagg_clip_range,
            quantization=cfg.secagg_quantization,
            accounting=cfg.dp_accounting,
            target_epsilon=cfg.dp_target_epsilon,
        )

    @property
    def central(self) -> bool:
        return self.dp == "central"

    @property
    def local(self) -> bool:
        return self.dp == "local"

    def update_noise(self) -> float:
        """The noise multiplier of the updates' sum. With adaptive clipping the count of
        unclipped updates takes part of the budget: z_update = (z^-2 - (2 sigma_b)^-2)^-1/2,
        so that both together are the Gaussian mechanism of multiplier z (Andrew et al. 2021,
        Theorem 1)."""
        if not self.adaptive or self.noise == 0:
            return self.noise
        return (self.noise**-2 - (2 * self.count_noise) ** -2) ** -0.5

    def describe(self) -> dict[str, Any]:
        """What a summary records of the settings."""
        facts: dict[str, Any] = {"secure_aggregation": self.secure, "dp": self.dp}
        if self.dp != "off":
            facts.update(dp_clip=self.clip, dp_noise=self.noise, dp_delta=self.delta)
            facts["dp_clipping"] = "adaptive" if self.adaptive else "fixed"
            facts["dp_accounting"] = self.accounting
            if self.target_epsilon is not None:
                facts["dp_target_epsilon"] = self.target_epsilon
        return facts


def check_privacy(name: str, support: Mapping[str, str | None], privacy: Privacy | None) -> None:
    """Refuse, in one line, a mechanism the algorithm does not support: ``support`` maps
    "secure_aggregation" and "dp" to None (supported) or the reason it is not
    (``Algorithm.privacy``)."""
    if privacy is None:
        return
    if privacy.secure and support.get("secure_aggregation"):
        raise UsageError(f"secure-aggregation: {name} {support['secure_aggregation']}")
    if privacy.dp != "off" and support.get("dp"):
        raise UsageError(f"dp: {name} {support['dp']}")


def reply_arrays(privacy: Privacy | None) -> dict[str, ArraySpec]:
    """The arrays a summand adds to the update, where the server sees summands (for the reply
    checks of an engine whose replies cannot be trusted)."""
    if privacy is None or privacy.secure or not privacy.adaptive:
        return {}
    return {CLIP_BIT: ArraySpec((1,), torch.float32)}


# ------------------------------------------------------------------------------ client side


def summand_reply(logic: ClientLogic, sent: Message, reply: Message, ctx: ClientContext) -> Message:
    """The reply a client sends to a message of a summed exchange: its summand (clipped,
    noised, with the extra arrays asked for) and the numbers the server may see; any other
    message's reply unchanged. Every engine's client side calls it on every reply."""
    if SUMMED not in sent.scalars:
        return reply
    part = logic.summand(sent, reply)
    scale = float(sent.scalars.get(SCALE, 1.0))
    arrays = {k: v * scale if scale != 1.0 else v for k, v in part.arrays.items()}
    for name, t in arrays.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            # Inside a secure sum nobody could tell: stop here (a lost reply on Flower).
            raise Diverged(
                f"round {ctx.round + 1}: client {ctx.client_id} diverged (NaN or Inf in its "
                f"update '{name}')",
                ctx.round + 1,
            )
    clip = float(sent.scalars.get(CLIP, 0.0))
    within = 1.0
    if clip > 0:
        norm = update_norm(arrays)
        within = 1.0 if norm <= clip else 0.0
        if norm > clip:
            arrays = {k: v * (clip / norm) for k, v in arrays.items()}
    noise = float(sent.scalars.get(LOCAL_NOISE, 0.0))
    if noise > 0:
        arrays = add_noise(arrays, noise * clip, ctx.rng("dp-local-noise"))
    if sent.scalars.get(WANT_BIT):
        arrays[CLIP_BIT] = torch.tensor([within], dtype=torch.float32)
    if sent.scalars.get(WANT_LOSS):
        arrays[LOSS] = torch.tensor([reply.scalars.get("loss", 0.0)], dtype=torch.float32)
    return Message(reply.kind, arrays=arrays, scalars=dict(part.scalars))


def update_norm(arrays: Mapping[str, torch.Tensor]) -> float:
    """The L2 norm of all floating-point arrays together (the extra summands left out)."""
    total = 0.0
    for name, t in arrays.items():
        if name not in EXTRA_SUMMANDS and t.is_floating_point():
            total += float(t.double().pow(2).sum())
    return math.sqrt(total)


def add_noise(
    arrays: Mapping[str, torch.Tensor], std: float, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """Each array plus Gaussian noise of standard deviation ``std``, drawn with ``gen`` on
    the host in sorted name order (the same numbers on every device and engine)."""
    out = dict(arrays)
    for name in sorted(arrays):
        t = arrays[name]
        if name in EXTRA_SUMMANDS or not t.is_floating_point():
            continue
        z = torch.randn(t.shape, generator=gen, dtype=torch.float64, device="cpu")
        out[name] = (t.double() + std * z.to(t.device)).to(t.dtype)
    return out


# ------------------------------------------------------------------------------ server side


def exchange_summed(
    channel: Any, messages: Mapping[int, Message], expect: Expected, request: SumRequest
) -> Summed:
    """The summed exchange over ``channel``: its own ``exchange_summed`` where it has one
    (the run loop's channel always does), else the plain mean of its replies."""
    method = getattr(channel, "exchange_summed", None)
    if method is not None:
        result: Summed = method(messages, expect, request)
        return result
    if request.secure:
        raise FedskewError("this channel has no secure aggregation (exchange_summed)")
    replies = channel.exchange(messages, expect)
    return plain_mean(replies, request)


def plain_mean(replies: Mapping[int, Message], request: SumRequest) -> Summed:
    """The weighted mean of the replies' summands in float64, for a summed exchange without
    secure aggregation. The server sees each summand here, so it enforces ``bound`` (a
    client that did not clip is clipped) and keeps each clip bit within [0, 1]."""
    clients = arrived(list(replies), replies)
    total = 0.0
    sums: dict[str, torch.Tensor] = {}
    for cid in clients:
        reply = replies[cid]
        arrays = {k: reply.arrays[k].double() for k in request.names()}
        if request.bound is not None:
            norm = update_norm(arrays)
            if norm > request.bound * (1 + CLIP_SLACK):
                arrays = {
                    k: v if k in EXTRA_SUMMANDS else v * (request.bound / norm)
                    for k, v in arrays.items()
                }
        if CLIP_BIT in arrays:
            arrays[CLIP_BIT] = arrays[CLIP_BIT].clamp(0.0, 1.0)
        w = request.weight(reply)
        total += w
        for k, v in arrays.items():
            sums[k] = sums[k] + w * v if k in sums else w * v
    mean = {k: v / total for k, v in sums.items()}
    return Summed(
        mean, total, {c: Message(replies[c].kind, scalars=replies[c].scalars) for c in clients}
    )


class PrivateAggregation:
    """The server side of a summed exchange, for a server that moves its model by the mean
    of the clients' updates: what its messages carry, the request, the noise (central DP)
    and the clip norm's adaptation. Its state (the clip norm) lives in the server's
    ``privacy_state``, which the checkpoint keeps."""

    def __init__(self, privacy: Privacy, seed: int, client_sizes: list[int]) -> None:
        self.privacy = privacy
        self.seed = seed
        self.max_size = float(max(client_sizes, default=1))

    @classmethod
    def install(cls, server: ServerLogic) -> PrivateAggregation | None:
        """The aggregation of ``server``'s run, its state added to the checkpointed fields;
        None when the run asks for no privacy."""
        privacy = server.setup.privacy
        if privacy is None:
            return None
        server.privacy_state = {"clip": privacy.clip}
        server.checkpoint_fields = (*type(server).checkpoint_fields, "privacy_state")
        return cls(privacy, server.setup.seed, server.setup.client_sizes)

    def message(self, msg: Message, state: Mapping[str, float], scale: float = 1.0) -> Message:
        """``msg`` with what tells the client how to form its summand."""
        p = self.privacy
        marks = {SUMMED: 1.0, CLIP: state["clip"] if p.dp != "off" else 0.0}
        if scale != 1.0:
            marks[SCALE] = scale
        if p.local:
            marks[LOCAL_NOISE] = p.noise
        if p.adaptive:
            marks[WANT_BIT] = 1.0
        if p.dp == "off":
            marks[WANT_LOSS] = 1.0
        if p.central:
            marks[UNIFORM] = 1.0
        return Message(msg.kind, arrays=msg.arrays, scalars={**msg.scalars, **marks},
                       strings=msg.strings)  # fmt: skip

    def request(
        self, arrays: Mapping[str, torch.Tensor], rnd: int, state: Mapping[str, float]
    ) -> SumRequest:
        """The request for summands of the floating-point ``arrays`` (the model sent)."""
        p = self.privacy
        shapes = {k: tuple(v.shape) for k, v in arrays.items() if v.is_floating_point()}
        if p.adaptive:
            shapes[CLIP_BIT] = (1,)
        if p.dp == "off":
            shapes[LOSS] = (1,)
        return SumRequest(
            shapes=shapes,
            uniform=p.central,
            secure=p.secure,
            seed=self.seed,
            round=rnd,
            clip_range=p.clip_range,
            quantization=p.quantization,
            max_weight=1.0 if p.central else self.max_size,
            bound=state["clip"] if p.central else None,
        )

    def exchange(
        self,
        channel: Any,
        rnd: int,
        clients: list[int],
        msg: Message,
        state: Mapping[str, float],
        clear: tuple[str, ...] = (),
        kind: str = "trained",
        scale: float = 1.0,
    ) -> Summed:
        """Send ``msg`` to ``clients`` and get the mean of their summands; ``clear``: the
        numbers besides ``num_samples`` the server reads from each reply; ``scale``: the
        factor the clients multiply their updates by (the mean is divided by it again)."""
        sent = self.message(msg, state, scale)
        request = self.request(msg.arrays, rnd, state)
        expect = {kind: needs(request.shapes, ("num_samples", *clear))}
        summed = exchange_summed(channel, {c: sent for c in clients}, expect, request)
        if scale != 1.0:
            summed.mean = {
                k: v if k in EXTRA_SUMMANDS else v / scale for k, v in summed.mean.items()
            }
        return summed

    def finish(
        self, rnd: int, summed: Summed, state: dict[str, float]
    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """(the mean update, the round's metrics) from the sum; under central DP the mean gets
        its noise here and the clip norm of adaptive clipping moves (``state``)."""
        p = self.privacy
        mean = dict(summed.mean)
        metrics: dict[str, float] = {}
        loss = mean.pop(LOSS, None)
        if loss is not None:
            metrics["train_loss"] = float(loss.reshape(-1)[0])
        bit = mean.pop(CLIP_BIT, None)
        if p.dp == "off":
            return mean, metrics
        clip = state["clip"]
        metrics["dp_clip"] = clip
        if p.central:
            m = len(summed.replies)
            std = p.update_noise() * clip / m
            mean = add_noise(mean, std, torch_rng(self.seed, rnd, SERVER, "dp-noise"))
            metrics["dp_noise_std"] = std
            if p.adaptive and bit is not None:
                gen = torch_rng(self.seed, rnd, SERVER, "dp-count-noise")
                draw = float(torch.randn(1, generator=gen, dtype=torch.float64)[0])
                unclipped = float(bit.reshape(-1)[0]) + p.count_noise * draw / m
                # Geometric update: the norm shrinks while more than the target quantile
                # of updates fit under it, grows while fewer do.
                state["clip"] = clip * math.exp(-p.clip_lr * (unclipped - p.target_quantile))
                metrics["dp_unclipped_fraction"] = unclipped
        return mean, metrics


def moved(
    arrays: Mapping[str, torch.Tensor], update: Mapping[str, torch.Tensor], step: float = 1.0
) -> dict[str, torch.Tensor]:
    """``arrays`` + ``step`` x ``update`` for the entries the update has (computed in float64,
    kept in each entry's dtype); the others (BatchNorm's batch counter) as they were. A
    running variance that noise made negative is set to 0 (post-processing)."""
    out = dict(arrays)
    for name, u in update.items():
        old = arrays[name]
        new = old.double() + step * u.to(old.device).reshape(old.shape)
        if name.endswith("running_var"):
            new = new.clamp(min=0.0)
        out[name] = new.to(old.dtype)
    return out
