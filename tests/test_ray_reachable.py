"""A --ray-address whose port accepts connections but is no Ray cluster (a silent listener:
a firewall's or a stopped process's backlog; another service) is one line within the wait,
not a ray.init that waits for ever (issue 50's replay: benchmarks/reliability_replay.py found
compare and tune hanging past 120 s on such a port; only a closed port was one line)."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedskew.core.errors import UsageError
from fedskew.grid.executors.ray_executor import check_reachable

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def silent() -> Iterator[str]:
    """An address that accepts connections (the kernel's backlog) and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield f"127.0.0.1:{listener.getsockname()[1]}"


def serve(handle) -> tuple[str, threading.Event]:
    """A one-connection TCP server on a thread that answers with ``handle(conn)``."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    done = threading.Event()

    def accept() -> None:
        conn, _ = listener.accept()
        with conn, listener:
            handle(conn)
            done.wait(10)

    threading.Thread(target=accept, daemon=True).start()
    return f"127.0.0.1:{listener.getsockname()[1]}", done


def test_a_port_that_never_answers_is_one_line_within_the_wait(silent):
    started = time.monotonic()
    with pytest.raises(UsageError, match="nothing answered within 1 s: not a Ray cluster") as e:
        check_reachable(silent, seconds=1)
    assert "\n" not in str(e.value) and time.monotonic() - started < 5


def test_another_protocol_is_one_line():
    httpd = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with pytest.raises(UsageError, match="not as gRPC does"):
            check_reachable(f"127.0.0.1:{httpd.server_address[1]}", seconds=2)
    finally:
        httpd.shutdown()
        httpd.server_close()

    def read_preface_and_close(conn: socket.socket) -> None:
        # Read all that was sent first: closing on unread bytes would reset the connection.
        got = b""
        while len(got) < 33 and (more := conn.recv(64)):
            got += more
        conn.close()

    address, done = serve(read_preface_and_close)
    with pytest.raises(UsageError, match="closed the connection"):
        check_reachable(address, seconds=2)
    done.set()


def test_an_http2_server_passes():
    # What a gRPC server (Ray's GCS) sends first: its SETTINGS frame on stream 0.
    address, done = serve(lambda conn: conn.sendall(bytes([0, 0, 6, 4, 0, 0, 0, 0, 0])
                                                    + bytes([0, 3, 0, 0, 0, 100])))  # fmt: skip
    check_reachable(address, seconds=2)
    done.set()


def test_a_grpc_server_passes():
    grpc = pytest.importorskip("grpc")
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        check_reachable(f"127.0.0.1:{port}", seconds=5)
    finally:
        server.stop(None)


@pytest.mark.parametrize("command", ["compare", "tune"])
def test_compare_and_tune_on_a_silent_port_are_one_line_soon(tmp_path, silent, command):
    pytest.importorskip("ray")
    if command == "tune":
        pytest.importorskip("optuna")
    experiment = (
        '[experiment]\ndataset = "digits"\nnum_clients = 4\nclients_per_round = 2\n'
        "rounds = 1\nlocal_epochs = 1\n"
    )
    file = tmp_path / f"{command}.toml"
    if command == "tune":
        file.write_text(
            '[tune]\ntrials = 1\nseeds = [100]\nlast = 1\npruner = "none"\n'
            'sampler = "random"\n[compare]\nseeds = [0]\nthreads = 1\n'
            + experiment
            + "[methods.fedavg.search]\nlr = { log = [0.01, 0.1] }\n"
        )
        args = ["tune", "-c", str(file), "-o", str(tmp_path / "t")]
    else:
        file.write_text(
            f'[compare]\nout_dir = "{tmp_path / "out"}"\nseeds = [0]\njobs = 1\nthreads = 1\n'
            + experiment
            + "[methods.fedavg]\n"
        )
        args = ["compare", "-c", str(file)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "fedskew", *args, "--executor", "ray", "--ray-address", silent]
    started = time.monotonic()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=90)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert f"cannot reach the Ray cluster at {silent}" in done.stderr
    assert time.monotonic() - started < 60
