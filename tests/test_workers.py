"""The worker-pool engine: clients in worker processes, results identical to in-process.

Worker start-up (spawn, torch import, data) costs seconds, so each test starts as few
engines as it can and runs on the digits default with 6 clients, 4 per round.
"""

from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing as mp
import os
import signal
import struct
import time
from pathlib import Path

import pytest
import torch

from fedskew.apps.cli import main
from fedskew.assembly.prepare import new_model, prepare
from fedskew.config import ExperimentConfig
from fedskew.core.errors import FedskewError, UsageError
from fedskew.engines.inprocess import InProcessEngine
from fedskew.engines.workers import WorkerPoolEngine, decode_frame, encode_frame
from fedskew.runs.loop import run
from fedskew.training.protocol import ClientState, Message

SMALL = ["-n", "6", "--clients-per-round", "4", "-e", "1", "-q"]
TIMING = ("seconds", "eval_seconds")


def rows(folder: Path) -> list[dict]:
    out = []
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for key in TIMING:
            record.pop(key, None)
        out.append(record)
    return out


def live_workers() -> list[str]:
    return [p.name for p in mp.active_children() if p.name.startswith("fedskew-worker")]


# ---------------------------------------------------------------------------- codec


def test_codec_round_trip_keeps_values_dtypes_and_memory_layout():
    gen = torch.Generator().manual_seed(0)
    arrays = {
        "f32": torch.randn(3, 4, generator=gen),
        "f64": torch.randn(5, generator=gen, dtype=torch.float64),
        "i64": torch.arange(-3, 3),
        "bool": torch.tensor([True, False, True]),
        "bf16": torch.randn(6, generator=gen).to(torch.bfloat16),
        "f16": torch.randn(2, 2, generator=gen).half(),
        "empty": torch.zeros(0, 7),
        "zero_dim": torch.tensor(2.5),
        "conv": torch.randn(4, 3, 5, 5, generator=gen).contiguous(
            memory_format=torch.channels_last
        ),
        "transposed": torch.randn(3, 5, generator=gen).t(),
    }
    msg = Message(
        "train",
        arrays=arrays,
        scalars={"lr": 0.1, "count": 3, "flag": True, "nan": math.nan, "inf": -math.inf},
        strings={"note": "héllo"},
    )
    state = ClientState(arrays={"c": torch.ones(2, 3)}, scalars={"steps": 4.0})
    frame = encode_frame({"client": 3, "round": 7}, msg, state)
    meta, got, got_state = decode_frame(frame)

    assert meta == {"client": 3, "round": 7}
    assert got.kind == "train" and got.strings == {"note": "héllo"}
    assert got.scalars["lr"] == 0.1 and got.scalars["count"] == 3 and got.scalars["flag"] is True
    assert math.isnan(got.scalars["nan"]) and got.scalars["inf"] == -math.inf
    assert list(got.arrays) == list(arrays)
    for name, t in arrays.items():
        u = got.arrays[name]
        assert u.dtype == t.dtype and u.shape == t.shape and u.stride() == t.stride(), name
        assert torch.equal(u, t), name
    assert got.arrays["conv"].is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(got_state.arrays["c"], state.arrays["c"])
    assert got_state.scalars == {"steps": 4.0}
    assert got.nbytes() == msg.nbytes()

    # The wire: length, JSON header, then each array's raw bytes in memory order, nothing
    # else (no pickle). Built here independently from NumPy.
    (length,) = struct.unpack_from("<Q", frame)
    header = json.loads(frame[8 : 8 + length])
    assert header["message"]["kind"] == "train"
    expected = [
        arrays["f32"].numpy().tobytes(),
        arrays["f64"].numpy().tobytes(),
        arrays["i64"].numpy().tobytes(),
        arrays["bool"].numpy().tobytes(),
        arrays["bf16"].view(torch.int16).numpy().tobytes(),
        arrays["f16"].numpy().tobytes(),
        b"",
        arrays["zero_dim"].numpy().tobytes(),
        arrays["conv"].permute(0, 2, 3, 1).contiguous().numpy().tobytes(),  # N, H, W, C
        arrays["transposed"].t().contiguous().numpy().tobytes(),  # as it lies in memory
        state.arrays["c"].numpy().tobytes(),
    ]
    assert frame[8 + length :] == b"".join(expected)

    # Decoded tensors own writable memory.
    got.arrays["f32"].add_(1.0)
    assert torch.equal(got.arrays["f32"], arrays["f32"] + 1.0)


def test_codec_sends_strided_views_as_plain_tensors_and_refuses_odd_values():
    base = torch.arange(24.0).reshape(4, 6)
    sliced = base[:, ::2]
    _, got, _ = decode_frame(encode_frame({}, Message("m", arrays={"s": sliced})))
    assert torch.equal(got.arrays["s"], sliced) and got.arrays["s"].is_contiguous()
    meta, none_msg, none_state = decode_frame(encode_frame({"stop": True}))
    assert meta == {"stop": True} and none_msg is None and none_state is None
    with pytest.raises(FedskewError, match="dtype"):
        encode_frame({}, Message("m", arrays={"q": torch.zeros(2, dtype=torch.float8_e4m3fn)}))
    with pytest.raises(FedskewError, match="scalar 'x'"):
        encode_frame({}, Message("m", scalars={"x": "text"}))  # type: ignore[dict-item]


def test_workers_option_is_validated():
    with pytest.raises(UsageError, match="workers"):
        ExperimentConfig(workers=-1).validate()
    with pytest.raises(UsageError, match="workers"):
        ExperimentConfig(workers=2, engine="flower-sim").validate()
    ExperimentConfig(workers=3).validate()


# ---------------------------------------------------------------------------- engine


def test_engine_matches_in_process_and_reports_client_errors(tmp_path):
    cfg = ExperimentConfig(num_clients=6, local_epochs=1, algorithm="fedavg")
    prep = prepare(cfg)
    model = new_model(prep)
    reference = InProcessEngine(
        prep.algorithm.Client(prep.params),
        prep.fed,
        model,
        prep.train,
        cfg.seed,
        test=(prep.dataset.x_test, prep.dataset.y_test),
    )
    msg = Message("train", arrays={k: v.clone() for k, v in model.state_dict().items()})
    clients = [4, 0, 3]
    # Sizes make the engine hand out the largest client first; replies keep message order.
    with WorkerPoolEngine(cfg, 2, client_sizes=prep.fed.sizes()) as engine:
        assert len(live_workers()) == 2
        for eng in (reference, engine):
            eng.begin_round(1)
        expected = reference.exchange({c: msg for c in clients})
        got = engine.exchange({c: msg for c in clients})
        assert list(got) == clients
        for c in clients:
            assert got[c].kind == expected[c].kind
            assert got[c].scalars == expected[c].scalars
            assert list(got[c].arrays) == list(expected[c].arrays)
            for name, t in expected[c].arrays.items():
                assert torch.equal(got[c].arrays[name], t), (c, name)
        assert engine.traffic == reference.traffic
        assert sorted(engine.client_states) == sorted(clients)

        with pytest.raises(FedskewError, match=r"client 0 failed in worker \d: UsageError: .*"):
            engine.exchange({0: Message("no_such_kind")})
        assert live_workers() == []  # a failed exchange ends the workers
        with pytest.raises(FedskewError, match="closed"):
            engine.exchange({0: msg})


def test_a_worker_that_dies_is_reported_not_waited_for():
    cfg = ExperimentConfig(num_clients=6, local_epochs=1)
    prep = prepare(cfg)
    msg = Message("train", arrays=dict(new_model(prep).state_dict()))
    with WorkerPoolEngine(cfg, 1) as engine:
        os.kill(engine.processes[0].pid, signal.SIGKILL)
        engine.processes[0].join(timeout=10)
        t0 = time.monotonic()
        with pytest.raises(FedskewError, match=r"worker 0 died during the task of client 2"):
            engine.exchange({2: msg})
        assert time.monotonic() - t0 < 10
    assert live_workers() == []


def test_start_up_errors_name_the_worker():
    cfg = ExperimentConfig(num_clients=6, partition="natural")  # digits has no natural clients
    with pytest.raises(FedskewError, match="worker 0: start-up failed: UsageError: partition"):
        WorkerPoolEngine(cfg, 1)
    assert live_workers() == []


# ---------------------------------------------------------------------------- runs


@pytest.mark.parametrize(
    "algorithm, params",
    [  # FedAvg: reply by reply in the test above
        ("moon", []),  # client state: the previous local model
        ("fedcme", ["-e", "2"]),  # several exchanges per round, mid-round client state
        ("fedfm", ["-p", "start_round=1", "-p", "lam=5"]),  # anchors from round 2 on
    ],
)
def test_runs_with_workers_equal_in_process_runs(tmp_path, algorithm, params):
    common = ["run", "-a", algorithm, "-r", "2", *SMALL, *params, "-o", str(tmp_path)]
    assert main([*common, "--name", "w0", "--workers", "0"]) == 0
    assert main([*common, "--name", "w2", "--workers", "2"]) == 0
    assert live_workers() == []
    in_process, workers = rows(tmp_path / "w0"), rows(tmp_path / "w2")
    assert [r["round"] for r in workers] == [1, 2]
    assert all(math.isfinite(r["accuracy"]) for r in workers)
    if algorithm in ("fedcme", "fedfm"):
        assert max(r["exchanges"] for r in workers) > 1
    assert workers == in_process  # accuracy, loss, bytes, per-class accuracy, train loss


def test_resume_of_an_interrupted_worker_run_matches_an_uninterrupted_run(tmp_path):
    # SCAFFOLD: each client's control variate lives in the parent and in the checkpoint.
    common = dict(
        algorithm="scaffold", num_clients=6, clients_per_round=4, local_epochs=1, rounds=3,
        quiet=True, seed=2,
    )  # fmt: skip
    full, _ = run(ExperimentConfig(out_dir=str(tmp_path / "a"), name="r", **common))

    def interrupt(record: dict) -> None:
        if record["round"] == 2:
            raise KeyboardInterrupt

    cfg = ExperimentConfig(out_dir=str(tmp_path / "b"), name="r", workers=2, **common)
    with pytest.raises(KeyboardInterrupt):
        run(cfg, on_round=interrupt)
    assert live_workers() == []  # closed on the way out
    unfinished = tmp_path / "b" / "r.incomplete"
    assert [r["round"] for r in rows(unfinished)] == [1, 2]
    assert json.loads((unfinished / "config.json").read_text())["workers"] == 2
    assert main(["run", "--resume", str(unfinished), "-q"]) == 0
    assert rows(tmp_path / "b" / "r") == rows(full)


def test_auto_workers_follow_the_measured_rule(monkeypatch):
    from fedskew.config import effective_workers

    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    bf16 = ExperimentConfig(precision="bf16", num_clients=10, clients_per_round=3)
    assert bf16.workers == "auto"
    assert effective_workers(bf16) == 3  # one per core, no more than clients per round
    assert effective_workers(dataclasses.replace(bf16, clients_per_round=8)) == 4
    assert effective_workers(dataclasses.replace(bf16, clients_per_round=1)) == 0
    assert effective_workers(dataclasses.replace(bf16, precision="fp32")) == 0
    assert effective_workers(dataclasses.replace(bf16, engine="flower-sim")) == 0
    assert effective_workers(dataclasses.replace(bf16, workers=0)) == 0
    assert effective_workers(dataclasses.replace(bf16, precision="fp32", workers=2)) == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0})
    assert effective_workers(bf16) == 0  # one core: nothing to run in parallel


def test_a_default_bf16_run_uses_workers_and_records_them(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    common = dict(rounds=2, local_epochs=1, quiet=True, precision="bf16", num_clients=6,
                  clients_per_round=3)  # fmt: skip
    auto, _ = run(ExperimentConfig(out_dir=str(tmp_path / "a"), name="r", **common))
    inproc, _ = run(ExperimentConfig(out_dir=str(tmp_path / "b"), name="r", workers=0, **common))
    used = [json.loads(x)["workers"] for x in (auto / "processes.jsonl").read_text().splitlines()]
    assert used == [2]
    assert rows(auto) == rows(inproc)


def test_auto_workers_stay_inside_the_memory(tmp_path, monkeypatch):
    from fedskew.engines import workers as pool

    gib = 2**30
    monkeypatch.setattr(pool, "available_memory_bytes", lambda: 8 * gib)
    # half of 8 GiB for copies of a 1 GiB dataset plus each worker's own overhead
    assert pool.affordable_workers(gib) == 4 * gib // (gib + pool.WORKER_OVERHEAD_BYTES)
    monkeypatch.setattr(pool, "available_memory_bytes", lambda: None)
    assert pool.affordable_workers(gib) > 1000  # unknown memory: no cap

    # Too little memory for two copies: a bf16 run with auto workers stays in one process
    # (an explicit count is the user's call and is kept).
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    monkeypatch.setattr(pool, "available_memory_bytes", lambda: pool.WORKER_OVERHEAD_BYTES)
    common = dict(rounds=1, local_epochs=1, quiet=True, precision="bf16", num_clients=6,
                  clients_per_round=3)  # fmt: skip
    auto, _ = run(ExperimentConfig(out_dir=str(tmp_path / "a"), name="r", **common))
    fixed, _ = run(ExperimentConfig(out_dir=str(tmp_path / "b"), name="r", workers=2, **common))
    used = [
        [json.loads(x)["workers"] for x in (f / "processes.jsonl").read_text().splitlines()]
        for f in (auto, fixed)
    ]
    assert used == [[0], [2]]
    assert rows(auto) == rows(fixed)
