"""Model registry: every model is a ``BodyHeadModel`` built from an input shape."""

from __future__ import annotations

import inspect
import operator
from typing import Any

from fedskew.core.errors import UsageError
from fedskew.core.references import entry_points, import_reference, is_reference, load_entry_point
from fedskew.models.base import BodyHeadModel, ModelInfo
from fedskew.models.cnn import build_cnn_cifar, build_fedavg_cnn, build_mlp, build_simple_cnn
from fedskew.models.resnet import build_resnet18

__all__ = [
    "MODELS",
    "BodyHeadModel",
    "ModelInfo",
    "build_model",
    "find_model",
    "register_model",
    "split_names",
]

MODELS: dict[str, ModelInfo] = {
    info.name: info
    for info in (
        ModelInfo(
            "mlp",
            "MLP on flattened input, 2 hidden ReLU layers (200-d features); options: hidden=200",
            build_mlp,
        ),
        ModelInfo(
            "simple-cnn",
            "MOON/FedCME simple CNN: 2 conv5 + 2 FC (84-d features); images >= 16x16; "
            "options: norm=none|bn|gn",
            build_simple_cnn,
        ),
        ModelInfo(
            "fedavg-cnn",
            "McMahan FedAvg CNN: conv 32, conv 64 (5x5, no padding), FC 512 (512-d features); "
            "images >= 16x16",
            build_fedavg_cnn,
        ),
        ModelInfo(
            "cnn-cifar",
            "McMahan CIFAR CNN (FedNH/FedACD Conv2Cifar, 192-d features, bias-free head); "
            "images >= 16x16",
            build_cnn_cifar,
        ),
        ModelInfo(
            "resnet18",
            "ResNet-18 (8 x width features, 512 by default); options: stem=cifar|imagenet, "
            "norm=bn|gn, head_bias=true|false, width=64",
            build_resnet18,
        ),
    )
}


_REGISTERED: dict[str, ModelInfo] = {}


def find_model(name: str) -> ModelInfo:
    """A built-in model, a ``module:builder`` reference, an installed entry point (group
    ``fedskew.models``) or one registered in this process. A user model is a
    ``builder(input_shape, num_classes, **options) -> BodyHeadModel`` (options are its
    keyword-only parameters) or a :class:`ModelInfo`."""
    info = MODELS.get(name) or _REGISTERED.get(name)
    if info is not None:
        return info
    found = import_reference(name, "model") if is_reference(name) else None
    if found is None:
        found = load_entry_point("model", name)
    if found is None:
        choices = sorted([*MODELS, *entry_points("model")])
        raise UsageError(
            f"unknown model '{name}' (choices: {', '.join(choices)}; "
            "or give package.module:builder)"
        )
    return as_model_info(found, name)


def register_model(name: str, builder: Any) -> None:
    """Make a model builder (or ModelInfo) known as ``name`` in this process."""
    _REGISTERED[name] = as_model_info(builder, name)


def as_model_info(obj: Any, name: str) -> ModelInfo:
    if isinstance(obj, ModelInfo):
        return obj
    if not callable(obj):
        raise UsageError(f"model '{name}' is {obj!r}, not a model builder")
    doc = (getattr(obj, "__doc__", None) or "user model").strip().splitlines()[0]
    return ModelInfo(name, doc, obj)


def _option_names(builder: Any) -> list[str]:
    # Options are the builder's keyword-only parameters; the signature is the single source
    # of truth, so adding an option to a builder needs no registry change.
    return [
        p.name
        for p in inspect.signature(builder).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]


def build_model(
    name: str, input_shape: tuple[int, ...], num_classes: int, **options: Any
) -> BodyHeadModel:
    """Build model ``name`` for inputs of ``input_shape`` (without the batch dimension).

    Raises UsageError for an unknown name, an unknown or invalid option, or an input shape
    the model cannot take. Initialisation uses PyTorch defaults and the global torch RNG,
    so callers control determinism with ``torch.manual_seed``.
    """
    info = find_model(name)
    # Shapes often come from numpy arrays or torch.Size: accept any integer-like value.
    try:
        shape = tuple(operator.index(d) for d in input_shape)
        classes = operator.index(num_classes)
    except TypeError:
        raise UsageError(
            f"model '{name}': invalid input shape {input_shape!r} or num_classes {num_classes!r}"
        ) from None
    if not shape or min(shape) < 1:
        raise UsageError(f"model '{name}': invalid input shape {shape}")
    if classes < 1:
        raise UsageError(f"model '{name}': num_classes must be positive, got {classes}")
    allowed = _option_names(info.builder)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        takes = f"options: {', '.join(allowed)}" if allowed else "it takes no options"
        raise UsageError(f"model '{name}' has no option {', '.join(unknown)} ({takes})")
    model = info.builder(shape, classes, **options)
    if not (callable(getattr(model, "body", None)) and callable(getattr(model, "head", None))):
        raise UsageError(
            f"model '{name}' has no body(x) and head(features): every fedskew model is "
            "body + head (see fedskew.models.base.BodyHeadModel)"
        )
    return model


def split_names(model: BodyHeadModel) -> tuple[list[str], list[str]]:
    """State-dict keys (parameters and buffers) of the body and of the head, in order."""
    body: list[str] = []
    head: list[str] = []
    for key in model.state_dict():
        if key.startswith("body."):
            body.append(key)
        elif key.startswith("head."):
            head.append(key)
        else:
            # A key outside both parts would silently escape head exchange or feature
            # matching, so refuse instead of guessing.
            raise ValueError(f"state_dict key {key!r} belongs to neither body nor head")
    return body, head
