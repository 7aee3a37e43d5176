"""Building an experiment from its configuration: data, partition, model, algorithm.

This layer knows no engine and no run folder. The run loop, every engine's client side
(worker processes, Flower nodes) and the benchmarks build the same experiment from the same
configuration here, so that every process holds the same data, partition and model.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedskew.algorithms import get_algorithm
from fedskew.config import ExperimentConfig, TrainingWork
from fedskew.core.device import ExecutionSettings, device_facts, resolve_device
from fedskew.core.errors import FedskewError, UsageError
from fedskew.core.machine import available_memory_bytes
from fedskew.core.rng import derive_seed
from fedskew.data.datasets import DATASETS, Dataset
from fedskew.data.federated import FederatedData
from fedskew.data.local_test import VALIDATION, split_local_test
from fedskew.data.partition import (
    PARTITIONS,
    check_partition,
    current_scheme,
    make_partition,
    partition_digest,
    read_partition_file,
    resolve_partition_params,
)
from fedskew.data.sources import load_dataset
from fedskew.data.user_datasets import default_model_for, find_dataset_loader
from fedskew.models import build_model, find_model
from fedskew.models.cost import TRAIN_FLOPS_PER_FORWARD, forward_cost
from fedskew.training.interface import Algorithm, InactiveMechanism, LocalTrainConfig, RunShape
from fedskew.training.privacy import Privacy, check_privacy
from fedskew.version import __version__

log = logging.getLogger("fedskew")


@dataclass
class Prepared:
    """Everything built before the first round."""

    cfg: ExperimentConfig
    dataset: Dataset
    model_name: str
    partition: list[np.ndarray]
    fed: FederatedData
    algorithm: type[Algorithm]
    params: Any
    train: LocalTrainConfig
    channels_last: bool = False
    # Where clients train and the model is evaluated; ``fed`` and ``test`` live there (the
    # dataset's own tensors stay in host memory for partitions, metrics and reports).
    device: torch.device = torch.device("cpu")
    test: tuple[torch.Tensor, torch.Tensor] | None = None
    # Each client's local test split (--local-test-fraction); ``partition`` is then what
    # remains for training. None: no local split.
    local_test: list[np.ndarray] | None = None
    # The clients' whole data before the split (the run folder's partition.npz and its
    # digest: the split is recomputed from it); None: ``partition`` itself.
    whole_partition: list[np.ndarray] | None = None
    # Secure aggregation and DP (fedskew.training.privacy); None: neither.
    privacy: Privacy | None = None
    # Each client's validation part (--validation-fraction), held out of ``partition``; the
    # dataset's test tensors are then these parts pooled. None: no validation split.
    validation: list[np.ndarray] | None = None

    @property
    def clients_data(self) -> list[np.ndarray]:
        """Every client's indices, local test split included (what partition.npz holds)."""
        return self.partition if self.whole_partition is None else self.whole_partition

    @property
    def x_test(self) -> torch.Tensor:
        return self.dataset.x_test if self.test is None else self.test[0]

    @property
    def y_test(self) -> torch.Tensor:
        return self.dataset.y_test if self.test is None else self.test[1]


def resolve_model_name(cfg: ExperimentConfig, dataset: Dataset | None = None) -> str:
    """The model's name (``auto``: the dataset's default); unknown names fail here."""
    name = default_model_for(cfg.dataset, dataset) if cfg.model == "auto" else cfg.model
    find_model(name)
    return name


def check_names(cfg: ExperimentConfig) -> None:
    """Fail on unknown names before any data is loaded."""
    get_algorithm(cfg.algorithm)
    if cfg.dataset not in DATASETS:
        find_dataset_loader(cfg.dataset)
    if cfg.partition not in PARTITIONS:
        raise UsageError(
            f"unknown partition '{cfg.partition}'; choose from: {', '.join(sorted(PARTITIONS))}"
        )
    if cfg.partition_file is None:
        resolve_partition_params(cfg.partition, dict(cfg.partition_params))
    if cfg.model != "auto" or cfg.dataset in DATASETS:
        resolve_model_name(cfg)


def build_partition(cfg: ExperimentConfig, dataset: Dataset) -> list[np.ndarray]:
    if cfg.partition_file is not None:
        partition = read_partition_file(cfg.partition_file)
        check_partition(partition, len(dataset.y_train), cfg.partition_file, cfg.partition_overlap)
        if len(partition) != cfg.num_clients:
            raise UsageError(
                f"{cfg.partition_file} has {len(partition)} clients but num-clients is "
                f"{cfg.num_clients}"
            )
        return partition
    if cfg.partition == "natural":
        if dataset.natural_partition is None:
            raise UsageError("partition 'natural' needs a dataset with its own clients (synthetic)")
        return dataset.natural_partition
    labels = dataset.y_train.numpy()
    return make_partition(
        labels,
        cfg.num_clients,
        # validate gives partition today's name; a config built without it may not have it.
        current_scheme(cfg.partition, cfg.partition_version),
        seed=cfg.seed,
        num_classes=dataset.num_classes,
        **cfg.partition_params,
    )


def load_experiment_data(cfg: ExperimentConfig) -> Dataset:
    if cfg.data_dir is not None and not Path(cfg.data_dir).is_dir():
        # Loaders look in other places when a folder lacks the files: a folder the user
        # named must exist, or the data would silently come from elsewhere. (Checked here,
        # where data is loaded, not in the configuration: a report of a run folder from
        # another machine reads the configuration without the data.)
        raise UsageError(f"data-dir {cfg.data_dir}: no such folder")
    return load_dataset(
        cfg.dataset,
        cfg.data_dir,
        download=cfg.download,
        num_clients=cfg.num_clients,
        seed=cfg.seed,
        synthetic_alpha=cfg.synthetic_alpha,
        synthetic_beta=cfg.synthetic_beta,
    )


def execution_settings(cfg: ExperimentConfig) -> ExecutionSettings:
    """The process-wide switches of ``cfg`` (TF32, deterministic algorithms, denormals)."""
    return ExecutionSettings(
        tf32=cfg.tf32, deterministic=cfg.deterministic, denormals=cfg.denormals
    )


def check_held_out(
    option: str, fraction: float, clients: list[np.ndarray], held: list[np.ndarray]
) -> None:
    """Refuse a held-out fraction that holds out nothing on every client (each client keeps
    round(F * n) of its n samples: below 1 / (2 n) that is none), which would run with null
    accuracies; warn, naming them, where only some clients hold out nothing."""
    none = [k for k, h in enumerate(held) if len(h) == 0]
    if not none:
        return
    sizes = [len(c) for c in clients]
    if len(none) == len(held):
        raise UsageError(
            f"{option} {fraction:g} holds out no sample on any client (each holds out "
            f"round({fraction:g} x its samples), and the largest client has {max(sizes)}): "
            f"use at least {1 / (2 * max(sizes)):.2g}, or 0 for none"
        )
    log.warning(
        "%s %g holds out no sample on %d of %d clients (first: client %d, %d samples): "
        "they have no %s accuracy", option, fraction, len(none), len(held), none[0],
        sizes[none[0]], "local test" if option.startswith("local") else "validation",
    )  # fmt: skip


def prepare(cfg: ExperimentConfig, dataset: Dataset | None = None) -> Prepared:
    """Data, partition, algorithm and training settings of ``cfg``; the training and test
    tensors are put on the run's device once (a no-op on the CPU). ``dataset``: the run's
    dataset as another process loaded it (a worker gets its parent's, in shared memory),
    instead of loading it here."""
    check_names(cfg)
    device = resolve_device(cfg.device)
    algorithm = get_algorithm(cfg.algorithm, feature_matching=cfg.feature_matching)
    params = algorithm.make_params(cfg.params)
    privacy = Privacy.of(cfg)
    check_privacy(algorithm.name, algorithm.privacy, privacy)
    if dataset is None:
        dataset = load_experiment_data(cfg)
    partition = build_partition(cfg, dataset)
    empty = [k for k, p in enumerate(partition) if len(p) == 0]
    if empty:
        raise UsageError(
            f"partition '{cfg.partition}' left {len(empty)} client(s) without data "
            f"(first: client {empty[0]}); use fewer clients or another partition"
        )
    local_test = whole = validation = None
    if cfg.local_test_fraction > 0:
        whole = partition
        partition, local_test = split_local_test(
            partition, dataset.y_train.numpy(), dataset.num_classes, cfg.local_test_fraction,
            cfg.seed,
        )  # fmt: skip
        check_held_out("local-test-fraction", cfg.local_test_fraction, whole, local_test)
    if cfg.validation_fraction > 0:
        whole = partition if whole is None else whole
        before = partition
        partition, validation = split_local_test(
            partition, dataset.y_train.numpy(), dataset.num_classes, cfg.validation_fraction,
            cfg.seed, VALIDATION,
        )  # fmt: skip
        check_held_out("validation-fraction", cfg.validation_fraction, before, validation)
        use_validation_as_test(dataset, validation)
    train = LocalTrainConfig(
        epochs=cfg.local_epochs,
        batch_size=cfg.batch_size,
        lr=cfg.lr,
        momentum=cfg.momentum,
        weight_decay=cfg.weight_decay,
        augment=cfg.augment,
        grad_clip=cfg.grad_clip,
        precision=cfg.precision,
        cuda_graphs=cfg.cuda_graphs,
    )
    model_name = resolve_model_name(cfg, dataset)
    check_model_fits(cfg, dataset, model_name)
    channels_last = use_channels_last(cfg, dataset, model_name)
    if channels_last:
        dataset.x_train = dataset.x_train.contiguous(memory_format=torch.channels_last)
        dataset.x_test = dataset.x_test.contiguous(memory_format=torch.channels_last)
    fed = FederatedData(
        dataset.x_train.to(device),
        dataset.y_train.to(device),
        partition,
        dataset.num_classes,
        local_test,
    )
    test = (dataset.x_test.to(device), dataset.y_test.to(device))
    return Prepared(
        cfg, dataset, model_name, partition, fed, algorithm, params, train, channels_last,
        device, test, local_test, whole, privacy, validation,
    )  # fmt: skip


def use_validation_as_test(dataset: Dataset, validation: list[np.ndarray]) -> None:
    """Put the clients' validation parts, pooled, where the test set was, and drop the test
    set: every evaluation of the run (accuracy, per-class accuracy, feature metrics) then
    scores the validation split, and nothing can read the test set by mistake. The pooled
    accuracy is the sample-weighted mean of the clients' own validation accuracies. Safe to
    repeat on a dataset already changed (a worker's copy of its parent's): it reads only
    the training tensors."""
    where = torch.from_numpy(np.sort(np.concatenate(validation)))
    dataset.x_test = dataset.x_train[where].clone()
    dataset.y_test = dataset.y_train[where].clone()


def validation_facts(prep: Prepared) -> dict[str, Any]:
    """The validation split, when the run has one: what a reader needs to know the run never
    scored on the test set, and to check two runs held out the same samples."""
    if prep.validation is None:
        return {}
    sizes = [len(v) for v in prep.validation]
    return {
        "evaluated_on": "validation",
        "validation_split": {
            "fraction": prep.cfg.validation_fraction,
            "seed": prep.cfg.seed,
            "per_client": "stratified, from each client's training data after its local test split",
            "samples": sum(sizes),
            "client_samples": sizes,
            "digest": partition_digest(prep.validation),
        },
    }


def use_host_tensors(prep: Prepared, tensors: dict[str, torch.Tensor]) -> None:
    """Let a CPU run's dataset, federated data and test set be ``tensors`` (x_train,
    y_train, x_test, y_test: equal values and layout, held elsewhere, e.g. in shared
    memory), so that this process drops its own copies."""
    if prep.device.type != "cpu":
        raise ValueError("use_host_tensors is for runs on the CPU")
    for name in ("x_train", "y_train", "x_test", "y_test"):
        old, new = getattr(prep.dataset, name), tensors[name]
        if old.shape != new.shape or old.stride() != new.stride() or old.dtype != new.dtype:
            raise ValueError(f"{name}: the new tensor's layout differs from the dataset's")
        setattr(prep.dataset, name, new)
    prep.fed.x, prep.fed.y = tensors["x_train"], tensors["y_train"]
    prep.fed.forget_clients()
    prep.test = (tensors["x_test"], tensors["y_test"])


def training_work(prep: Prepared, model: torch.nn.Module) -> TrainingWork:
    """What one client's local training costs, estimated from the model and the partition:
    the ``--workers auto`` choice rests on it (``fedskew.config.execution_choice``)."""
    per_sample = forward_cost(model, prep.dataset.input_shape, prep.channels_last)
    sizes = [len(p) for p in prep.partition]
    mean_client = sum(sizes) / max(1, len(sizes))
    train_flops = TRAIN_FLOPS_PER_FORWARD * per_sample.flops
    return TrainingWork(
        client_flops=prep.train.epochs * mean_client * train_flops,
        step_flops=min(prep.train.batch_size, max(sizes, default=0)) * train_flops,
        model_bytes=per_sample.parameter_bytes,
        activation_bytes=prep.train.batch_size * per_sample.activation_bytes,
    )


def new_model(prep: Prepared) -> torch.nn.Module:
    """The initial model, seeded from the experiment seed without touching global RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(prep.cfg.seed, -1, -1, "model-init"))
        model = build_model(
            prep.model_name,
            prep.dataset.input_shape,
            prep.dataset.num_classes,
            **prep.cfg.model_options,
        )
        model = prep.algorithm.adapt_model(prep.params, model)
    if prep.channels_last:
        model = model.to(memory_format=torch.channels_last)
    # Initialised on the CPU from the seed above, then moved: the same initial weights on
    # every device.
    return model.to(prep.device)


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_model_fits(cfg: ExperimentConfig, dataset: Dataset, model_name: str) -> None:
    """Refuse a model whose weights alone exceed the memory left, before they exist.

    Near the machine's size the kernel grants the allocation and its OOM killer ends the run
    (or another process) while the weights are initialised: no error, no line. The model is
    built on the meta device (shapes, no storage) to count its bytes; the run needs several
    times that (clients' copies, gradients), so only what cannot fit at all is refused."""
    left = available_memory_bytes()
    if left is None:
        return
    try:
        with torch.device("meta"):
            probe = build_model(model_name, dataset.input_shape, dataset.num_classes,
                                **cfg.model_options)  # fmt: skip
    except FedskewError:
        raise
    except Exception:  # noqa: BLE001 - a model that cannot be built on meta is built as before
        return
    tensors = [*probe.parameters(), *probe.buffers()]
    need = sum(t.numel() * t.element_size() for t in tensors)
    if need > left:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        raise FedskewError(
            f"out of host memory: an allocation of {_size(need)} for model {model_name}'s "
            f"weights cannot be met ({_size(left)} available of {_size(total)}); use a "
            "smaller model (--model-option) or a machine with more memory"
        )


def use_channels_last(cfg: ExperimentConfig, dataset: Dataset, model_name: str) -> bool:
    """channels_last is faster for convolutions on CPU (measured in benchmarks/), and the
    same for everything else, so 'auto' turns it on for models with convolutions."""
    if cfg.memory_format != "auto":
        return cfg.memory_format == "channels_last" and len(dataset.input_shape) == 3
    if len(dataset.input_shape) != 3:
        return False
    probe = build_model(model_name, dataset.input_shape, dataset.num_classes, **cfg.model_options)
    return any(isinstance(m, torch.nn.Conv2d) for m in probe.modules())


def local_test_facts(prep: Prepared) -> dict[str, Any]:
    """How many samples the local test splits hold, and how many clients got none (too
    small for the fraction), when the run has them."""
    if prep.local_test is None:
        return {}
    sizes = [len(t) for t in prep.local_test]
    return {"local_test_samples": sum(sizes), "clients_without_local_test": sizes.count(0)}


def inactive_mechanisms(prep: Prepared, per_round: int) -> list[InactiveMechanism]:
    """What the algorithm declares its options and this run's shape keep from ever acting
    (``Algorithm.inactive_mechanisms``)."""
    shape = RunShape(
        rounds=prep.cfg.rounds, local_epochs=prep.train.epochs, clients_per_round=per_round
    )
    return list(prep.algorithm.inactive_mechanisms(prep.params, shape))


def all_acted_round(cfg: ExperimentConfig) -> int:
    """The first round (1-based) by which every mechanism the method declares has acted:
    the fewest rounds for which ``Algorithm.inactive_mechanisms`` lists none (FedFM
    launched at 0-based round s: s + 1; a method without such mechanisms: 1); rounds + 1
    when some mechanism never acts within the run. Tuning reads it to judge a trial only
    once the trial is the method it names."""
    algorithm = get_algorithm(cfg.algorithm, feature_matching=cfg.feature_matching)
    params = algorithm.make_params(cfg.params)
    per_round = cfg.per_round()
    for rounds in range(1, cfg.rounds + 1):
        shape = RunShape(rounds=rounds, local_epochs=cfg.local_epochs, clients_per_round=per_round)
        if not algorithm.inactive_mechanisms(params, shape):
            return rounds
    return cfg.rounds + 1


def partition_class_facts(prep: Prepared) -> dict[str, Any]:
    """Per class, the training samples the partition holds and how many clients hold any,
    with the classes' names: what a report ranks minority and majority classes by, kept
    here so that it needs neither partition.npz nor the dataset."""
    counts = prep.fed.class_counts()
    return {
        "class_names": list(prep.dataset.class_names),
        "partition_class_samples": counts.sum(axis=0).tolist(),
        "partition_class_clients": (counts > 0).sum(axis=0).tolist(),
    }


def resolved_facts(prep: Prepared, per_round: int) -> dict[str, Any]:
    return {
        "model": prep.model_name,
        "clients_per_round": per_round,
        "num_clients": len(prep.partition),
        # partition.npz stays out of shared results (it is large); its digest in config.json
        # lets a report check that compared runs had the same clients without it.
        "partition_digest": partition_digest(prep.clients_data),
        **local_test_facts(prep),
        **validation_facts(prep),
        "algorithm": prep.algorithm.name,
        "algorithm_params": vars(prep.params),
        # Recorded once, when the run starts: a resume keeps config.json, and the reports
        # mark the runs whose method was partly a plainer one.
        "inactive_mechanisms": [m.record() for m in inactive_mechanisms(prep, per_round)],
        "dataset_source": prep.dataset.source,
        "num_classes": prep.dataset.num_classes,
        **partition_class_facts(prep),
        "train_samples": int(len(prep.dataset.y_train)),
        "test_samples": int(len(prep.dataset.y_test)),
        "fedskew_version": __version__,
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "channels_last": prep.channels_last,
        **device_facts(prep.device),
    }
