"""``fedskew run --engine flower-sim``: the experiment on Flower's Simulation Runtime, run the
way Flower runs a local simulation now (``flwr.simulation.run_simulation`` is deprecated): a
SuperLink of its own in simulation mode, and the fedskew app submitted to it with ``flwr run``.

The experiment travels as the app's run config (:func:`simulation_run_config`), the virtual
SuperNodes and their resources as federation config. The SuperLink (on a free port of
127.0.0.1, its FLWR_HOME a temporary folder) gets ``FEDSKEW_OUTPUT_ROOT`` = the run's ``-o``
folder, so the ServerApp writes the run folder where ``fedskew run`` would, and
``FEDSKEW_SIMULATION`` so that the run folder says ``flower-sim``. The rounds reach
``on_round`` from the run folder's metrics.jsonl as the ServerApp writes them.

Every process the simulation starts (the SuperLink, its SuperExec, the simulation process,
Ray's) inherits a tag in its environment; when the run ends, successfully or not, any tagged
process still running is ended, and nothing else.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fedskew.apps.flower.app_config import write_app
from fedskew.apps.flower.processes import end_processes, tagged_processes
from fedskew.apps.flower.run_config import OUTPUT_ROOT_VARIABLE, SIMULATION_VARIABLE
from fedskew.apps.flower.submit import (
    check_finished,
    config_pairs,
    flower_command,
    follow_log,
    run_status,
    start_run,
)
from fedskew.config import TABLES, ExperimentConfig, parse_pair
from fedskew.core.device import resolve_device
from fedskew.core.durable import read_jsonl
from fedskew.core.errors import FedskewError, UsageError
from fedskew.runs.folder import INCOMPLETE
from fedskew.runs.loop import default_run_name

# Processes started by a Flower simulation carry this variable (see run_simulation).
PROCESS_TAG_VARIABLE = "FEDSKEW_SIMULATION_TAG"
CONNECTION = "fedskew-simulation"  # the SuperLink connection, in the temporary FLWR_HOME
START_SECONDS = 120.0  # until the SuperLink listens
POLL_SECONDS = 0.5


def run_simulation(
    cfg: ExperimentConfig,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    on_start: Callable[[int], None] | None = None,
    resume: Path | None = None,
    cpus_per_client: float = 1.0,
    setup_timeout: float | None = None,
    gpus_per_client: float | None = None,
) -> tuple[Path, dict[str, Any]]:
    """``fedskew run --engine flower-sim``: the experiment on Flower's Simulation Runtime
    (Ray backend), one virtual SuperNode per client; the finished run folder and its
    summary. The setup waits as :func:`~fedskew.apps.flower.server.handshake` says
    (``setup_timeout``: seconds without an answer; None: grows with the load).

    On CUDA (``device`` cuda, or auto with a GPU) each virtual client gets a GPU fraction,
    ``gpus_per_client`` (default: the visible GPUs shared by the clients of a round), and
    Ray shows each client actor its GPU as cuda:0."""
    cfg.validate()
    if gpus_per_client is None:
        gpus_per_client = simulation_gpus_per_client(cfg)
    root = Path(cfg.out_dir).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    if resume is not None:
        folder = Path(resume).resolve()
        name = folder.name.removesuffix(INCOMPLETE)
        run_config: dict[str, Any] = {"resume": str(folder)}
    else:
        name = default_run_name(cfg)
        folder = root / f"{name}{INCOMPLETE}"
        run_config = {**simulation_run_config(cfg, root), "name": name}
    run_config["setup-timeout"] = float(setup_timeout or 0.0)
    federation = {
        "num-supernodes": cfg.num_clients,
        "client-resources-num-cpus": max(1, math.ceil(cpus_per_client)),
        "client-resources-num-gpus": float(gpus_per_client),
        "init-args-logging-level": "error",
        "init-args-log-to-driver": False,
    }
    tag = uuid.uuid4().hex
    with tempfile.TemporaryDirectory(prefix="fedskew-flower-sim-") as scratch:
        home = Path(scratch)
        env = {
            "FLWR_HOME": str(home),
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
            OUTPUT_ROOT_VARIABLE: str(root),
            SIMULATION_VARIABLE: "1",
            PROCESS_TAG_VARIABLE: tag,
            # The app's dependency is this fedskew, already here: nothing to install.
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        }
        if cfg.data_dir:
            env["FEDSKEW_DATA"] = str(Path(cfg.data_dir).expanduser().resolve())
        try:
            _start_superlink(home, env)
            app = write_app(home / "app")
            run_id = start_run(
                app, CONNECTION, [config_pairs(run_config)], config_pairs(federation), env=env
            )
            logs = follow_log(run_id, CONNECTION, subprocess.DEVNULL if cfg.quiet else None, env)
            done = len(_rows(folder))
            if on_start is not None:
                on_start(done)
            while logs.poll() is None:
                done = _report_rounds(folder, root / name, done, on_round)
                time.sleep(POLL_SECONDS)
            _report_rounds(folder, root / name, done, on_round)
            check_finished(run_status(run_id, CONNECTION, env))
        finally:
            ended = end_processes(tagged_processes(PROCESS_TAG_VARIABLE, tag))
            if ended and not cfg.quiet:
                print(f"fedskew: ended {len(ended)} processes of the simulation", file=sys.stderr)
    finished = root / name
    try:
        summary = json.loads((finished / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise FedskewError(f"the Flower simulation ended without a run folder {finished}") from None
    return finished, summary


def simulation_run_config(cfg: ExperimentConfig, root: Path) -> dict[str, Any]:
    """The Flower run config of ``cfg`` for a ServerApp whose output root is ``root`` (the
    run's own folder): every key the app declares, "" for unset, tables as text."""
    from fedskew.apps.flower.run_config import NOT_IN_RUN_CONFIG

    values: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        if f.name in NOT_IN_RUN_CONFIG or f.name in ("out_dir", "name"):
            continue
        value = getattr(cfg, f.name)
        key = f.name.replace("_", "-")
        if f.name == "partition_file" and value:
            values[key] = _inside(root, Path(value), "--partition-file")
        elif f.name in TABLES:
            values[key] = _table_text(f.name, value or {})
        elif f.name == "track":
            values[key] = ",".join(value or [])
        else:
            values[key] = "" if value is None else value
    return values


def _table_text(name: str, table: dict[str, Any]) -> str:
    """``{"lam": 10}`` -> ``"lam=10"``, refused where the text would not read back the same
    (a value with a space, a comma or an equals sign in it)."""
    items = []
    for key, value in table.items():
        text = f"{key}={str(value).lower() if isinstance(value, bool) else value}"
        if "," in text or " " in text or parse_pair(text, name) != (key, value):
            raise UsageError(
                f"--engine flower-sim passes {name} to Flower as text of key=value pairs, and "
                f"{key}={value!r} does not read back the same: run it in process"
            )
        items.append(text)
    return " ".join(items)


def _inside(root: Path, path: Path, option: str) -> str:
    """``path`` relative to ``root``: the ServerApp reads only inside its output root."""
    resolved = path.expanduser().resolve()
    if resolved != root and root not in resolved.parents:
        raise UsageError(
            f"{option} {path}: --engine flower-sim reads files only inside the output folder "
            f"{root} (-o), as a deployed ServerApp does: copy it there"
        )
    return str(resolved.relative_to(root))


def _rows(folder: Path) -> list[dict[str, Any]]:
    path = folder / "metrics.jsonl"
    return read_jsonl(path) if path.is_file() else []


def _report_rounds(
    running: Path,
    finished: Path,
    done: int,
    on_round: Callable[[dict[str, Any]], None] | None,
) -> int:
    """Pass the rounds written since the ``done`` first to ``on_round``; the count now."""
    rows = _rows(running) or _rows(finished)  # renamed when the run finishes
    for row in rows[done:]:
        if on_round is not None:
            on_round(row)
    return max(done, len(rows))


def _start_superlink(home: Path, env: dict[str, str]) -> None:
    """A SuperLink in simulation mode on a free port of 127.0.0.1, and the connection to it
    in ``home``'s config.toml. A port taken between choosing and binding it: another one."""
    log = home / "superlink.log"
    for _ in range(3):
        port = _free_port()
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [flower_command("flower-superlink"), "--simulation", "--insecure",
                 "--host", "127.0.0.1", "--port", str(port),
                 "--disable-runtime-dependency-installation"],  # fmt: skip
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **env}, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + START_SECONDS
        while proc.poll() is None and not _listening(port):
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if proc.poll() is None and _listening(port):
            (home / "config.toml").write_text(
                f'[superlink.{CONNECTION}]\naddress = "127.0.0.1:{port}"\ninsecure = true\n',
                encoding="utf-8",
            )
            return
        proc.kill()
    said = log.read_text(errors="replace").strip().splitlines()
    raise FedskewError(
        f"Flower's SuperLink did not start for the simulation: {said[-1] if said else 'no output'}"
    )


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


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
