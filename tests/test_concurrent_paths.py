"""benchmarks/concurrent_paths.py, the logic of the streams and N-process rows of
graph_step_check.py, checked on the CPU (on CUDA the same code issues each replica's work on
its own stream; that has not run here)."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import concurrent_paths as cp  # noqa: E402
from step_setting import Setting  # noqa: E402


def setting(**changes) -> Setting:  # type: ignore[no-untyped-def]
    values = dict(model="fedavg-cnn", shape=(1, 28, 28), options={}, precision="fp32",
                  device=torch.device("cpu"), batch=4, steps=3, timed_steps=3, clients=3,
                  client_steps=2, rounds=1)  # fmt: skip
    return Setting(**{**values, **changes})


def test_interleaved_clients_train_as_each_would_alone() -> None:
    """Step i of every client before step i + 1 of any (the streams path's order): each
    client ends with the weights, momentum and loss its own LocalStep.train gives it alone
    over the same batches, bit for bit (a wrong row, step index or replica would not)."""
    s = setting(model="resnet18", shape=(3, 8, 8), options={"width": 8})
    steps, perms, _ = cp.replicas(s, 3)
    assert cp.interleaved(steps, perms, s.batch, None) == 3 * s.batch * s.timed_steps
    assert not torch.equal(perms[0], perms[1])  # each client its own batch order
    for k, step in enumerate(steps):
        alone, _, _ = cp.replicas(s, k + 1)  # its k-th replica: the same weights and data
        alone[k].train(torch.Generator().manual_seed(10 + k))  # the same permutation
        got, want = step.model.state_dict(), alone[k].model.state_dict()
        assert all(torch.equal(got[n], want[n]) for n in want), k
        assert all(torch.equal(a, b) for a, b in zip(step.momentum, alone[k].momentum, strict=True))
        assert torch.equal(step.loss_sum, alone[k].loss_sum)


def test_each_clients_loads_and_replays_are_issued_on_its_own_stream(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """What the CPU cannot run, checked by its calls: with streams, every load and step of
    client k is issued while stream k is the current one (torch.cuda.stream stood in for)."""
    from contextlib import contextmanager

    current: list[str] = ["default"]
    issued: list[tuple[str, int, str, int]] = []

    @contextmanager
    def stream(s):  # type: ignore[no-untyped-def]
        current.append(s)
        yield
        current.pop()

    class Step:
        def __init__(self, k: int) -> None:
            self.k = k

        def load(self, rows, draws, i):  # type: ignore[no-untyped-def]
            issued.append((current[-1], self.k, "load", i))
            return int(rows.shape[0])

        def run(self, size, full):  # type: ignore[no-untyped-def]
            assert size == full == 2
            issued.append((current[-1], self.k, "run", -1))

    monkeypatch.setattr(torch.cuda, "stream", stream)
    perms = [torch.arange(6), torch.arange(6)]
    assert cp.interleaved([Step(0), Step(1)], perms, 2, ["s0", "s1"]) == 12  # type: ignore[list-item]
    assert issued == [
        (f"s{k}", k, what, i if what == "load" else -1)
        for i in range(3) for k in range(2) for what in ("load", "run")
    ]  # fmt: skip


def test_streams_row_on_the_cpu_says_it_ran_one_after_another() -> None:
    row = cp.streams_path(setting(clients=2))
    assert row["samples_per_second"] > 0 and row["peak_mib"] is None and not row["graph"]
    assert row["note"].startswith("2 replicas one after another (no streams on cpu)")


def test_aggregate_is_all_samples_over_first_start_to_last_end() -> None:
    results = [
        {"samples": 600, "start": 10.0, "end": 13.0, "peak_mib": 100.0, "graph": True,
         "reason": ""},
        {"samples": 600, "start": 11.0, "end": 14.0, "peak_mib": 120.5, "graph": True,
         "reason": ""},
    ]  # fmt: skip
    row = cp.aggregate(results, batch=60)
    # 1200 samples in 4 s (not 1200 / 3 s each: the later start lengthens the wall time)
    assert row["samples_per_second"] == 300.0 and row["ms_per_step"] == 200.0
    assert row["peak_mib"] == 120.5 and row["peak_mib_each"] == [100.0, 120.5]
    assert "samples/s each: 200, 200" in row["note"] and "CUDA graph" in row["note"]


def test_n_processes_measure_together_and_a_failed_one_says_why() -> None:
    row = cp.run_processes(setting(), 2)
    assert row["processes"] == 2 and row["samples_per_second"] > 0
    said = r"a process ended before it was ready \(exit 1\): .*UsageError: unknown model"
    with pytest.raises(RuntimeError, match=said):
        cp.run_processes(setting(model="no-such-model"), 2)


def test_a_hung_or_chatty_process_is_a_failure_that_says_why(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A process that never says ready is stopped at the deadline; one that prints other
    lines and ends gives its last error line, not a JSON error."""
    monkeypatch.setattr(cp, "PROCESS_DEADLINE_S", 1.0)
    hang = [sys.executable, "-c", "import time; time.sleep(60)"]
    monkeypatch.setattr(cp, "child_command", lambda s, r: hang)
    with pytest.raises(RuntimeError, match="had not said it was ready after 1 s and was stopped"):
        cp.run_processes(setting(), 2)
    chatty = [sys.executable, "-c",
              "import sys; print('hello'); print('[1]'); sys.exit('no GPU here')"]  # fmt: skip
    monkeypatch.setattr(cp, "child_command", lambda s, r: chatty)
    with pytest.raises(RuntimeError, match=r"ended before it was ready \(exit 1\): no GPU here"):
        cp.run_processes(setting(), 2)


def fake_mps(folder: Path, start_exit: int = 0) -> Path:
    """A stand-in nvidia-cuda-mps-control: logs its arguments, pipe directory and stdin."""
    folder.mkdir()
    exe = folder / cp.MPS_CONTROL
    exe.write_text(
        "#!/bin/sh\n"
        f'echo "$* pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY stdin=$(cat)"'
        f' >> "{folder}/calls"\n'
        f'if [ "$1" = "-d" ] && [ {start_exit} -ne 0 ]; then echo "An instance of this daemon '
        f'is already running" >&2; exit {start_exit}; fi\n'
    )  # fmt: skip
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return folder


def test_mps_starts_private_and_always_quits(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The daemon starts with -d under the path's own pipe and log folders, its clients get
    them, and quit is sent after, also when the measurement fails."""
    bin_dir = fake_mps(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    seen: list[dict[str, str]] = []

    def measured(s, count, env):  # type: ignore[no-untyped-def]
        seen.append(env)
        return {"samples_per_second": 5.0, "note": f"{count} processes"}

    monkeypatch.setattr(cp, "run_processes", measured)
    row = cp._under_mps(setting(), 3, tmp_path / "mps")
    assert row == {"samples_per_second": 5.0, "note": "under MPS (private daemon): 3 processes"}
    pipe, log = tmp_path / "mps" / "pipe", tmp_path / "mps" / "log"
    assert seen[0]["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe)
    calls = (bin_dir / "calls").read_text().splitlines()
    assert calls == [f"-d pipe={pipe} log={log} stdin=", f" pipe={pipe} log={log} stdin=quit"]

    def fails(s, count, env):  # type: ignore[no-untyped-def]
        raise RuntimeError("a process ended before it was ready (exit 1): no device")

    monkeypatch.setattr(cp, "run_processes", fails)
    (bin_dir / "calls").unlink()
    with pytest.raises(RuntimeError, match="no device; MPS log: no MPS log"):
        cp._under_mps(setting(), 2, tmp_path / "mps2")
    assert (bin_dir / "calls").read_text().splitlines()[-1].endswith("stdin=quit")


def test_mps_that_cannot_start_is_a_row_that_says_why(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    bin_dir = fake_mps(tmp_path / "bin", start_exit=1)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(cp, "run_processes", lambda *a: pytest.fail("measured without MPS"))
    row = cp._under_mps(setting(), 2, tmp_path / "mps")
    assert row["samples_per_second"] is None
    assert row["note"] == (f"not measured: {cp.MPS_CONTROL} -d failed (exit 1): An instance of "
                           "this daemon is already running")  # fmt: skip
    assert len((bin_dir / "calls").read_text().splitlines()) == 1  # nothing to quit
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    row = cp._under_mps(setting(), 2, tmp_path / "mps3")
    assert row["note"] == f"not measured: {cp.MPS_CONTROL} not found on PATH"


def test_a_setting_crosses_to_a_process_as_json() -> None:
    s = setting(model="resnet18", shape=(3, 8, 8), options={"width": 8})
    assert Setting.from_json(json.loads(json.dumps(s.to_json()))) == s
