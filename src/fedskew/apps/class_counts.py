"""The class counts of a run's partition, for the report's minority / majority split: per
class, the training samples the partition holds and how many clients hold any; and, for
the split of each client's classes into local-majority, local-minority and absent ones
(:class:`ClientCounts`), every client's own training counts and the test set's.

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
from fedskew.data.local_test import split_local_test
from fedskew.data.partition import load_partition, partition_stats
from fedskew.report.local_split import ClientClassCounts
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
    partition, dataset, where = run_partition(record, load_dataset)
    return partition_stats(partition, dataset.y_train.numpy(), dataset.num_classes), where


def run_partition(
    record: RunRecord, load_dataset: LoadDataset
) -> tuple[list[np.ndarray], Any, str]:
    """(the clients' sample indices, local test splits included, the dataset, where the
    partition came from), as :func:`partition_counts` finds them."""
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
    # A partition.npz from another dataset (or damaged) indexes samples this one lacks.
    size = len(dataset.y_train)
    for k, idx in enumerate(partition):
        if idx.size and (idx.min() < 0 or idx.max() >= size):
            raise FedskewError(
                f"{where}: client {k} holds sample indices outside the dataset's "
                f"{size} training samples"
            )
    return partition, dataset, where


class ClientCounts:
    """Per run, each client's own training class counts: its part of the partition, less
    its local test split where the run held one out (``--local-test-fraction``; the split is
    recomputed, a pure function of the partition, the labels, the fraction and the seed),
    counted against the dataset's labels; with the test set's class counts. Or why there
    are none (one line). Each (partition, split) is counted once."""

    def __init__(self, load_dataset: LoadDataset) -> None:
        self.load_dataset = load_dataset
        self.cache: dict[str, ClientClassCounts | str] = {}

    def __call__(self, record: RunRecord) -> ClientClassCounts | str:
        key = repr((record.partition_digest or str(record.folder), record.config.get("dataset"),
                    record.config.get("local_test_fraction"), record.seed))  # fmt: skip
        if key not in self.cache:
            try:
                self.cache[key] = self._count(record)
            except COUNT_ERRORS as exc:
                self.cache[key] = f"class counts not available: {first_line(exc)}"
        return self.cache[key]

    def _count(self, record: RunRecord) -> ClientClassCounts | str:
        partition, dataset, where = run_partition(record, self.load_dataset)
        labels = dataset.y_train.numpy()
        cfg = config_from_saved(record.config, record.folder)
        if cfg.local_test_fraction > 0:
            partition = split_local_test(
                partition, labels, dataset.num_classes, cfg.local_test_fraction, cfg.seed
            )[0]
            where += ", less each client's local test split"
        train = partition_stats(partition, labels, dataset.num_classes)
        recorded = record.resolved.get("partition_class_samples")
        if isinstance(recorded, list) and recorded != train.sum(axis=0).tolist():
            return (
                f"the training counts of the {where} do not add up to config.json's "
                "partition_class_samples (another dataset or partition than the run's)"
            )
        test = np.bincount(dataset.y_test.numpy(), minlength=dataset.num_classes)
        recorded = record.resolved.get("test_samples")
        if isinstance(recorded, int) and recorded != int(test.sum()):
            return (
                f"the dataset read here has {int(test.sum())} test samples, the run "
                f"recorded {recorded} (another dataset than the run's)"
            )
        return ClientClassCounts(train, test.tolist(), f"{where}, with the dataset's labels")


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
