"""How many clients fit on a GPU when trained together (``fedskew.engines.together``).

Stacking K clients holds K copies of everything one client needs: model-sized tensors (the
message's weights on the device, the starting state, the stacked parameters, their gradients,
momentum, and the weight-decay temporary of the SGD step) and the activations saved for the
backward pass. ResNet-18 at CIFAR size takes about 0.8 GiB per client, so 100 clients do not
fit an 80 GB card: the clients of an exchange are trained in chunks that the free memory holds.

The estimate, made before the first stacked step: one training forward pass of one client's
batch, counting the bytes of the tensors it saves for backward, times ACTIVATION_FACTOR, plus
MODEL_COPIES times the model's bytes; the chunk is what SAFETY of the free memory holds. An
algorithm's own per-client tensors (MOON's two frozen models, FedDyn's two tensors per
parameter, FedACD's mixup draws) are known only once each client's ``plain_<kind>`` has made
them: the stacks then add ``plan_stack_bytes`` per client, and a chunk's stack that would not
fit with them is trained in pieces that do. An estimate can be wrong (another process takes
memory, the allocator fragments), so the runtime also halves a chunk that runs out of memory
and goes on.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from fedskew.training.local import PlainTraining

# Model-sized tensors per client while it trains stacked: the message's weights moved to the
# device, the starting state dict, the stacked parameters, their gradients, the momentum
# buffers, and the weight-decay temporary of the foreach SGD step (engines/together.py).
MODEL_COPIES = 6
# Saved activations per client under vmap against one client alone: measured on the CPU
# with saved-tensor hooks (saved_activation_bytes, and the same under vmap), ResNet-18 on
# 32x32 inputs, batch 32, widths 16 and 64 (full), K = 2 and 4: 1.52 each time (the second
# GPU review measured 1.45 at batch 64). tests/test_together.py measures it again.
VMAP_ACTIVATIONS = 1.55
# The backward's transient activation gradients on top of what is saved (the review's
# estimate: 10 to 20 %).
BACKWARD_TRANSIENT = 1.2
ACTIVATION_FACTOR = VMAP_ACTIVATIONS * BACKWARD_TRANSIENT
# Of the free memory, the share the chunk may take (the rest: the allocator's rounding and
# fragmentation, cuDNN workspaces, the evaluation).
SAFETY = 0.85


# What the stacked loop holds per client beyond the plan's own tensors (engines/together.py):
# a stacked copy of its tensors, step tensors and gradient shift; of the carried state the
# stack and each step's replacement; of tensors trained beside the model the stack, its
# gradient and its momentum.
STACK_COPIES = {"tensors": 1, "step_tensors": 1, "grad_shift": 1, "carried": 2, "trained": 3}


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of ``tensors``' elements."""
    return sum(t.numel() * t.element_size() for t in tensors)


def plan_stack_bytes(plan: PlainTraining) -> int:
    """The bytes stacking adds for one client's ``plan`` (its per-client tensors,
    STACK_COPIES times each kind): 0 for plain cross-entropy."""
    return sum(n * tensor_bytes(getattr(plan, kind).values()) for kind, n in STACK_COPIES.items())


def model_bytes(model: nn.Module) -> int:
    """The bytes of the model's parameters and buffers."""
    return tensor_bytes([*model.parameters(), *model.buffers()])


@contextmanager
def _buffers_kept(model: nn.Module) -> Iterator[None]:
    """The model's buffers (BatchNorm's running statistics) as they were, after the block."""
    kept = [b.detach().clone() for b in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in zip(model.buffers(), kept, strict=True):
                buffer.copy_(value)


def saved_activation_bytes(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """The bytes autograd saves for backward in one training forward pass and cross-entropy
    on the batch ``(x, y)``, each storage counted once (the model's weights, which backward
    also saves, are not activations and are left out)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    was_training = model.training
    model.train()
    with _buffers_kept(model), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(model(x), y)
    del loss
    model.train(was_training)
    return sum(seen.values())


def client_bytes(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """The estimated GPU memory one more client takes when trained stacked, from one batch
    of its data (see the module docstring)."""
    activations = saved_activation_bytes(model, x, y)
    return int(MODEL_COPIES * model_bytes(model) + ACTIVATION_FACTOR * activations)


def free_bytes(device: torch.device) -> int | None:
    """The memory this process may still take on ``device``: the driver's free memory plus
    what PyTorch's allocator holds unused; None on the CPU (no limit is estimated there)."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + cached)


def clients_that_fit(free: int, per_client: int) -> int:
    """How many clients SAFETY of ``free`` bytes holds, at least 1."""
    return max(1, int(SAFETY * free) // max(1, per_client))
