"""The class counts of a run's partition, for the report's minority / majority split: per
class, the training samples the partition holds and how many clients hold any.

Read from config.json's resolved facts (``partition_class_samples``,
``partition_class_clients``: runs record them since they were added), else counted from the
run's partition.npz against the dataset's labels, else from the partition rebuilt from the
run's configuration (a pure function of it); the dataset is read from local files only, and
only a dataset built into fedskew (:func:`partition_counts`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from fedskew.assembly.prepare import build_partition
from fedskew.config import ExperimentConfig
from fedskew.core.errors import FedskewError
from fedskew.data.datasets import CIFAR10_CLASSES, CIFAR100_CLASSES, DATASETS, FMNIST_CLASSES
from fedskew.data.partition import load_partition, partition_stats
from fedskew.report.per_class import ClassCounts
from fedskew.report.runs import RunRecord
from fedskew.runs.folder import config_from_saved

LoadDataset = Callable[[ExperimentConfig], Any]  # a Dataset, loaded from local files


class PartitionCounts:
    """Class counts per run, each partition counted once (by its digest where recorded)."""

    def __init__(self, load_dataset: LoadDataset) -> None:
        self.load_dataset = load_dataset
        self.cache: dict[str, ClassCounts | str] = {}

    def __call__(self, record: RunRecord) -> ClassCounts | str:
        recorded = recorded_counts(record.resolved)
        if recorded is not None:
            return recorded
        key = record.partition_digest or str(record.folder)
        if key not in self.cache:
            self.cache[key] = self._count(record)
        return self.cache[key]

    def _count(self, record: RunRecord) -> ClassCounts | str:
        try:
            counts, where = partition_counts(record, self.load_dataset)
        except COUNT_ERRORS as exc:
            return f"class counts not available: {first_line(exc)}"
        return ClassCounts(
            samples=counts.sum(axis=0).tolist(),
            clients=(counts > 0).sum(axis=0).tolist(),
            where=f"{where} with the dataset's labels",
        )


# What counting a partition may fail with: a folder, dataset or partition file that is not
# there or not what it should be.
COUNT_ERRORS = (FedskewError, OSError, ValueError)


def partition_counts(record: RunRecord, load_dataset: LoadDataset) -> tuple[np.ndarray, str]:
    """(clients x classes training samples of the run's partition, where the partition came
    from): the folder's partition.npz, else the partition rebuilt from the run's
    configuration (a pure function of it), counted against the labels of the dataset as
    ``load_dataset`` reads it from local files; one of COUNT_ERRORS when neither works.

    Only a dataset built into fedskew is loaded: a run folder that names one by reference
    (``module:loader``) or entry point would have the report import and call code that the
    folder chose. Only files the record's reader may read are read (the folder's own)."""
    cfg = config_from_saved(record.config, record.folder)
    if cfg.dataset not in DATASETS:
        raise FedskewError(
            f"dataset {cfg.dataset!r} is not built into fedskew, and a report runs no code "
            "that a run folder names"
        )
    files = record.reader
    dataset = load_dataset(dataclasses.replace(cfg, download=False))
    path = record.folder / "partition.npz"
    if files.exists(path):
        files.check(path, "partition file")
        partition, where = load_partition(path)[0], "partition.npz"
    else:
        if cfg.partition_file is not None:
            files.check(Path(cfg.partition_file), "partition file config.json names")
        partition = build_partition(cfg, dataset)
        where = "partition rebuilt from config.json"
    return partition_stats(partition, dataset.y_train.numpy(), dataset.num_classes), where


def first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__


def recorded_counts(resolved: dict[str, Any]) -> ClassCounts | None:
    samples = resolved.get("partition_class_samples")
    clients = resolved.get("partition_class_clients")
    if not isinstance(samples, list) or not isinstance(clients, list):
        return None
    return ClassCounts(
        samples=[int(x) for x in samples],
        clients=[int(x) for x in clients],
        where="config.json",
    )


def class_names_of(records: list[RunRecord]) -> list[str] | None:
    """The classes' names as a run recorded them (config.json), else the dataset's own
    (fmnist, cifar10, ...) when the dataset is one fedskew knows by name; None otherwise:
    the report then numbers the classes."""
    for rec in records:
        names = rec.resolved.get("class_names")
        if isinstance(names, list) and names:
            return [str(n) for n in names]
    known = {"fmnist": FMNIST_CLASSES, "cifar10": CIFAR10_CLASSES, "cifar100": CIFAR100_CLASSES}
    datasets = {str(r.config.get("dataset")) for r in records}
    if len(datasets) == 1:
        found = known.get(datasets.pop())
        return list(found) if found is not None else None
    return None
