"""Clients trained together: a round's clients as one stacked model (``torch.func``).

One client at a time leaves a GPU mostly idle when models are small: each step is a handful
of small kernels. Here the clients of an exchange train at once: their parameters, buffers
and momentum buffers are stacked along a new first dimension, and ``torch.func.vmap`` over
``functional_call`` runs every client's step of the same index in one batched forward and
backward (a convolution becomes a grouped one).

What stays exactly as one after another:

* each client's batches: its epoch permutations (and augmentation draws) come from its own
  addressed generator, in the same order, so every client sees the batches it would see alone
  (all of a round's are drawn when training starts, so that a step gathers every client's
  batch with a few tensor operators);
* the optimiser: SGD with momentum and weight decay, written out per element as
  ``torch.optim.SGD`` computes it, and gradient clipping by each client's own norm;
* BatchNorm: each client's batch statistics and running buffers (see below).

What differs: floating-point rounding (a batched convolution sums in another order), so
results agree with one after another within fp32 tolerance, not bit for bit.

Ragged steps. Clients hold different amounts of data, so they run different numbers of steps
and their last batch of an epoch is smaller. Clients are ordered by their number of steps,
largest first: at step ``s`` the active clients are a prefix of the stack (a view, no copy),
and a finished client is simply not computed any more. Within a step, batches of different
sizes are padded to the largest and masked: the cross-entropy is the mean over each client's
real samples, and BatchNorm layers compute their statistics over the real samples only (a
masked batch norm replaces the module's forward on padded steps; running mean and variance
are updated as ``nn.BatchNorm`` updates them). An algorithm's own loss may use the whole
batch (batch statistics, batch means), which padding would change: there a ragged step runs
one vmap per batch size instead, unpadded, and BatchNorm's buffers go back to the stack.

The seams (``PlainTraining`` in ``fedskew.training.local``), as ``train_client`` has them: a
loss ``(model, x, y, tensors)``, one function for all clients, called on the real model with
each client's stacked weights swapped in (``functional_call`` on a module holding the model,
so ``model.parameters()`` inside the loss are the client's); per-client ``tensors`` (a global
model, an anchor, class counts, a control variate), stacked along dim 0 and mapped with the
weights; a per-parameter ``grad_shift`` added to each client's gradient after clipping,
before the step; step tensors, a row per step drawn before training (stacked as (steps,
clients, ...), zero-padded to the largest row), whose row ``s`` the loss finds at step ``s``;
carried state, per-client tensors the loss reads that ``after_step`` replaces from the loss's
``LossOutput.aux`` in the same vmap as the loss (the aux has the batch's shape, which differs
between the vmaps of a ragged step) and ``after_epoch`` at each client's own epoch end (a
(steps, clients) mask made before training picks the clients, ``torch.where`` keeps the
others' values); and ``ctx.state``, read by ``plain_<kind>`` before training and written by
``finish`` after it, as one after another.

Which algorithms. A handler split into ``plain_<kind>`` (``PlainTraining``: the shared loop
and optimiser, the algorithm's loss, per-client tensors, gradient shift, tensors trained
beside the model, step tensors and carried state given as data) trains together: FedAvg,
CReFF and FedNH (cross-entropy), FedProx, FedLC, FedRS, FedDecorr, FedNTD (the global model
as the teacher's per-client tensors; its KL written out, as kl_div has no batching rule),
SCAFFOLD (its correction as the gradient shift), FedDyn (g_k and the
server model as tensors), FedNova (cross-entropy; its normalised update in ``finish``),
FedProto (the global prototypes as tensors), FedCME (train, train_first and train_rest; the
global class features as tensors; its evaluate exchange trains nothing), MOON (the frozen
global and previous models' weights as tensors; clients with and without a previous model
train in separate stacks), FedROD (its personal head trained beside the model), FedFM and
FedFM-Lite (the matching term in ``AnchorMatchingLoss``, the global anchors as tensors;
FedFM's anchor exchange trains nothing), FedACD (its mixup draws as step tensors; the
margins' table and the confusion sums as carried state, grown after each step and turned
into the next epoch's margins at each client's epoch end), and the feature-matching plug-in
around any of these (``<inner>+fm``: a client logic that wraps the handlers and says how, see
``plain_handler``; the inner plan with ``InnerMatchingLoss``). Every other exchange, a client
logic that wraps the handlers without saying how, and a model with dropout or with a
BatchNorm without running statistics are trained one after another, and the reason is logged
once. ``--precision bf16`` trains together too: autocast does not reach the kernels
inside ``vmap`` (they would run in fp32), so ``_AutocastInVmap`` makes its casts explicitly;
the curves stay within bf16's own rounding spread of one after another (tests). The memory
estimate (``together_memory``) counts the model's copies and activations before a chunk, and
an algorithm's per-client tensors (MOON's two frozen models, FedDyn's two tensors per
parameter) once the chunk's plans exist, training the chunk in pieces where they would not
fit; a chunk that runs out of GPU memory is halved.

Fused (``--clients-together fused``, ``train_together(fused=True)``): the same stacks, loop,
schedule and SGD step, but a cross-entropy step runs the stacked weights as one wide model
with native BatchNorm (``engines/fused.py``) instead of vmap. An algorithm's own loss runs
under vmap as above, but each call of a model's body (or of one of its layers) escapes vmap
into one fused forward of every client (``_fused_bodies``). ``fused_why_not`` says when it
cannot (a layer the fused model does not know), and vmap trains instead.

CUDA graphs (``train_together(graphs=True)``, from ``--cuda-graphs``): every step whose
active clients all have a batch of one size runs ``_ChunkStep.body``, graph-safe as the
one-client ``LocalStep`` is (static buffers of its shape filled by the host, state written
in place, no host reads), and on CUDA is replayed by ``training/graph_replay.py``, one graph
per shape (active clients, batch width). The CPU runs the same body eagerly.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._C._functorch import (
    _add_batch_dim,
    get_unwrapped,
    is_batchedtensor,
    maybe_get_bdim,
    maybe_get_level,
)
from torch.func import functional_call, vmap
from torch.overrides import TorchFunctionMode

from fedskew.core.precision import autocast
from fedskew.data.federated import ClientData
from fedskew.engines.fused import fused_body, fused_cross_entropy, fused_logits, fused_obstacle
from fedskew.models.base import BodyHeadModel
from fedskew.training.graph_replay import GraphReplay
from fedskew.training.graph_step import foreach_sgd
from fedskew.training.interface import ClientLogic, LocalTrainConfig
from fedskew.training.local import (
    AUGMENT_PAD,
    ClientLoss,
    EpochUpdate,
    LossOutput,
    PlainTraining,
    StepUpdate,
    TrainResult,
    batch_bounds,
    crop_and_flip,
    draw_augmentation,
)

log = logging.getLogger("fedskew")
MODES = ("auto", "off", "vmap", "fused")
TOGETHER = ("vmap", "fused")  # the resolved modes that train an exchange's clients at once


def resolve_mode(mode: str, device: torch.device) -> str:
    """``auto``: vmap on CUDA (many small kernels to batch), one after another on the CPU,
    where benchmarks/clients_together.py measured the stacked step slower."""
    if mode == "auto":
        return "vmap" if device.type == "cuda" else "off"
    return mode


# ---------------------------------------------------------------------------- eligibility


def plain_handler(logic: ClientLogic, kind: str) -> tuple[Callable[..., PlainTraining] | None, str]:
    """The client logic's ``plain_<kind>`` split when an engine may use it in place of its
    ``on_<kind>`` handler, else None and the reason.

    A logic that routes its messages itself (overrides ``handle``) is bypassed only where it
    says how: the class that overrides ``handle`` names the client logic whose handlers it
    wraps (``wraps_handlers``, a base class) and itself defines ``wrapped_plain(kind, msg,
    ctx)``, the wrapped ``plain_<kind>`` with what its ``handle`` adds (the feature-matching
    plug-in). That wrapped logic must have the split for ``kind`` by the same rules, and no
    class in between may override ``on_<kind>`` or ``plain_<kind>``: ``handle`` would run
    those, the split would not."""
    cls = type(logic)
    owner = _defining_class(cls, "handle")
    if owner is ClientLogic or owner is None:
        reason = _split_obstacle(cls, kind)
        return (None, reason) if reason else (getattr(logic, f"plain_{kind}"), "")
    reason = _wrapper_obstacle(cls, owner, kind)
    if reason:
        return None, reason
    return functools.partial(logic.wrapped_plain, kind), ""  # type: ignore[attr-defined]


def _split_obstacle(cls: type, kind: str) -> str:
    """Why ``cls`` (whose ``handle`` is ClientLogic's) has no usable split for ``kind``."""
    if _defining_class(cls, f"plain_{kind}") is None:
        return (
            f"{cls.__name__}'s '{kind}' handler's local step is not plain (no plain_{kind} split)"
        )
    # A subclass that overrides on_<kind> but inherits plain_<kind> must not be bypassed.
    if _defining_class(cls, f"on_{kind}") is not _defining_class(cls, f"plain_{kind}"):
        return f"{cls.__name__} overrides on_{kind} without its plain_{kind} split"
    return ""


def _wrapper_obstacle(cls: type, owner: type, kind: str) -> str:
    """Why ``cls``, whose ``handle`` is ``owner``'s, cannot be bypassed for ``kind``."""
    inner = vars(owner).get("wraps_handlers")
    if (
        not isinstance(inner, type)
        or not issubclass(owner, inner)
        or _defining_class(cls, "wrapped_plain") is not owner
    ):
        return f"{cls.__name__} routes its messages itself (wrapped handlers without a plain split)"
    if _defining_class(inner, f"on_{kind}") is None:  # the wrapper's own kind (an exchange)
        return f"{cls.__name__}'s '{kind}' handler's local step is not plain (its own handler)"
    for name in (f"on_{kind}", f"plain_{kind}"):
        if _defining_class(cls, name) is not _defining_class(inner, name):
            return f"{cls.__name__} overrides {name} of the {inner.__name__} it wraps"
    if _defining_class(inner, "handle") is not ClientLogic:
        return f"{cls.__name__} wraps {inner.__name__}, which routes its messages itself"
    return _split_obstacle(inner, kind)


def _defining_class(cls: type, name: str) -> type | None:
    return next((c for c in cls.__mro__ if name in vars(c)), None)


def model_obstacle(model: nn.Module) -> str:
    """Why this model cannot be trained stacked ("" when it can)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            return f"the model has dropout ({name}), whose masks would not follow each client"
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and (
            not module.track_running_stats or module.momentum is None
        ):
            return f"the model's BatchNorm {name} keeps no running statistics with a momentum"
    return ""


# ---------------------------------------------------------------------------- BatchNorm

_MASK: list[torch.Tensor] = []  # the current per-sample mask while a padded step runs
_ESCAPED: list[bool] = []  # non-empty while a fused body runs outside vmap (_fused_bodies)


class _BatchNormFormula(TorchFunctionMode):
    """Every ``F.batch_norm`` in the block computed from its formula, over the samples
    ``_MASK`` marks when a padded step runs (one client's batch inside vmap): statistics,
    output and running buffers as ``nn.BatchNorm`` computes them on the unpadded batch, up to
    rounding.

    Why not torch's own batch_norm inside vmap: on CUDA its dispatch asks the input which
    memory format it is in, which a vmapped tensor cannot answer ("NYI: querying
    is_contiguous inside of vmap", seen on an H200 with torch 2.11 for every model with
    BatchNorm); and it cannot leave padding out of the statistics. A mode rather than a
    patched ``forward``: frozen models called inside a loss (MOON's) normalise the same way."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if _ESCAPED and (func is F.batch_norm or func is torch.batch_norm):
            return func(*args, **kwargs)  # a fused body's, outside vmap: torch's own
        if func is F.batch_norm:
            return _batch_norm(*args, **kwargs)
        if func is torch.batch_norm:  # aten's order: input, weight, bias, running stats, ...
            x, weight, bias, mean, var, training, momentum, eps = args[:8]
            return _batch_norm(x, mean, var, weight, bias, training, momentum, eps)
        return func(*args, **kwargs)


def _batch_norm(
    x: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    training: bool = False,
    momentum: float | None = 0.1,
    eps: float = 1e-5,
    *_: Any,
) -> torch.Tensor:
    given = x.dtype  # bf16 under autocast: statistics in fp32, the output back in bf16
    x = x.float() if given == torch.bfloat16 else x
    shape = (1, -1, *([1] * (x.dim() - 2)))
    if not training:
        assert running_mean is not None and running_var is not None
        mean, var = running_mean, running_var
    else:
        dims = [0, *range(2, x.dim())]
        mask = _MASK[-1] if _MASK else None
        count: torch.Tensor | float
        if mask is None:
            # A Python number: a tensor made from it would be a copy from the host each step.
            count = float(x.numel() // x.shape[1])
            var, mean = torch.var_mean(x, dims, correction=0)
        else:
            w = mask.to(x.dtype).reshape(-1, *([1] * (x.dim() - 1)))
            count = mask.to(x.dtype).sum() * (x[0, 0].numel())
            mean = (x * w).sum(dims) / count
            centred = x - mean.reshape(shape)
            var = (centred * centred * w).sum(dims) / count
        if running_mean is not None and running_var is not None:
            with torch.no_grad():
                factor = 0.0 if momentum is None else float(momentum)
                running_mean.mul_(1 - factor).add_(mean.detach() * factor)
                if isinstance(count, float):
                    unbiased = var.detach() * (count / max(count - 1.0, 1.0))
                else:
                    unbiased = var.detach() * count / (count - 1).clamp(min=1)
                running_var.mul_(1 - factor).add_(unbiased * factor)
    # As torch's CPU kernel does: per-channel scale and shift, then one pass over x (fewer
    # kernels and passes over the activations than normalising, scaling and shifting apart).
    scale = torch.rsqrt(var + eps)
    if weight is not None:
        scale = scale * weight
    shift = -mean * scale
    if bias is not None:
        shift = shift + bias
    return torch.addcmul(shift.reshape(shape), x, scale.reshape(shape)).to(given)


class _ContiguousGroupNorm(TorchFunctionMode):
    """Every ``F.group_norm`` of a vmapped input whose strides are not row-major run on a
    row-major copy.

    torch's group_norm asks its input for its suggested memory format, and a vmapped tensor
    can say only whether it is contiguous in the default format: a channels_last activation
    (prepare's default layout for convolutional models; the stacked weights keep it, so the
    grouped convolutions return channels_last) raised "NYI: querying is_contiguous inside
    of vmap for memory_format other than torch.contiguous_format" (torch 2.13, CPU) for
    ResNet-18 with GroupNorm, every algorithm. ``Tensor.contiguous`` is not enough: a
    (N, C, 1, 1) activation with channels_last strides counts as contiguous and is returned
    as it is. The copy holds the same values: only the order in which the kernel sums a
    group differs, as between CPU and CUDA."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if (func is F.group_norm or func is torch.group_norm) and is_batchedtensor(args[0]):
            x = args[0]
            if x.stride() != _row_major(x.shape):
                args = (x.clone(memory_format=torch.contiguous_format), *args[1:])
        return func(*args, **kwargs)


def _row_major(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a row-major (C-contiguous) tensor of ``shape``, size-1 dimensions
    included."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


@contextlib.contextmanager
def _norms_in_vmap(batch_norm: bool, group_norm: bool) -> Iterator[None]:
    """:class:`_BatchNormFormula` in the block where the model has BatchNorm,
    :class:`_ContiguousGroupNorm` where it has GroupNorm (modes cost a Python call per
    operator: none where the model needs none)."""
    with contextlib.ExitStack() as stack:
        if batch_norm:
            stack.enter_context(_BatchNormFormula())
        if group_norm:
            stack.enter_context(_ContiguousGroupNorm())
        yield


# ---------------------------------------------------------------------------- training


class _Client:
    """One client's side of the stacked loop: its data, generator and batch schedule."""

    def __init__(
        self, data: ClientData, gen: torch.Generator, epochs: int, batch_size: int, augment: bool
    ) -> None:
        self.data = data
        self.gen = gen
        self.bounds = batch_bounds(len(data), batch_size)
        self.epochs = epochs
        self.steps = epochs * len(self.bounds)
        self.augment = augment

    def draw_epoch(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The next epoch's dataset rows, in order, and its augmentation (3, n) if any: the
        permutation, then the augmentation, from the client's generator, as the one-client
        loop draws them, moved to the data's device in one copy."""
        n = len(self.data)
        perm = torch.randperm(n, generator=self.gen, device=self.gen.device)
        draws = None
        if self.augment:
            sizes = [stop - start for start, stop in self.bounds]
            epoch = torch.cat([perm[None], draw_augmentation(self.gen, sizes)])
            epoch = epoch.to(self.data.device, non_blocking=True)
            perm, draws = epoch[0], epoch[1:]
        else:
            perm = perm.to(self.data.device, non_blocking=True)
        return self.data.indices.index_select(0, perm), draws


class _Schedule:
    """Every step's batch rows of the stacked clients (in stack order), drawn when training
    starts: a step then gathers its batches with a few tensor operators, not with Python
    per client (issue 39). Each client's generator gives the numbers in the order it would
    alone (its epochs one after another), so the batches are the same.

    ``index[s, i, :w]`` are client ``i``'s rows at step ``s`` padded to the widest batch
    ``w`` by repeating the batch's first row (real values, masked out), ``mask`` marks the
    real ones and ``draws[s, i]`` the augmentation (padding: the identity)."""

    def __init__(self, clients: Sequence[_Client], device: torch.device) -> None:
        steps = max((c.steps for c in clients), default=0)
        widest = max((b - a for c in clients for a, b in c.bounds), default=0)
        self.augment = bool(clients) and clients[0].augment
        self.index = torch.zeros(steps, len(clients), widest, dtype=torch.int64, device=device)
        self.mask = torch.zeros(steps, len(clients), widest, device=device)
        if self.augment:
            identity = torch.full((3, widest), AUGMENT_PAD, dtype=torch.int64, device=device)
            identity[2].zero_()
            self.draws = identity.expand(steps, len(clients), 3, widest).clone()
        real = torch.get_default_dtype()
        self.steps = steps
        sizes: list[list[int]] = [[] for _ in range(steps)]
        for i, c in enumerate(clients):
            if not c.steps:  # no data: nothing drawn, as alone
                continue
            pos, valid = _batch_positions(c.bounds, widest, device)
            epochs = [c.draw_epoch() for _ in range(c.epochs)]
            rows = torch.stack([r for r, _ in epochs])  # (epochs, n)
            self.index[: c.steps, i] = rows[:, pos].reshape(c.steps, widest)
            valid = valid.repeat(c.epochs, 1)
            self.mask[: c.steps, i] = valid.to(real)
            if self.augment:
                draws = torch.stack([d for _, d in epochs])[:, :, pos]  # type: ignore[misc]
                draws = draws.permute(0, 2, 1, 3).reshape(c.steps, 3, widest)
                self.draws[: c.steps, i] = torch.where(valid[:, None], draws, identity)
            for s in range(c.steps):
                a, b = c.bounds[s % len(c.bounds)]
                sizes[s].append(b - a)
        self.sizes = sizes  # per step, the batch size of each active client
        self.width = [max(z) for z in sizes]
        self.padded = [min(z) != max(z) for z in sizes]
        self.groups = _size_groups(sizes, device)

    def batches(
        self, step: int, x: torch.Tensor, y: torch.Tensor, which: torch.Tensor | int, width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and labels of step ``step`` for the first ``which`` clients of the stack
        (or those at positions ``which``), ``width`` samples each, augmented."""
        index = self.index[step]
        draws = self.draws[step] if self.augment else None
        if isinstance(which, int):
            index = _prefix(index, which)
            draws = None if draws is None else _prefix(draws, which)
        else:
            index = index.index_select(0, which)
            draws = None if draws is None else draws[which]
        if width != index.shape[1]:
            index = index[:, :width]
            draws = None if draws is None else draws[..., :width]
        return self.gather(index, draws, x, y)

    def gather(
        self, index: torch.Tensor, draws: torch.Tensor | None, x: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs (clients, batch, ...) and labels of dataset rows ``index`` (clients,
        batch), augmented by ``draws`` (clients, 3, batch) when the schedule augments."""
        xb = x[index]
        if draws is not None:
            # One kernel for the whole stack, client after client.
            flat = xb.reshape(index.numel(), *xb.shape[2:])
            stacked = draws.permute(1, 0, 2).reshape(3, index.numel())
            xb = crop_and_flip(flat, stacked).reshape(xb.shape)
        return xb, y[index]


def _size_groups(
    sizes: Sequence[Sequence[int]], device: torch.device
) -> list[list[tuple[int, torch.Tensor]]]:
    """Per step, its clients grouped by batch size: (size, their positions in the stack),
    one group when every batch is the same size. The positions of all steps reach the device
    in one copy: a ragged step of an algorithm's loss (``_loss_step``) builds no tensor from
    Python numbers, which on CUDA would wait for the host."""
    by_step = []
    for step_sizes in sizes:
        by_size: dict[int, list[int]] = {}
        for position, size in enumerate(step_sizes):
            by_size.setdefault(size, []).append(position)
        by_step.append(list(by_size.items()))
    flat = [position for groups in by_step for _, group in groups for position in group]
    moved = torch.tensor(flat, dtype=torch.int64, device="cpu").to(device, non_blocking=True)
    parts = iter(moved.split([len(group) for groups in by_step for _, group in groups]))
    return [[(size, next(parts)) for size, _ in groups] for groups in by_step]


def _batch_positions(
    bounds: Sequence[tuple[int, int]], width: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(batches, width) positions within an epoch of each batch's samples, padded with the
    batch's first position, and the mask of real ones."""
    starts = torch.tensor([a for a, _ in bounds], device=device)
    sizes = torch.tensor([b - a for a, b in bounds], device=device)
    offsets = torch.arange(width, device=device)
    valid = offsets[None] < sizes[:, None]
    pos = starts[:, None] + torch.where(valid, offsets[None], 0)
    return pos, valid


_BESIDE = "\0beside/"  # names of tensors trained beside the model among the stacked weights


class _LossModule(nn.Module):
    """An algorithm's loss as a module holding the model, so that ``functional_call`` swaps
    the stacked weights in for the whole loss: the model's forward and any
    ``model.parameters()`` the loss reads."""

    def __init__(
        self, model: nn.Module, loss: ClientLoss, after_step: StepUpdate | None = None
    ) -> None:
        super().__init__()
        self.model = model
        self.loss = loss
        self.after_step = after_step

    def forward(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        tensors: Mapping[str, torch.Tensor],
        carried: Mapping[str, torch.Tensor],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss, and the carried tensors after the step (``after_step``, in the same
        vmap: its aux keeps the batch's shape, which differs between vmaps of a ragged
        step; the carried tensors do not)."""
        out = self.loss(self.model, x, y, {**tensors, **carried})
        loss = out.loss if isinstance(out, LossOutput) else out
        if self.after_step is None:
            return loss, {}
        if not isinstance(out, LossOutput):
            raise TypeError("after_step needs a loss that returns a LossOutput (its aux)")
        return loss, self.after_step(carried, {k: v.detach() for k, v in out.aux.items()})


def train_together(
    model: nn.Module,
    datas: Sequence[ClientData],
    cfg: LocalTrainConfig,
    gens: Sequence[torch.Generator],
    starts: Sequence[Mapping[str, torch.Tensor]],
    epochs: Sequence[int],
    *,
    loss: ClientLoss | None = None,
    tensors: Sequence[Mapping[str, torch.Tensor]] = (),
    grad_shifts: Sequence[Mapping[str, torch.Tensor]] = (),
    trained: Sequence[Mapping[str, torch.Tensor]] = (),
    step_tensors: Sequence[Mapping[str, torch.Tensor]] = (),
    carried: Sequence[Mapping[str, torch.Tensor]] = (),
    after_step: StepUpdate | None = None,
    after_epoch: EpochUpdate | None = None,
    fused: bool = False,
    graphs: bool = False,
) -> tuple[list[TrainResult], list[dict[str, torch.Tensor]]]:
    """Train client k from ``starts[k]`` (a state dict) on ``datas[k]`` for ``epochs[k]``
    epochs with generator ``gens[k]``, all clients at once; ``model`` gives the architecture
    (its own weights are not used). ``loss``, ``tensors[k]`` and ``grad_shifts[k]`` are
    ``PlainTraining``'s (None: cross-entropy; empty: none), and so are ``trained[k]`` and
    ``carried[k]``, whose tensors hold client k's trained and final values afterwards, and
    ``step_tensors[k]``, ``after_step`` and ``after_epoch``. ``fused``: the steps run as one
    fused model with native BatchNorm (``engines/fused.py``) where ``fused_why_not`` says
    nothing against it, else by vmap. ``graphs``: steps whose clients' batches are all of one
    size replay as CUDA graphs (``_ChunkStep``; callers decide with
    ``graph_step.resolve_graphs``). Returns each client's TrainResult and trained state."""
    augment = cfg.augment and bool(datas) and datas[0].x.dim() == 4
    clients = [
        _Client(d, g, e, cfg.batch_size, augment)
        for d, g, e in zip(datas, gens, epochs, strict=True)
    ]
    # Most steps first: at every step the active clients are a prefix of the stack.
    order = sorted(range(len(clients)), key=lambda k: -clients[k].steps)
    params = {
        name: torch.stack([starts[k][name] for k in order]).detach().requires_grad_(p.requires_grad)
        for name, p in model.named_parameters()
    }
    # torch.stack already copies: the stacks own their memory, starts are left as they were.
    buffers = {
        name: torch.stack([starts[k][name] for k in order]).detach()
        for name, _ in model.named_buffers()
    }
    extra = _stacked(tensors, order)
    shifts = _stacked(grad_shifts, order)
    beside = {name: t.detach().requires_grad_(True) for name, t in _stacked(trained, order).items()}
    if beside and loss is None:
        raise ValueError("tensors trained beside the model need the loss that uses them")
    carry = _stacked(carried, order)
    if (carry or any(step_tensors)) and loss is None:
        raise ValueError("step tensors and carried state need the loss that uses them")
    by_step = _stacked_steps(step_tensors, order, [clients[k].steps for k in order])
    names = [*extra, *carry, *by_step]
    if len(set(names)) != len(names):
        raise ValueError(f"a loss's tensors must have distinct names, got {sorted(names)}")
    clipped = set(params)  # the model's parameters, as train_client clips them
    params.update({_BESIDE + name: t for name, t in beside.items()})
    extra.update(beside)
    first = clients[order[0]] if clients else None
    device = first.data.device if first is not None else torch.device("cpu")
    fuse = fused and not fused_why_not(model, loss)
    model.train()
    chunk = _ChunkStep(
        model, params, buffers, clipped, cfg,
        schedule=_Schedule([clients[k] for k in order], device),
        x_all=first.data.x if first is not None else None,
        y_all=first.data.y if first is not None else None,
        loss=None if loss is None else _LossModule(model, loss, after_step),
        fuse=fuse, extra=extra, beside=set(beside), shifts=shifts, carry=carry,
        by_step=by_step, graphs=graphs,
    )  # fmt: skip
    running = [sum(1 for c in clients if c.steps > step) for step in range(chunk.schedule.steps)]
    ends = _EpochEnds([clients[k] for k in order], device) if after_epoch and carry else None
    for step, active in enumerate(running):
        chunk.step(step, active)
        if ends is not None and ends.any[step]:
            assert after_epoch is not None
            ends.update(after_epoch, carry, active, step)
    loss_sums = chunk.loss_sums

    loss_host = loss_sums.tolist()
    results: list[TrainResult | None] = [None] * len(clients)
    finals: list[dict[str, torch.Tensor] | None] = [None] * len(clients)
    for position, k in enumerate(order):
        steps = clients[k].steps
        mean = loss_host[position] / steps if steps else 0.0
        results[k] = TrainResult(steps=steps, samples=len(datas[k]) * epochs[k], mean_loss=mean)
        state = {name: p[position].detach() for name, p in params.items() if name in clipped}
        state.update({name: b[position] for name, b in buffers.items()})
        finals[k] = state
        with torch.no_grad():
            for name, t in beside.items():
                trained[k][name].copy_(t[position])
            for name, t in carry.items():
                carried[k][name].copy_(t[position])
    return results, finals  # type: ignore[return-value]


class _ChunkStep:
    """The stacked clients' steps, one at a time (``train_together``'s loop body).

    A step whose active clients all have a batch of one size (every step but those at a
    short last batch) runs :meth:`body`, which is graph-safe as ``graph_step.LocalStep``'s
    step is: before it, the host copies the step's batch rows (and augmentation draws and
    step tensors' rows) into static buffers of its shape (active clients, batch width); the
    body reads only those, the stacks and the carried tensors, writes the weights, momentum,
    BatchNorm's buffers, loss sums and carried tensors in place, and reads nothing back. On
    the CPU it runs eagerly (it is the CPU's code path); with ``graphs`` on CUDA it is
    replayed by ``GraphReplay``, one graph per shape (a chunk's shapes change only as
    clients finish). Other steps (batches of several sizes) run :meth:`ragged`, eagerly."""

    def __init__(
        self,
        model: nn.Module,
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        clipped: set[str],
        cfg: LocalTrainConfig,
        *,
        schedule: _Schedule,
        x_all: torch.Tensor | None,
        y_all: torch.Tensor | None,
        loss: _LossModule | None,
        fuse: bool,
        extra: dict[str, torch.Tensor],
        beside: set[str],
        shifts: dict[str, torch.Tensor],
        carry: dict[str, torch.Tensor],
        by_step: dict[str, torch.Tensor],
        graphs: bool,
    ) -> None:
        self.model, self.params, self.buffers, self.cfg = model, params, buffers, cfg
        self.schedule, self.x_all, self.y_all = schedule, x_all, y_all
        self.bound, self.fuse = loss, fuse
        self.extra, self.beside, self.shifts = extra, beside, shifts
        self.carry, self.by_step = carry, by_step
        # The optimiser's tensors: those with a gradient (frozen ones are left alone).
        self.names = [name for name, p in params.items() if p.requires_grad]
        self.clip = [name in clipped for name in self.names]
        self.momentum = {name: torch.zeros_like(params[name]) for name in self.names}
        device = schedule.index.device
        self.loss_sums = torch.zeros(schedule.index.shape[1], device=device)
        self.has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
        self.has_gn = any(isinstance(m, nn.GroupNorm) for m in model.modules())
        self.bodies = _bodies(model, loss.loss) if fuse and loss is not None else []
        # Static buffers: per shape the batch rows and draws; the step tensors' current row.
        self.index: dict[tuple[int, int], torch.Tensor] = {}
        self.draws: dict[tuple[int, int], torch.Tensor] = {}
        self.rows = {name: t[0].clone() for name, t in by_step.items()}
        self.graphs = graphs
        self.replay = GraphReplay(device, self.body, "a chunk of clients' step")

    def step(self, step: int, active: int) -> None:
        """Step ``step`` of the first ``active`` clients of the stack."""
        if len(self.schedule.groups[step]) != 1:
            self.ragged(step, active)
            return
        key = self.load(step, active)
        if step == 0 or not self.graphs:  # the first starts momentum (a copy): eager
            self.body(key, first=step == 0)
        else:
            self.replay.run(key)

    def load(self, step: int, active: int) -> tuple[int, int]:
        """Fill the static buffers of this step's shape and return the shape: what the
        host does between replays."""
        width = self.schedule.width[step]
        key = (active, width)
        if key not in self.index:
            self.index[key] = self.schedule.index.new_empty(active, width)
            if self.schedule.augment:
                self.draws[key] = self.schedule.draws.new_empty(active, 3, width)
        self.index[key].copy_(self.schedule.index[step, :active, :width])
        if self.schedule.augment:
            self.draws[key].copy_(self.schedule.draws[step, :active, :, :width])
        for name, t in self.by_step.items():
            self.rows[name].copy_(t[step])
        return key

    def contexts(self) -> contextlib.ExitStack:
        """Autocast as the precision says (and its casts inside vmap), the norms' modes
        inside vmap (BatchNorm by its formula, GroupNorm on row-major inputs), the model's
        bodies fused where they run fused."""
        stack = contextlib.ExitStack()
        device_type = self.x_all.device.type if self.x_all is not None else "cpu"
        stack.enter_context(autocast(self.cfg.precision, device_type))
        stack.enter_context(_autocast_in_vmap(self.cfg.precision))
        # A fused cross-entropy step runs no vmap (a fused loss does, its bodies not).
        in_vmap = not (self.fuse and self.bound is None)
        stack.enter_context(_norms_in_vmap(self.has_bn and in_vmap, self.has_gn and in_vmap))
        if self.bodies:
            stack.enter_context(_fused_bodies(self.bodies))
        return stack

    def body(self, key: tuple[int, int], first: bool = False) -> None:
        """A step whose ``active`` clients have batches of ``width`` samples, from the static
        buffers of that shape: graph-safe (see the class's docstring)."""
        active, width = key
        assert self.x_all is not None and self.y_all is not None
        p_now = {name: _prefix(p, active) for name, p in self.params.items()}
        b_now = {name: _prefix(b, active) for name, b in self.buffers.items()}
        model_p = {name: p for name, p in p_now.items() if name[0] != "\0"}
        xb, yb = self.schedule.gather(self.index[key], self.draws.get(key), self.x_all, self.y_all)
        new: dict[str, torch.Tensor] = {}
        with self.contexts():
            if self.bound is None and self.fuse:
                losses = fused_cross_entropy(fused_logits(self.model, model_p, b_now, xb), yb)
            elif self.bound is None:
                losses = _vmapped_cross_entropy(self.model, model_p, b_now, xb, yb, None)
            else:
                # Tensors trained beside the model reach the loss as the views differentiated.
                t_now = {
                    name: p_now[_BESIDE + name] if name in self.beside else _prefix(t, active)
                    for name, t in self.extra.items()
                }
                t_now.update({name: _prefix(t, active) for name, t in self.rows.items()})
                c_now = {name: _prefix(c, active) for name, c in self.carry.items()}
                losses, new = _vmapped_loss(self.bound, model_p, b_now, t_now, c_now, xb, yb)
        self.update(losses, [p_now[name] for name in self.names], active, first)
        with torch.no_grad():
            _prefix(self.loss_sums, active).add_(losses.detach())
            if self.bound is not None and self.bound.after_step is not None:
                for name, c in self.carry.items():
                    _prefix(c, active).copy_(new[name])

    def ragged(self, step: int, active: int) -> None:
        """A step whose clients' batches differ in size (eager): padded and masked for
        cross-entropy by vmap, else one forward per batch size."""
        assert self.x_all is not None and self.y_all is not None
        x, y = self.x_all, self.y_all
        rows = {name: t[step] for name, t in self.by_step.items()}
        new = self.carry
        with self.contexts():
            if self.bound is None and self.fuse:
                losses, positions = _fused_step(
                    self.model, self.params, self.buffers, self.schedule, step, x, y
                )
            elif self.bound is None:
                losses = _padded_cross_entropy(
                    self.model, self.params, self.buffers, self.schedule, active, step, x, y
                )
                positions = None
            else:
                losses, positions, new = _loss_step(
                    self.bound, self.params, self.buffers, {**self.extra, **rows}, self.carry,
                    self.schedule, step, x, y,
                )  # fmt: skip
        # Gradients of the whole stacks (a group's weights are picked by index), then the
        # active clients' rows.
        self.update(losses, [self.params[name] for name in self.names], active, step == 0)
        with torch.no_grad():
            # Each loss added as train_client adds it (to the fp32 sum in the loss's dtype,
            # then rounded): a float64 run's mean losses are one after another's.
            if positions is None:
                _prefix(self.loss_sums, active).add_(losses.detach())
            else:
                added = self.loss_sums.index_select(0, positions) + losses.detach()
                self.loss_sums.index_copy_(0, positions, added.to(self.loss_sums.dtype))
            for name, c in self.carry.items():
                if new[name] is not c:
                    c.copy_(new[name])

    def update(
        self, losses: torch.Tensor, inputs: list[torch.Tensor], active: int, first: bool
    ) -> None:
        """The gradients of the clients' summed losses and the SGD step of the first
        ``active`` clients."""
        grads = torch.autograd.grad(losses.sum(), inputs, allow_unused=True)
        now = [None if g is None else _prefix(g, active) for g in grads]
        _sgd_step(
            [_prefix(self.params[name], active) for name in self.names],
            now,
            [_prefix(self.momentum[name], active) for name in self.names],
            [None if name not in self.shifts else _prefix(self.shifts[name], active)
             for name in self.names],
            self.clip,
            self.cfg,
            first,
        )  # fmt: skip


def _stacked_steps(
    per_client: Sequence[Mapping[str, torch.Tensor]], order: Sequence[int], steps: Sequence[int]
) -> dict[str, torch.Tensor]:
    """Each client's step tensors (``PlainTraining.step_tensors``: a row per step) stacked as
    (steps, clients, ...): a step reads its rows with one index. Rows are zero-padded at the
    end to the largest of the stack, and after a client's last step."""
    if not per_client or not per_client[0]:
        return {}
    names = list(per_client[0])
    if any(list(t) != names for t in per_client):
        raise ValueError("clients trained together must give the same step tensors, by name")
    out = {}
    for name in names:
        parts = [per_client[k][name] for k in order]
        for part, n in zip(parts, steps, strict=True):
            if part.dim() != parts[0].dim() or part.shape[0] != n:
                raise ValueError(f"step tensor '{name}' has {tuple(part.shape)} rows for {n} steps")
        shape = [max(part.shape[d] for part in parts) for d in range(1, parts[0].dim())]
        stack = parts[0].new_zeros(max(steps, default=0), len(parts), *shape)
        for i, part in enumerate(parts):
            stack[(slice(0, part.shape[0]), i, *(slice(0, w) for w in part.shape[1:]))] = part
        out[name] = stack
    return out


class _EpochEnds:
    """The steps at which clients of the stack end an epoch (each after its own number of
    batches), as a (steps, clients) mask made before training, so that a step picks its
    clients with no tensor made from Python numbers while it runs."""

    def __init__(self, clients: Sequence[_Client], device: torch.device) -> None:
        steps = max((c.steps for c in clients), default=0)
        ending = [[False] * len(clients) for _ in range(steps)]
        for i, c in enumerate(clients):
            for step in range(len(c.bounds) - 1, c.steps, len(c.bounds)):
                ending[step][i] = True
        self.any = [any(row) for row in ending]
        host = torch.tensor(ending, dtype=torch.bool, device="cpu").reshape(steps, len(clients))
        self.mask = host.to(device, non_blocking=True)

    def update(
        self,
        after_epoch: EpochUpdate,
        carry: dict[str, torch.Tensor],
        active: int,
        step: int,
    ) -> None:
        """``after_epoch`` for the clients whose epoch ends at ``step`` (mapped over the
        active ones, kept where the mask says), written into the carried tensors in place
        (they are the chunk step's static tensors)."""
        now = {name: _prefix(t, active) for name, t in carry.items()}
        new = vmap(after_epoch)(now)
        mask = _prefix(self.mask[step], active)
        # Every new value before any copy: an update may move one carried value to another.
        out = {}
        for name, t in now.items():
            ends = mask.reshape(-1, *([1] * (t.dim() - 1)))
            out[name] = torch.where(ends, new[name], t)
        with torch.no_grad():
            for name, t in now.items():
                t.copy_(out[name])


# Autocast's CPU/CUDA op lists, as far as a model's forward and its loss reach them:
# products and convolutions run in bf16, the losses autocast casts up run in fp32.
_TO_BF16 = frozenset(
    {
        F.linear,
        F.conv1d,
        F.conv2d,
        F.conv3d,
        F.conv_transpose1d,
        F.conv_transpose2d,
        F.conv_transpose3d,
        F.prelu,
        torch.matmul,
        torch.mm,
        torch.bmm,
        torch.addmm,
        torch.baddbmm,
        torch.addbmm,
        torch.Tensor.matmul,
        torch.Tensor.__matmul__,
        torch.Tensor.mm,
        torch.Tensor.bmm,
    }
)
_TO_FP32 = frozenset({F.cross_entropy, F.nll_loss, F.kl_div, F.mse_loss})
# Norms: one after another, CPU autocast leaves them out of its lists, so a bf16 input is
# normalised with the fp32 weights (statistics accumulated in fp32) and comes out bf16; the
# same here (BatchNorm: :func:`_batch_norm`, which the stacked step uses in any precision).
_NORMS = frozenset({F.layer_norm, F.group_norm})


class _AutocastInVmap(TorchFunctionMode):
    """bf16 autocast's casts, made explicitly where ``torch.autocast`` does not reach.

    Measured on torch 2.13: under ``torch.autocast("cpu", dtype=torch.bfloat16)`` a Linear or
    Conv2d called through ``vmap(functional_call)`` returns float32 (autocast's dispatch key
    sits below vmap's batching). A function mode runs before the dispatcher, inside vmap too,
    so here the floating-point inputs of autocast's lower-precision ops (the fp32 master
    weights among them, so their gradients come back fp32) are cast to bf16, and those of the
    losses autocast runs in fp32 are cast up. It casts only while autocast is enabled for
    the tensors' device: a term in :func:`~fedskew.core.precision.in_fp32`, which switches
    autocast off, stays fp32 as one after another."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in _TO_BF16:
            dtype = torch.bfloat16
        elif func in _TO_FP32 or func in _NORMS:
            dtype = torch.float32
        else:
            return func(*args, **kwargs)
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if first is None or not torch.is_autocast_enabled(first.device.type):
            return func(*args, **kwargs)
        if func in _NORMS and first.dtype == torch.bfloat16:
            out = func(
                *[
                    a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                    for a in args
                ],
                **kwargs,
            )
            return out.to(torch.bfloat16)

        def cast(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                return value.to(dtype)
            return value

        return func(*[cast(a) for a in args], **{k: cast(v) for k, v in kwargs.items()})


def _autocast_in_vmap(precision: str) -> contextlib.AbstractContextManager[object]:
    """:class:`_AutocastInVmap` under ``bf16`` (entered with autocast itself), else nothing."""
    return _AutocastInVmap() if precision == "bf16" else contextlib.nullcontext()


def _prefix(t: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` clients of a stacked tensor: the tensor itself when that is all of
    them, since a slice of a parameter costs an operator every step and one more in the
    backward (issue 39)."""
    return t if n == t.shape[0] else t[:n]


def _stacked(
    per_client: Sequence[Mapping[str, torch.Tensor]], order: Sequence[int]
) -> dict[str, torch.Tensor]:
    """Each client's tensors stacked along a new first dimension, in stack order."""
    if not per_client or not per_client[0]:
        return {}
    names = list(per_client[0])
    if any(list(t) != names for t in per_client):
        raise ValueError("clients trained together must give the same tensors, by name")
    return {name: torch.stack([per_client[k][name] for k in order]) for name in names}


def _vmapped_cross_entropy(
    model: nn.Module,
    p_now: dict[str, torch.Tensor],
    b_now: dict[str, torch.Tensor],
    xb: torch.Tensor,
    yb: torch.Tensor,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """Each client's cross-entropy (mean over the real samples ``mask`` marks, when the
    batches are padded) of its batch through its stacked weights, in one vmap."""

    def one(p: dict, b: dict, x: torch.Tensor, y: torch.Tensor, m: Any) -> torch.Tensor:
        if m is None:
            return F.cross_entropy(functional_call(model, (p, b), (x,)), y)
        _MASK.append(m)
        try:
            logits = functional_call(model, (p, b), (x,))
        finally:
            _MASK.pop()
        ce = F.cross_entropy(logits, y, reduction="none")
        return (ce * m).sum() / m.sum()

    padded = mask is not None
    return vmap(one, in_dims=(0, 0, 0, 0, 0 if padded else None))(p_now, b_now, xb, yb, mask)


def _padded_cross_entropy(
    model: nn.Module,
    params: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    schedule: _Schedule,
    active: int,
    step: int,
    x_all: torch.Tensor,
    y_all: torch.Tensor,
) -> torch.Tensor:
    """The cross-entropy of each of the first ``active`` clients' batch ``step``, ragged
    batches padded and masked in one vmap."""
    xb, yb, mask = _gather(schedule, active, step, x_all, y_all)
    p_now = {name: _prefix(p, active) for name, p in params.items() if name[0] != "\0"}
    b_now = {name: _prefix(b, active) for name, b in buffers.items()}
    return _vmapped_cross_entropy(model, p_now, b_now, xb, yb, mask)


def fused_why_not(model: nn.Module, loss: ClientLoss | None) -> str:
    """Why clients of ``model`` trained with ``loss`` cannot run fused ("" when they can).
    An algorithm's own loss fuses too: it runs under vmap, its calls of the model's body
    escape into one fused forward (:func:`_fused_bodies`)."""
    return fused_obstacle(model)


def _unbatched(t: torch.Tensor, level: int, k: int) -> torch.Tensor | None:
    """The (K, ...) stack behind a tensor vmap batched at ``level`` (an unbatched one
    expanded to K); None for one batched at another level.

    Private functorch calls, here only: the body's input and the weights functional_call
    swapped in are BatchedTensors inside vmap, and the fused body needs their stacks. The
    stacks keep their autograd history (the backward runs outside vmap), so gradients reach
    the stacked parameters as through vmap."""
    if not is_batchedtensor(t):
        return t.unsqueeze(0).expand(k, *t.shape)
    if maybe_get_level(t) != level:
        return None
    return _stack(t)


def _stack(t: torch.Tensor) -> torch.Tensor:
    """The (K, ...) tensor behind a BatchedTensor, its batch dimension first."""
    return get_unwrapped(t).movedim(maybe_get_bdim(t), 0)


@contextlib.contextmanager
def _fused_bodies(bodies: Sequence[nn.Module]) -> Iterator[None]:
    """While the block runs, each of ``bodies`` called inside vmap on a batched input runs
    as one fused forward of every client (native BatchNorm, running buffers updated in
    place on the stacks) and returns its output batched again; any other call, or one whose
    tensors are not the vmap's, runs the body's own forward."""
    patched = []
    for body in bodies:
        original = body.forward

        def forward(x: torch.Tensor, _body: nn.Module = body, _own: Any = original) -> Any:
            if not isinstance(x, torch.Tensor) or not is_batchedtensor(x):
                return _own(x)
            level = maybe_get_level(x)
            xs = _stack(x)
            k = xs.shape[0]
            stacks: dict[str, torch.Tensor] = {}
            for name, t in [*_body.named_parameters(), *_body.named_buffers()]:
                u = _unbatched(t, level, k)
                if u is None:
                    return _own(x)
                stacks[name] = u
            names = {n for n, _ in _body.named_parameters()}
            params = {n: t for n, t in stacks.items() if n in names}
            buffers = {n: t for n, t in stacks.items() if n not in names}
            _ESCAPED.append(True)
            try:
                out = fused_body(_body, params, buffers, xs)
            finally:
                _ESCAPED.pop()
            return _add_batch_dim(out, 0, level)

        body.forward = forward  # type: ignore[method-assign]
        patched.append(body)
    try:
        yield
    finally:
        for body in patched:
            del body.forward


def _bodies(model: nn.Module, loss: ClientLoss | None) -> list[nn.Module]:
    """The bodies a loss calls, and their layers (a loss may run them one by one: FedFM's
    pre-ReLU features): the model's, and those of models the loss keeps (MOON's and FedNTD's
    frozen copies) that the fused model can run."""
    models = [model] if isinstance(model, BodyHeadModel) else []
    for m in _kept_modules(loss, set()):
        if isinstance(m, BodyHeadModel) and m not in models and not fused_obstacle(m):
            models.append(m)
    found: list[nn.Module] = []
    for m in models:
        found += [m.body, *m.body.children()]
    return found


def _kept_modules(loss: object, seen: set[int]) -> Iterator[nn.Module]:
    """The modules a loss's owner keeps, and those of the losses it wraps (the feature-matching
    plug-in's ``InnerMatchingLoss`` keeps the inner algorithm's loss, whose owner keeps MOON's
    frozen models): without them, those models' bodies ran under vmap, BatchNorm by formula."""
    owner = getattr(loss, "__self__", loss)
    if id(owner) in seen or not hasattr(owner, "__dict__"):
        return
    seen.add(id(owner))
    for value in vars(owner).values():
        if isinstance(value, nn.Module):
            yield from value.modules()
        elif callable(value) and not isinstance(value, type):
            yield from _kept_modules(value, seen)


def _fused_step(
    model: nn.Module,
    params: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    schedule: _Schedule,
    step: int,
    x_all: torch.Tensor,
    y_all: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cross-entropy through the fused model of the clients' batch ``step`` when the
    batches differ in size, and the clients' positions in the stack.

    Ragged batches are not padded (padding would enter BatchNorm's statistics): each batch
    size runs its own fused forward on its clients' rows, BatchNorm's buffers (copies)
    written back to the stack after it."""
    parts, where = [], []
    for size, index in schedule.groups[step]:
        xb, yb = schedule.batches(step, x_all, y_all, index, size)
        p_now = {name: p.index_select(0, index) for name, p in params.items() if name[0] != "\0"}
        b_now = {name: b.index_select(0, index) for name, b in buffers.items()}
        parts.append(fused_cross_entropy(fused_logits(model, p_now, b_now, xb), yb))
        with torch.no_grad():
            for name, b in buffers.items():
                b.index_copy_(0, index, b_now[name])
        where.append(index)
    return torch.cat(parts), torch.cat(where)


def _vmapped_loss(
    bound: _LossModule,
    p_now: dict[str, torch.Tensor],
    b_now: dict[str, torch.Tensor],
    t_now: dict[str, torch.Tensor],
    c_now: dict[str, torch.Tensor],
    xb: torch.Tensor,
    yb: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each client's loss of its batch (and its carried tensors after the step), in one
    vmap. The model's weights go to functional_call; tensors trained beside it reach the
    loss among its tensors."""

    def one(
        p: dict, b: dict, t: dict, c: dict, x: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        state = {"model." + k: v for k, v in {**p, **b}.items()}
        return functional_call(bound, state, (x, y, t, c))

    return vmap(one)(p_now, b_now, t_now, c_now, xb, yb)


def _loss_step(
    bound: _LossModule,
    params: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    extra: dict[str, torch.Tensor],
    carry: dict[str, torch.Tensor],
    schedule: _Schedule,
    step: int,
    x_all: torch.Tensor,
    y_all: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """An algorithm's loss of the clients' batch ``step`` when the batches differ in size:
    the losses, their positions in the stack, and the carried tensors after the step
    (``carry`` itself without an ``after_step``).

    An algorithm's loss may use the whole batch (batch statistics, a batch mean), so padding
    cannot be masked out of it: clients whose batches differ in size run in one vmap per
    size, without padding. The new carried tensors are new tensors (the step's graph may
    hold the old ones until its backward)."""
    updates = bound.after_step is not None
    parts, where = [], []
    for size, index in schedule.groups[step]:
        xb, yb = schedule.batches(step, x_all, y_all, index, size)
        p_now = {name: p.index_select(0, index) for name, p in params.items() if name[0] != "\0"}
        # Copies: BatchNorm's running statistics go back to the stack after the forward.
        b_now = {name: b.index_select(0, index) for name, b in buffers.items()}
        t_now = {name: t.index_select(0, index) for name, t in extra.items()}
        c_now = {name: c.index_select(0, index) for name, c in carry.items()}
        losses, new = _vmapped_loss(bound, p_now, b_now, t_now, c_now, xb, yb)
        parts.append(losses)
        with torch.no_grad():
            for name, b in buffers.items():
                b.index_copy_(0, index, b_now[name])
        if updates:
            carry = {name: c.index_copy(0, index, new[name]) for name, c in carry.items()}
        where.append(index)
    return torch.cat(parts), torch.cat(where), carry


def _gather(
    schedule: _Schedule, active: int, step: int, x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(clients, batch, ...) inputs and labels of the first ``active`` clients at this step,
    gathered on the data's device; a (clients, batch) mask of real samples when the
    batches differ in size, else None."""
    width = schedule.width[step]
    xb, yb = schedule.batches(step, x, y, active, width)
    if not schedule.padded[step]:
        return xb, yb, None
    mask = _prefix(schedule.mask[step], active)
    return xb, yb, mask if width == mask.shape[1] else mask[:, :width]


def _sgd_step(
    weights: list[torch.Tensor],
    grads: list[torch.Tensor | None],
    momentum: list[torch.Tensor],
    shifts: list[torch.Tensor | None],
    clip: list[bool],
    cfg: LocalTrainConfig,
    first_step: bool,
) -> None:
    """``torch.optim.SGD`` (momentum, weight decay, no dampening or Nesterov) on stacked
    ``weights`` (clients first), after clipping each client's gradient by its own norm (over
    the tensors ``clip`` marks: the model's) and adding its ``shifts``
    (``PlainTraining.grad_shift``), as ``run_plain`` does: the one-client step's update
    (``graph_step.foreach_sgd``), one multi-tensor (foreach) kernel per operation over all
    the stacked tensors, as the optimiser itself does on CUDA. The gradients are only read
    (``autograd.grad`` may hand one tensor to two inputs)."""
    have = [i for i, g in enumerate(grads) if g is not None]
    if not have:
        return
    with torch.no_grad():
        g: list[torch.Tensor] = [grads[i] for i in have]  # type: ignore[misc]
        params = [weights[i] for i in have]
        if cfg.grad_clip > 0:
            own = [j for j, i in enumerate(have) if clip[i]]
            if own:
                # clip_grad_norm_: the norm of the per-tensor norms, coefficient clamped at 1.
                active = g[own[0]].shape[0]
                norms = torch.stack(
                    [torch.linalg.vector_norm(g[j].reshape(active, -1), dim=1) for j in own]
                )
                total = torch.linalg.vector_norm(norms, dim=0)
                coef = torch.clamp(cfg.grad_clip / (total + 1e-6), max=1.0)
                for j in own:
                    g[j] = g[j] * coef.reshape(-1, *([1] * (g[j].dim() - 1)))
        foreach_sgd(
            params,
            g,
            [shifts[i] for i in have],
            [momentum[i] for i in have] if cfg.momentum else [],
            [first_step] * len(have),
            cfg,
        )
