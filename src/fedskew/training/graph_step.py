"""The local step as one graph-safe function, and its replay as a CUDA graph.

A CUDA graph replays a recorded sequence of kernels with one host call: what the host spends
per operator (30-90 microseconds on the GPU machines of the checks, about 200 operators per
ResNet-18 step) is paid once at capture. Replay runs the same kernels on the same memory, so
a step can be captured only if it is *graph-safe*:

* everything it reads lives in tensors whose memory does not change from step to step (the
  model's parameters and buffers, the optimiser's momentum, the loss sum, and static buffers
  the host fills before each step: the batch's row positions, its augmentation draws, a step
  tensor's row);
* everything it changes is changed in place (parameters, momentum, BatchNorm's running
  statistics, the loss sum, carried state): a Python name bound to a new tensor is not seen
  by a replay;
* nothing reads a value back to the host and no Python branch depends on a tensor's value;
* it issues the same operators on the same shapes every time (one graph per batch size and
  precision; the short last batch of an epoch runs eagerly).

:class:`LocalStep` is that step for one client (its data, the algorithm's loss, per-client
tensors, gradient shift, tensors trained beside the model, step tensors and carried state,
as ``PlainTraining`` gives them): forward and loss (under the precision's autocast), the
gradients by ``torch.autograd.grad``, clipping, the shift, and SGD with momentum and weight
decay as ``torch.optim.SGD`` computes it, written with foreach operators over the parameter
list. On the CPU it runs eagerly and is what ``run_plain`` trains with; it gives
``local_train``'s numbers bit for bit (tests/test_graph_step.py, fp32 and float64, every
algorithm). On CUDA, where the step is graph-safe (:func:`graph_obstacle`), full-size steps
are replayed by ``graph_replay.GraphReplay`` (two eager warm-up steps on a side stream, in
which cuDNN chooses its algorithms, then a capture, then replays).

A round's clients trained together (stacked or fused, ``engines/together.py``) keep the same
contract in their chunk step, with the same driver.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fedskew.core.precision import autocast
from fedskew.data.federated import ClientData
from fedskew.training.graph_replay import GraphReplay, say_once
from fedskew.training.interface import ClientContext, LocalTrainConfig
from fedskew.training.local import (
    ClientLoss,
    EpochUpdate,
    LossOutput,
    LossTerm,
    PlainTraining,
    StepUpdate,
    TrainResult,
    batch_bounds,
    combined_loss,
    crop_and_flip,
    cross_entropy_loss,
    draw_augmentation,
)

GRAPH_MODES = ("auto", "on", "off")


def graph_obstacle(model: nn.Module) -> str:
    """Why a CUDA graph cannot replay this model's training step ("" when it can)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            # Replays draw from the generator's offset as captured; not checked bit for bit.
            return f"the model has dropout ({name}): its random masks are not replayed as drawn"
        if (
            isinstance(module, nn.modules.batchnorm._BatchNorm)
            and module.track_running_stats
            and module.momentum is None
        ):
            # nn.BatchNorm reads its batch counter back to the host each step.
            return f"the model's BatchNorm {name} averages its statistics cumulatively"
    return ""


def resolve_graphs(mode: str, device: torch.device, model: nn.Module) -> tuple[bool, str]:
    """Whether the local step is replayed as a CUDA graph, and why not when it is not.
    ``auto`` and ``on`` capture on CUDA where the step is graph-safe; the CPU always runs
    the same step eagerly."""
    if mode not in GRAPH_MODES:
        raise ValueError(f"cuda-graphs must be one of {', '.join(GRAPH_MODES)}, got {mode!r}")
    if mode == "off":
        return False, "cuda-graphs off"
    if device.type != "cuda":
        return False, f"no CUDA graphs on {device.type}: the graph-safe step runs eagerly"
    reason = graph_obstacle(model)
    if reason:
        return False, reason
    return True, ""


class LocalStep:
    """One client's local training from static buffers (the module's docstring says why).

    ``loss`` (None: cross-entropy) gets ``(model, x, y, tensors)`` with ``tensors`` the
    per-client ones, the tensors trained beside the model, the carried state and the current
    row of each step tensor, in that order (``run_plain``'s). ``graphs``: replay full-size
    steps as a CUDA graph (callers decide with :func:`resolve_graphs`)."""

    def __init__(
        self,
        model: nn.Module,
        data: ClientData,
        cfg: LocalTrainConfig,
        *,
        loss: ClientLoss | None = None,
        tensors: Mapping[str, torch.Tensor] | None = None,
        grad_shift: Mapping[str, torch.Tensor] | None = None,
        trained: Mapping[str, torch.Tensor] | None = None,
        step_tensors: Mapping[str, torch.Tensor] | None = None,
        carried: Mapping[str, torch.Tensor] | None = None,
        after_step: StepUpdate | None = None,
        after_epoch: EpochUpdate | None = None,
        extra_terms: Sequence[LossTerm] = (),
        graphs: bool = False,
    ) -> None:
        self.model = model
        self.data = data
        self.cfg = cfg
        self.loss = loss
        self.tensors = dict(tensors or {})
        self.trained = dict(trained or {})
        self.step_tensors = dict(step_tensors or {})
        self.after_step = after_step
        self.after_epoch = after_epoch
        self.extra_terms = tuple(extra_terms)
        if loss is None and (self.step_tensors or carried):
            raise ValueError("step tensors and carried state need the loss that uses them")
        if after_step is not None and loss is None:
            raise ValueError("after_step needs the loss whose aux it reads")
        shift = dict(grad_shift or {})
        self.shifts_given = list(shift.values())
        # The optimiser's parameters, as run_plain's SGD has them: the model's, then the
        # tensors trained beside it. Only the model's are clipped (clip_grad_norm_ over
        # model.parameters()). Frozen ones get no gradient and SGD leaves them alone.
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params: list[torch.Tensor] = [p for _, p in named] + list(self.trained.values())
        self.clipped = len(named)
        self.shifts: list[torch.Tensor | None] = [shift.get(n) for n, _ in named]
        self.shifts += [None] * len(self.trained)
        # Static state: momentum (SGD's buffers, allocated once), whether each has started
        # (SGD's first step copies the step into it), the loss sum, and per batch size the
        # batch's positions and augmentation draws, filled before each step.
        self.momentum = [torch.zeros_like(p) for p in self.params] if cfg.momentum else []
        self.started = [False] * len(self.params)
        self.loss_sum = torch.zeros((), device=data.device)
        self.rows: dict[int, torch.Tensor] = {}
        self.draws: dict[int, torch.Tensor] = {}
        self.step_rows = {name: t[0].clone() for name, t in self.step_tensors.items()}
        self.carried = {name: t.detach().clone() for name, t in (carried or {}).items()}
        self._pending: dict[str, torch.Tensor] = {}
        self.augment = cfg.augment and data.x.dim() == 4
        self.graphs = graphs
        # Full-size steps as CUDA graphs, one per batch size (graph_replay.py).
        self.replay = GraphReplay(data.device, self.body, "the local step", self._drop_pending)

    # ------------------------------------------------------------------ the step itself

    def body(self, size: int) -> None:
        """One step on the batch in the static buffers of ``size``: graph-safe (reads static
        tensors, writes in place, no host reads, the same operators every time)."""
        loss = self.loss_of(size)
        grads = torch.autograd.grad(loss, self.params, allow_unused=True)
        self.sgd(list(grads))
        self.loss_sum.add_(loss.detach())
        if self._pending:
            self._carry(self._pending)
            self._pending = {}

    def loss_of(self, size: int) -> torch.Tensor:
        """The step's loss from the static buffers (gather, augmentation, forward under the
        precision's autocast, plug-in terms; the carried state's update kept for after the
        optimiser step). The seam another layout overrides (a fused chunk of clients: its
        stacked parameters in ``params``, the sum of its clients' losses here), keeping
        :meth:`body`, :meth:`sgd` and the capture driver."""
        xb, yb = self.data.batch(self.rows[size])
        if self.augment:
            xb = crop_and_flip(xb, self.draws[size])
        with autocast(self.cfg.precision, xb.device.type):
            if self.loss is None:
                out: LossOutput | torch.Tensor = cross_entropy_loss(self.model, xb, yb)
            else:
                fixed = {**self.tensors, **self.trained, **self.carried, **self.step_rows}
                out = self.loss(self.model, xb, yb, fixed)
            if self.after_step is not None:
                if not isinstance(out, LossOutput):
                    raise TypeError("after_step needs a loss that returns a LossOutput (its aux)")
                aux = {name: t.detach() for name, t in out.aux.items()}
                self._pending = self.after_step(self.carried, aux)
            return combined_loss(out, self.extra_terms, yb)

    @torch.no_grad()
    def sgd(self, grads: list[torch.Tensor | None]) -> None:
        """Clipping, the gradient shift and ``torch.optim.SGD``'s update (momentum, weight
        decay, no dampening or Nesterov), in place on the parameters and momentum.

        Gradients from ``autograd.grad`` may share memory (one tensor handed to two inputs),
        so they are only read: every change makes a new (temporary) list, as SGD's
        ``grad.add(param, alpha=wd)`` does."""
        cfg = self.cfg
        have = [i for i, g in enumerate(grads) if g is not None]
        if not have:
            return
        g: list[torch.Tensor] = [grads[i] for i in have]  # type: ignore[misc]
        if cfg.grad_clip > 0:
            own = [j for j, i in enumerate(have) if i < self.clipped]
            if own:
                # clip_grad_norm_'s arithmetic: the total 2-norm, the coefficient clamped at 1.
                total = torch.nn.utils.get_total_norm([g[j] for j in own], 2.0)
                coef = torch.clamp(cfg.grad_clip / (total + 1e-6), max=1.0)
                scaled = torch._foreach_mul([g[j] for j in own], coef)
                for j, t in zip(own, scaled, strict=True):
                    g[j] = t
        foreach_sgd(
            [self.params[i] for i in have],
            g,
            [self.shifts[i] for i in have],
            [self.momentum[i] for i in have] if cfg.momentum else [],
            [not self.started[i] for i in have],
            cfg,
        )
        for i in have:
            self.started[i] = True

    def _carry(self, new: Mapping[str, torch.Tensor]) -> None:
        """New carried values into the static carried tensors, in place. A new value may be
        one of the old ones (an epoch update's ``"last": carried["seen"]`` beside a new
        ``"seen"``): such values are copied aside first, so that every static tensor gets
        the value the update meant, whatever order the copies run in."""
        homes = {t.untyped_storage().data_ptr() for t in self.carried.values()}
        with torch.no_grad():
            staged = {}
            for name, t in new.items():
                static = self.carried[name]
                if t.shape != static.shape or t.dtype != static.dtype:
                    raise ValueError(
                        f"carried tensor '{name}' changed from {tuple(static.shape)} "
                        f"{static.dtype} to {tuple(t.shape)} {t.dtype}: its update must keep both"
                    )
                if t is static:
                    continue  # unchanged
                staged[name] = t.clone() if t.untyped_storage().data_ptr() in homes else t
            for name, t in staged.items():
                self.carried[name].copy_(t)

    # ------------------------------------------------------------------ the loop

    def load(self, rows: torch.Tensor, draws: torch.Tensor | None, step: int) -> int:
        """Fill the static buffers of this batch's size (positions, augmentation, the step
        tensors' row ``step``) and return the size: what the host does between replays."""
        size = int(rows.shape[0])
        if size not in self.rows:
            self.rows[size] = torch.empty(size, dtype=torch.int64, device=self.data.device)
            if self.augment:
                self.draws[size] = torch.empty(3, size, dtype=torch.int64, device=self.data.device)
        self.rows[size].copy_(rows)
        if draws is not None:
            self.draws[size].copy_(draws)
        for name, t in self.step_tensors.items():
            self.step_rows[name].copy_(t[step])
        return size

    def train(self, gen: torch.Generator, epochs: int | None = None) -> TrainResult:
        """``local_train``'s loop over this step: a permutation (and augmentation) per epoch
        from ``gen``, moved to the device once per epoch; the short last batch eager."""
        cfg, data = self.cfg, self.data
        self.model.train()
        n = len(data)
        n_epochs = cfg.epochs if epochs is None else epochs
        bounds = batch_bounds(n, cfg.batch_size)
        full = bounds[0][1] - bounds[0][0] if bounds else 0
        self.loss_sum.zero_()
        steps = 0
        draws: torch.Tensor | None = None
        for _ in range(n_epochs):
            perm = torch.randperm(n, generator=gen, device=gen.device)
            if self.augment:
                drawn = draw_augmentation(gen, [stop - start for start, stop in bounds])
                epoch = torch.cat([perm[None], drawn]).to(data.device, non_blocking=True)
                perm, draws = epoch[0], epoch[1:]
            else:
                perm = perm.to(data.device, non_blocking=True)
            for start, stop in bounds:
                size = self.load(
                    perm[start:stop], None if draws is None else draws[:, start:stop], steps
                )
                self.run(size, full)
                steps += 1
            if self.after_epoch is not None:
                # run_plain's loss calls after_epoch under the step's autocast: the same here.
                with autocast(cfg.precision, data.device.type):
                    self._carry(self.after_epoch(self.carried))
        mean_loss = float(self.loss_sum) / steps if steps else 0.0
        return TrainResult(steps=steps, samples=n * n_epochs, mean_loss=mean_loss)

    def run(self, size: int, full: int) -> None:
        """The step on the loaded batch: a replay where a graph of its size exists, else
        eager (warm-up and capture first where graphs are on)."""
        if not self.graphs or size != full:
            self.body(size)
            return
        self.replay.run(size)

    @property
    def _graph(self) -> dict[Any, Any]:
        """The captured graphs, by batch size."""
        return self.replay.graphs

    @property
    def graph_reason(self) -> str:
        """Why capture was given up, when it was."""
        return self.replay.reason

    def _drop_pending(self) -> None:
        self._pending = {}


@torch.no_grad()
def foreach_sgd(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    shifts: Sequence[torch.Tensor | None],
    momentum: list[torch.Tensor],
    fresh: Sequence[bool],
    cfg: LocalTrainConfig,
) -> None:
    """``torch.optim.SGD``'s update (momentum, weight decay, no dampening or Nesterov) of
    already clipped ``grads``, each plus its gradient shift (None: none), in foreach
    operators, in place on ``params`` and ``momentum`` (one buffer per parameter where
    ``cfg.momentum``). A ``fresh`` buffer starts as SGD starts it, a copy of the step.
    The gradients are only read (``autograd.grad`` may hand one tensor to two inputs): each
    change makes a new list, as SGD's ``grad.add(param, alpha=wd)`` does. The one-client
    step and the stacked clients' step (``engines/together.py``) both update with it."""
    g = list(grads)
    shifted = [j for j, shift in enumerate(shifts) if shift is not None]
    if shifted:
        deltas: list[torch.Tensor] = [shifts[j] for j in shifted]  # type: ignore[misc]
        moved = torch._foreach_add([g[j] for j in shifted], deltas)
        for j, t in zip(shifted, moved, strict=True):
            g[j] = t
    if cfg.weight_decay != 0:
        g = list(torch._foreach_add(g, params, alpha=cfg.weight_decay))
    step = g
    if cfg.momentum != 0:
        new = [j for j, f in enumerate(fresh) if f]
        going = [j for j, f in enumerate(fresh) if not f]
        if new:
            torch._foreach_copy_([momentum[j] for j in new], [g[j] for j in new])
        if going:
            torch._foreach_mul_([momentum[j] for j in going], cfg.momentum)
            torch._foreach_add_([momentum[j] for j in going], [g[j] for j in going])
        step = momentum
    torch._foreach_add_(params, step, alpha=-cfg.lr)


def train_plain(plan: PlainTraining, ctx: ClientContext) -> TrainResult:
    """``run_plain``'s training of one client with :class:`LocalStep` (graphs as
    ``ctx.train.cuda_graphs`` and the device allow), the plan's carried tensors holding
    their final values after it, as ``run_plain`` leaves them."""
    graphs, reason = resolve_graphs(ctx.train.cuda_graphs, ctx.data.device, ctx.model)
    if reason and ctx.data.device.type == "cuda":
        say_once(reason, "local steps run eagerly, not as CUDA graphs: %s", logging.INFO)
    step = LocalStep(
        ctx.model,
        ctx.data,
        ctx.train,
        loss=plan.loss,
        tensors=plan.tensors,
        grad_shift=plan.grad_shift,
        trained=plan.trained,
        step_tensors=plan.step_tensors,
        carried=plan.carried,
        after_step=plan.after_step,
        after_epoch=plan.after_epoch,
        extra_terms=ctx.loss_terms,
        graphs=graphs,
    )
    result = step.train(ctx.rng(plan.purpose), plan.epochs)
    with torch.no_grad():
        for name, t in plan.carried.items():
            t.copy_(step.carried[name])
    return result
