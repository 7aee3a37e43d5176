"""What TensorBoard shows: the scalars its web server serves (the HTTP data API its pages
read, ``/data/plugin/scalars/...``), with TensorBoard started as tracking.md tells a user to
start it, ``tensorboard --logdir DIR``, on a free port of this machine.

TensorBoard reads event files through one of two loaders: the fast one, the Rust data server
of the ``tensorboard-data-server`` package (``--load_fast=true``; the default ``auto`` picks it
wherever that package has its binary), and the Python one (``--load_fast=false``). Reading the
event files with TensorBoard's Python classes is not enough: float64 tensor summaries read
back there, while the fast loader leaves the run that holds them empty."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

Series = dict[str, list[tuple[int, float]]]


def data_server_binary() -> str | None:
    """The Rust data server's binary the default loader runs, or None where it is absent
    (then ``auto`` falls back to the Python loader)."""
    try:
        from tensorboard_data_server import server_binary
    except ImportError:
        return None
    return server_binary()


def _command() -> list[str]:
    script = Path(sys.executable).with_name("tensorboard")  # what `tensorboard` runs
    return [str(script)] if script.is_file() else [sys.executable, "-m", "tensorboard.main"]


@contextmanager
def tensorboard(logdir: Path, load_fast: str | None = None) -> Iterator[str]:
    """TensorBoard serving ``logdir``, with its default loader or ``--load_fast=load_fast``:
    its base URL. Its output is read for the address it prints, and shown if it fails."""
    command = [*_command(), "--logdir", str(logdir), "--host", "127.0.0.1", "--port", "0"]
    if load_fast is not None:
        command.append(f"--load_fast={load_fast}")
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "tensorboard.log"
        with log.open("w") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        try:
            yield _address(process, log)
        finally:
            process.terminate()  # its data server exits with it (it watches TensorBoard's pipe)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _address(process: subprocess.Popen, log: Path) -> str:
    deadline = time.monotonic() + 120
    while True:
        found = re.search(r"TensorBoard \S+ at (http://\S+?)/? ", log.read_text())
        if found:
            return found.group(1)
        if process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"TensorBoard did not start: {log.read_text()}")
        time.sleep(0.2)


def _get(url: str, path: str, **query: str) -> Any:
    address = f"{url}{path}?{urllib.parse.urlencode(query)}" if query else f"{url}{path}"
    with urllib.request.urlopen(address, timeout=30) as response:
        return json.load(response)


def served_scalars(url: str, run: str) -> Series:
    """Every scalar series TensorBoard serves for ``run``: ``{tag: [(step, value)]}``."""
    tags = _get(url, "/data/plugin/scalars/tags").get(run, {})
    return {
        tag: [
            (int(step), value)
            for _, step, value in _get(url, "/data/plugin/scalars/scalars", run=run, tag=tag)
        ]  # fmt: skip
        for tag in tags
    }


def served_runs(url: str) -> list[str]:
    """The runs TensorBoard lists (also the ones with nothing it can show)."""
    return list(_get(url, "/data/runs"))


def read_served(url: str, run: str, expected: Series, wait: float = 60) -> Series:
    """``run``'s scalars as served, once they equal ``expected`` or ``wait`` seconds on:
    both loaders read the event files in the background after TensorBoard starts."""
    deadline = time.monotonic() + wait
    while True:
        got = served_scalars(url, run)
        if got == expected or time.monotonic() > deadline:
            return got
        time.sleep(0.5)
