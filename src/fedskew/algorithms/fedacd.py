"""FedACD (Zhou et al., IJCAI 2025): federated learning with adaptability over client distributions.

A local model adapts well to every client's label distribution when its per-class error rates
are equal. The client tracks a soft confusion matrix P (row i: the mean softmax output over its
samples of class i) and trains with

    L = L_LA + lam * L_flat

- ``L_flat`` (Eq. 7) pulls each sample's non-true probabilities towards a flat spread:
  KL(sg[q] || p) with q_y = p_y and q_k = (1 - p_y) / (C - 1) for k != y.
- ``L_LA`` (Eq. 8) is cross-entropy on logits shifted by log Delta_{y,i}, Delta_yi = P_yi / P_iy,
  which pushes P towards symmetry (and so, with flat rows, towards equal diagonals).
- Input mixup in every mini-batch; both terms are mixed: mix * L(x~, y_a) + (1 - mix) * L(x~, y_b).

After training the client scores its final model by D = mean over its classes of KL(P_i || Q_i),
Q a smoothed identity (Q_ii = tau), and uploads D as one scalar. The server averages the models
with weights from the scores only (sample counts are not used, and not sent).

Choices the paper leaves open ([PROPOSAL] in docs/ALGORITHMS.md section 3), defaults first:

- KL direction of L_flat: ``flat_kl=qp`` is KL(sg[q] || p); ``flat_kl=pq`` is KL(p || sg[q]).
  Both sum over all classes: the true-class term is zero in value, and keeping it makes the
  gradient on the logits p - q, which moves only non-true mass and never the true logit.
- When P is estimated: at the start of the round with the received model on all local data
  (eval mode, no grad); during training the detached softmax outputs of one epoch's batches
  give P for the next epoch (a mixed sample adds to row y_a with weight mix, row y_b with
  1 - mix). 1e-8 is added to the denominators.
- Missing classes: Delta_yk = ``delta`` (1e-3) when class k has no local sample; every log Delta
  is clipped to [log delta, -log delta] because rows of rare classes are noisy.
- Mixup: one mix ~ Beta(mixup_alpha, mixup_alpha) per batch (``mixup_alpha=1.0``; 0.2 is the
  usual alternative), partner = a random permutation of the batch. The optional
  class-balanced partner sampling is not implemented.
- The score: rows averaged over present classes (``score_rows=mean``; ``sum`` adds them).
- Score to weight: ``weighting=inverse`` (V = 1/D); ``softmax`` (V = exp(-D)); ``uniform``
  (1/|S_t|: the paper's FedACD_base ablation; the score is then not computed nor sent).
  ``S_t`` is the set of clients whose reply arrived; the weights are normalised over it.
- Which loss lam scales: L_flat (lam = 1 in the paper, where the choice does not matter).

Ablation switches: ``lam=0`` drops L_flat, ``margin=false`` turns L_LA into plain CE,
``mixup=false``, ``weighting=uniform``. The paper's CIFAR model is ``-m cnn-cifar``.

Clients train together (``fedskew.engines.together``) through ``PlainTraining``'s step
tensors and carried state: every batch's mixup draws are made before training (their generator
is not the batch order's) and reach the loss as step tensors; the margins' table and the
epoch's confusion sums are carried, the sums grown after each step from the batch's detached
softmax outputs (``add_to_confusion``) and the table recomputed at each of the client's own
epoch ends (``margins_of_epoch``). One after another, ``run_plain`` computes what the handler
computed before the split but for the last bit of the confusion sums: a mixed batch's weighted
outputs are added as a product, where ``index_add_``'s Python ``alpha`` was a fused
multiply-add on the CPU (no tensor weight, which clients trained together need, gives that).
Without mixup or without margins nothing differs; with both, float64 runs differ by about
1e-14 in the weights after a round, and fp32 and bf16 runs, whose logits see the margins
rounded to their precision, were bit for bit the same in every case checked.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fedskew.algorithms.fedavg import FedAvgServer
from fedskew.core.errors import UsageError
from fedskew.core.precision import in_fp32
from fedskew.data.federated import ClientData
from fedskew.training.interface import (
    Algorithm,
    ClientContext,
    ClientLogic,
    check_one_of,
    keeps_nothing,
)
from fedskew.training.local import (
    LossOutput,
    PlainTraining,
    TrainResult,
    batch_bounds,
    get_arrays,
    run_plain,
    set_arrays,
    trained_needs,
)
from fedskew.training.protocol import Expected, Message, ScalarSpec

EPS = 1e-8  # added to denominators of P and of Delta
# PlainTraining.step_tensors: each batch's mixing weight and partner permutation.
MIX, PARTNER = "mix", "partner"
# PlainTraining.carried: the margins' table, and the epoch's confusion sums behind the next.
LOG_DELTA, SUMS, WEIGHTS = "log_delta", "confusion_sums", "confusion_weights"
WEIGHTINGS = ("inverse", "softmax", "uniform")
FLAT_KLS = ("qp", "pq")
SCORE_ROWS = ("mean", "sum")


@dataclass
class FedACDParams:
    lam: float = 1.0  # weight of L_flat; 0 switches the flattening term off
    margin: bool = True  # adaptive logit margins; false gives plain cross-entropy
    delta: float = 1e-3  # Delta for missing classes, and the clip of log Delta
    mixup: bool = True
    mixup_alpha: float = 1.0
    tau: float = 1 - 1e-5  # diagonal of the template matrix Q
    weighting: str = "inverse"
    flat_kl: str = "qp"
    score_rows: str = "mean"
    # The server cannot check a client's score D: with inverse weighting a client that
    # claims D = 0 would own the average. A cap below 1 bounds any client's weight [PROPOSAL];
    # 1 (the default) leaves the paper's weights as they are.
    max_weight: float = 1.0

    def validate(self) -> None:
        if not (self.lam >= 0 and math.isfinite(self.lam)):
            raise UsageError(f"fedacd: lam must be a finite number >= 0, got {self.lam}")
        if not 0 < self.delta < 1:
            raise UsageError(f"fedacd: delta must be in (0, 1), got {self.delta}")
        if not (self.mixup_alpha > 0 and math.isfinite(self.mixup_alpha)):
            raise UsageError(f"fedacd: mixup_alpha must be > 0, got {self.mixup_alpha}")
        if not 0 < self.tau < 1:
            raise UsageError(f"fedacd: tau must be in (0, 1), got {self.tau}")
        check_one_of("fedacd", "weighting", self.weighting, WEIGHTINGS)
        check_one_of("fedacd", "flat_kl", self.flat_kl, FLAT_KLS)
        check_one_of("fedacd", "score_rows", self.score_rows, SCORE_ROWS)
        if not 0 < self.max_weight <= 1:
            raise UsageError(f"fedacd: max_weight must be in (0, 1], got {self.max_weight}")


# --- the soft confusion matrix ------------------------------------------------------------


def empty_confusion(num_classes: int, device: torch.device | str) -> dict[str, torch.Tensor]:
    """Confusion sums with nothing added yet: per row (true class) the weighted sum of
    softmax outputs and the sum of weights, in float64."""
    f64 = torch.float64
    return {
        SUMS: torch.zeros(num_classes, num_classes, dtype=f64, device=device),
        WEIGHTS: torch.zeros(num_classes, dtype=f64, device=device),
    }


def confusion_of(sums: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """P from the confusion sums (each row over its weight, EPS added) and the row weights."""
    return sums[SUMS] / (sums[WEIGHTS].unsqueeze(1) + EPS), sums[WEIGHTS]


@torch.no_grad()
def soft_confusion(
    model: torch.nn.Module, data: ClientData, num_classes: int, batch_size: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """P over all of the client's data in eval mode, and the per-class sample counts.

    Rows of classes the client lacks are zero; their count (0) marks them as undefined."""
    was_training = model.training
    model.eval()
    sums = empty_confusion(num_classes, data.device)
    n = len(data)
    for start in range(0, n, batch_size):
        xb, yb = data.batch(torch.arange(start, min(start + batch_size, n), device=data.device))
        probs = F.softmax(model.head(model.body(xb)).float(), dim=1)
        sums = add_to_confusion(sums, {"probs": probs, "y_a": yb})
    model.train(was_training)
    return confusion_of(sums)


# --- the local losses ---------------------------------------------------------------------


def flat_target(probs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """q with q_y = p_y and the rest of the mass, 1 - p_y, spread evenly over the others."""
    num_classes = probs.shape[1]
    p_y = probs.gather(1, y.unsqueeze(1))
    rest = ((1.0 - p_y) / (num_classes - 1)).expand_as(probs)
    # where, not scatter_ into a copy: scatter_ has no batching rule (clients trained
    # together compute this under vmap).
    is_y = torch.arange(num_classes, device=y.device) == y.unsqueeze(1)
    return torch.where(is_y, p_y, rest)


@in_fp32
def flat_kl(logits: torch.Tensor, y: torch.Tensor, direction: str = "qp") -> torch.Tensor:
    """Per-sample flattening loss, the target q treated as a constant."""
    log_p = F.log_softmax(logits, dim=1)
    q = flat_target(log_p.detach().exp(), y)
    if direction == "qp":
        return (torch.special.xlogy(q, q) - q * log_p).sum(dim=1)
    log_q = torch.log(q.clamp_min(torch.finfo(q.dtype).tiny))
    return (log_p.exp() * (log_p - log_q)).sum(dim=1)


def log_margins(confusion: torch.Tensor, present: torch.Tensor, delta: float) -> torch.Tensor:
    """(C, C) table of log Delta_yi = log(P_yi / P_iy), clipped to [log delta, -log delta].

    Column k of a missing class gets log delta, which nearly removes k from the local softmax;
    the diagonal is 0 (Delta_yy = 1); rows of missing classes are never used and are 0."""
    ratio = confusion / (confusion.t() + EPS)
    table = torch.log(ratio.clamp(min=delta, max=1.0 / delta))
    # where, not boolean indexing: nothing read back to the host mid-training.
    table = torch.where(present[None, :], table, math.log(delta))
    table = torch.where(present[:, None], table, 0.0)
    # where, not fill_diagonal_: that has no batching rule, and clients trained together
    # compute their tables under vmap.
    eye = torch.eye(table.shape[0], dtype=torch.bool, device=table.device)
    return torch.where(eye, 0.0, table)


class Mixup:
    """Input-mixup draws for one client's round: a Beta mixing weight and a partner permutation
    per batch, both from the client's addressed generator."""

    def __init__(self, alpha: float, gen: torch.Generator, batch_sizes: Sequence[int] = ()) -> None:
        self.alpha = alpha
        self.gen = gen
        # torch's Beta sampler takes no generator: seed a NumPy one from the addressed stream.
        seed = torch.randint(0, 2**62, (1,), generator=gen, device=gen.device)
        self._np = np.random.default_rng(int(seed))
        self.batch_sizes = list(batch_sizes)

    def draw(self, n: int) -> tuple[float, torch.Tensor]:
        """The mixing weight and the partner permutation of one batch of ``n`` (in host
        memory)."""
        mix = float(self._np.beta(self.alpha, self.alpha))
        return mix, torch.randperm(n, generator=self.gen, device=self.gen.device)

    def draw_steps(self, epochs: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The draws of ``epochs`` epochs of ``batch_sizes``, batch after batch as :meth:`draw`
        makes them, as step tensors: the mixing weights (steps,) in float64 (the numbers drawn) and
        the partner permutations (steps, largest batch), zero-padded at the end, each moved
        to ``device`` in one copy."""
        draws = [self.draw(n) for _ in range(epochs) for n in self.batch_sizes]
        host = self.gen.device  # named: a default device (meta, cuda) must not take them
        widest = max(self.batch_sizes, default=0)
        partners = torch.zeros(len(draws), widest, dtype=torch.int64, device=host)
        for step, (_, perm) in enumerate(draws):
            partners[step, : len(perm)] = perm
        mixes = torch.tensor([mix for mix, _ in draws], dtype=torch.float64, device=host)
        return mixes.to(device, non_blocking=True), partners.to(device, non_blocking=True)


def label_loss(
    params: FedACDParams, logits: torch.Tensor, y: torch.Tensor, log_delta: torch.Tensor | None
) -> torch.Tensor:
    """The loss of the (possibly mixed) inputs against one label vector, batch-averaged."""
    shifted = logits
    if log_delta is not None:
        shifted = logits + log_delta.to(logits.dtype)[y]
    loss = F.cross_entropy(shifted, y)
    if params.lam > 0:
        loss = loss + params.lam * flat_kl(logits, y, params.flat_kl).mean()
    return loss


def acd_loss(
    params: FedACDParams,
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    tensors: Mapping[str, torch.Tensor],
) -> LossOutput:
    """L_LA + lam * L_flat of one batch, mixed with the batch's draws in ``tensors`` (MIX,
    PARTNER) and shifted by the margins there (LOG_DELTA); its ``aux`` holds what the
    confusion sums need when margins are kept.

    The mixing weight is a float64 tensor cast as a Python number would be (to the
    operand's dtype after ``1 - mix`` in float64): one after another computes as before the
    draws became tensors."""
    mix, y_b = tensors.get(MIX), y
    if mix is not None:
        perm = tensors[PARTNER][: x.shape[0]]
        x = mix.to(x.dtype) * x + (1.0 - mix).to(x.dtype) * x[perm]
        y_b = y[perm]
    features = model.body(x)
    logits = model.head(features)
    log_delta = tensors.get(LOG_DELTA)
    loss = label_loss(params, logits, y, log_delta)
    if mix is not None:
        other = label_loss(params, logits, y_b, log_delta)
        loss = mix.to(loss.dtype) * loss + (1.0 - mix).to(loss.dtype) * other
    aux: dict[str, torch.Tensor] = {}
    if log_delta is not None:
        aux = {"probs": F.softmax(logits.detach().float(), dim=1), "y_a": y, "y_b": y_b}
        if mix is not None:
            aux["mix"] = mix
    return LossOutput(loss, features, logits, aux)


def start_carried(
    num_classes: int, delta: float, start: tuple[torch.Tensor, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The carried state at the start of training: the margins of the start-of-round P
    (and its per-class counts) and empty confusion sums."""
    confusion, counts = start
    return {
        LOG_DELTA: log_margins(confusion, counts > 0, delta),
        **empty_confusion(num_classes, confusion.device),
    }


def add_to_confusion(
    carried: Mapping[str, torch.Tensor], aux: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The confusion sums with a batch's softmax outputs added (``acd_loss``'s aux): each
    sample to row y_a with weight mix, to row y_b with 1 - mix (in float64, as
    ``soft_confusion`` adds). Without mixup, to row y_a with weight 1."""
    probs = aux["probs"].to(torch.float64)
    sums, weights = carried[SUMS], carried[WEIGHTS]
    mix = aux.get("mix")
    if mix is None:
        rows = aux["y_a"]
        sums = _rows_added(sums, rows, probs)
        weights = _rows_added(weights, rows, torch.ones_like(rows, dtype=torch.float64))
    else:
        w = mix.to(torch.float64)
        for rows, share in ((aux["y_a"], w), (aux["y_b"], 1.0 - w)):
            sums = _rows_added(sums, rows, probs * share)
            weights = _rows_added(weights, rows, share.expand(rows.shape))
    return {**carried, SUMS: sums, WEIGHTS: weights}


def _rows_added(t: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``t.index_add(0, rows, values)`` (the same additions, in the same order) as
    ``scatter_add``: under vmap, index_add with each client's own rows runs client by client
    (its batching rule loops over the clients), scatter_add runs once for all of them."""
    index = rows.reshape(-1, *[1] * (values.dim() - 1)).expand_as(values)
    return t.scatter_add(0, index, values)


def margins_of_epoch(carried: Mapping[str, torch.Tensor], delta: float) -> dict[str, torch.Tensor]:
    """At an epoch's end: the next epoch's margins from this epoch's P, and empty sums."""
    confusion, weights = confusion_of(carried)
    return {
        LOG_DELTA: log_margins(confusion, weights > 0, delta),
        SUMS: torch.zeros_like(carried[SUMS]),
        WEIGHTS: torch.zeros_like(weights),
    }


# --- the score and the aggregation weights ------------------------------------------------


def template_matrix_q(
    num_classes: int, tau: float, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The paper's template matrix Q (Eq. 10): tau on the diagonal, (1 - tau) / (C - 1)
    elsewhere, a smoothed identity (KL(P_i || I_i) would be infinite)."""
    off = (1.0 - tau) / (num_classes - 1)
    q = torch.full((num_classes, num_classes), off, dtype=torch.float64, device=device)
    return q.fill_diagonal_(tau)


def adaptability_divergence(
    confusion: torch.Tensor, present: torch.Tensor, tau: float, rows: str = "mean"
) -> float:
    """D = mean (or sum) over present classes i of KL(P_i || Q_i); smaller is better."""
    if not bool(present.any()):
        raise ValueError("no class is present: the score is undefined")
    p = confusion.to(torch.float64)
    q = template_matrix_q(p.shape[0], tau, p.device)
    kl = (torch.special.xlogy(p, p) - p * q.log()).sum(dim=1)[present]
    return float(kl.mean() if rows == "mean" else kl.sum())


def aggregation_weights(divergences: Sequence[float], weighting: str) -> list[float]:
    """Normalised weights from the clients' scores D (the sample counts play no part)."""
    d = torch.tensor([float(v) for v in divergences], dtype=torch.float64, device="cpu")
    if weighting == "inverse":
        v = 1.0 / d.clamp_min(1e-12)
    elif weighting == "softmax":
        v = torch.softmax(-d, dim=0)  # exp(-D) normalised, without overflow
    elif weighting == "uniform":
        v = torch.ones_like(d)
    else:
        raise ValueError(f"unknown weighting '{weighting}'")
    return (v / v.sum()).tolist()


def capped_weights(weights: Sequence[float], cap: float) -> list[float]:
    """Normalised ``weights`` with none above ``cap`` (1/n when n clients cannot reach 1
    under it): the excess of capped clients goes to the others in proportion to their
    weights, until no weight is above the cap."""
    if cap >= 1:
        return list(weights)
    cap = max(cap, 1.0 / len(weights))
    out = [float(w) for w in weights]
    capped: set[int] = set()
    while True:
        over = {i for i, w in enumerate(out) if i not in capped and w > cap}
        if not over:
            return out
        capped |= over
        free = [i for i in range(len(out)) if i not in capped]
        rest = 1.0 - cap * len(capped)
        free_total = sum(out[i] for i in free)
        for i in capped:
            out[i] = cap
        for i in free:
            out[i] = out[i] / free_total * rest if free_total > 0 else rest / len(free)


# --- server and client --------------------------------------------------------------------


class FedACDServer(FedAvgServer):
    """FedAvg's round, with weights from the clients' scores instead of their sample counts."""

    def expected(self) -> Expected:
        scores = () if self.params.weighting == "uniform" else ("divergence",)
        return trained_needs(self.global_arrays, *scores)  # no sample counts are sent

    def weights(self, replies: Mapping[int, Message], clients: list[int]) -> list[float]:
        if self.params.weighting == "uniform":
            return [1.0 / len(clients)] * len(clients)
        divergences = [replies[c].scalars["divergence"] for c in clients]
        weights = aggregation_weights(divergences, self.params.weighting)
        return capped_weights(weights, self.params.max_weight)

    def metrics(
        self, replies: Mapping[int, Message], clients: list[int], weights: list[float]
    ) -> dict[str, float]:
        metrics = super().metrics(replies, clients, weights)
        if self.params.weighting != "uniform":
            divergences = [replies[c].scalars["divergence"] for c in clients]
            metrics["divergence"] = sum(divergences) / len(divergences)
            metrics["weight_max"] = max(weights)
        return metrics

    def server_lr(self) -> float:
        return 1.0  # no server step: the global model is the weighted average


class FedACDClient(ClientLogic):
    def on_train(self, msg: Message, ctx: ClientContext) -> Message:
        return run_plain(self.plain_train(msg, ctx), ctx)

    def plain_train(self, msg: Message, ctx: ClientContext) -> PlainTraining:
        """Load the global model; before training, P of the received model over the local
        data (the first epoch's margins; skipped when they are off) and every batch's mixup
        draws; after it, the score of the trained model."""
        p: FedACDParams = self.params
        set_arrays(ctx.model, msg.arrays)
        num_classes = ctx.data.num_classes
        start = soft_confusion(ctx.model, ctx.data, num_classes) if p.margin else None
        steps: dict[str, torch.Tensor] = {}
        if p.mixup:
            bounds = batch_bounds(len(ctx.data), ctx.train.batch_size)
            mixer = Mixup(p.mixup_alpha, ctx.rng("fedacd-mixup"), [b - a for a, b in bounds])
            steps[MIX], steps[PARTNER] = mixer.draw_steps(ctx.train.epochs, ctx.data.device)

        def finish(result: TrainResult) -> Message:
            scalars = {"loss": result.mean_loss}
            if p.weighting != "uniform":
                confusion, counts = soft_confusion(ctx.model, ctx.data, num_classes)
                scalars["divergence"] = adaptability_divergence(
                    confusion, counts > 0, p.tau, p.score_rows
                )
            return Message("trained", arrays=get_arrays(ctx.model), scalars=scalars)

        return self.plan(finish, num_classes, start, steps)

    def plan(
        self,
        finish: Callable[[TrainResult], Message],
        num_classes: int,
        start: tuple[torch.Tensor, torch.Tensor] | None,
        steps: dict[str, torch.Tensor],
    ) -> PlainTraining:
        """The local training from the start-of-round P and its class counts (``start``,
        None without margins) and every step's mixup draws (``steps``, empty without
        mixup)."""
        if num_classes < 2:
            raise UsageError("fedacd needs at least 2 classes")
        carried: dict[str, torch.Tensor] = {}
        if self.params.margin:
            if start is None:
                raise ValueError("margins need the start-of-round confusion matrix")
            carried = start_carried(num_classes, self.params.delta, start)
        return PlainTraining(
            finish,
            loss=self.loss,
            step_tensors=steps,
            carried=carried,
            after_step=self.after_step if carried else None,
            after_epoch=self.after_epoch if carried else None,
        )

    def loss(
        self,
        model: torch.nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        t: Mapping[str, torch.Tensor],
    ) -> LossOutput:
        return acd_loss(self.params, model, x, y, t)

    def after_step(
        self, carried: Mapping[str, torch.Tensor], aux: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        return add_to_confusion(carried, aux)

    def after_epoch(self, carried: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return margins_of_epoch(carried, self.params.delta)


class FedACD(Algorithm):
    name = "fedacd"
    description = (
        "FedACD: flattened-error KL + adaptive logit margins + mixup, "
        "aggregation weighted by confusion-matrix adaptability"
    )
    Params = FedACDParams
    Server = FedACDServer
    Client = FedACDClient
    privacy = {
        "secure_aggregation": "weighs each client by its divergence D, which the server "
        "normalises (and caps) over the round's clients: a client cannot weigh its own update",
        "dp": "weighs clients by their divergence D, sent in clear and unbounded by the clip norm",
    }

    @classmethod
    def reply_scalars(cls, params: Any) -> dict[str, ScalarSpec]:
        return {"divergence": ScalarSpec(low=0.0)}  # a KL divergence

    client_state = classmethod(keeps_nothing)
