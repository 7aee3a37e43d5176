"""Clients trained together: a round's clients as one stacked model (``torch.func``).

One client at a time leaves a GPU mostly idle when models are small: each step is a handful
of small kernels. Here the clients of an exchange train at once: their parameters, buffers
and momentum buffers are stacked along a new first dimension, and ``torch.func.vmap`` over
``functional_call`` runs every client's step of the same index in one batched forward and
backward (a convolution becomes a grouped one).

What stays exactly as one after another:

* each client's batches: its epoch permutations (and augmentation draws) come from its own
  addressed generator, in the same order, so every client sees the batches it would see alone;
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
are updated as ``nn.BatchNorm`` updates them).

Which algorithms. Only a handler whose local step is plain (``PlainTraining`` in
``fedskew.training.local``: cross-entropy, the shared optimiser, no hooks or extra loss
terms) can be trained together: FedAvg, CReFF and FedNH today. Every other exchange, a client
logic that wraps the handlers (the feature-matching plug-in), a model with dropout or with a
BatchNorm without running statistics, and ``--precision bf16`` (autocast does not reach the
kernels inside ``vmap``: they would run in fp32) are trained one after another, and the reason
is logged once.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

from fedskew.core.precision import autocast
from fedskew.data.federated import ClientData
from fedskew.training.interface import ClientLogic, LocalTrainConfig
from fedskew.training.local import (
    AUGMENT_PAD,
    PlainTraining,
    TrainResult,
    batch_bounds,
    crop_and_flip,
    draw_augmentation,
)

log = logging.getLogger("fedskew")
MODES = ("auto", "off", "vmap")


def resolve_mode(mode: str, device: torch.device) -> str:
    """``auto``: vmap on CUDA (many small kernels to batch), one after another on the CPU,
    where benchmarks/clients_together.py measured the stacked step slower."""
    if mode == "auto":
        return "vmap" if device.type == "cuda" else "off"
    return mode


# ---------------------------------------------------------------------------- eligibility


def plain_handler(logic: ClientLogic, kind: str) -> tuple[Callable[..., PlainTraining] | None, str]:
    """The client logic's ``plain_<kind>`` split when an engine may use it in place of its
    ``on_<kind>`` handler, else None and the reason."""
    cls = type(logic)
    if cls.handle is not ClientLogic.handle:
        return None, f"{cls.__name__} routes its messages itself (a plug-in wraps the handlers)"
    split = getattr(logic, f"plain_{kind}", None)
    if split is None:
        return None, f"{cls.__name__}'s '{kind}' handler's local step is not plain cross-entropy"
    # A subclass that overrides on_<kind> but inherits plain_<kind> must not be bypassed.
    if _defining_class(cls, f"on_{kind}") is not _defining_class(cls, f"plain_{kind}"):
        return None, f"{cls.__name__} overrides on_{kind} without its plain_{kind} split"
    return split, ""


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


# ---------------------------------------------------------------------------- masked BN

_MASK: list[torch.Tensor] = []  # the current per-sample mask while a padded step runs


def _masked_batch_norm(module: nn.modules.batchnorm._BatchNorm, x: torch.Tensor) -> torch.Tensor:
    """BatchNorm in training mode over the samples ``_MASK`` marks (one client's batch inside
    vmap): statistics, output and running buffers as ``nn.BatchNorm`` computes them on the
    unpadded batch, up to rounding."""
    mask = _MASK[-1]
    shape = (1, -1, *([1] * (x.dim() - 2)))
    dims = [0, *range(2, x.dim())]
    w = mask.to(x.dtype).reshape(-1, *([1] * (x.dim() - 1)))
    count = mask.to(x.dtype).sum() * (x[0, 0].numel())
    mean = (x * w).sum(dims) / count
    centred = x - mean.reshape(shape)
    var = (centred * centred * w).sum(dims) / count
    out = centred * torch.rsqrt(var + module.eps).reshape(shape)
    if module.affine:
        out = out * module.weight.reshape(shape) + module.bias.reshape(shape)
    with torch.no_grad():
        momentum = float(module.momentum)
        module.num_batches_tracked.add_(1)
        module.running_mean.mul_(1 - momentum).add_(mean.detach() * momentum)
        unbiased = var.detach() * count / (count - 1).clamp(min=1)
        module.running_var.mul_(1 - momentum).add_(unbiased * momentum)
    return out


@contextlib.contextmanager
def _masked_norms(model: nn.Module, active: bool) -> Iterator[None]:
    """Every BatchNorm of ``model`` computes with :func:`_masked_batch_norm` in the block
    (when ``active``: a padded step)."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not active or not norms:
        yield
        return
    for module in norms:
        module.forward = _masked_batch_norm.__get__(module)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for module in norms:
            del module.forward


# ---------------------------------------------------------------------------- training


class _Client:
    """One client's side of the stacked loop: its data, generator and batch schedule."""

    def __init__(
        self, data: ClientData, gen: torch.Generator, epochs: int, batch_size: int, augment: bool
    ) -> None:
        self.data = data
        self.gen = gen
        self.bounds = batch_bounds(len(data), batch_size)
        self.steps = epochs * len(self.bounds)
        self.augment = augment
        self.rows: torch.Tensor | None = None  # this epoch's data rows, in order
        self.draws: torch.Tensor | None = None  # this epoch's augmentation (3, n), if any

    def batch_rows(self, step: int) -> torch.Tensor:
        """The dataset rows of this client's batch number ``step`` (drawing the epoch's
        permutation, then its augmentation, at each epoch start, as the one-client loop
        does, and moving them to the device in one copy)."""
        b = step % len(self.bounds)
        if b == 0 or self.rows is None:
            n = len(self.data)
            perm = torch.randperm(n, generator=self.gen, device=self.gen.device)
            if self.augment:
                sizes = [stop - start for start, stop in self.bounds]
                epoch = torch.cat([perm[None], draw_augmentation(self.gen, sizes)])
                epoch = epoch.to(self.data.device, non_blocking=True)
                perm, self.draws = epoch[0], epoch[1:]
            else:
                perm = perm.to(self.data.device, non_blocking=True)
            self.rows = self.data.indices.index_select(0, perm)
        start, stop = self.bounds[b]
        return self.rows[start:stop]

    def batch_draws(self, step: int) -> torch.Tensor:
        """The augmentation of batch number ``step`` (after ``batch_rows(step)``)."""
        assert self.draws is not None
        start, stop = self.bounds[step % len(self.bounds)]
        return self.draws[:, start:stop]


def train_together(
    model: nn.Module,
    datas: Sequence[ClientData],
    cfg: LocalTrainConfig,
    gens: Sequence[torch.Generator],
    starts: Sequence[Mapping[str, torch.Tensor]],
    epochs: Sequence[int],
) -> tuple[list[TrainResult], list[dict[str, torch.Tensor]]]:
    """Train client k from ``starts[k]`` (a state dict) on ``datas[k]`` for ``epochs[k]``
    epochs with generator ``gens[k]``, all clients at once; ``model`` gives the architecture
    (its own weights are not used). Returns each client's TrainResult and trained state."""
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
    buffers = {
        name: torch.stack([starts[k][name] for k in order]).detach().clone()
        for name, _ in model.named_buffers()
    }
    momentum = {name: torch.zeros_like(p) for name, p in params.items()}
    first = clients[order[0]] if clients else None
    device = first.data.device if first is not None else torch.device("cpu")
    loss_sums = torch.zeros(len(clients), device=device)
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    model.train()
    x_all, y_all = (first.data.x, first.data.y) if first is not None else (None, None)
    max_steps = clients[order[0]].steps if clients else 0

    for step in range(max_steps):
        active = sum(1 for k in order if clients[k].steps > step)
        xb, yb, mask = _gather([clients[k] for k in order[:active]], step, x_all, y_all)
        padded = mask is not None
        p_now = {name: p[:active] for name, p in params.items()}
        b_now = {name: b[:active] for name, b in buffers.items()}

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

        with autocast(cfg.precision, xb.device.type), _masked_norms(model, padded and has_bn):
            losses = vmap(one, in_dims=(0, 0, 0, 0, 0 if padded else None))(
                p_now, b_now, xb, yb, mask
            )
        for p in params.values():
            p.grad = None
        losses.sum().backward()
        with torch.no_grad():
            _sgd_step(params, momentum, active, cfg, first_step=step == 0)
            loss_sums[:active] += losses.detach().float()

    loss_host = loss_sums.tolist()
    results: list[TrainResult | None] = [None] * len(clients)
    finals: list[dict[str, torch.Tensor] | None] = [None] * len(clients)
    for position, k in enumerate(order):
        steps = clients[k].steps
        mean = loss_host[position] / steps if steps else 0.0
        results[k] = TrainResult(steps=steps, samples=len(datas[k]) * epochs[k], mean_loss=mean)
        state = {name: p[position].detach() for name, p in params.items()}
        state.update({name: b[position] for name, b in buffers.items()})
        finals[k] = state
    return results, finals  # type: ignore[return-value]


def _gather(
    clients: Sequence[_Client],
    step: int,
    x: torch.Tensor,
    y: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(clients, batch, ...) inputs and labels of this step, gathered on the data's device;
    a (clients, batch) mask of real samples when the batches differ in size, else None."""
    rows = [c.batch_rows(step) for c in clients]
    sizes = [len(r) for r in rows]
    width = max(sizes)
    mask = None
    if min(sizes) != width:
        mask = torch.zeros(len(rows), width, device=x.device)
        for i, size in enumerate(sizes):
            mask[i, :size] = 1.0
        # Padding rows repeat the client's first sample: real values, masked out.
        rows = [torch.cat([r, r[:1].expand(width - len(r))]) for r in rows]
    index = torch.stack(rows)
    xb = x[index]
    if clients[0].augment:
        # Each client's augmentation from its own generator, after its permutation, as
        # alone; padding rows get the identity (offsets AUGMENT_PAD, no flip). One kernel
        # for the whole stack.
        draws = [c.batch_draws(step) for c in clients]
        if mask is not None:
            identity = torch.full((3, width), AUGMENT_PAD, dtype=torch.int64, device=x.device)
            identity[2].zero_()
            draws = [torch.cat([d, identity[:, d.shape[1] :]], 1) for d in draws]
        flat = xb.reshape(len(rows) * width, *xb.shape[2:])
        stacked = torch.cat(draws, dim=1)
        xb = crop_and_flip(flat, stacked).reshape(xb.shape)
    return xb, y[index], mask


def _sgd_step(
    params: dict[str, torch.Tensor],
    momentum: dict[str, torch.Tensor],
    active: int,
    cfg: LocalTrainConfig,
    first_step: bool,
) -> None:
    """``torch.optim.SGD`` (momentum, weight decay, no dampening or Nesterov) on the first
    ``active`` clients of the stack, after clipping each client's gradient by its own norm.
    One multi-tensor (foreach) kernel per operation over all the stacked tensors, as the
    optimiser itself does on CUDA."""
    names = [name for name, p in params.items() if p.grad is not None]
    if not names:
        return
    weights = [params[name][:active] for name in names]
    grads = [params[name].grad[:active] for name in names]  # type: ignore[index]
    if cfg.grad_clip > 0:
        # clip_grad_norm_: the norm of the per-tensor norms, coefficient clamped at 1.
        norms = torch.stack([torch.linalg.vector_norm(g.reshape(active, -1), dim=1) for g in grads])
        total = torch.linalg.vector_norm(norms, dim=0)
        coef = torch.clamp(cfg.grad_clip / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.reshape(-1, *([1] * (g.dim() - 1))))
    steps = (
        torch._foreach_add(grads, weights, alpha=cfg.weight_decay) if cfg.weight_decay else grads
    )
    if cfg.momentum != 0:
        buffers = [momentum[name][:active] for name in names]
        if first_step:
            torch._foreach_copy_(buffers, steps)
        else:
            torch._foreach_mul_(buffers, cfg.momentum)
            torch._foreach_add_(buffers, steps)
        steps = buffers
    torch._foreach_add_(weights, steps, alpha=-cfg.lr)
