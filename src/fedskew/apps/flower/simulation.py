"""``fedskew run --engine flower-sim``: the experiment on Flower's simulation engine."""

from __future__ import annotations

import logging
import math
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedskew.apps.flower.client import client_app
from fedskew.apps.flower.processes import end_processes, tagged_processes
from fedskew.apps.flower.server import serve
from fedskew.config import ExperimentConfig
from fedskew.core.device import resolve_device
from fedskew.core.errors import FedskewError, UsageError

log = logging.getLogger("fedskew")
# Processes started by a Flower simulation carry this variable (see run_simulation).
PROCESS_TAG_VARIABLE = "FEDSKEW_SIMULATION_TAG"


def run_simulation(
    cfg: ExperimentConfig,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    on_start: Callable[[int], None] | None = None,
    resume: Path | None = None,
    cpus_per_client: float = 1.0,
    setup_timeout: float | None = None,
    gpus_per_client: float | None = None,
) -> tuple[Path, dict[str, Any]]:
    """``fedskew run --engine flower-sim``: the experiment on Flower's simulation engine
    (Ray backend), one virtual SuperNode per client. The setup waits as :func:`handshake`
    says (``setup_timeout``: seconds without an answer; None: grows with the load).

    Every process the simulation starts inherits a tag in its environment; when it ends,
    successfully or not, any tagged process still running (Ray may leave a ClientAppActor
    that was still starting when the run failed) is ended, and nothing else.

    On CUDA (``device`` cuda, or auto with a GPU) each virtual client gets a GPU fraction,
    ``gpus_per_client`` (default: the visible GPUs shared by the clients of a round), and
    Ray shows each client actor its GPU as cuda:0."""
    from flwr.simulation import run_simulation as flower_run_simulation

    if gpus_per_client is None:
        gpus_per_client = simulation_gpus_per_client(cfg)

    outcome: dict[str, Any] = {}
    app = ServerApp()

    @app.main()
    def _main(grid: Grid, context: Context) -> None:
        try:
            outcome["result"] = serve(
                grid, cfg, on_round, on_start, resume, setup_timeout=setup_timeout
            )
        except BaseException as exc:  # re-raised below, outside Flower's thread
            outcome["error"] = exc

    if cfg.quiet:
        logging.getLogger("flwr").setLevel(logging.WARNING)
    tag = uuid.uuid4().hex
    previous = os.environ.get(PROCESS_TAG_VARIABLE)
    os.environ[PROCESS_TAG_VARIABLE] = tag
    try:
        flower_run_simulation(
            server_app=app,
            client_app=client_app,
            num_supernodes=cfg.num_clients,
            backend_config={
                "client_resources": {"num_cpus": cpus_per_client, "num_gpus": gpus_per_client},
                "init_args": {"log_to_driver": False, "logging_level": "error"},
            },
        )
    finally:
        if previous is None:
            os.environ.pop(PROCESS_TAG_VARIABLE, None)
        else:
            os.environ[PROCESS_TAG_VARIABLE] = previous
        ended = end_processes(tagged_processes(PROCESS_TAG_VARIABLE, tag))
        if ended:
            log.info("ended %d processes the Flower simulation left running", len(ended))
    if "error" in outcome:
        raise outcome["error"]
    if "result" not in outcome:
        raise FedskewError("the Flower simulation ended without a result (see its log)")
    return outcome["result"]


def simulation_gpus_per_client(cfg: ExperimentConfig) -> float:
    """The GPU fraction of a virtual client: 0 on the CPU, else 1/k with k the clients each
    GPU must hold for a round's clients to train at once (at most one GPU each). Ray places
    a fraction below 1 on a single GPU, so 2 GPUs and 3 clients take 1/2 each, not 2/3 (two
    of which would not fit on one GPU)."""
    if cfg.device.startswith("cuda:"):
        raise UsageError(
            "--engine flower-sim places its clients on the GPUs through Ray (each client "
            "actor sees its GPU as cuda:0): use --device cuda or auto"
        )
    device = resolve_device(cfg.device)
    if device.type != "cuda":
        return 0.0
    return 1.0 / math.ceil(cfg.per_round() / torch.cuda.device_count())
