"""FedCME (Nie et al., arXiv 2307.08574): client matching, classifier exchange, feature alignment.

A round, as the server runs it (``exchange`` is the part that moves, ``E`` the local epochs,
``s = floor(E/2)``):

1. Cold start (``cold_start=evaluate``, the [PROPOSAL] default): every selected client
   without a stored evaluation vector receives the global model in an ``evaluate`` exchange
   and answers with the per-class accuracy of that model on its evaluation subset. The client
   keeps the model it received, so the next exchange does not send it again.
   ``cold_start=random`` skips this exchange and pairs such clients at random.
2. Matching on the stored evaluation vectors (``matching``, see below).
3. ``train_first``: each client receives the global model (unless cached), the global class
   features and ``partner`` (the id whose part it will receive, -1 for none). A paired client
   trains ``s`` epochs, keeps the half-trained model in its state and uploads its part. An
   unpaired client (the odd one out) trains all ``E`` epochs at once and answers with its
   final upload: it takes no part in the second exchange.
4. ``train_rest`` (paired clients only): the server relays the partner's part, the client loads
   it over its half-trained model, starts a fresh SGD optimiser (momentum buffers re-created:
   [PROPOSAL]) and trains the remaining ``E - s`` epochs.
5. Final upload: the model, ``num_samples`` and ``loss``, the class-mean features of the
   present classes with a presence mask (only when ``mu > 0``), and the evaluation vector
   (only when matching uses it). The server averages models with weights D_k, aggregates
   class features with the memory mechanism and stores the evaluation vectors.

Matching options (the server's cosine similarity of two vectors is a.b / ((|a|+eps)(|b|+eps)),
eps = 1e-12, so a zero vector has similarity 0 to everything: [PROPOSAL]):

* ``one-to-one`` (default, the paper's): clients sorted by similarity to the mean vector of the
  selected clients, ascending (stable: ties keep the selection order); the first client left
  is paired with the remaining client least similar to it (ties: the earliest in that order),
  both leave; with an odd count the last client is unpaired and trains plain ([PROPOSAL]).
* ``many-to-one`` (the paper's ablation): every selected client receives the part of the one
  other selected client least similar to it (ties: the earliest in the ascending order above).
  There is no exclusivity: a client's part may go to several clients, and a client nobody
  chose uploads nothing. The server sends ``share`` (1 or 0) to say whether to upload.
* ``random``: a seeded shuffle of the selected clients paired two by two; no evaluation
  vectors are computed or sent.

Under ``cold_start=random``, clients with a stored vector are matched among themselves as above,
clients without one are paired at random among themselves (many-to-one: each gets a random
donor), and the odd ones out of both groups, if any, form a pair.

``exchange``: ``head`` (default: the final linear layer, keys ``head.``; [PROPOSAL]), ``body``,
``model`` (everything), ``none`` (no matching, no evaluation vectors, one exchange per round).
With ``E = 1``, ``s = 0``: the exchange would happen before any training, between parts that
are all the global model's, so it changes nothing; the round is then run like
``exchange=none`` (one exchange, no matching) and the ``exchanged`` metric reads 0.

Feature alignment: the local class means are taken with the final local body, in eval mode,
over all local data. The server fills a class a client lacks with the current global feature
(the memory mechanism), skips classes never observed, and averages with weights D_k / sum D_j
([PROPOSAL]; ``feature_weights=uniform`` for 1/M). The alignment loss is the mean over the
classes of the batch that have a global feature of the mean squared L2 distance between the
features and that global feature ([PROPOSAL] normalisation), weighted by ``mu`` and used in
both halves ([PROPOSAL]). ``mu = 0`` switches alignment off and then no features are computed
or sent either way: nothing would use them.

Missing replies (a dead node, a rejected reply): a client whose reply does not arrive leaves
the round at that exchange, and later exchanges address only the others. A new client whose
cold-start vector is missing is not matched (the round goes on with the rest). A paired client
whose partner's half-time reply is missing gets no part in ``train_rest`` (an empty message)
and finishes its training with its own part; a many-to-one receiver whose donor is missing
likewise. A paired client whose final upload is missing is left out of the aggregation.
``exchanged`` counts the parts actually relayed and ``donors`` the clients whose part was.

Evaluation vector ([PROPOSAL]): per-class accuracy of the final local model, in eval mode, on a
uniform random ``eval_fraction`` of the local data (at least one sample, redrawn every round)
to which the first drawn sample of every present class the draw missed is added; 0 for
classes absent from that subset.

Parameters (``-p key=value``): ``mu`` 0.01 (the paper also uses 0.1), ``exchange`` head,
``matching`` one-to-one, ``cold_start`` evaluate, ``feature_weights`` samples (or uniform),
``eval_fraction`` 0.2.

Communication per round, with B model bytes, H part bytes, C classes, d feature size, M
clients, N of them cold-started, P paired, kn classes with a global feature, n_k the classes
of client k, V = 1 when matching uses vectors, 8 bytes a number, 1 byte a mask entry, float32
features and vectors: down = M*B + M*8 + [kn > 0]*M*(4*kn*d + C) + P*H;
up = N*4C + P*H + sum_k (B + 16 + [mu > 0]*(4*n_k*d + C) + V*4C). That is FedAvg's traffic
plus one part each way per paired client, the features and the vector. Many-to-one adds 8
down per client (``share``), sends a part down to every client and up only from the chosen
ones. Without exchange there is no partner number, no part and no vector (V = 0, N = 0).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from fedskew.core.errors import UsageError
from fedskew.core.precision import in_fp32
from fedskew.core.rng import SERVER, numpy_rng
from fedskew.data.federated import ClientData
from fedskew.training.aggregation import weighted_average
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
    LossFn,
    LossOutput,
    PlainTraining,
    TrainResult,
    class_feature_means,
    get_arrays,
    run_plain,
    set_arrays,
    trained_needs,
    trained_reply,
)
from fedskew.training.protocol import (
    ArraySpec,
    Channel,
    Expected,
    Message,
    NoReplies,
    arrived,
    needs,
)
from fedskew.training.state_spec import OrNone, PerClient, Spec, StatePart, model_part

EPS = 1e-12
EXCHANGES = ("head", "body", "model", "none")
MATCHINGS = ("one-to-one", "many-to-one", "random")
COLD_STARTS = ("evaluate", "random")
FEATURE_WEIGHTS = ("samples", "uniform")

# Message array names that are not model weights.
GLOBAL_FEATURES, GLOBAL_KNOWN = "global_features", "global_known"
FEATURES, PRESENT, EVAL_VECTOR = "features", "present", "eval_vector"
# Client state names.
CACHED, HALF = "fedcme/global/", "fedcme/half/"
STATE_FEATURES, STATE_KNOWN = "fedcme/features", "fedcme/known"
LOSS_SUM, STEPS = "fedcme/loss_sum", "fedcme/steps"


@dataclass
class FedCMEParams:
    mu: float = 0.01
    exchange: str = "head"
    matching: str = "one-to-one"
    cold_start: str = "evaluate"
    feature_weights: str = "samples"
    eval_fraction: float = 0.2

    def validate(self) -> None:
        if not 0 <= self.mu < float("inf"):
            raise UsageError(f"fedcme: mu must be a finite number >= 0, got {self.mu}")
        check_one_of("fedcme", "exchange", self.exchange, EXCHANGES)
        check_one_of("fedcme", "matching", self.matching, MATCHINGS)
        check_one_of("fedcme", "cold_start", self.cold_start, COLD_STARTS)
        check_one_of("fedcme", "feature_weights", self.feature_weights, FEATURE_WEIGHTS)
        if not 0 < self.eval_fraction <= 1:
            raise UsageError(f"fedcme: eval_fraction must be in (0, 1], got {self.eval_fraction}")


def exchanges_parts(params: FedCMEParams, epochs: int) -> bool:
    """Whether rounds exchange parts: both sides decide it from the same settings."""
    return params.exchange != "none" and epochs // 2 > 0


def uses_vectors(params: FedCMEParams, epochs: int) -> bool:
    return exchanges_parts(params, epochs) and params.matching != "random"


def part_prefix(exchange: str) -> str:
    return {"head": "head.", "body": "body.", "model": ""}[exchange]


# --- matching (server) ------------------------------------------------------------------------


def cosine_matrix(vectors: torch.Tensor) -> torch.Tensor:
    v = vectors.to(torch.float64)
    norms = v.norm(dim=1) + EPS
    return (v @ v.T) / (norms[:, None] * norms[None, :])


def ascending_order(vectors: torch.Tensor) -> list[int]:
    """Row positions sorted by cosine similarity to the mean row, ascending, ties stable."""
    v = vectors.to(torch.float64)
    mean = v.mean(dim=0)
    sims = (v @ mean) / ((v.norm(dim=1) + EPS) * (mean.norm() + EPS))
    return sorted(range(len(v)), key=lambda i: float(sims[i]))


def match_one_to_one(ids: Sequence[int], vectors: torch.Tensor) -> dict[int, int]:
    """Greedy complementary pairs (symmetric map); an odd one out is absent from the map."""
    sim = cosine_matrix(vectors)
    order = ascending_order(vectors)
    pairs: dict[int, int] = {}
    while len(order) >= 2:
        k = order.pop(0)
        j = min(order, key=lambda i: float(sim[k, i]))  # min keeps the first of equals
        order.remove(j)
        pairs[ids[k]], pairs[ids[j]] = ids[j], ids[k]
    return pairs


def match_many_to_one(ids: Sequence[int], vectors: torch.Tensor) -> dict[int, int]:
    """receiver -> donor: every client gets the part of the other client least similar to it."""
    sim = cosine_matrix(vectors)
    order = ascending_order(vectors)
    donors: dict[int, int] = {}
    for k in range(len(ids)):
        others = [i for i in order if i != k]
        if others:
            donors[ids[k]] = ids[min(others, key=lambda i: float(sim[k, i]))]
    return donors


def random_pairs(ids: Sequence[int], rng: np.random.Generator) -> tuple[dict[int, int], int | None]:
    """Seeded pairs of consecutive shuffled clients, and the odd one out (or None)."""
    shuffled = [ids[i] for i in rng.permutation(len(ids))]
    pairs: dict[int, int] = {}
    for a, b in zip(shuffled[0::2], shuffled[1::2], strict=False):
        pairs[a], pairs[b] = b, a
    leftover = shuffled[-1] if len(shuffled) % 2 else None
    return pairs, leftover


# --- features (both sides) ----------------------------------------------------------------------


def aggregate_features(
    global_features: torch.Tensor,
    known: torch.Tensor,
    local_means: Sequence[torch.Tensor],
    present: Sequence[torch.Tensor],
    weights: Sequence[float],
) -> tuple[torch.Tensor, torch.Tensor]:
    """New (C, d) global class features and (C,) known mask, with the memory mechanism.

    A client lacking class c contributes the current global feature of c when there is one,
    and nothing otherwise; per class, the weights of the contributors are renormalised.
    """
    means = torch.stack([m.to(torch.float64) for m in local_means])  # (K, C, d)
    mask = torch.stack(list(present)).bool()  # (K, C)
    w = torch.tensor([float(x) for x in weights], dtype=torch.float64, device=means.device)
    values = torch.where(mask[..., None], means, global_features.to(torch.float64)[None])
    contributes = mask | known[None, :]
    cw = w[:, None] * contributes  # (K, C)
    total = cw.sum(dim=0)
    new_known = known | mask.any(dim=0)
    out = (cw[..., None] * values).sum(dim=0) / total.clamp(min=EPS)[:, None]
    out[~new_known] = 0.0
    return out.to(global_features.dtype), new_known


@in_fp32
def alignment_loss(
    features: torch.Tensor, y: torch.Tensor, global_features: torch.Tensor, known: torch.Tensor
) -> torch.Tensor:
    """Mean over the batch's classes with a global feature of the per-class mean squared L2
    distance between the samples' features and that class's global feature (0, with the
    graph kept, when no sample's class has one).

    Samples of unknown classes are weighted 0 rather than masked out, and the per-class
    means are summed with ``where``: the same value (to the last bits of a sum) without a
    single read back to the host, which a boolean mask or ``bincount`` costs on a GPU at
    every step. The per-class sums are ``scatter_add``s (``index_add``'s additions in the
    same order): under vmap, index_add with each client's own labels runs client by client
    (its batching rule loops over the clients), scatter_add once for all of them."""
    num_classes = global_features.shape[0]
    weight = known[y].to(features.dtype)
    sq = ((features - global_features[y].to(features.dtype)) ** 2).sum(dim=1) * weight
    zeros = torch.zeros(num_classes, dtype=sq.dtype, device=sq.device)
    sums = zeros.scatter_add(0, y, sq)
    counts = zeros.scatter_add(0, y, weight)
    in_batch = counts > 0
    means = torch.where(in_batch, sums / counts.clamp(min=1.0), 0.0)
    return means.sum() / in_batch.sum().clamp(min=1).to(sq.dtype)


def fedcme_loss(mu: float, features: torch.Tensor | None, known: torch.Tensor | None) -> LossFn:
    def loss_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> LossOutput:
        feats = model.body(x)
        logits = model.head(feats)
        loss = F.cross_entropy(logits, y)
        if features is not None and known is not None and mu > 0:
            loss = loss + mu * alignment_loss(feats, y, features, known)
        return LossOutput(loss, feats, logits)

    return loss_fn


# --- evaluation vector (client) -------------------------------------------------------------


def eval_subset(labels: torch.Tensor, fraction: float, gen: torch.Generator) -> torch.Tensor:
    """Positions of a uniform random ``fraction`` of the data (at least one), plus the first
    drawn position of every present class the draw missed. Drawn and returned in the
    generator's (host) memory, whatever device ``labels`` are on."""
    labels = labels.to(gen.device)
    n = int(labels.numel())
    perm = torch.randperm(n, generator=gen, device=gen.device)
    size = min(n, max(1, round(fraction * n)))
    chosen = perm[:size]
    missing = set(labels.unique().tolist()) - set(labels[chosen].unique().tolist())
    extra = []
    for pos in perm[size:].tolist():
        label = int(labels[pos])
        if label in missing:
            extra.append(pos)
            missing.discard(label)
            if not missing:
                break
    return torch.cat([chosen, torch.tensor(extra, dtype=torch.int64, device=gen.device)])


@torch.no_grad()
def evaluation_vector(
    model: torch.nn.Module, data: ClientData, rows: torch.Tensor, batch_size: int = 1024
) -> torch.Tensor:
    """(C,) float32 per-class accuracy on the given rows; 0 for classes absent there."""
    was_training = model.training
    model.eval()
    correct = torch.zeros(data.num_classes, dtype=torch.int64, device=data.device)
    counts = torch.zeros(data.num_classes, dtype=torch.int64, device=data.device)
    for start in range(0, len(rows), batch_size):
        xb, yb = data.batch(rows[start : start + batch_size])
        hit = model(xb).argmax(dim=1) == yb
        correct += torch.bincount(yb[hit], minlength=data.num_classes)
        counts += torch.bincount(yb, minlength=data.num_classes)
    model.train(was_training)
    return (correct.double() / counts.clamp(min=1).double()).float()


def client_eval_vector(ctx: ClientContext, fraction: float) -> torch.Tensor:
    rows = eval_subset(ctx.data.labels, fraction, ctx.rng("fedcme-eval-subset"))
    return evaluation_vector(ctx.model, ctx.data, rows)


# --- server ---------------------------------------------------------------------------------


class FedCMEServer(ServerLogic):
    checkpoint_fields = ("vectors", "features", "known")  # server state a resumed run needs

    def __init__(self, params: FedCMEParams, setup: ServerSetup) -> None:
        super().__init__(params, setup)
        self.vectors: dict[int, torch.Tensor] = {}  # last evaluation vector of every client
        self.features: torch.Tensor | None = None  # (C, d) once a class has been observed
        self.known = torch.zeros(setup.num_classes, dtype=torch.bool, device="cpu")

    def round(self, rnd: int, clients: list[int], channel: Channel) -> dict[str, float]:
        """One round, in the steps of the module docstring."""
        if not exchanges_parts(self.params, self.setup.train.epochs):
            replies = channel.exchange(
                {c: self.train_message("train", False) for c in clients}, self.final_upload()
            )
            clients = arrived(clients, replies)
            no_exchange = {"cold_starts": 0.0, "exchanged": 0.0, "donors": 0.0}
            return {**no_exchange, **self.aggregate(clients, replies)}
        clients, cold_started = self.cold_start(clients, channel)
        donor = self.match(rnd, clients)
        clients, replies = self.first_half(clients, cold_started, donor, channel)
        clients, replies, exchanged = self.exchange(clients, replies, donor, channel)
        return {
            "cold_starts": float(len(cold_started)),
            **exchanged,
            **self.aggregate(clients, replies),
        }

    def cold_start(self, clients: list[int], channel: Channel) -> tuple[list[int], set[int]]:
        """Step 1: the selected clients without an evaluation vector evaluate the global
        model, and keep it. Returns the clients still in the round and the cold-started ones."""
        p: FedCMEParams = self.params
        new = [c for c in clients if c not in self.vectors]
        if not (uses_vectors(p, self.setup.train.epochs) and new and p.cold_start == "evaluate"):
            return clients, set()
        evaluated = channel.exchange(
            {c: Message("evaluate", arrays=self.global_arrays) for c in new},
            {"evaluated": needs((EVAL_VECTOR,))},
        )
        # A new client without a vector leaves the round; the others need not wait for it.
        clients = [c for c in clients if c not in new or c in evaluated]
        if not clients:
            raise NoReplies(f"none of {len(new)} cold-started clients replied")
        new = [c for c in new if c in evaluated]
        for c in new:
            self.vectors[c] = evaluated[c].arrays[EVAL_VECTOR].clone()
        return clients, set(new)

    def match(self, rnd: int, clients: list[int]) -> dict[int, int]:
        """Step 2, the paper's MakeMatching: receiver -> donor for this round (symmetric
        for pairs)."""
        p: FedCMEParams = self.params
        if p.matching == "random":
            pairs, _ = random_pairs(
                clients, numpy_rng(self.setup.seed, rnd, SERVER, "fedcme-match")
            )
            return pairs
        seen = [c for c in clients if c in self.vectors]
        unseen = [c for c in clients if c not in self.vectors]
        rng = numpy_rng(self.setup.seed, rnd, SERVER, "fedcme-cold-start")
        vectors = torch.stack([self.vectors[c] for c in seen]) if seen else None
        if p.matching == "many-to-one":
            donor = match_many_to_one(seen, vectors) if seen else {}
            for c in clients:
                if c not in donor and len(clients) > 1:
                    others = [o for o in clients if o != c]
                    donor[c] = others[int(rng.integers(len(others)))]
            return donor
        donor = match_one_to_one(seen, vectors) if seen else {}
        random_part, leftover = random_pairs(unseen, rng)
        donor.update(random_part)
        odd_seen = [c for c in seen if c not in donor]
        if leftover is not None and odd_seen:
            donor[leftover], donor[odd_seen[0]] = odd_seen[0], leftover
        return donor

    def first_half(
        self, clients: list[int], cached: set[int], donor: Mapping[int, int], channel: Channel
    ) -> tuple[list[int], dict[int, Message]]:
        """Step 3: ``train_first`` with each client's partner (the global model unless the
        client kept it from the cold start). Paired clients answer with a half, the others
        with their final upload. Returns the clients that replied and the replies."""
        sharing = set(donor.values())
        first = {}
        for c in clients:
            msg = self.train_message("train_first", c in cached)
            msg.scalars["partner"] = float(donor.get(c, -1))
            if self.params.matching == "many-to-one":
                msg.scalars["share"] = float(c in sharing)
            first[c] = msg
        # A half is relayed, not read: a partner missing from it trains on its own part.
        replies = channel.exchange(first, {"half": needs(), **self.final_upload()})
        return arrived(clients, replies), replies

    def exchange(
        self,
        clients: list[int],
        replies: dict[int, Message],
        donor: Mapping[int, int],
        channel: Channel,
    ) -> tuple[list[int], dict[int, Message], dict[str, float]]:
        """Step 4: ``train_rest`` relays each half-trained client its donor's part; the
        client finishes training and uploads. Returns the clients with a final upload, the
        uploads, and the ``exchanged`` and ``donors`` metrics."""
        sharing = set(donor.values())
        halves = [c for c in clients if replies[c].kind == "half"]
        # Only parts that arrived: a client whose donor is missing gets an empty train_rest.
        parts = {c: replies[c].arrays for c in halves if c in sharing}
        rest = {c: Message("train_rest", arrays=dict(parts.get(donor.get(c), {}))) for c in halves}
        if halves:
            # A half is no upload: a client whose final reply is missing leaves the aggregation.
            replies = {c: r for c, r in replies.items() if r.kind != "half"}
            replies.update(channel.exchange(rest, self.final_upload()))
            clients = arrived(clients, replies)
        metrics = {
            "exchanged": float(sum(1 for m in rest.values() if m.arrays)),
            "donors": float(len({donor[c] for c in halves if donor.get(c) in parts})),
        }
        return clients, replies, metrics

    def final_upload(self) -> Expected:
        """What ``aggregate`` reads from a final upload (the evaluation vector is optional:
        a client without one keeps its last)."""
        features = (FEATURES, PRESENT) if self.params.mu > 0 else ()
        return trained_needs((*self.global_arrays, *features), "num_samples")

    def aggregate(self, clients: list[int], replies: Mapping[int, Message]) -> dict[str, float]:
        """Step 5: average the final uploads, aggregate the class features, keep the
        evaluation vectors."""
        p: FedCMEParams = self.params
        sizes = [replies[c].scalars["num_samples"] for c in clients]
        models = [{k: replies[c].arrays[k] for k in self.global_arrays} for c in clients]
        self.global_arrays = weighted_average(models, sizes)
        if p.mu > 0:
            means, present = [], []
            for c in clients:
                arrays = replies[c].arrays
                mask = arrays[PRESENT].bool()
                full = torch.zeros(len(mask), arrays[FEATURES].shape[1], device=mask.device)
                full[mask] = arrays[FEATURES].float()
                means.append(full)
                present.append(mask)
            if self.features is None:
                self.features = torch.zeros_like(means[0])
            weights = sizes if p.feature_weights == "samples" else [1.0] * len(clients)
            self.features, self.known = aggregate_features(
                self.features, self.known, means, present, weights
            )
        for c in clients:
            if EVAL_VECTOR in replies[c].arrays:
                self.vectors[c] = replies[c].arrays[EVAL_VECTOR].clone()
        return {
            "train_loss": self.mean_train_loss(replies, clients),
            "known_classes": float(self.known.sum()),
        }

    def train_message(self, kind: str, cached: bool) -> Message:
        arrays: dict[str, torch.Tensor] = {} if cached else dict(self.global_arrays)
        if self.params.mu > 0 and self.features is not None and bool(self.known.any()):
            arrays[GLOBAL_FEATURES] = self.features[self.known]
            arrays[GLOBAL_KNOWN] = self.known.clone()
        return Message(kind, arrays=arrays)


# --- client ---------------------------------------------------------------------------------


class FedCMEClient(ClientLogic):
    def on_evaluate(self, msg: Message, ctx: ClientContext) -> Message:
        """Cold start: the global model's evaluation vector; the model is kept for training."""
        set_arrays(ctx.model, msg.arrays)
        for k, v in msg.arrays.items():
            ctx.state.arrays[CACHED + k] = v.detach().clone()
        return Message(
            "evaluated", arrays={EVAL_VECTOR: client_eval_vector(ctx, self.params.eval_fraction)}
        )

    def on_train(self, msg: Message, ctx: ClientContext) -> Message:
        return run_plain(self.plain_train(msg, ctx), ctx)

    def plain_train(self, msg: Message, ctx: ClientContext) -> PlainTraining:
        """A round without exchange: E epochs with alignment, then the final upload."""
        self.load_round_start(msg, ctx)
        return PlainTraining(
            lambda result: self.final_upload(ctx, result.mean_loss * result.steps, result.steps),
            loss=self.loss,
            tensors=self.alignment(ctx),
        )

    def on_train_first(self, msg: Message, ctx: ClientContext) -> Message:
        return run_plain(self.plain_train_first(msg, ctx), ctx)

    def plain_train_first(self, msg: Message, ctx: ClientContext) -> PlainTraining:
        self.load_round_start(msg, ctx)
        partner = int(msg.scalars["partner"])
        share = bool(msg.scalars.get("share", float(partner >= 0)))
        if partner < 0 and not share:
            return self.plain_train_alone(ctx)

        def finish(result: TrainResult) -> Message:
            ctx.state.scalars[LOSS_SUM] = result.mean_loss * result.steps
            ctx.state.scalars[STEPS] = float(result.steps)
            for k, v in get_arrays(ctx.model).items():
                ctx.state.arrays[HALF + k] = v
            part = get_arrays(ctx.model, part_prefix(self.params.exchange)) if share else {}
            return Message("half", arrays=part)

        return PlainTraining(
            finish,
            epochs=ctx.train.epochs // 2,
            purpose="train-first",
            loss=self.loss,
            tensors=self.alignment(ctx),
        )

    def plain_train_alone(self, ctx: ClientContext) -> PlainTraining:
        """All E epochs at once and the final upload: a client without a partner."""
        return PlainTraining(
            lambda result: self.final_upload(ctx, result.mean_loss * result.steps, result.steps),
            loss=self.loss,
            tensors=self.alignment(ctx),
        )

    def on_train_rest(self, msg: Message, ctx: ClientContext) -> Message:
        return run_plain(self.plain_train_rest(msg, ctx), ctx)

    def plain_train_rest(self, msg: Message, ctx: ClientContext) -> PlainTraining:
        half = {
            k[len(HALF) :]: ctx.state.arrays.pop(k)
            for k in list(ctx.state.arrays)
            if k.startswith(HALF)
        }
        if not half:
            raise UsageError("fedcme: train_rest reached a client that holds no half-trained model")
        set_arrays(ctx.model, half)
        set_arrays(ctx.model, msg.arrays)  # the partner's part over our own

        def finish(result: TrainResult) -> Message:
            loss_sum = ctx.state.scalars.pop(LOSS_SUM) + result.mean_loss * result.steps
            steps = ctx.state.scalars.pop(STEPS) + result.steps
            return self.final_upload(ctx, loss_sum, steps)

        # A fresh optimiser: momentum built on our own part would push the partner's part.
        return PlainTraining(
            finish,
            epochs=ctx.train.epochs - ctx.train.epochs // 2,
            purpose="train-rest",
            loss=self.loss,
            tensors=self.alignment(ctx),
        )

    def load_round_start(self, msg: Message, ctx: ClientContext) -> None:
        """Load the global model (from the message, or kept from the cold start) and keep the
        global features in state for both halves."""
        model = {k: v for k, v in msg.arrays.items() if k not in (GLOBAL_FEATURES, GLOBAL_KNOWN)}
        cached = {
            k[len(CACHED) :]: ctx.state.arrays.pop(k)
            for k in list(ctx.state.arrays)
            if k.startswith(CACHED)
        }
        if not model:
            if not cached:
                raise UsageError("fedcme: no global model in the message and none kept")
            model = cached
        set_arrays(ctx.model, model)
        ctx.state.arrays.pop(STATE_FEATURES, None)
        ctx.state.arrays.pop(STATE_KNOWN, None)
        if self.params.mu > 0 and GLOBAL_KNOWN in msg.arrays:
            known = msg.arrays[GLOBAL_KNOWN].bool()
            features = msg.arrays[GLOBAL_FEATURES]
            full = torch.zeros(len(known), features.shape[1], device=features.device)
            full[known] = features.float()
            ctx.state.arrays[STATE_FEATURES] = full
            ctx.state.arrays[STATE_KNOWN] = known.clone()

    def alignment(self, ctx: ClientContext) -> dict[str, torch.Tensor]:
        """The global class features and which are known, from the client's state, as the
        loss's tensors (none before any is known, or with ``mu`` 0)."""
        features = ctx.state.arrays.get(STATE_FEATURES)
        known = ctx.state.arrays.get(STATE_KNOWN)
        if features is None or known is None:
            return {}
        return {"features": features, "known": known}

    def loss(
        self,
        model: torch.nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        alignment: Mapping[str, torch.Tensor],
    ) -> LossOutput | torch.Tensor:
        loss_fn = fedcme_loss(self.params.mu, alignment.get("features"), alignment.get("known"))
        return loss_fn(model, x, y)

    def final_upload(self, ctx: ClientContext, loss_sum: float, steps: float) -> Message:
        """The final upload; the round's state entries are dropped."""
        ctx.state.arrays.pop(STATE_FEATURES, None)
        ctx.state.arrays.pop(STATE_KNOWN, None)
        arrays = get_arrays(ctx.model)
        if self.params.mu > 0:
            means, counts = class_feature_means(ctx.model, ctx.data, ctx.data.num_classes)
            present = counts > 0
            arrays[FEATURES] = means[present]
            arrays[PRESENT] = present
        if uses_vectors(self.params, ctx.train.epochs):
            arrays[EVAL_VECTOR] = client_eval_vector(ctx, self.params.eval_fraction)
        return trained_reply(ctx, loss_sum / steps if steps else 0.0, arrays)


def has_vector(server: FedCMEServer, client: int, trained: bool | None) -> bool | None:
    """Whether a client has an evaluation vector at a checkpoint: where the matching uses
    them, once it has trained (a vector stays once made); else never."""
    if uses_vectors(server.params, server.setup.train.epochs):
        return trained
    return False


class FedCME(Algorithm):
    name = "fedcme"
    description = (
        "FedCME: complementary client pairs by evaluation vectors, mid-round classifier "
        "exchange, alignment to global class features"
    )
    Params = FedCMEParams
    Server = FedCMEServer
    Client = FedCMEClient
    privacy = {
        "secure_aggregation": "pairs clients by their evaluation vectors and relays one "
        "client's classifier head to another",
        "dp": "pairs clients by their evaluation vectors and relays one client's classifier "
        "head to another",
    }

    @classmethod
    def reply_arrays(
        cls, params: FedCMEParams, model: torch.nn.Module, num_classes: int
    ) -> dict[str, ArraySpec]:
        """The final upload's class features (rows of the n classes ``present`` marks) and
        evaluation vector (also the reply to "evaluate")."""
        return {
            FEATURES: ArraySpec(("n", model.feature_dim)),
            PRESENT: ArraySpec((num_classes,), torch.bool, true_count="n"),
            EVAL_VECTOR: ArraySpec((num_classes,)),
        }

    @classmethod
    def checkpoint_specs(
        cls, params: FedCMEParams, model: torch.nn.Module, num_classes: int
    ) -> dict[str, Spec]:
        """The clients' last evaluation vectors (of every client that has trained, where
        the matching uses them); the global class features once observed."""
        return {
            "vectors": PerClient(ArraySpec((num_classes,)), holds=has_vector),
            "features": OrNone(ArraySpec((num_classes, model.feature_dim))),
        }

    @classmethod
    def client_state(
        cls, params: FedCMEParams, model: torch.nn.Module, num_classes: int
    ) -> tuple[StatePart, ...]:
        """What lives within a round (the model kept from the cold start, the half-trained
        model and its loss, the global features): gone by its end, except where a reply
        was dropped (``--on-divergence drop``)."""
        half = model_part(HALF, model)
        features = {
            STATE_FEATURES: ArraySpec((num_classes, model.feature_dim)),
            STATE_KNOWN: ArraySpec((num_classes,), torch.bool),
        }
        return (
            model_part(CACHED, model),
            StatePart(half.arrays, (LOSS_SUM, STEPS)),
            StatePart(features),
        )

    @classmethod
    def inactive_mechanisms(cls, params: FedCMEParams, shape: RunShape) -> list[InactiveMechanism]:
        """The exchange without the epochs to split or a partner to pair with; the feature
        alignment in a one-round run (global class features exist from the second round)."""
        found: list[InactiveMechanism] = []
        if params.exchange != "none" and shape.local_epochs // 2 == 0:
            found.append(
                InactiveMechanism(
                    "classifier exchange",
                    {"exchange": params.exchange, "local_epochs": shape.local_epochs},
                    "the exchange would come after floor(E/2) = 0 epochs, before any training, "
                    "so rounds run as exchange=none",
                )
            )
        elif params.exchange != "none" and shape.clients_per_round < 2:
            found.append(
                InactiveMechanism(
                    "classifier exchange",
                    {"exchange": params.exchange, "clients_per_round": shape.clients_per_round},
                    "one client per round has no partner to exchange with",
                )
            )
        if params.mu > 0:
            found += starts_too_late(
                "feature alignment", 1, shape, {"mu": params.mu},
                "the global class features it aligns to come from the first round's uploads",
            )  # fmt: skip
        return found
