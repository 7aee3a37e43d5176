"""The run loop: rounds, evaluation, checkpoints and the run folder, above the engines.

``run`` builds the experiment (``fedskew.assembly.prepare``), starts an engine, opens the run
folder (or reopens one to resume it), then plays the rounds: the server logic plays each
round over the engine, the global model is evaluated on the test set, the round's state
goes to the checkpoint and its metrics to ``metrics.jsonl``. The engine is used only
through the :class:`~fedskew.engines.base.Engine` interface.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import re
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedskew.assembly.prepare import (
    Prepared,
    check_names,
    execution_settings,
    inactive_mechanisms,
    new_model,
    prepare,
    resolved_facts,
    training_work,
    use_host_tensors,
)
from fedskew.config import Execution, ExperimentConfig, config_hash, execution_choice, plural
from fedskew.core.denormals import denormals_state
from fedskew.core.device import device_facts, settings_applied
from fedskew.core.errors import Diverged, FedskewError, UsageError
from fedskew.core.gpu_memory import memory_peaks, reset_peaks, run_peaks
from fedskew.core.gpu_sharing import gpu_sharing_facts
from fedskew.core.machine import cpu_features, machine_facts, software_facts
from fedskew.data.federated import sample_clients
from fedskew.engines.base import Engine, ServerSideClientStates
from fedskew.engines.inprocess import InProcessEngine
from fedskew.engines.secure_sum import simulated_secure_mean
from fedskew.engines.shared_data import dataset_nbytes, shared_memory_available
from fedskew.engines.workers import (
    WorkerPoolEngine,
    affordable_workers,
    main_allows_spawn,
    worker_bytes,
)
from fedskew.metrics.client_spread import CLIENT_SERIES, is_local_evaluation_key
from fedskew.metrics.evaluation import client_distribution_accuracy, evaluate
from fedskew.metrics.per_class import per_class_summary
from fedskew.runs.checkpoint import (
    check_checkpoint,
    load_server_state,
    read_checkpoint,
    save_checkpoint,
    server_state,
)
from fedskew.runs.folder import INCOMPLETE, RunFolder, check_writable
from fedskew.runs.local_evaluation import evaluate_on_clients, has_personal_part
from fedskew.runs.measurements import Measurements, due, final_values
from fedskew.runs.privacy import PrivacyLedger
from fedskew.runs.saved_state import (
    RecordSpec,
    SavedStateSpec,
    check_saved_state,
    metrics_digest,
)
from fedskew.runs.tracking import TrackingSession, check_available, check_saved_trackers
from fedskew.training.graph_step import resolve_graphs
from fedskew.training.interface import ClientLogic, ServerLogic, ServerSetup
from fedskew.training.local import set_arrays
from fedskew.training.privacy import plain_mean
from fedskew.training.protocol import (
    Expected,
    Message,
    NoReplies,
    Summed,
    SumRequest,
    largest_state,
)

RoundCallback = Callable[[dict[str, Any]], None]
# Builds the engine of a run from the prepared experiment, the client logic and the
# scratch model the run loop made (the in-process engine uses both).
EngineFactory = Callable[[Prepared, ClientLogic, torch.nn.Module], Engine]
log = logging.getLogger("fedskew")
# One line about how the run executes (what --workers auto chose, a count capped):
# `fedskew run` prints it unless -q; for the Python API it is an INFO record.
notes = logging.getLogger("fedskew.execution")


def run(
    cfg: ExperimentConfig,
    on_round: RoundCallback | None = None,
    resume: Path | None = None,
    on_start: Callable[[int], None] | None = None,
    engine_factory: EngineFactory | None = None,
) -> tuple[Path, dict[str, Any]]:
    """Run the experiment (or continue the one in ``resume``); return the finished run
    folder and the summary.

    ``engine_factory`` builds the engine that carries the algorithm's messages; by default
    the in-process engine, or the worker-pool engine when ``cfg.workers`` asks for worker
    processes (see :func:`default_engine_factory`). The Flower ServerApp passes one that
    sends them through Flower's Grid. The engine is closed when the run ends, also on
    errors. An engine that may lose replies gets its faults recorded per round, and a
    round in which no client replied is skipped with the server state put back.

    The run's TF32 and determinism switches hold while it runs and are put back after it.
    """
    cfg.validate()
    threads = torch.get_num_threads()  # --workers auto may set this process's count
    try:
        with settings_applied(execution_settings(cfg)):
            return _run(cfg, on_round, resume, on_start, engine_factory)
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def _run(
    cfg: ExperimentConfig,
    on_round: RoundCallback | None,
    resume: Path | None,
    on_start: Callable[[int], None] | None,
    engine_factory: EngineFactory | None,
) -> tuple[Path, dict[str, Any]]:
    check_names(cfg)
    check_available(cfg.track)  # a missing tracker package: one line, before any work
    if resume is None:
        check_writable(Path(cfg.out_dir))
    prep = prepare(cfg)
    per_round = cfg.per_round()
    if per_round > len(prep.partition):
        raise UsageError(f"{per_round} clients per round but only {len(prep.partition)} clients")
    ledger = PrivacyLedger(prep, per_round)  # needs the accountant under DP: checked here
    factory = default_engine_factory(cfg) if engine_factory is None else engine_factory
    model = new_model(prep)
    eval_model = new_model(prep)
    setup = server_setup(prep, model)
    server = prep.algorithm.Server(prep.params, setup)
    client_logic = prep.algorithm.Client(prep.params)
    engine = factory(prep, client_logic, model)
    execution = getattr(factory, "execution", None)
    if isinstance(execution, Execution) and (execution.auto or execution.capped):
        notes.info("%s", execution.note())
    if cfg.precision == "bf16" and prep.device.type == "cpu" and not cpu_features()["native_bf16"]:
        notes.warning(
            "bf16 on this CPU is emulated (it shows neither avx512_bf16 nor amx_bf16): "
            "expect it several times slower than fp32"
        )
    for mechanism in inactive_mechanisms(prep, per_round):
        log.warning("%s: %s", prep.algorithm.name, mechanism.line())
    for line in ledger.warnings(cfg.rounds):
        log.warning("%s", line)
    measurements = Measurements(prep, eval_model)
    state = RunState(
        prep, setup, server, engine, eval_model, per_round, measurements=measurements,
        execution=execution if isinstance(execution, Execution) else None, ledger=ledger,
    )  # fmt: skip
    tracking = TrackingSession()  # none until the run folder is open
    try:
        open_folder(state, resume)
        tracking = TrackingSession.start(cfg, state.run_folder, state.history)
        started = time.perf_counter()
        if on_start is not None:
            on_start(state.start_round)
        for rnd in range(state.start_round, cfg.rounds):
            state.playing = rnd + 1
            reset_peaks(prep.device)
            record = play_round(state, rnd)
            record.update(ledger.record(rnd))
            if setup.is_eval_round(rnd):
                t1 = time.perf_counter()
                state.last_eval = evaluate_global_model(state)
                state.last_eval.update(evaluate_local_splits(state, rnd))
                record.update(state.last_eval)
                record["eval_seconds"] = round(time.perf_counter() - t1, 4)
            record.update(measurements.measure(rnd, server, skipped="skipped" in record))
            record.update(memory_peaks(prep.device))
            keep_round(state, rnd, record)
            tracking.log_round(record)
            state.playing = None
            if on_round is not None:
                try:
                    on_round(record)
                except BaseException:
                    # The caller stopped the run (a pruner, a test): not the run's failure.
                    state.stopped_by_caller = True
                    raise
        if cfg.tsne:
            measurements.write_tsne(cfg.rounds - 1, server, state.run_folder.path)
        folder, summary = finish(state, time.perf_counter() - started)
        tracking.finish(folder, summary)
        return folder, summary
    except KeyboardInterrupt:
        tracking.close("killed")
        if state.folder is None:
            raise
        raise RunInterrupted(state) from None
    except Exception as exc:
        if state.folder is not None and not state.stopped_by_caller:
            record_stop(state, exc)
        raise
    finally:
        tracking.close("failed")  # nothing left to close after a finish or an interrupt
        engine.close()
        if state.folder is not None:
            state.folder.release()


def record_stop(state: RunState, exc: Exception) -> None:
    """Write why the run stopped into its unfinished folder (``RunFolder.record_stop``):
    diverged at the round where NaN or Inf appeared, else failed at the round being
    played. A folder that cannot take the record (the disk that failed the run) keeps the
    error on the command line alone."""
    folder = state.run_folder
    if not folder.path.name.endswith(INCOMPLETE):
        return  # finished: the error came after the rename
    if isinstance(exc, Diverged):
        kind, rnd = "diverged", exc.round
    else:
        kind, rnd = "failed", state.playing
    reason = str(exc) if isinstance(exc, FedskewError) else f"{type(exc).__name__}: {exc}"
    try:
        folder.record_stop(kind, rnd, len(state.history), reason.strip() or type(exc).__name__)
    except OSError as err:
        log.warning("could not record the stop in %s: %s", folder.path, err.strerror or err)


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during a run, once its folder exists: says which folder to resume and how.
    A KeyboardInterrupt still, for code that catches that."""

    def __init__(self, state: RunState) -> None:
        done = state.history[-1]["round"] if state.history else 0
        folder = state.run_folder.path
        super().__init__(
            f"interrupted after round {done} of {state.cfg.rounds}; the run folder {folder} "
            f"keeps the finished rounds: continue with  fedskew run --resume {folder}"
        )
        self.folder = folder


def default_engine_factory(cfg: ExperimentConfig) -> DefaultEngineFactory:
    """The in-process engine, or worker processes where ``cfg.workers`` (or ``auto``) asks
    for two or more (``fedskew.config.execution_choice``)."""
    return DefaultEngineFactory(cfg)


class DefaultEngineFactory:
    """Builds a run's engine as ``cfg.workers`` says, and keeps what it chose and why
    (``execution``: for the run's note and processes.jsonl).

    ``auto`` on the CPU estimates the clients' work from the model and the partition
    (``training_work``), never starts more workers than half the available memory holds
    (the dataset once, in shared memory, and each worker's own memory), and sets this
    process's torch threads where the clients train here. Workers on the CPU map the
    dataset from shared memory, and this process then uses those tensors too, so that the
    dataset is held once."""

    def __init__(self, cfg: ExperimentConfig) -> None:
        self.cfg = cfg
        self.execution: Execution | None = None

    def __call__(self, prep: Prepared, client_logic: ClientLogic, model: torch.nn.Module) -> Engine:
        cfg = self.cfg
        on_host = prep.device.type == "cpu"
        work = None
        if cfg.workers == "auto" and cfg.engine == "inprocess" and on_host:
            try:
                work = training_work(prep, model)
            except Exception as exc:  # a model the estimate cannot run: taken as large
                log.debug("no estimate of the clients' work: %s", exc)
        spawn_ok = cfg.workers != "auto" or main_allows_spawn()
        choice = execution_choice(cfg, work, spawn_ok=spawn_ok)
        shared = on_host and shared_memory_available(dataset_nbytes(prep.dataset))
        if choice.auto and choice.workers >= 2:
            fits = affordable_workers(
                dataset_nbytes(prep.dataset), shared=shared, per_worker=worker_bytes(work)
            )
            if fits < choice.workers:
                used = fits if fits >= 2 else 0
                choice = dataclasses.replace(
                    choice,
                    workers=used,
                    threads=choice.threads if used else None,
                    reason=f"{choice.reason}; {plural(fits, 'worker')} fit in half the "
                    "available memory",
                )
        self.execution = choice
        if choice.workers <= 1:
            if choice.threads is not None and choice.auto:
                torch.set_num_threads(choice.threads)
            return InProcessEngine.from_prepared(prep, client_logic, model)
        engine = WorkerPoolEngine(
            prep.cfg,
            workers=choice.workers,
            client_sizes=prep.fed.sizes(),
            threads=choice.threads or 1,
            dataset=prep.dataset if shared else None,
        )
        views = engine.shared_tensors()
        if views is not None:
            use_host_tensors(prep, views)
        return engine


def server_setup(prep: Prepared, model: torch.nn.Module) -> ServerSetup:
    cfg = prep.cfg
    return ServerSetup(
        # The server logic runs on the CPU (its work is aggregation): host copies of the
        # initial weights (the very tensors when the model is on the CPU).
        initial_arrays={k: v.cpu() for k, v in model.state_dict().items()},
        num_clients=len(prep.partition),
        num_classes=prep.dataset.num_classes,
        client_sizes=prep.fed.sizes(),
        seed=cfg.seed,
        train=prep.train,
        rounds=cfg.rounds,
        eval_every=cfg.eval_every,
        privacy=prep.privacy,
    )


@dataclass
class RunState:
    """A run in progress: what its rounds play with, and what they have produced."""

    prep: Prepared
    setup: ServerSetup
    server: ServerLogic
    engine: Engine
    eval_model: torch.nn.Module
    per_round: int
    folder: RunFolder | None = None
    start_round: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    last_eval: dict[str, Any] = field(default_factory=dict)
    measurements: Measurements | None = None  # the metrics asked for besides accuracy
    execution: Execution | None = None  # what the default engine factory chose, and why
    metrics_digest: str = ""  # of the metrics lines of history (saved_state.metrics_digest)
    ledger: PrivacyLedger | None = None  # the privacy spent per round (DP runs)
    playing: int | None = None  # the round (1-based) being played, None between rounds
    stopped_by_caller: bool = False  # an exception from on_round: the caller's, not a failure

    def __post_init__(self) -> None:
        self.client_counts = self.prep.fed.class_counts()

    @property
    def cfg(self) -> ExperimentConfig:
        return self.prep.cfg

    @property
    def run_folder(self) -> RunFolder:
        if self.folder is None:
            raise RuntimeError("the run folder is not open yet")
        return self.folder


def open_folder(state: RunState, resume: Path | None) -> None:
    """Create the run folder, or reopen ``resume`` and restore its last checkpoint."""
    cfg, prep = state.cfg, state.prep
    if resume is None:
        folder = RunFolder.create(Path(cfg.out_dir), default_run_name(cfg))
        folder.claim()
        # config.json makes the folder resumable (RunFolder.reopen), so it comes last: a
        # kill before it leaves a folder that says so, never one without its partition.
        folder.write_partition(prep.clients_data, partition_meta(cfg))
        resolved = resolved_facts(prep, state.per_round)
        if state.ledger is not None:
            resolved.update(state.ledger.facts())
        folder.write_config({**cfg.to_dict(), "resolved": resolved})
    else:
        folder = RunFolder.reopen(resume)
        folder.claim()
        try:
            if not partitions_equal(folder.read_partition(), prep.clients_data):
                raise FedskewError(
                    f"{resume}: the saved partition differs from the one rebuilt from its config"
                )
            restore(state, folder)
            check_saved_trackers(cfg, folder)  # before this process leaves a line in it
        except BaseException:
            folder.release()
            raise
        folder.clear_stop()  # it goes on; a new stop writes its own record
    state.folder = folder
    folder.append_process(
        {
            "from_round": state.start_round + 1,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "workers": state.engine.worker_count,
            **device_facts(prep.device),
            **execution_facts(state),
            "data_source": prep.dataset.source,
            **machine_facts(),
            **software_facts(),
        }
    )


def execution_facts(state: RunState) -> dict[str, Any]:
    """How this process's stretch of the run executes besides its device and worker count
    (processes.jsonl)."""
    cfg, engine = state.cfg, state.engine
    facts: dict[str, Any] = {
        "tf32": cfg.tf32,
        "deterministic": cfg.deterministic,
        "clients_together": engine.clients_together,
        **graph_facts(state),
        # How many of a compare's runs shared this process's GPU (set by compare only).
        **gpu_sharing_facts(),
    }
    if engine.worker_devices:
        facts["worker_devices"] = list(engine.worker_devices)
    # Each worker's torch threads and where its data lives (shared memory, or loaded by
    # each): one value when all agree.
    for key, attribute in (
        ("threads_per_worker", "worker_threads"),
        ("worker_data", "worker_data"),
    ):
        values = getattr(engine, attribute, None)
        if engine.worker_count and values:
            facts[key] = values[0] if len(set(values)) == 1 else values
    if state.execution is not None:
        facts["workers_reason"] = state.execution.reason  # what auto chose, a count capped
    # Measured, not assumed: what this process's thread pool does with denormals, and what
    # the worker processes or nodes reported (an engine of a user's may not say).
    facts["denormals"] = denormals_state()
    client_denormals = getattr(engine, "client_denormals", None)
    if client_denormals:
        facts["client_denormals"] = dict(client_denormals)
    # What each Flower node said it computes with (torch, fedskew, device): a deployed
    # run's clients are computed on other machines than this line's.
    client_nodes = getattr(engine, "client_nodes", None)
    if client_nodes:
        facts["nodes"] = [dict(n) for n in client_nodes]
    return facts


def graph_facts(state: RunState) -> dict[str, Any]:
    """Whether this process's local steps replay as CUDA graphs (``cuda_graphs``: on or off)
    and, where not everywhere, why (``cuda_graphs_reason``), as fedskew.training.graph_step
    decides for the run's device and model."""
    graphs, reason = resolve_graphs(state.cfg.cuda_graphs, state.prep.device, state.eval_model)
    facts: dict[str, Any] = {"cuda_graphs": "on" if graphs else "off"}
    if not graphs:
        facts["cuda_graphs_reason"] = reason
    elif state.engine.clients_together in ("vmap", "fused"):
        # A chunk's steps whose clients' batches are all of one size replay; the others
        # (a short last batch among full ones) run eagerly.
        facts["cuda_graphs_reason"] = (
            f"clients trained together (--clients-together {state.engine.clients_together}) "
            "replay the steps whose batches are of one size; steps with a short last batch "
            "among them run eagerly"
        )
    return facts


def restore(state: RunState, folder: RunFolder) -> None:
    """Continue from the folder's checkpoint, with metrics.jsonl made to agree with it.

    Rounds whose metrics line came after the last checkpoint run again (their lines go);
    the line of the checkpoint's own round, lost when a kill fell between the checkpoint
    and the line, is taken from the checkpoint. Anything else (lines missing further back,
    a checkpoint of another run) cannot be reconciled and stops the resume."""
    rows = folder.read_metrics()
    done = 0
    if folder.checkpoint_path.exists():
        path = folder.checkpoint_path
        ckpt = read_checkpoint(path)
        check_checkpoint(
            ckpt, path, state.prep.algorithm.name, config_hash(state.cfg), state.cfg.rounds
        )
        done = ckpt.round
        record = ckpt.record  # any value: checked with the lines below
        if len(rows) == done - 1 and isinstance(record, dict) and _is_round(record, done):
            rows.append(record)
        if len(rows) < done:
            raise FedskewError(
                f"{folder.metrics_path} has the metrics of rounds 1..{len(rows)} but "
                f"{path} holds round {done}: cannot reconcile them, so this run cannot be resumed"
            )
        check_saved_state(ckpt, path, rows[:done], folder.metrics_path, saved_state_spec(state))
        load_server_state(state.server, ckpt.server)
        state.engine.restore_client_states(ckpt.clients)
    state.start_round = done
    state.history = rows[:done]
    state.metrics_digest = metrics_digest(state.history)
    folder.keep_metrics(state.history)
    state.last_eval = next(
        ({k: v for k, v in r.items() if is_eval_key(k)}
         for r in reversed(state.history) if "accuracy" in r),
        {},
    )  # fmt: skip


def _is_round(record: dict[str, Any], number: int) -> bool:
    value = record.get("round")
    return type(value) is int and value == number


def saved_state_spec(state: RunState) -> SavedStateSpec:
    """What this run's checkpoints and metrics lines hold, for a resume to check its folder."""
    prep, cfg = state.prep, state.cfg
    algorithm, model = prep.algorithm, state.eval_model  # the run's architecture
    num_classes, num_clients = prep.dataset.num_classes, len(prep.partition)
    series: tuple[str, ...] = ()
    if prep.local_test is not None:
        personal = has_personal_part(algorithm.Client)
        series = ("client_accuracy", *(("client_personal_accuracy",) if personal else ()))
    records = RecordSpec(
        num_clients=num_clients,
        num_classes=num_classes,
        sampled=lambda rnd: sample_clients(cfg.seed, rnd, num_clients, state.per_round),
        evaluated=state.setup.is_eval_round,
        features_due=lambda rnd: due(cfg.feature_metrics_every, rnd, cfg.rounds),
        local_series=series,
    )
    return SavedStateSpec(
        algorithm=algorithm.name,
        server=state.server,
        fields=algorithm.checkpoint_specs(prep.params, model, num_classes),
        client_parts=algorithm.client_state(prep.params, model, num_classes),
        records=records,
        clients_here=isinstance(state.engine, ServerSideClientStates),
    )


def partition_meta(cfg: ExperimentConfig) -> dict[str, Any]:
    if cfg.partition_file is not None:
        return {"scheme": "file", "file": str(Path(cfg.partition_file).resolve())}
    return {"scheme": cfg.partition, **cfg.partition_params}


def play_round(state: RunState, rnd: int) -> dict[str, Any]:
    """The server plays round ``rnd`` over the engine; its metrics line without evaluation."""
    cfg, engine, server = state.cfg, state.engine, state.server
    clients = sample_clients(cfg.seed, rnd, len(state.prep.partition), state.per_round)
    engine.begin_round(rnd)
    channel = FiniteReplies(engine, rnd, drop=cfg.on_divergence == "drop")
    lossy = engine.may_lose_replies or channel.drop
    # A round may lose replies part-way; its server state is then put back.
    before = copy.deepcopy(server_state(server)) if lossy else None
    t0 = time.perf_counter()
    served = channel if state.measurements is None else state.measurements.channel(rnd, channel)
    try:
        with device_replies(engine, served is channel and server.takes_device_replies()):
            round_metrics = server.round(rnd, clients, served)
    except Diverged as exc:
        cause = dp_noise_cause(state)
        if not cause:
            raise
        raise Diverged(f"{exc}. {cause}", exc.round) from None
    except NoReplies as exc:
        assert before is not None  # only lost or dropped replies leave a round without any
        load_server_state(server, before)
        log.warning("round %d skipped: %s", rnd + 1, exc)
        round_metrics = {"skipped": 1.0}
    round_seconds = time.perf_counter() - t0
    faults = engine.faults()
    trained = [c for c in clients if c not in faults.missing and c not in channel.dropped]
    record: dict[str, Any] = {
        "round": rnd + 1,
        "clients": clients,
        "samples": cfg.local_epochs * sum(len(state.prep.partition[c]) for c in trained),
        "bytes_down": engine.traffic.bytes_down,
        "bytes_up": engine.traffic.bytes_up,
        "exchanges": engine.traffic.exchanges,
        "seconds": round(round_seconds, 4),
        **{k: float(v) for k, v in round_metrics.items()},
    }
    if engine.may_lose_replies:
        record["missing_replies"] = sorted(faults.missing)
        record["rejected_replies"] = sorted(faults.rejected)
    if channel.drop:
        record["diverged_replies"] = sorted(channel.dropped)
    where = non_finite_array(server.global_arrays)
    if where is not None:
        raise Diverged(
            f"round {rnd + 1}: the global model has NaN or Inf in '{where}' after aggregation; "
            "the last good checkpoint is kept (lower --lr, or add --grad-clip)"
            + (f". {cause}" if (cause := dp_noise_cause(state)) else ""),
            rnd + 1,
        )
    for name in server.checkpoint_fields:
        where = non_finite_in(getattr(server, name), name)
        if where is not None:
            # SCAFFOLD's c, FedDyn's h, FedFM's anchors: a reply that passed the checks can
            # still overflow the server's own state, which the next checkpoint would keep.
            raise Diverged(
                f"round {rnd + 1}: the server state has NaN or Inf in '{where}' after "
                "aggregation; the last good checkpoint is kept (lower --lr, add --grad-clip, "
                "or look for a client sending extreme values)",
                rnd + 1,
            )
    drift = changed_entry(state.setup.initial_arrays, server.global_arrays)
    if drift is not None:
        # A client replying in float64 would make every later checkpoint another model's:
        # stop before it is saved, while the finished rounds still resume.
        raise FedskewError(
            f"round {rnd + 1}: after aggregation the global model's {drift}; the last good "
            "checkpoint is kept (the algorithm's clients must reply with the model's dtypes "
            "and shapes)"
        )
    return record


@contextmanager
def device_replies(engine: Engine, allowed: bool) -> Iterator[None]:
    """For the block, the in-process engine leaves the replies' arrays on its device where
    ``allowed`` (the server computes with them there; no measurement wraps its channel, as
    the local-risk one keeps the replies on the host). Other engines' replies come from other
    processes, in host memory."""
    if not (allowed and isinstance(engine, InProcessEngine)):
        yield
        return
    engine.replies_on_device = True
    try:
        yield
    finally:
        engine.replies_on_device = False


def dp_noise_cause(state: RunState) -> str:
    """Under DP, what noise the model a client diverged on carried: the noise follows the
    clip norm, which adaptive clipping grows while updates are larger than it; noise that
    wrecks the model makes the next updates larger still, and training ends in NaN ("client
    11: NaN" at a clip norm grown from 1 to 155 on digits) with no fault of the client or of
    --lr. "" without DP or before any round was played."""
    privacy = state.prep.privacy
    if privacy is None or privacy.dp == "off" or not state.history:
        return ""
    last = state.history[-1]
    clip = last.get("dp_clip")
    if clip is None:
        return ""
    if privacy.local:
        std, where = privacy.noise * clip, "each client's update"
    else:
        std, where = last.get("dp_noise_std", 0.0), "the mean update"
    grown = (
        f", grown from {privacy.clip:g} by adaptive clipping"
        if privacy.adaptive and clip > privacy.clip
        else ""
    )
    remedy = (
        "fixed clipping, or a lower dp-target-quantile or dp-clip-lr, keeps it smaller"
        if privacy.adaptive
        else "a smaller dp-clip or dp-noise keeps it smaller"
    )
    return (
        f"Under DP the model it trained had Gaussian noise of deviation {std:.3g} per value "
        f"on {where} in round {last['round']} (clip norm {clip:.3g}{grown}); noise that "
        f"large can wreck the model and make training diverge ({remedy})"
    )


def changed_entry(
    initial: Mapping[str, torch.Tensor], now: Mapping[str, torch.Tensor]
) -> str | None:
    """How the global model's entries differ from the initial model's in name, dtype or
    shape (the first difference found), or None."""
    for name, tensor in initial.items():
        got = now.get(name)
        if got is None:
            return f"'{name}' is missing"
        if got.dtype != tensor.dtype or got.shape != tensor.shape:
            return (
                f"'{name}' is {tuple(got.shape)} {got.dtype}, was {tuple(tensor.shape)} "
                f"{tensor.dtype}"
            )
    extra = sorted(set(now) - set(initial))
    return f"'{extra[0]}' is new" if extra else None


class FiniteReplies:
    """The engine as the server logic sees it: replies with NaN or Inf (a diverged client)
    stop the run with the round and client named, or with ``drop`` are left out."""

    def __init__(self, engine: Engine, rnd: int, drop: bool) -> None:
        self.engine = engine
        self.round = rnd
        self.drop = drop
        self.dropped: set[int] = set()

    def exchange(
        self, messages: Mapping[int, Message], expect: Expected | None = None
    ) -> dict[int, Message]:
        replies = self.engine.exchange(messages, expect)
        for cid in list(replies):
            where = non_finite_value(replies[cid])
            if where is None:
                continue
            if not self.drop:
                raise Diverged(
                    f"round {self.round + 1}: client {cid} diverged (NaN or Inf in its "
                    f"reply's '{where}'); the last good checkpoint is kept. Lower --lr, add "
                    "--grad-clip, or --on-divergence drop to leave such replies out",
                    self.round + 1,
                )
            log.warning("round %d: reply of client %d dropped: NaN or Inf in '%s'",
                        self.round + 1, cid, where)  # fmt: skip
            self.dropped.add(cid)
            del replies[cid]
        return replies

    def exchange_summed(
        self, messages: Mapping[int, Message], expect: Expected, request: SumRequest
    ) -> Summed:
        """A summed exchange (``fedskew.training.privacy``): secure on an engine that sums
        itself (Flower's SecAgg+); otherwise over the replies, which pass the checks above
        first: SecAgg+'s arithmetic simulated, or the plain mean without secure aggregation."""
        native = getattr(self.engine, "exchange_summed", None)
        if request.secure and native is not None:
            summed: Summed = native(messages, expect, request)
            return summed
        replies = self.exchange(messages, expect)
        if not request.secure:
            return plain_mean(replies, request)
        summed, extra = simulated_secure_mean(replies, request)
        # What SecAgg+ sends up is the masked int64 vectors, not the float summands.
        self.engine.traffic.bytes_up += extra
        return summed


def non_finite_array(arrays: Mapping[str, torch.Tensor]) -> str | None:
    """The name of a floating tensor holding NaN or Inf (the first, where all are on one
    device), or None. Every reply of a round and the new global model pass here, so: each
    tensor's extremes (``aminmax``: a NaN propagates into them, an Inf is one of them) in one
    pass without a boolean copy of every element (about 10x faster on a CPU than
    ``isfinite(t).all()``), and one read back per device, not one per tensor (on a GPU each is
    a synchronisation; ResNet-18 has 122 tensors)."""
    floats = [(name, t) for name, t in arrays.items() if t.is_floating_point() and t.numel()]
    for device in dict.fromkeys(t.device for _, t in floats):
        named = [(name, t) for name, t in floats if t.device == device]
        # float64 holds the extremes of every floating dtype exactly.
        extremes = torch.stack(
            [torch.stack(torch.aminmax(t.detach())).to(torch.float64) for _, t in named]
        )
        finite = torch.isfinite(extremes).all(dim=1)
        if not bool(finite.all()):
            return named[int(torch.nonzero(~finite)[0])][0]
    return None


def non_finite_in(value: Any, where: str) -> str | None:
    """Where in ``value`` (tensors and float arrays, inside dicts, lists and tuples) a NaN
    or Inf is, as 'field.key[index]', or None. Plain numbers are left alone: a server may
    keep an infinite bound on purpose."""
    if isinstance(value, torch.Tensor):
        finite = not value.is_floating_point() or bool(torch.isfinite(value).all())
        return None if finite else where
    if isinstance(value, np.ndarray):
        finite = value.dtype.kind != "f" or bool(np.isfinite(value).all())
        return None if finite else where
    if isinstance(value, Mapping):
        items: Any = ((f"{where}.{k}", v) for k, v in value.items())
    elif isinstance(value, list | tuple):
        items = ((f"{where}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for name, inner in items:
        found = non_finite_in(inner, name)
        if found is not None:
            return found
    return None


def non_finite_value(msg: Message) -> str | None:
    """The name of the first array or number of ``msg`` holding NaN or Inf, or None."""
    where = non_finite_array(msg.arrays)
    if where is not None:
        return where
    for name, value in msg.scalars.items():
        if not np.isfinite(value):
            return name
    return None


def evaluate_global_model(state: RunState) -> dict[str, Any]:
    """Accuracy, loss, per-class accuracy and accuracy on the clients' label distributions
    of the model the server logic says to score."""
    prep = state.prep
    set_arrays(state.eval_model, state.server.eval_arrays())
    result = evaluate(
        state.eval_model,
        prep.x_test,
        prep.y_test,
        prep.dataset.num_classes,
        precision=prep.train.precision,
    )
    return {
        "accuracy": result.accuracy,
        "loss": result.loss,
        "client_dist_accuracy": client_distribution_accuracy(
            result.per_class_accuracy, state.client_counts
        ),
        "per_class_accuracy": [
            None if np.isnan(a) else round(float(a), 6) for a in result.per_class_accuracy
        ],
    }


def evaluate_local_splits(state: RunState, rnd: int) -> dict[str, Any]:
    """The per-client part of an evaluation round (--local-test-fraction), else nothing."""
    local = state.prep.local_test
    if local is None:
        return {}
    return evaluate_on_clients(
        state.engine,
        rnd,
        state.server.eval_arrays(),
        [len(t) for t in local],
        has_personal_part(state.prep.algorithm.Client),
    )


def keep_round(state: RunState, rnd: int, record: dict[str, Any]) -> None:
    """The round's checkpoint (when due), then its metrics line: metrics of a round are
    only kept once its state is safe."""
    cfg, folder = state.cfg, state.run_folder
    digest = metrics_digest([record], state.metrics_digest)
    if cfg.checkpoint_every and ((rnd + 1) % cfg.checkpoint_every == 0 or rnd + 1 == cfg.rounds):
        save_checkpoint(
            folder.checkpoint_path,
            rnd + 1,
            state.server,
            state.engine.client_states,
            algorithm=state.prep.algorithm.name,
            config_hash=config_hash(cfg),
            record=record,
            metrics_digest=digest,
        )
    folder.append_metrics(record)
    state.history.append(record)
    state.metrics_digest = digest


def privacy_state(server: Any) -> dict[str, float] | None:
    """The server's privacy state (the adaptive clip norm), where its algorithm keeps one."""
    found = getattr(server, "privacy_state", None)
    return found if isinstance(found, dict) else None


def check_some_round_played(history: list[dict[str, Any]]) -> None:
    """A run whose every round was skipped (no reply arrived or could be summed) trained
    nothing: its model is the initial one, and a summary would read as a result."""
    if history and all("skipped" in row for row in history):
        raise FedskewError(
            f"every round ({len(history)}) was skipped: no client's reply arrived or could be "
            "summed, so the model is the initial one (the warnings above say why each round "
            "was skipped)"
        )


def finish(state: RunState, seconds_this_process: float) -> tuple[Path, dict[str, Any]]:
    """Write the summary and give the run folder its final name (a run that played no
    round is a failure, not a result)."""
    check_some_round_played(state.history)
    folder = state.run_folder
    summary = make_summary(
        state.cfg,
        state.prep,
        state.per_round,
        len(state.prep.partition),
        state.history,
        state.last_eval,
    )
    summary.update(final_values(state.history))  # final_personal_accuracy and the like
    summary.update(per_class_summary(state.history))
    if state.ledger is not None:
        summary.update(state.ledger.summary(state.history, privacy_state(state.server)))
    summary.update(client_state_size(state.engine))
    summary.update(run_peaks(state.history))
    summary["wall_seconds_this_process"] = round(seconds_this_process, 3)
    summary["processes"] = folder.read_processes()
    return folder.finish(summary), summary


def client_state_size(engine: Engine) -> dict[str, int]:
    """The largest client's state in bytes and how many clients hold one, at the end of the
    run: the numbers a report would otherwise read from checkpoint.npz, kept in the summary
    because checkpoints are often deleted or not shared. Empty where the clients keep their
    state themselves (Flower), as this process cannot see it."""
    if not isinstance(engine, ServerSideClientStates):
        return {}
    largest, holders = largest_state(engine.client_states)
    return {"client_state_bytes_max": largest, "clients_with_state": holders}


EVAL_KEYS = ("accuracy", "loss", "client_dist_accuracy", "per_class_accuracy")


def is_eval_key(key: str) -> bool:
    """Whether a metrics record's ``key`` is a result of the evaluation of its round."""
    return key in EVAL_KEYS or is_local_evaluation_key(key)


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
        **{
            f"final_{name}_{stat}": last_eval[f"{name}_{stat}"]
            for name in CLIENT_SERIES
            for stat in ("mean", "std", "worst10", "gap")
            if f"{name}_{stat}" in last_eval
        },
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
    name = f"{cfg.algorithm}-{cfg.dataset}-{cfg.partition}-s{cfg.seed}-{stamp}"
    # module:Name references and local objects make names with ':' or '/': one component.
    return re.sub(r"[^A-Za-z0-9._+-]", "-", name)
