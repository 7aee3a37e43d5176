"""What a model costs per sample: floating-point operations, parameter and activation bytes.

An estimate, for choosing how to run (``--workers auto``), not a profiler: one forward pass
of a single zero sample through a copy of the model counts the multiply-adds of its
convolutions and linear layers and the bytes of what its leaf modules output.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

# A training step costs about three forward passes: the forward, and a backward that
# computes gradients for both the inputs and the weights of each layer.
TRAIN_FLOPS_PER_FORWARD = 3


@dataclass(frozen=True)
class ForwardCost:
    flops: float  # of one sample's forward pass (a multiply-add counts 2)
    parameter_bytes: int
    activation_bytes: int  # outputs of the leaf modules for one sample


def forward_cost(
    model: nn.Module, input_shape: tuple[int, ...], channels_last: bool = False
) -> ForwardCost:
    """The forward cost of one sample of ``input_shape`` (without the batch dimension).
    Layers other than convolutions and linear layers count as free; every parameter counts
    at least one multiply-add, so a model of unknown layers is not taken for free."""
    probe = copy.deepcopy(model).cpu().eval()
    flops = 0.0
    activations = 0

    def count(module: nn.Module, inputs: tuple, output: object) -> None:
        nonlocal flops, activations
        if isinstance(output, torch.Tensor) and not any(True for _ in module.children()):
            activations += output.nbytes
        if isinstance(module, nn.modules.conv._ConvNd) and isinstance(output, torch.Tensor):
            per_output = module.in_channels // module.groups
            for k in module.kernel_size:
                per_output *= k
            flops += 2.0 * output.numel() * per_output
        elif isinstance(module, nn.Linear) and isinstance(output, torch.Tensor):
            flops += 2.0 * output.numel() * module.in_features

    hooks = [m.register_forward_hook(count) for m in probe.modules()]
    x = torch.zeros(1, *input_shape)
    if channels_last and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    try:
        with torch.no_grad():
            probe(x)
    finally:
        for hook in hooks:
            hook.remove()
    parameters = sum(p.numel() for p in probe.parameters())
    return ForwardCost(
        flops=max(flops, 2.0 * parameters),
        parameter_bytes=sum(p.nbytes for p in probe.parameters()),
        activation_bytes=activations,
    )
