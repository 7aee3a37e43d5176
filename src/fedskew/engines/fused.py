"""A round's clients as one fused model with native BatchNorm (``--clients-together fused``).

The vmap path (``engines/together.py``) maps one client's forward over the stacked weights:
torch turns each convolution into a grouped one, but BatchNorm inside ``vmap`` has to be
computed from its formula (about 40 operators per layer and step against the 2 of torch's
own kernels; ``../shared/docs/gpu-review-3.md`` section 3), so a stacked ResNet-18 step
issues about five times the operators of one client's step. Here the same stacked weights
are run as one wide network, laid out channel-wise (the horizontal fusion of HFTA): client
``k`` owns channels ``[k*C, (k+1)*C)`` of every activation, so

* a Conv2d is one convolution with ``K * groups`` groups over ``(N, K*C, H, W)``;
* a BatchNorm is torch's own batch norm over ``K*C`` channels (each channel's statistics are
  one client's, and its running buffers are the client's rows of the stacked buffers);
* a GroupNorm of ``g`` groups is one GroupNorm of ``K*g`` groups (a group never spans two
  clients' channels);
* a Linear is one batched matrix product (``baddbmm``) over the clients;
* ReLU, pooling, flatten and residual adds keep the layout as they are.

Nothing is copied into a fused parameter: each fused weight is a reshape (a view) of the
stacked ``(K, ...)`` tensor the SGD step of ``together.py`` updates, so each client's
gradient is its own, as with K separate models. The per-client cross-entropies are summed
before the backward, so gradients do not mix.

Ragged steps as in ``together.py``: active clients are a prefix of the stack (views of the
first rows); where batches differ in size (a client's short last batch) the clients run in
one fused forward per batch size (rows picked with ``index_select``, BatchNorm's buffers
written back), never padded, since padding would enter BatchNorm's statistics.

What is fused: the models built from the layers above (every model of fedskew's zoo:
mlp, simple-cnn with any norm, fedavg-cnn, cnn-cifar, resnet18 with BatchNorm or GroupNorm)
with every algorithm that trains together. Cross-entropy (FedAvg, CReFF, FedNova,
SCAFFOLD's gradient shift) runs the whole model through ``fused_logits``. An algorithm's
own loss is one client's function of the model, which can call the model on other inputs or
with other weights (MOON's frozen models, FedACD's mixup): it runs under vmap, and each call
of a body (or of a body's layer) runs ``fused_body`` outside vmap (``together.py``'s
``_fused_bodies``). A model with a layer this module does not know trains by vmap;
``fused_obstacle`` says why, and the runtime logs it once. A BatchNorm in eval mode (a
frozen model's) normalises by its running statistics.

A layer of another kind fuses itself by defining ``fused_forward(tensors, x, clients)``:
``tensors`` its parameters and buffers by local name, stacked ``(K, ...)``; ``x`` and the
result in the fused layout (FedNH's prototype head does).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from fedskew.models.base import BodyHeadModel
from fedskew.models.resnet import BasicBlock, GlobalAvgPool

Tensors = Mapping[str, torch.Tensor]


class _Fused:
    """One fused forward: the stacked weights of ``clients`` clients (first dimension) and
    the batch counters to add one to once it has run."""

    def __init__(self, params: Tensors, buffers: Tensors, clients: int) -> None:
        self.params = params
        self.buffers = buffers
        self.k = clients
        self.counters: list[torch.Tensor] = []

    def weight(self, name: str) -> torch.Tensor | None:
        """The fused view of a stacked parameter: the clients' rows one after another along
        the first (output) dimension; None where the layer has none."""
        t = self.params.get(name)
        if t is None:
            return None
        return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])

    def buffer(self, name: str) -> torch.Tensor | None:
        t = self.buffers.get(name)
        return None if t is None else t.reshape(-1)

    def run(self, module: nn.Module, prefix: str, x: torch.Tensor) -> torch.Tensor:
        own = getattr(module, "fused_forward", None)
        if own is not None:  # a layer that fuses itself (FedNH's prototype head)
            names = [n for n, _ in module.named_parameters()] + [
                n for n, _ in module.named_buffers()
            ]
            tensors = {n: {**self.params, **self.buffers}[prefix + n] for n in names}
            return own(tensors, x, self.k)
        return _LAYERS[type(module)](self, module, prefix, x)


def _sequential(f: _Fused, module: nn.Module, prefix: str, x: torch.Tensor) -> torch.Tensor:
    for name, child in module.named_children():
        x = f.run(child, f"{prefix}{name}.", x)
    return x


def _body_head(f: _Fused, module: nn.Module, prefix: str, x: torch.Tensor) -> torch.Tensor:
    assert isinstance(module, BodyHeadModel)
    return f.run(module.head, prefix + "head.", f.run(module.body, prefix + "body.", x))


def _conv(f: _Fused, module: nn.Module, prefix: str, x: torch.Tensor) -> torch.Tensor:
    assert isinstance(module, nn.Conv2d)
    weight = f.weight(prefix + "weight")
    assert weight is not None
    return F.conv2d(
        x,
        weight,
        f.weight(prefix + "bias"),
        module.stride,
        module.padding,  # type: ignore[arg-type]
        module.dilation,
        module.groups * f.k,
    )


def _linear(f: _Fused, module: nn.Module, prefix: str, x: torch.Tensor) -> torch.Tensor:
    """(N, K*in) -> (N, K*out): client k's features through its own weights, one product."""
    weight = f.params[prefix + "weight"]  # (K, out, in)
    n = x.shape[0]
    per_client = x.reshape(n, f.k, -1).transpose(0, 1)  # (K, N, in), a view
    bias = f.params.get(prefix + "bias")
    if bias is None:
        out = torch.bmm(per_client, weight.transpose(1, 2))
    else:
        out = torch.baddbmm(bias.unsqueeze(1), per_client, weight.transpose(1, 2))
    return out.transpose(0, 1).reshape(n, -1)


def _batch_norm(f: _Fused, module: nn.Module, prefix: str, x: torch.Tensor) -> torch.Tensor:
    """torch's own batch norm over every client's channels: the statistics of a channel
    are one client's, its running buffers that client's rows of the stack (views: updated
    in place, as the module updates its own)."""
    assert isinstance(module, nn.modules.batchnorm._BatchNorm)
    # A frozen model in eval mode (MOON's, FedNTD's teacher) normalises by its running
    # statistics, as the module would.
    training = module.training
    counter = f.buffers.get(prefix + "num_batches_tracked")
    if counter is not None and training:
        f.counters.append(counter)
    return F.batch_norm(
        x,
        f.buffer(prefix + "running_mean"),
        f.buffer(prefix + "running_var"),
        f.weight(prefix + "weight"),
        f.weight(prefix + "bias"),
        training,
        float(module.momentum),  # type: ignore[arg-type]  # None is fused_obstacle's
        module.eps,
    )


def _group_norm(f: _Fused, module: nn.Module, prefix: str, x: torch.Tensor) -> torch.Tensor:
    assert isinstance(module, nn.GroupNorm)
    return F.group_norm(
        x, module.num_groups * f.k, f.weight(prefix + "weight"), f.weight(prefix + "bias"),
        module.eps,
    )  # fmt: skip


def _relu(f: _Fused, module: nn.Module, prefix: str, x: torch.Tensor) -> torch.Tensor:
    return F.relu(x)


def _max_pool(f: _Fused, module: nn.Module, prefix: str, x: torch.Tensor) -> torch.Tensor:
    assert isinstance(module, nn.MaxPool2d)
    return F.max_pool2d(
        x, module.kernel_size, module.stride, module.padding, module.dilation,
        ceil_mode=module.ceil_mode,
    )  # fmt: skip


def _avg_pool(f: _Fused, module: nn.Module, prefix: str, x: torch.Tensor) -> torch.Tensor:
    assert isinstance(module, nn.AvgPool2d)
    return F.avg_pool2d(
        x, module.kernel_size, module.stride, module.padding,  # type: ignore[arg-type]
        module.ceil_mode, module.count_include_pad, module.divisor_override,
    )  # fmt: skip


def _global_mean(f: _Fused, module: nn.Module, prefix: str, x: torch.Tensor) -> torch.Tensor:
    return x.mean(dim=(2, 3), keepdim=True)


def _flatten(f: _Fused, module: nn.Module, prefix: str, x: torch.Tensor) -> torch.Tensor:
    # Client k's (C, H, W) block is contiguous in (K*C, H, W): flattening keeps it whole.
    return x.flatten(1)


def _identity(f: _Fused, module: nn.Module, prefix: str, x: torch.Tensor) -> torch.Tensor:
    return x


def _basic_block(f: _Fused, module: nn.Module, prefix: str, x: torch.Tensor) -> torch.Tensor:
    """ResNet's BasicBlock.forward, layer by layer in the fused layout."""
    assert isinstance(module, BasicBlock)
    out = f.run(module.conv1, prefix + "conv1.", x)
    out = F.relu(f.run(module.norm1, prefix + "norm1.", out))
    out = f.run(module.norm2, prefix + "norm2.", f.run(module.conv2, prefix + "conv2.", out))
    return F.relu(out + f.run(module.shortcut, prefix + "shortcut.", x))


Layer = Callable[[_Fused, nn.Module, str, torch.Tensor], torch.Tensor]
# Exact types: a subclass may override forward, which the fused layer would not follow.
_LAYERS: dict[type, Layer] = {
    BodyHeadModel: _body_head,
    nn.Sequential: _sequential,
    nn.Conv2d: _conv,
    nn.Linear: _linear,
    nn.BatchNorm1d: _batch_norm,
    nn.BatchNorm2d: _batch_norm,
    nn.GroupNorm: _group_norm,
    nn.ReLU: _relu,
    nn.MaxPool2d: _max_pool,
    nn.AvgPool2d: _avg_pool,
    GlobalAvgPool: _global_mean,
    nn.Flatten: _flatten,
    nn.Identity: _identity,
    BasicBlock: _basic_block,
}


def fused_obstacle(model: nn.Module) -> str:
    """Why ``model`` cannot run fused ("" when it can): a layer this module does not fuse,
    or one whose settings it does not follow."""
    fuses_itself = [
        name for name, module in model.named_modules() if hasattr(module, "fused_forward")
    ]
    for name, module in model.named_modules():
        where = name or "the model"
        if any(name == own or name.startswith(own + ".") for own in fuses_itself):
            continue
        if type(module) not in _LAYERS:
            return f"{where} is a {type(module).__name__}, a layer the fused model does not have"
        if isinstance(module, nn.Conv2d) and module.padding_mode != "zeros":
            return f"{where} pads with {module.padding_mode!r}, the fused model with zeros"
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and (
            not module.track_running_stats or module.momentum is None
        ):
            return f"{where} keeps no running statistics with a momentum"
        if isinstance(module, nn.Flatten) and (module.start_dim, module.end_dim) != (1, -1):
            return f"{where} flattens dimensions {module.start_dim}..{module.end_dim}, not 1.."
    return ""


def fused_logits(
    model: nn.Module, params: Tensors, buffers: Tensors, x: torch.Tensor
) -> torch.Tensor:
    """The logits (K, N, classes) of K clients, client k's batch ``x[k]`` (shape (K, N, ...))
    through its stacked weights ``params[name][k]``, in one fused forward of ``model``'s
    architecture (its own weights are not used). BatchNorm's running buffers among
    ``buffers`` are updated in place, their batch counters advanced by one."""
    return fused_body(model, params, buffers, x).flatten(2)


def fused_body(
    module: nn.Module, params: Tensors, buffers: Tensors, x: torch.Tensor
) -> torch.Tensor:
    """``module`` (a model's body, or any module ``fused_obstacle`` accepts) of K clients in
    one fused forward: client k's batch ``x[k]`` through its stacked weights
    ``params[name][k]`` (names local to ``module``); the output is (K, N, ...). BatchNorm's
    running buffers among ``buffers`` are updated in place, their counters advanced."""
    k, n = x.shape[0], x.shape[1]
    # (N, K*C, ...): client k's sample i in channels [k*C, (k+1)*C) of row i.
    wide = x.transpose(0, 1).reshape(n, k * x.shape[2], *x.shape[3:])
    fused = _Fused(params, buffers, k)
    out = fused.run(module, "", wide)
    if fused.counters:  # one kernel for every layer's counter, as each module adds its own
        with torch.no_grad():
            torch._foreach_add_(fused.counters, 1)
    return out.reshape(n, k, out.shape[1] // k, *out.shape[2:]).transpose(0, 1)


def fused_cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each client's mean cross-entropy (K,), from logits (K, N, classes), labels (K, N)."""
    per_sample = F.cross_entropy(logits.permute(1, 2, 0), y.transpose(0, 1), reduction="none")
    return per_sample.mean(0)
