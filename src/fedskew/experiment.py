"""One experiment end to end: data, partition, model, engine, rounds, run folder."""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedskew import __version__
from fedskew.algorithm_interface import ClientLogic, LocalTrainConfig, ServerSetup
from fedskew.algorithms import get_algorithm
from fedskew.algorithms.local import set_arrays
from fedskew.checkpoint import load_checkpoint, load_server_state, save_checkpoint, server_state
from fedskew.config import ExperimentConfig, effective_workers
from fedskew.data.federated import FederatedData, sample_clients
from fedskew.data.partition import PARTITIONS, make_partition
from fedskew.data.sources import DATASETS, Dataset, load_dataset
from fedskew.engine.inprocess import InProcessEngine
from fedskew.errors import FedskewError, UsageError
from fedskew.machine import describe
from fedskew.metrics.evaluation import client_distribution_accuracy, evaluate
from fedskew.models import MODELS, build_model
from fedskew.protocol import NoReplies
from fedskew.rng import derive_seed
from fedskew.runfolder import RunFolder, check_writable

RoundCallback = Callable[[dict[str, Any]], None]
EngineFactory = Callable[["Prepared", ClientLogic, torch.nn.Module], Any]
log = logging.getLogger("fedskew")


@dataclass
class Prepared:
    """Everything built before the first round."""

    cfg: ExperimentConfig
    dataset: Dataset
    model_name: str
    partition: list[np.ndarray]
    fed: FederatedData
    algorithm: Any
    params: Any
    train: LocalTrainConfig
    channels_last: bool = False


def resolve_model_name(cfg: ExperimentConfig) -> str:
    if cfg.model == "auto":
        return DATASETS[cfg.dataset].default_model
    if cfg.model not in MODELS:
        raise UsageError(f"unknown model '{cfg.model}'; choose from: {', '.join(sorted(MODELS))}")
    return cfg.model


def check_names(cfg: ExperimentConfig) -> None:
    """Fail on unknown names before any data is loaded."""
    get_algorithm(cfg.algorithm)
    if cfg.dataset not in DATASETS:
        raise UsageError(
            f"unknown dataset '{cfg.dataset}'; choose from: {', '.join(sorted(DATASETS))}"
        )
    if cfg.partition not in PARTITIONS:
        raise UsageError(
            f"unknown partition '{cfg.partition}'; choose from: {', '.join(sorted(PARTITIONS))}"
        )
    resolve_model_name(cfg)


def build_partition(cfg: ExperimentConfig, dataset: Dataset) -> list[np.ndarray]:
    if cfg.partition == "natural":
        if dataset.natural_partition is None:
            raise UsageError("partition 'natural' needs a dataset with its own clients (synthetic)")
        return dataset.natural_partition
    labels = dataset.y_train.numpy()
    return make_partition(
        labels,
        cfg.num_clients,
        cfg.partition,
        seed=cfg.seed,
        num_classes=dataset.num_classes,
        **cfg.partition_params,
    )


def load_experiment_data(cfg: ExperimentConfig) -> Dataset:
    return load_dataset(
        cfg.dataset,
        cfg.data_dir,
        download=cfg.download,
        num_clients=cfg.num_clients,
        seed=cfg.seed,
        synthetic_alpha=cfg.synthetic_alpha,
        synthetic_beta=cfg.synthetic_beta,
    )


def prepare(cfg: ExperimentConfig) -> Prepared:
    check_names(cfg)
    algorithm = get_algorithm(cfg.algorithm, feature_matching=cfg.feature_matching)
    params = algorithm.make_params(cfg.params)
    dataset = load_experiment_data(cfg)
    partition = build_partition(cfg, dataset)
    empty = [k for k, p in enumerate(partition) if len(p) == 0]
    if empty:
        raise UsageError(
            f"partition '{cfg.partition}' left {len(empty)} client(s) without data "
            f"(first: client {empty[0]}); use fewer clients or another partition"
        )
    train = LocalTrainConfig(
        epochs=cfg.local_epochs,
        batch_size=cfg.batch_size,
        lr=cfg.lr,
        momentum=cfg.momentum,
        weight_decay=cfg.weight_decay,
        augment=cfg.augment,
        grad_clip=cfg.grad_clip,
        precision=cfg.precision,
    )
    model_name = resolve_model_name(cfg)
    channels_last = use_channels_last(cfg, dataset, model_name)
    if channels_last:
        dataset.x_train = dataset.x_train.contiguous(memory_format=torch.channels_last)
        dataset.x_test = dataset.x_test.contiguous(memory_format=torch.channels_last)
    fed = FederatedData(dataset.x_train, dataset.y_train, partition, dataset.num_classes)
    return Prepared(
        cfg, dataset, model_name, partition, fed, algorithm, params, train, channels_last
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
    return model


def use_channels_last(cfg: ExperimentConfig, dataset: Dataset, model_name: str) -> bool:
    """channels_last is faster for convolutions on CPU (measured in benchmarks/), and the
    same for everything else, so 'auto' turns it on for models with convolutions."""
    if cfg.memory_format != "auto":
        return cfg.memory_format == "channels_last" and len(dataset.input_shape) == 3
    if len(dataset.input_shape) != 3:
        return False
    probe = build_model(model_name, dataset.input_shape, dataset.num_classes, **cfg.model_options)
    return any(isinstance(m, torch.nn.Conv2d) for m in probe.modules())


def run(
    cfg: ExperimentConfig,
    on_round: RoundCallback | None = None,
    resume: Path | None = None,
    on_start: Callable[[int], None] | None = None,
    engine_factory: EngineFactory | None = None,
) -> tuple[Path, dict[str, Any]]:
    """Run the experiment (or continue the one in ``resume``); return the finished run
    folder and the summary.

    ``engine_factory`` builds the engine that carries the algorithm's messages (the
    in-process engine by default, or with ``cfg.workers`` >= 2 the worker-pool engine,
    whose processes end with the run, also on errors; the Flower ServerApp passes one
    that sends them through Flower's Grid). An engine whose ``may_lose_replies`` is true
    can return fewer replies than it was sent; a round in which no client replied is
    skipped and recorded.
    """
    cfg.validate()
    workers = effective_workers(cfg) if engine_factory is None else 0
    if workers <= 1:
        return _run(cfg, on_round, resume, on_start, engine_factory)
    from fedskew.engine.workers import WorkerPoolEngine, affordable_workers

    started: list[WorkerPoolEngine] = []

    def start_workers(prep: Prepared, client_logic: ClientLogic, model: Any) -> Any:
        count = workers
        if cfg.workers == "auto":  # each worker holds the dataset: stay inside the memory
            data = (prep.dataset.x_train, prep.dataset.x_test)
            count = min(count, affordable_workers(sum(t.nbytes for t in data)))
        if count <= 1:
            return InProcessEngine.from_prepared(prep, client_logic, model)
        started.append(WorkerPoolEngine(prep.cfg, client_sizes=prep.fed.sizes(), workers=count))
        return started[-1]

    try:
        return _run(cfg, on_round, resume, on_start, start_workers)
    finally:
        for engine in started:
            engine.close()


def _run(
    cfg: ExperimentConfig,
    on_round: RoundCallback | None,
    resume: Path | None,
    on_start: Callable[[int], None] | None,
    engine_factory: EngineFactory | None,
) -> tuple[Path, dict[str, Any]]:
    cfg.validate()
    check_names(cfg)
    if resume is None:
        check_writable(Path(cfg.out_dir))
    prep = prepare(cfg)
    per_round = cfg.per_round()
    num_clients = len(prep.partition)
    if per_round > num_clients:
        raise UsageError(f"{per_round} clients per round but only {num_clients} clients")

    model = new_model(prep)
    eval_model = new_model(prep)
    setup = ServerSetup(
        initial_arrays=model.state_dict(),
        num_clients=num_clients,
        num_classes=prep.dataset.num_classes,
        client_sizes=prep.fed.sizes(),
        seed=cfg.seed,
        train=prep.train,
        rounds=cfg.rounds,
        eval_every=cfg.eval_every,
    )
    server = prep.algorithm.Server(prep.params, setup)
    client_logic = prep.algorithm.Client(prep.params)
    factory = InProcessEngine.from_prepared if engine_factory is None else engine_factory
    engine = factory(prep, client_logic, model)
    may_lose = bool(getattr(engine, "may_lose_replies", False))
    client_counts = prep.fed.class_counts()

    history: list[dict[str, Any]] = []
    start_round = 0
    if resume is None:
        folder = RunFolder.create(Path(cfg.out_dir), default_run_name(cfg))
        folder.write_config({**cfg.to_dict(), "resolved": resolved_facts(prep, per_round)})
        folder.write_partition(prep.partition, {"scheme": cfg.partition, **cfg.partition_params})
    else:
        folder = RunFolder.reopen(resume)
        if not partitions_equal(folder.read_partition(), prep.partition):
            raise FedskewError(
                f"{resume}: the saved partition differs from the one rebuilt from its config"
            )
        if folder.checkpoint_path.exists():
            done, saved_server, client_states, _ = load_checkpoint(folder.checkpoint_path)
            load_server_state(server, saved_server)
            engine.client_states = client_states
            start_round = done
        history = folder.read_metrics(up_to_round=start_round)

    folder.append_process(
        {"from_round": start_round + 1, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
         "workers": getattr(engine, "worker_count", 0), **describe()}
    )  # fmt: skip
    started = time.perf_counter()
    last_eval: dict[str, Any] = next(
        ({k: r[k] for k in EVAL_KEYS} for r in reversed(history) if "accuracy" in r), {}
    )
    if on_start is not None:
        on_start(start_round)
    for rnd in range(start_round, cfg.rounds):
        clients = sample_clients(cfg.seed, rnd, num_clients, per_round)
        engine.begin_round(rnd)
        # A lossy engine may fail a round part-way; its server state is then put back.
        before = copy.deepcopy(server_state(server)) if may_lose else None
        t0 = time.perf_counter()
        try:
            round_metrics = server.round(rnd, clients, engine)
        except NoReplies as exc:
            load_server_state(server, before)
            log.warning("round %d skipped: %s", rnd + 1, exc)
            round_metrics = {"skipped": 1.0}
        round_seconds = time.perf_counter() - t0
        trained = [c for c in clients if not may_lose or c not in engine.missing]
        record: dict[str, Any] = {
            "round": rnd + 1,
            "clients": clients,
            "samples": cfg.local_epochs * sum(len(prep.partition[c]) for c in trained),
            "bytes_down": engine.traffic.bytes_down,
            "bytes_up": engine.traffic.bytes_up,
            "exchanges": engine.traffic.exchanges,
            "seconds": round(round_seconds, 4),
            **{k: float(v) for k, v in round_metrics.items()},
        }
        if may_lose:
            record["missing_replies"] = sorted(engine.missing)
            record["rejected_replies"] = sorted(engine.rejected)
        if setup.is_eval_round(rnd):
            t1 = time.perf_counter()
            set_arrays(eval_model, server.eval_arrays())
            result = evaluate(
                eval_model,
                prep.dataset.x_test,
                prep.dataset.y_test,
                prep.dataset.num_classes,
                precision=prep.train.precision,
            )
            last_eval = {
                "accuracy": result.accuracy,
                "loss": result.loss,
                "client_dist_accuracy": client_distribution_accuracy(
                    result.per_class_accuracy, client_counts
                ),
                "per_class_accuracy": [
                    None if np.isnan(a) else round(float(a), 6) for a in result.per_class_accuracy
                ],
            }
            record.update(last_eval)
            record["eval_seconds"] = round(time.perf_counter() - t1, 4)
        # The checkpoint goes first: metrics of a round are only kept once its state is safe.
        if cfg.checkpoint_every and (
            (rnd + 1) % cfg.checkpoint_every == 0 or rnd + 1 == cfg.rounds
        ):
            save_checkpoint(folder.checkpoint_path, rnd + 1, server, engine.client_states)
        folder.append_metrics(record)
        history.append(record)
        if on_round is not None:
            on_round(record)

    summary = make_summary(cfg, prep, per_round, num_clients, history, last_eval)
    summary["wall_seconds_this_process"] = round(time.perf_counter() - started, 3)
    summary["processes"] = folder.read_processes()
    final = folder.finish(summary)
    return final, summary


EVAL_KEYS = ("accuracy", "loss", "client_dist_accuracy", "per_class_accuracy")


def resolved_facts(prep: Prepared, per_round: int) -> dict[str, Any]:
    return {
        "model": prep.model_name,
        "clients_per_round": per_round,
        "num_clients": len(prep.partition),
        "algorithm": prep.algorithm.name,
        "algorithm_params": vars(prep.params),
        "dataset_source": prep.dataset.source,
        "num_classes": prep.dataset.num_classes,
        "train_samples": int(len(prep.dataset.y_train)),
        "test_samples": int(len(prep.dataset.y_test)),
        "fedskew_version": __version__,
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "channels_last": prep.channels_last,
    }


def partitions_equal(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def make_summary(
    cfg: ExperimentConfig,
    prep: Prepared,
    per_round: int,
    num_clients: int,
    history: list[dict[str, Any]],
    last_eval: dict[str, Any],
) -> dict[str, Any]:
    accuracies = [r["accuracy"] for r in history if "accuracy" in r]
    train_seconds = sum(r["seconds"] for r in history)
    samples = sum(r.get("samples", 0) for r in history)
    return {
        "algorithm": prep.algorithm.name,
        "dataset": cfg.dataset,
        "model": prep.model_name,
        "partition": cfg.partition,
        "num_clients": num_clients,
        "clients_per_round": per_round,
        "rounds": cfg.rounds,
        "seed": cfg.seed,
        "final_accuracy": last_eval.get("accuracy"),
        "final_loss": last_eval.get("loss"),
        "final_client_dist_accuracy": last_eval.get("client_dist_accuracy"),
        "best_accuracy": max(accuracies) if accuracies else None,
        "total_bytes_down": sum(r["bytes_down"] for r in history),
        "total_bytes_up": sum(r["bytes_up"] for r in history),
        "train_seconds": round(train_seconds, 3),
        "eval_seconds": round(sum(r.get("eval_seconds", 0.0) for r in history), 3),
        "train_samples_per_second": round(samples / train_seconds, 1) if train_seconds else None,
    }


def default_run_name(cfg: ExperimentConfig) -> str:
    if cfg.name:
        return cfg.name
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return f"{cfg.algorithm}-{cfg.dataset}-{cfg.partition}-s{cfg.seed}-{stamp}"
