"""The worker-pool engine: clients in worker processes, results identical to in-process;
the dataset in shared memory; what --workers auto chooses.

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
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from run_metrics import rows

import fedskew.config as config
from fedskew.apps.cli import main
from fedskew.assembly.prepare import new_model, prepare, training_work
from fedskew.config import ExperimentConfig, TrainingWork, execution_choice
from fedskew.core.errors import FedskewError, UsageError
from fedskew.data.sources import load_dataset
from fedskew.engines import shared_data
from fedskew.engines import workers as pool
from fedskew.engines.inprocess import InProcessEngine
from fedskew.engines.workers import WorkerPoolEngine, decode_frame, encode_frame
from fedskew.runs.loop import default_engine_factory, run
from fedskew.training.protocol import ClientState, Message

SMALL = ["-n", "6", "--clients-per-round", "4", "-e", "1", "-q"]


def live_workers() -> list[str]:
    return [p.name for p in mp.active_children() if p.name.startswith("fedskew-worker")]


def shared_files() -> list[str]:
    """This process's shared-memory dataset files (named with its pid)."""
    prefix = f"{shared_data.PREFIX}{os.getpid()}-"
    return sorted(p.name for p in shared_data.SHM_DIR.glob(f"{prefix}*"))


def processes(folder: Path) -> list[dict]:
    return [json.loads(x) for x in (folder / "processes.jsonl").read_text().splitlines()]


def mapping_of(pid: int, name: str) -> dict[str, int]:
    """Rss, Private_Dirty, ... (kB) of process ``pid``'s mapping of the file ``name``,
    from /proc/pid/smaps (Linux)."""
    fields: dict[str, int] = {}
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if len(head) >= 5 and "-" in head[0] and not line.endswith(" kB"):
            inside = name in line
            continue
        if inside and line.endswith(" kB"):
            key, value = line.split(":", 1)
            fields[key] = fields.get(key, 0) + int(value.split()[0])
    return fields


needs_shm = pytest.mark.skipif(
    not shared_data.shared_memory_available(), reason="no /dev/shm on this machine"
)


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


def test_a_worker_that_dies_is_reported_not_waited_for(monkeypatch, caplog):
    cfg = ExperimentConfig(num_clients=6, local_epochs=1)
    prep = prepare(cfg)
    msg = Message("train", arrays=dict(new_model(prep).state_dict()))
    # No room in /dev/shm (a container's is often small): the worker loads its own data.
    monkeypatch.setattr(pool, "shared_memory_available", lambda nbytes=0: False)
    with WorkerPoolEngine(cfg, 1, threads=2, dataset=prep.dataset) as engine:
        assert engine.worker_threads == [2] and engine.worker_data == ["loaded"]
        assert "each worker loads its own copy" in caplog.text
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


def test_auto_chooses_workers_and_threads_from_cores_and_work(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg = ExperimentConfig(num_clients=20, clients_per_round=8, rounds=30)
    assert cfg.workers == "auto"
    big = TrainingWork(client_flops=50e9, step_flops=1.6e9)  # fedavg-cnn-like clients
    small_steps = TrainingWork(client_flops=50e9, step_flops=50e6)  # many small steps

    def choice(cfg, work=big, cores=2, **kw):
        got = execution_choice(cfg, work, cores=cores, **kw)
        return got.workers, got.threads

    # One-thread workers, one per core up to the clients per round: fp32 and bf16 alike.
    assert choice(cfg) == (2, 1)
    assert choice(dataclasses.replace(cfg, precision="bf16")) == (2, 1)
    assert choice(cfg, work=None, cores=4) == (4, 1)
    assert choice(dataclasses.replace(cfg, clients_per_round=3), cores=4) == (3, 1)
    reason = execution_choice(cfg, big, cores=2).reason
    assert (
        reason == "auto: 2 cores, 8 clients per round; one-thread workers hold up on a busy machine"
    )
    assert execution_choice(cfg, big, cores=2).note() == f"2 worker processes x 1 thread ({reason})"
    # More cores than clients: the spare cores become threads where a step can use them.
    assert choice(dataclasses.replace(cfg, clients_per_round=4), cores=16) == (4, 4)
    assert choice(dataclasses.replace(cfg, clients_per_round=4), small_steps, cores=16) == (4, 1)
    # Nothing to run side by side, or too little work to ship: in this process, with the
    # threads one client's steps can use.
    assert choice(dataclasses.replace(cfg, clients_per_round=1), cores=16) == (0, 16)
    assert choice(dataclasses.replace(cfg, clients_per_round=1), small_steps, cores=16) == (0, 1)
    assert choice(cfg, cores=1) == (0, 1)
    tiny = TrainingWork(client_flops=0.05e9, step_flops=20e6)  # the digits MLP
    assert choice(cfg, tiny, cores=8) == (0, 1)
    assert "too little to ship" in execution_choice(cfg, tiny, cores=8).reason
    short = dataclasses.replace(cfg, rounds=1)  # 8 x 50 GFLOP: seconds of training
    assert choice(short) == (0, 2)
    assert "starting worker processes" in execution_choice(short, big, cores=2).reason
    unguarded = execution_choice(cfg, big, cores=2, spawn_ok=False)
    assert (unguarded.workers, "__main__" in unguarded.reason) == (0, True)
    # OMP_NUM_THREADS is the user's thread count per process.
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert choice(cfg, cores=8) == (4, 2)
    assert choice(cfg, cores=2) == (0, 2)
    monkeypatch.delenv("OMP_NUM_THREADS")
    # Other engines, given counts.
    assert choice(dataclasses.replace(cfg, engine="flower-sim")) == (0, None)
    assert choice(dataclasses.replace(cfg, workers=0), cores=16) == (0, None)
    assert choice(dataclasses.replace(cfg, workers=3), cores=16) == (3, 1)
    capped = execution_choice(dataclasses.replace(cfg, workers=1000, clients_per_round=2))
    assert (capped.workers, capped.threads, capped.capped, capped.auto) == (2, 1, True, False)
    assert capped.reason == "--workers 1000 capped: 2 clients train per round"
    one = execution_choice(dataclasses.replace(cfg, workers=4, clients_per_round=1))
    assert (one.workers, one.capped) == (0, True)
    # usable_cores reads the affinity (and a container's CPU quota).
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    assert config.effective_workers(cfg, big) == 4


def test_the_work_estimate_follows_model_and_partition():
    prep = prepare(ExperimentConfig(num_clients=6, local_epochs=2, batch_size=32))
    work = training_work(prep, new_model(prep))
    mean = sum(len(p) for p in prep.partition) / 6
    params = sum(p.numel() for p in new_model(prep).parameters())
    # The digits MLP: its linear layers are all its work, about 2 FLOPs per parameter.
    per_sample = 3 * 2 * params
    assert work.client_flops == pytest.approx(2 * mean * per_sample, rel=0.05)
    assert work.step_flops == pytest.approx(32 * per_sample, rel=0.05)
    assert work.client_flops < config.MIN_CLIENT_FLOPS  # so auto keeps digits in process
    assert work.model_bytes == 4 * params and work.activation_bytes > 0


def test_a_script_without_a_main_guard_gets_no_workers(tmp_path, monkeypatch):
    guarded, bare = tmp_path / "guarded.py", tmp_path / "bare.py"
    guarded.write_text('import fedskew\nif __name__ == "__main__":\n    fedskew.run()\n')
    bare.write_text("import fedskew\nfedskew.run()\n")
    for path, allowed in ((guarded, True), (bare, False)):
        fake = types.ModuleType("__main__")
        fake.__file__ = str(path)
        monkeypatch.setitem(sys.modules, "__main__", fake)
        assert pool.main_allows_spawn() is allowed, path
    fake = types.ModuleType("__main__")  # an interactive session: no script to run again
    monkeypatch.setitem(sys.modules, "__main__", fake)
    assert pool.main_allows_spawn()


# ---------------------------------------------------------------------------- shared data


@needs_shm
def test_workers_map_the_shared_dataset_and_compute_as_in_process():
    cfg = ExperimentConfig(num_clients=6, local_epochs=1, algorithm="fedavg", workers=2)
    ref = prepare(cfg)
    model = new_model(ref)
    reference = InProcessEngine.from_prepared(ref, ref.algorithm.Client(ref.params), model)
    msg = Message("train", arrays={k: v.clone() for k, v in model.state_dict().items()})
    clients = [1, 5, 2]
    prep = prepare(cfg)
    own = {key: getattr(prep.dataset, key) for key in shared_data.TENSORS}
    factory = default_engine_factory(cfg)
    engine = factory(prep, prep.algorithm.Client(prep.params), new_model(prep))
    try:
        assert isinstance(engine, WorkerPoolEngine)
        assert factory.execution.workers == 2 and factory.execution.threads == 1
        name = Path(engine._shared.header["path"]).name
        # Every worker mapped it and trains on views of it; the file is already gone.
        assert engine.worker_data == ["shared", "shared"]
        assert engine.worker_threads == [1, 1]
        assert shared_files() == []
        # This process uses the shared tensors too: its own copies are dropped.
        for key, t in own.items():
            now = getattr(prep.dataset, key)
            assert now.data_ptr() != t.data_ptr(), key
            assert torch.equal(now, t) and now.stride() == t.stride(), key
        assert prep.fed.x is prep.dataset.x_train and prep.test[0] is prep.dataset.x_test
        assert mapping_of(os.getpid(), name).get("Size", 0) > 0
        for eng in (reference, engine):
            eng.begin_round(0)
        expected = reference.exchange({c: msg for c in clients})
        got = engine.exchange({c: msg for c in clients})
        for c in clients:
            for key, t in expected[c].arrays.items():
                assert torch.equal(got[c].arrays[key], t), (c, key)
        # The workers read the data from the shared pages and wrote none of them (a write
        # would copy a page into the worker, or fault on the read-only mapping).
        for process in engine.processes:
            mapped = mapping_of(process.pid, name)
            assert mapped.get("Rss", 0) > 0, mapped
            assert mapped.get("Private_Dirty", 0) == 0, mapped
            assert mapped.get("Anonymous", 0) == 0, mapped
    finally:
        engine.close()
    assert live_workers() == [] and shared_files() == []


@needs_shm
def test_a_failed_start_up_removes_the_shared_dataset():
    dataset = load_dataset("digits")
    cfg = ExperimentConfig(num_clients=6, partition="natural")  # digits has no natural clients
    with pytest.raises(FedskewError, match="worker 0: start-up failed: UsageError: partition"):
        WorkerPoolEngine(cfg, 1, dataset=dataset)
    assert live_workers() == [] and shared_files() == []


@needs_shm
def test_a_killed_parent_leaves_no_shared_dataset(tmp_path):
    # Killed between writing the file and its workers mapping it: multiprocessing's
    # resource tracker, a process of its own, removes the file when the parent is gone.
    script = (
        "import os, signal, torch\n"
        "from fedskew.data.datasets import Dataset\n"
        "from fedskew.engines.shared_data import SharedDataset\n"
        "x, y = torch.zeros(4, 3), torch.zeros(4, dtype=torch.int64)\n"
        "d = Dataset('d', x, y, x, y, 2, (3,), ['a', 'b'], 'test')\n"
        "print(SharedDataset.create(d).path, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(shared_data.__file__).parents[2])},
    )  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    path = Path(proc.stdout.strip())
    assert path.name.startswith(shared_data.PREFIX)
    deadline = time.monotonic() + 30
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not path.exists()


@needs_shm
def test_a_default_run_uses_workers_and_records_them(tmp_path, monkeypatch):
    # The digits MLP is too small for workers; lowered thresholds make auto start them.
    monkeypatch.setattr(config, "MIN_CLIENT_FLOPS", 0)
    monkeypatch.setattr(config, "MIN_RUN_FLOPS", 0)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    common = dict(rounds=2, local_epochs=1, quiet=True, precision="bf16", num_clients=6,
                  clients_per_round=3)  # fmt: skip
    auto, summary = run(ExperimentConfig(out_dir=str(tmp_path / "a"), name="r", **common))
    inproc, _ = run(ExperimentConfig(out_dir=str(tmp_path / "b"), name="r", workers=0, **common))
    [facts] = processes(auto)
    assert facts["workers"] == 2 and facts["threads_per_worker"] == 1
    assert facts["worker_data"] == "shared"
    assert facts["workers_reason"].startswith("auto: 2 cores, 3 clients per round; ")
    assert facts["data_source"] == processes(inproc)[0]["data_source"]
    assert processes(inproc)[0]["workers_reason"] == "--workers 0"
    assert rows(auto) == rows(inproc)
    assert live_workers() == [] and shared_files() == []


def test_auto_workers_stay_inside_the_memory(tmp_path, monkeypatch):
    gib = 2**30
    monkeypatch.setattr(pool, "available_memory_bytes", lambda: 8 * gib)
    # Half of 8 GiB: the 1 GiB dataset once in shared memory, the rest for workers.
    assert pool.affordable_workers(gib) == 3 * gib // pool.WORKER_OVERHEAD_BYTES
    # Workers that load their own copies (CUDA): a copy each.
    assert pool.affordable_workers(gib, shared=False) == 4 * gib // (
        gib + pool.WORKER_OVERHEAD_BYTES
    )
    monkeypatch.setattr(pool, "available_memory_bytes", lambda: None)
    assert pool.affordable_workers(gib) > 1000  # unknown memory: no cap

    # Too little memory for two workers: a run with auto workers stays in one process
    # (an explicit count is the user's call and is kept).
    monkeypatch.setattr(config, "MIN_CLIENT_FLOPS", 0)
    monkeypatch.setattr(config, "MIN_RUN_FLOPS", 0)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    monkeypatch.setattr(pool, "available_memory_bytes", lambda: pool.WORKER_OVERHEAD_BYTES)
    common = dict(rounds=1, local_epochs=1, quiet=True, num_clients=6, clients_per_round=3)
    auto, _ = run(ExperimentConfig(out_dir=str(tmp_path / "a"), name="r", **common))
    fixed, _ = run(ExperimentConfig(out_dir=str(tmp_path / "b"), name="r", workers=2, **common))
    assert [[p["workers"] for p in processes(f)] for f in (auto, fixed)] == [[0], [2]]
    assert "fit in half the available memory" in processes(auto)[0]["workers_reason"]
    assert rows(auto) == rows(fixed)


def test_run_says_what_it_chose_and_caps_a_count_no_round_can_use(tmp_path, capsys):
    common = ["run", "-n", "6", "-e", "1", "-r", "1", "-o", str(tmp_path)]
    assert main([*common, "--clients-per-round", "4", "--name", "auto"]) == 0
    notes = [x for x in capsys.readouterr().err.splitlines() if x.startswith("fedskew: ")]
    cores = len(os.sched_getaffinity(0))
    assert len(notes) == 1, notes
    assert notes[0].startswith(
        f"fedskew: clients in this process, 1 thread (auto: {cores} cores, 4 clients per "
        "round; a client's training is about "
    )
    assert notes[0].endswith(" GFLOP, too little to ship to another process)")
    assert main([*common, "-q", "--clients-per-round", "4", "--name", "quiet"]) == 0
    assert capsys.readouterr().err == ""
    # 1000 workers for 2 clients a round: 2 start, and the run says so.
    assert main([*common, "--clients-per-round", "2", "--workers", "1000", "--name", "w"]) == 0
    notes = [x for x in capsys.readouterr().err.splitlines() if x.startswith("fedskew: ")]
    assert notes == [
        "fedskew: 2 worker processes x 1 thread (--workers 1000 capped: 2 clients train per round)"
    ]
    [facts] = processes(tmp_path / "w")
    assert facts["workers"] == 2 and facts["threads_per_worker"] == 1
    assert facts["workers_reason"] == "--workers 1000 capped: 2 clients train per round"
    assert rows(tmp_path / "w")[0]["accuracy"] > 0
    assert live_workers() == []


@pytest.mark.parametrize(
    "algorithm, mode", [("fedavg", "vmap"), ("moon", "vmap"), ("fedavg", "fused")]
)
def test_workers_train_their_clients_together(tmp_path, algorithm, mode):
    """With --clients-together vmap (or fused) each worker gets its share of an exchange's
    clients at once and trains them together where the algorithm allows it (else one after
    another in the worker): the same curve as the in-process run within fp32 rounding, and
    processes.jsonl says how the clients trained."""
    common = ["run", "-a", algorithm, "-r", "2", *SMALL, "-o", str(tmp_path),
              "--clients-together", mode]  # fmt: skip
    assert main([*common, "--name", "w0", "--workers", "0"]) == 0
    assert main([*common, "--name", "w2", "--workers", "2"]) == 0
    assert live_workers() == []
    in_process, workers = rows(tmp_path / "w0"), rows(tmp_path / "w2")
    ran = [json.loads(x) for x in (tmp_path / "w2" / "processes.jsonl").read_text().splitlines()]
    assert [p["clients_together"] for p in ran] == [mode]
    for a, b in zip(in_process, workers, strict=True):
        assert a["clients"] == b["clients"] and a["bytes_up"] == b["bytes_up"]
        for key in ("train_loss", "loss", "accuracy"):
            # Stacks of 2 clients against one of 4 (where the algorithm trains together):
            # the last bits of fp32 differ (tests/test_together.py's tolerance).
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-3), key


def test_a_batch_goes_to_the_worker_with_the_fewest_samples():
    engine = types.SimpleNamespace(client_sizes=[50, 10, 40, 30, 20], processes=[0, 1])
    batches = WorkerPoolEngine.batches(engine, [0, 1, 2, 3, 4])
    assert batches == {0: [0, 4, 1], 1: [2, 3]}  # 50+20+10 and 40+30 samples
