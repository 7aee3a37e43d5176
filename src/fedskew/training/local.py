"""The shared local-training loop, and the model and feature helpers every algorithm reuses
(the server's averaging is in ``fedskew.training.aggregation``)."""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fedskew.core.precision import autocast
from fedskew.data.federated import ClientData
from fedskew.training.interface import ClientContext, LocalTrainConfig
from fedskew.training.protocol import Message, Needs, needs


@dataclass
class LossOutput:
    """What a loss function computed: the loss, and the features and logits it used,
    so that plug-in loss terms (feature matching) can add to it without a second pass."""

    loss: torch.Tensor
    features: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    # Detached tensors the loss hands to PlainTraining.after_step (FedACD's softmax outputs).
    aux: dict[str, torch.Tensor] = field(default_factory=dict)


# loss_fn(model, x, y) -> LossOutput (or a bare loss tensor). Algorithms write their loss here.
LossFn = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], "LossOutput | torch.Tensor"]
# term(features, logits, y) -> scalar added to the loss: plug-ins install these on the context.
LossTerm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# Called after backward, before the optimiser step (SCAFFOLD corrects gradients here).
StepHook = Callable[[torch.nn.Module], None]
# loss(model, x, y, tensors) -> LossOutput (or a bare loss): a LossFn whose per-client tensors
# come as its last argument (PlainTraining.tensors) instead of from a closure, so that an
# engine training clients together can stack them and map one loss over the clients.
ClientLoss = Callable[
    [torch.nn.Module, torch.Tensor, torch.Tensor, Mapping[str, torch.Tensor]],
    "LossOutput | torch.Tensor",
]
# after_step(carried, aux) -> carried and after_epoch(carried) -> carried: one client's
# carried tensors anew, after a step from its loss's LossOutput.aux, or at an epoch's end.
StepUpdate = Callable[
    [Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]], dict[str, torch.Tensor]
]
EpochUpdate = Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]


def cross_entropy_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> LossOutput:
    features = model.body(x)
    logits = model.head(features)
    return LossOutput(F.cross_entropy(logits, y), features, logits)


@dataclass
class TrainResult:
    steps: int
    samples: int
    mean_loss: float


def make_optimizer(model: torch.nn.Module, cfg: LocalTrainConfig) -> torch.optim.SGD:
    return torch.optim.SGD(
        model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
    )


AUGMENT_PAD = 4


def draw_augmentation(
    gen: torch.Generator, sizes: Sequence[int], pad: int = AUGMENT_PAD
) -> torch.Tensor:
    """The random crops and flips of consecutive batches of ``sizes`` samples, drawn with
    ``gen`` in host memory: a (3, sum(sizes)) int64 tensor of row offsets, column offsets
    and flips (0/1), batch after batch.

    Per batch the draws are row offsets, column offsets, then flips, in that order: drawing
    an epoch's batches at once takes the same numbers from the generator as drawing them
    batch by batch, so the epoch's augmentation reaches the device in one copy instead of
    several blocking copies per step."""
    parts = []
    for n in sizes:
        dy = torch.randint(0, 2 * pad + 1, (n,), generator=gen, device=gen.device)
        dx = torch.randint(0, 2 * pad + 1, (n,), generator=gen, device=gen.device)
        flip = torch.rand(n, generator=gen, device=gen.device) < 0.5
        parts.append(torch.stack([dy, dx, flip.long()]))
    if not parts:
        return torch.zeros(3, 0, dtype=torch.int64, device=gen.device)
    return torch.cat(parts, dim=1)


def crop_and_flip(x: torch.Tensor, draws: torch.Tensor, pad: int = AUGMENT_PAD) -> torch.Tensor:
    """Random crop with zero padding and horizontal flip of a (N, C, H, W) batch, as
    ``draws`` (3, N) on the batch's device say (see :func:`draw_augmentation`). Row offset
    ``pad``, column offset ``pad`` and no flip give the input back unchanged. Nothing here
    reads a value back to the host."""
    n, _, h, w = x.shape
    dev = x.device
    padded = F.pad(x, (pad, pad, pad, pad))
    dy, dx, flip = draws[0], draws[1], draws[2].bool()
    rows = (dy[:, None] + torch.arange(h, device=dev)[None, :])[:, None, :, None]
    cols = (dx[:, None] + torch.arange(w, device=dev)[None, :])[:, None, None, :]
    batch = torch.arange(n, device=dev)[:, None, None, None]
    chan = torch.arange(x.shape[1], device=dev)[None, :, None, None]
    out = padded[batch, chan, rows, cols]
    return torch.where(flip[:, None, None, None], out.flip(-1), out)


def batch_bounds(n: int, batch_size: int) -> list[tuple[int, int]]:
    """Batch slices covering 0..n; a last batch of one sample joins the one before,
    because BatchNorm cannot train on a single sample."""
    bounds = [(s, min(s + batch_size, n)) for s in range(0, n, batch_size)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        bounds[-2:] = [(bounds[-2][0], n)]
    return bounds


def combined_loss(
    out: LossOutput | torch.Tensor, extra_terms: Sequence[LossTerm], y: torch.Tensor
) -> torch.Tensor:
    """The loss a step minimises: the loss function's, plus each plug-in term of its
    features and logits (inside the forward's autocast, as the terms' callers expect)."""
    if not isinstance(out, LossOutput):
        if extra_terms:
            raise RuntimeError("extra loss terms need a loss_fn that returns a LossOutput")
        return out
    loss = out.loss
    if extra_terms:
        if out.features is None or out.logits is None:
            raise RuntimeError("extra loss terms need a loss_fn that returns features")
        for term in extra_terms:
            loss = loss + term(out.features, out.logits, y)
    return loss


def local_train(
    model: torch.nn.Module,
    data: ClientData,
    cfg: LocalTrainConfig,
    gen: torch.Generator,
    *,
    loss_fn: LossFn = cross_entropy_loss,
    epochs: int | None = None,
    before_step: StepHook | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    extra_terms: Sequence[LossTerm] = (),
) -> TrainResult:
    """SGD over the client's data: a fresh permutation per epoch, slices as batches.

    No DataLoader: the client's rows are gathered per batch from tensors held once
    for all clients, which keeps the loop at bare-PyTorch speed. Under ``cfg.precision``
    "bf16" the loss function and plug-in terms run under bf16 autocast; parameters,
    gradients and the optimizer's state stay fp32.

    On a GPU the data and model live there; the epoch's permutation and augmentation are
    drawn with the addressed CPU generator (the same on every device) and moved once per
    epoch, so that no step waits for the host.
    """
    model.train()
    opt = optimizer if optimizer is not None else make_optimizer(model, cfg)
    n = len(data)
    n_epochs = cfg.epochs if epochs is None else epochs
    steps = 0
    loss_sum = torch.zeros((), device=data.device)
    bounds = batch_bounds(n, cfg.batch_size)
    augment = cfg.augment and data.x.dim() == 4  # crops and flips are for images
    for _ in range(n_epochs):
        perm = torch.randperm(n, generator=gen, device=gen.device)
        if augment:
            draws = draw_augmentation(gen, [stop - start for start, stop in bounds])
            # The permutation and the augmentation in one copy (int64 both); non_blocking
            # from pageable memory is staged by CUDA before the call returns, so the host
            # tensors may be freed, and the copy does not stall the stream.
            epoch = torch.cat([perm[None], draws]).to(data.device, non_blocking=True)
            perm, draws = epoch[0], epoch[1:]
        else:
            perm = perm.to(data.device, non_blocking=True)
        for start, stop in bounds:
            xb, yb = data.batch(perm[start:stop])
            if augment:
                xb = crop_and_flip(xb, draws[:, start:stop])
            # Forward pass and loss under the precision policy; backward outside, weights fp32.
            with autocast(cfg.precision, xb.device.type):
                loss = combined_loss(loss_fn(model, xb, yb), extra_terms, yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            if before_step is not None:
                before_step(model)
            opt.step()
            loss_sum += loss.detach()
            steps += 1
    mean_loss = float(loss_sum) / steps if steps else 0.0
    return TrainResult(steps=steps, samples=n * n_epochs, mean_loss=mean_loss)


# Which loop run_plain trains with: "graph-safe" (fedskew.training.graph_step, the default:
# the step a CUDA graph replays, run eagerly on the CPU) or "loop" (local_train through
# train_client, with torch.optim.SGD: the reference the graph-safe step is tested against).
LOCAL_STEP: ContextVar[str] = ContextVar("fedskew_local_step", default="graph-safe")


@contextlib.contextmanager
def local_step_path(path: str) -> Iterator[None]:
    """``run_plain`` trains with ``path`` ("graph-safe" or "loop") in the block."""
    if path not in ("graph-safe", "loop"):
        raise ValueError(f"local step path must be graph-safe or loop, got {path!r}")
    token = LOCAL_STEP.set(path)
    try:
        yield
    finally:
        LOCAL_STEP.reset(token)


_SAID: set[str] = set()


def _say_once(line: str) -> None:
    if line not in _SAID:
        _SAID.add(line)
        logging.getLogger("fedskew").info("%s", line)


def train_client(
    ctx: ClientContext,
    *,
    loss_fn: LossFn = cross_entropy_loss,
    epochs: int | None = None,
    before_step: StepHook | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    purpose: str = "train",
    plan: PlainTraining | None = None,
) -> TrainResult:
    """``local_train`` on a client's context, with the loss terms plug-ins installed there;
    given the ``plan`` these arguments come from (``run_plain``), the graph-safe step instead
    (the same numbers), unless ``local_step_path("loop")`` says otherwise."""
    if plan is not None and LOCAL_STEP.get() == "graph-safe":
        # Imported here: graph_step builds on this module's loop helpers.
        from fedskew.training.graph_step import train_plain

        return train_plain(plan, ctx)
    if plan is None and ctx.data.device.type == "cuda" and ctx.train.cuda_graphs != "off":
        # A handler that calls train_client itself (not through run_plain's plan) may pass
        # any hook or optimiser: it trains with local_train, eagerly. Said once per process.
        _say_once(
            "local steps of a handler without a plain split (train_client called directly) "
            "run eagerly with local_train, not as CUDA graphs"
        )
    return local_train(
        ctx.model,
        ctx.data,
        ctx.train,
        ctx.rng(purpose),
        loss_fn=loss_fn,
        epochs=epochs,
        before_step=before_step,
        optimizer=optimizer,
        extra_terms=ctx.loss_terms,
    )


@dataclass
class PlainTraining:
    """A handler split around its local training, when that training is plain: the shared
    loop (``train_client``: the context's optimiser settings and generator of ``purpose``, for
    ``epochs``, None: the configured ones), with the algorithm's loss and per-step gradient
    shift given as data. ``finish`` builds the reply (and updates ``ctx.state``) from the
    trained model and the TrainResult.

    ``loss`` (None: cross-entropy) is one function for every client of an exchange: a plain
    function or a bound method of the client logic, hyper-parameters read from there; what
    differs from client to client (a global model, class counts, a control variate) is in
    ``tensors``, which the loss receives as its last argument. ``grad_shift`` maps parameter
    names to tensors added to their gradients after clipping and before the optimiser step
    (SCAFFOLD's correction). ``trained`` holds leaf tensors outside the model that the same
    optimiser trains with it (FedROD's personal head; not clipped, as ``train_client`` clips
    the model's parameters only): the loss finds them among its tensors, and after training
    they hold the trained values. Inside ``loss``, ``model.parameters()`` and the model's forward
    see the weights being trained, whichever way the engine trains.

    Step tensors and carried state, for a loss whose inputs change while the client trains
    (FedACD's). ``step_tensors`` are drawn before training, one row per step (``(steps, ...)``,
    steps = epochs x batches per epoch, epochs after one another): at the client's step ``s``
    the loss finds row ``s`` of each among its tensors. Trained together, rows of different
    shapes are zero-padded at the end to the largest of the stack, so the loss takes what it
    needs (FedACD: the first ``len(x)`` entries of a batch's partner permutation).
    ``carried`` are per-client tensors the loss finds among its tensors and that change as it
    trains: after every step ``after_step(carried, aux)`` gives their new values from the
    detached tensors the loss returned in ``LossOutput.aux``, and at the end of each of the
    client's epochs ``after_epoch(carried)`` gives them anew. Like ``loss``, each is one
    function for every client, written for one client's tensors; it returns new tensors,
    changes none in place and reads nothing back to the host: trained together, both are
    mapped over the stack (``vmap``), ``after_epoch`` with only the clients whose epoch ends
    at that step taking its values. After training the ``carried`` tensors hold the client's
    final values.

    An algorithm whose handler ``on_<kind>`` is ``run_plain(self.plain_<kind>(msg, ctx), ctx)``
    lets an engine train several clients' local steps together (``fedskew.engines.together``):
    the engine calls ``plain_<kind>`` per client (which loads the model and may compute what
    it needs before training), trains them all at once, loads each client's trained weights
    and calls its ``finish``. One after another, ``run_plain`` does exactly what the unsplit
    handler did."""

    finish: Callable[[TrainResult], Message]
    epochs: int | None = None
    purpose: str = "train"
    loss: ClientLoss | None = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    grad_shift: dict[str, torch.Tensor] = field(default_factory=dict)
    trained: dict[str, torch.Tensor] = field(default_factory=dict)
    step_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    carried: dict[str, torch.Tensor] = field(default_factory=dict)
    after_step: StepUpdate | None = None
    after_epoch: EpochUpdate | None = None

    @property
    def stepwise(self) -> bool:
        """Whether the loss's tensors change from step to step (step tensors, carried state)."""
        return bool(self.step_tensors or self.carried)

    def loss_fn(self, batches_per_epoch: int = 0) -> LossFn:
        """The loss as ``train_client`` takes it, ``tensors`` and ``trained`` bound; a
        stepwise one (step tensors, carried state) for one client's training, whose epochs
        end every ``batches_per_epoch`` steps."""
        if self.loss is None:
            if self.stepwise:
                raise ValueError("step tensors and carried state need the loss that uses them")
            return cross_entropy_loss
        if self.stepwise:
            return _StepwiseLoss(self, batches_per_epoch)
        loss, tensors = self.loss, {**self.tensors, **self.trained}
        return lambda model, x, y: loss(model, x, y, tensors)

    def optimizer(self, model: torch.nn.Module, cfg: LocalTrainConfig) -> torch.optim.SGD | None:
        """The shared optimiser over the model's parameters and ``trained`` (None when there
        is nothing beside the model: ``train_client`` makes its own)."""
        if not self.trained:
            return None
        return torch.optim.SGD(
            [*model.parameters(), *self.trained.values()],
            lr=cfg.lr,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
        )

    def before_step(self) -> StepHook | None:
        """``grad_shift`` as a hook of ``train_client`` (None when there is none)."""
        if not self.grad_shift:
            return None
        shift = self.grad_shift

        def add_shift(model: torch.nn.Module) -> None:
            for name, p in model.named_parameters():
                delta = shift.get(name)
                if delta is not None and p.grad is not None:
                    p.grad.add_(delta)

        return add_shift


class _StepwiseLoss:
    """One client's loss with its step tensors and carried state, as the stacked loop gives
    them: row ``s`` of the step tensors at step ``s``, the carried tensors anew after each
    step (``after_step``) and at each epoch's end (``after_epoch``)."""

    def __init__(self, plan: PlainTraining, batches_per_epoch: int) -> None:
        assert plan.loss is not None
        if plan.after_epoch is not None and batches_per_epoch < 1:
            raise ValueError("after_epoch needs the number of batches per epoch (loss_fn's)")
        self.loss = plan.loss
        self.plan = plan
        self.fixed = {**plan.tensors, **plan.trained}
        self.carried = dict(plan.carried)
        self.batches_per_epoch = batches_per_epoch
        self.step = 0

    def __call__(
        self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor
    ) -> LossOutput | torch.Tensor:
        rows = {name: t[self.step] for name, t in self.plan.step_tensors.items()}
        out = self.loss(model, x, y, {**self.fixed, **self.carried, **rows})
        if self.plan.after_step is not None:
            if not isinstance(out, LossOutput):
                raise TypeError("after_step needs a loss that returns a LossOutput (its aux)")
            aux = {name: t.detach() for name, t in out.aux.items()}
            self.carried = self.plan.after_step(self.carried, aux)
        self.step += 1
        if self.plan.after_epoch is not None and self.step % self.batches_per_epoch == 0:
            self.carried = self.plan.after_epoch(self.carried)
        return out

    def keep_final(self) -> None:
        """The final carried values into the plan's tensors."""
        with torch.no_grad():
            for name, t in self.plan.carried.items():
                t.copy_(self.carried[name])


def run_plain(plan: PlainTraining, ctx: ClientContext) -> Message:
    """Train one client as ``plan`` says and return its reply: through ``train_client``,
    which trains with the graph-safe step (replayed as a CUDA graph where
    ``ctx.train.cuda_graphs`` and the device allow; local_train's numbers bit for bit), or
    with ``local_train`` under ``local_step_path("loop")``."""
    loss_fn = plan.loss_fn(len(batch_bounds(len(ctx.data), ctx.train.batch_size)))
    result = train_client(
        ctx,
        loss_fn=loss_fn,
        epochs=plan.epochs,
        before_step=plan.before_step(),
        optimizer=plan.optimizer(ctx.model, ctx.train),
        purpose=plan.purpose,
        plan=plan,
    )
    # The graph-safe step leaves the plan's carried tensors final itself.
    if isinstance(loss_fn, _StepwiseLoss) and LOCAL_STEP.get() == "loop":
        loss_fn.keep_final()
    return plan.finish(result)


def trained_reply(
    ctx: ClientContext,
    loss: float,
    arrays: dict[str, torch.Tensor] | None = None,
    scalars: Mapping[str, float] | None = None,
) -> Message:
    """The reply to a "train" message: ``arrays`` (the whole trained model by default),
    the client's sample count and mean training loss, then any further ``scalars``."""
    return Message(
        "trained",
        arrays=get_arrays(ctx.model) if arrays is None else arrays,
        scalars={"num_samples": float(len(ctx.data)), "loss": loss, **(scalars or {})},
    )


def trained_needs(arrays: Iterable[str], *scalars: str) -> dict[str, Needs]:
    """What a server reads from replies of kind "trained" (``trained_reply``'s): ``arrays``,
    the ``loss`` (its ``train_loss`` metric) and ``scalars``; the ``expect`` of its exchange."""
    return {"trained": needs(arrays, ("loss", *scalars))}


def get_arrays(model: torch.nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """A detached copy of the model's state (parameters and buffers) under ``prefix``."""
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k.startswith(prefix)}


def set_arrays(model: torch.nn.Module, arrays: Mapping[str, torch.Tensor]) -> None:
    """Load named tensors into the model in place (a subset is allowed)."""
    state = model.state_dict()
    with torch.no_grad():
        for k, v in arrays.items():
            state[k].copy_(v)


# features(x) -> (N, d): the representation class means are taken of (default: model.body).
FeatureFn = Callable[[torch.Tensor], torch.Tensor]


@torch.no_grad()
def class_feature_sums(
    model: torch.nn.Module,
    data: ClientData,
    num_classes: int,
    rows: torch.Tensor | None = None,
    batch_size: int = 1024,
    features: FeatureFn | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class sums of body features (or of ``features``, a function of the same model)
    and per-class counts over the client's data (or the given rows of it), in eval mode,
    every sample counted exactly once."""
    feature_fn = model.body if features is None else features
    was_training = model.training
    model.eval()
    dev = data.device
    positions = torch.arange(len(data), device=dev) if rows is None else rows.to(dev)
    sums: torch.Tensor | None = None
    counts = torch.zeros(num_classes, dtype=torch.int64, device=dev)
    for start in range(0, len(positions), batch_size):
        xb, yb = data.batch(positions[start : start + batch_size])
        feats = feature_fn(xb).float()
        if sums is None:
            sums = torch.zeros(num_classes, feats.shape[1], device=feats.device)
        sums.index_add_(0, yb, feats)
        counts += torch.bincount(yb, minlength=num_classes)
    model.train(was_training)
    if sums is None:
        sums = torch.zeros(num_classes, getattr(model, "feature_dim", 0), device=dev)
    return sums, counts


def class_feature_means(
    model: torch.nn.Module,
    data: ClientData,
    num_classes: int,
    rows: torch.Tensor | None = None,
    features: FeatureFn | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(C, d) class means of body features (zero rows for absent classes) and (C,) counts."""
    sums, counts = class_feature_sums(model, data, num_classes, rows, features=features)
    means = sums / counts.clamp(min=1).unsqueeze(1).to(sums.dtype)
    return means, counts


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A gradient-free eval-mode copy of the model's architecture (a teacher: the global
    or previous model). Build it once per client logic and reload it with ``set_arrays``:
    a deep copy per client per round would dominate the cost of small models."""
    frozen = copy.deepcopy(model)
    frozen.requires_grad_(False)
    for p in frozen.parameters():
        p.grad = None
    return frozen.eval()
