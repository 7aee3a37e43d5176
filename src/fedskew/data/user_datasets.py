"""User datasets: a loader found by ``module:function`` reference, by installed entry
point (group ``fedskew.datasets``) or registered in this process; calling it with the
arguments it accepts, checking the ``fedskew.data.datasets.Dataset`` it returns, and
the model ``--model auto`` picks for it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from fedskew.core.errors import DataError, UsageError
from fedskew.core.references import entry_points, import_reference, is_reference, load_entry_point
from fedskew.data.datasets import DATASETS, Dataset

_REGISTERED_LOADERS: dict[str, Callable[..., Dataset]] = {}


def find_dataset_loader(name: str) -> Callable[..., Dataset]:
    """The loader of a user dataset: a ``module:function`` reference, an installed entry
    point (group ``fedskew.datasets``) or one registered in this process. A loader is called
    with the keyword arguments it accepts among ``data_dir``, ``download``, ``num_clients``
    and ``seed`` and returns a :class:`Dataset` (tensors normalised, images NCHW). It may
    carry a ``default_model`` attribute (the model for ``--model auto``)."""
    loader = _REGISTERED_LOADERS.get(name)
    if loader is None:
        loader = (
            import_reference(name, "dataset")
            if is_reference(name)
            else load_entry_point("dataset", name)
        )
    if loader is None:
        choices = [*DATASETS, *sorted(entry_points("dataset"))]
        raise UsageError(
            f"unknown dataset '{name}'; choose from: {', '.join(choices)}, "
            "or give package.module:loader"
        )
    if not callable(loader):
        raise UsageError(f"dataset '{name}' is {loader!r}, not a loader function")
    return loader


def register_dataset(name: str, loader: Callable[..., Dataset]) -> None:
    """Make a dataset loader known as ``name`` in this process."""
    if not callable(loader):
        raise UsageError(f"dataset '{name}' is {loader!r}, not a loader function")
    _REGISTERED_LOADERS[name] = loader


def default_model_for(name: str, dataset: Dataset | None = None) -> str:
    """The model ``--model auto`` picks: the dataset's own choice, else an MLP for flat
    inputs and the simple CNN for images."""
    if name in DATASETS:
        return DATASETS[name].default_model
    chosen = getattr(find_dataset_loader(name), "default_model", None)
    if isinstance(chosen, str):
        return chosen
    if dataset is not None and len(dataset.input_shape) == 3:
        return "simple-cnn"
    return "mlp"


def load_user_dataset(name: str, loader: Callable[..., Dataset], **offered: Any) -> Dataset:
    """Call a user loader with the arguments it takes; check what it returns."""
    try:
        params = inspect.signature(loader).parameters
    except (TypeError, ValueError):
        params = {}
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in offered.items() if takes_all or k in params}
    try:
        dataset = loader(**kwargs)
    except (UsageError, DataError):
        raise
    except Exception as exc:
        raise DataError(
            f"dataset '{name}': its loader failed: {type(exc).__name__}: {exc}"
        ) from None
    check_dataset(dataset, name)
    return dataset


def check_dataset(dataset: object, name: str) -> None:
    """A user dataset must be a Dataset whose tensors agree with each other."""
    if not isinstance(dataset, Dataset):
        raise DataError(f"dataset '{name}': the loader returned {type(dataset).__name__}, "
                        "not a fedskew.data.sources.Dataset")  # fmt: skip
    problems = []
    for split in ("train", "test"):
        x, y = getattr(dataset, f"x_{split}"), getattr(dataset, f"y_{split}")
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
            problems.append(f"x_{split}/y_{split} are not tensors")
            continue
        if x.shape[0] != y.shape[0] or x.shape[0] == 0:
            problems.append(f"{split}: {x.shape[0]} inputs and {y.shape[0]} labels")
        elif tuple(x.shape[1:]) != tuple(dataset.input_shape):
            problems.append(f"{split} inputs are {tuple(x.shape[1:])}, input_shape says "
                            f"{tuple(dataset.input_shape)}")  # fmt: skip
        elif y.dtype != torch.int64 or int(y.min()) < 0 or int(y.max()) >= dataset.num_classes:
            problems.append(f"{split} labels must be int64 in 0..{dataset.num_classes - 1}")
        elif not x.is_floating_point() or not bool(torch.isfinite(x).all()):
            problems.append(f"{split} inputs must be finite floating-point values")
    if problems:
        raise DataError(f"dataset '{name}': {problems[0]}")
