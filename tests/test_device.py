"""The device option and the device path (issue 12).

This machine may have no GPU. Two kinds of checks stand in for CUDA here:

* Device-correctness on the CPU: every algorithm's client handlers, its server round and the
  evaluation run under ``torch.device("meta")`` as the default device, while the model, the
  data and the messages are real CPU tensors. A tensor factory that forgets its device
  (``torch.zeros(n)`` where ``torch.zeros(n, device=x.device)`` is meant) then makes a meta
  tensor, which fails when it meets a CPU tensor, or yields garbage that the exact comparison
  with a plain run catches. That is the bug that would mix CPU and CUDA tensors on a GPU.
  It does not cover host-side indices used on device tensors (those are moved explicitly:
  ``ClientData.batch``, the epoch permutation, augmentation and mixup draws).
* Device-parametrised tests run on ``cpu`` and on ``cuda``; without CUDA the latter are
  skipped with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from host_sync_check import SYNC_CASES, cuda_syncs, sync_counts, waits_per_step
from tiny_bn import NAME as TINY_BN

from fedskew.algorithms import ALGORITHMS
from fedskew.apps.cli import main
from fedskew.assembly.prepare import new_model, prepare
from fedskew.config import ExperimentConfig, build_config, config_hash
from fedskew.core.device import (
    CUBLAS_VALUE,
    CUBLAS_VARIABLE,
    ExecutionSettings,
    check_device_spec,
    cuda_count,
    resolve_device,
    settings_applied,
    tf32_state,
)
from fedskew.core.errors import UsageError
from fedskew.core.gpu_memory import PEAK_KEYS, memory_peaks, reset_peaks
from fedskew.engines.client_runtime import ClientRuntime
from fedskew.engines.inprocess import InProcessEngine
from fedskew.runs.loop import RunState, evaluate_global_model, play_round, run, server_setup
from fedskew.training.protocol import ClientState, Message

HAS_CUDA = cuda_count() > 0
NO_CUDA = "no CUDA device here (CPU-only torch or no GPU): benchmarks/gpu_check.sh runs these"
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)),
]


# ---------------------------------------------------------------------------- the option


@pytest.mark.parametrize("spec", ["auto", "cpu", "cuda", "cuda:0", "cuda:12", " CPU "])
def test_device_spellings_are_accepted(spec: str) -> None:
    assert check_device_spec(spec) == spec.strip().lower()


@pytest.mark.parametrize("spec", ["gpu", "cuda:", "cuda:x", "mps", "", 3, None])
def test_other_device_spellings_are_one_line_errors(spec: object) -> None:
    with pytest.raises(UsageError, match="device must be auto, cpu, cuda or cuda:N"):
        check_device_spec(spec)


def test_cpu_and_auto_resolve_here() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if HAS_CUDA else "cpu"
    assert resolve_device("auto").type == expected


@pytest.mark.skipif(HAS_CUDA, reason="CUDA is available: the error cannot be shown")
@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_cuda_is_a_one_line_error(spec: str) -> None:
    with pytest.raises(UsageError, match="no CUDA device is available") as err:
        resolve_device(spec)
    assert "\n" not in str(err.value)
    with pytest.raises(UsageError, match=f"device {spec}: no CUDA device"):
        build_config({}, {"device": spec})


@pytest.mark.skipif(HAS_CUDA, reason="CUDA is available: the error cannot be shown")
def test_cli_device_cuda_without_cuda(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = main(["run", "--device", "cuda", "-r", "1", "-q", "-o", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "no CUDA device is available" in err
    assert not list(tmp_path.iterdir())


def test_cli_options_reach_the_config(tmp_path: Path) -> None:
    cfg = build_config(
        {}, {"device": "cpu", "tf32": "on", "deterministic": True, "clients_together": "vmap"}
    )
    assert (cfg.device, cfg.tf32, cfg.deterministic, cfg.clients_together) == (
        "cpu", True, True, "vmap",
    )  # fmt: skip
    with pytest.raises(UsageError, match="clients-together must be one of auto, off, vmap"):
        build_config({}, {"clients_together": "streams"})


def test_execution_options_leave_the_config_hash_alone() -> None:
    """device, tf32, deterministic and clients_together change rounding, not the experiment:
    a run may be resumed on another device (see EXECUTION_ONLY)."""
    base = ExperimentConfig()
    other = ExperimentConfig(
        device="cpu", tf32=True, deterministic=True, clients_together="vmap",
        clients_together_max=8,
    )  # fmt: skip
    assert config_hash(base) == config_hash(other)


def test_execution_settings_are_put_back() -> None:
    before = ExecutionSettings.current()
    with settings_applied(ExecutionSettings(tf32=not before.tf32, deterministic=True)):
        assert torch.are_deterministic_algorithms_enabled()
        assert tf32_state() == (("ieee", "ieee") if before.tf32 else ("tf32", "tf32"))
    assert ExecutionSettings.current() == before


def _tf32_readings() -> dict[str, object]:
    """What a user's code may read about TF32, through either API ("raises" where PyTorch
    refuses the read)."""
    backends = torch.backends
    readers = {
        "matmul.allow_tf32": lambda: backends.cuda.matmul.allow_tf32,
        "matmul.fp32_precision": lambda: backends.cuda.matmul.fp32_precision,
        "cudnn.allow_tf32": lambda: backends.cudnn.allow_tf32,
        "cudnn.conv.fp32_precision": lambda: backends.cudnn.conv.fp32_precision,
        "fp32_precision": lambda: backends.fp32_precision,
        "float32_matmul_precision": torch.get_float32_matmul_precision,
    }
    out: dict[str, object] = {}
    for name, read in readers.items():
        try:
            out[name] = read()
        except RuntimeError:
            out[name] = "raises"
    return out


@pytest.fixture
def user_tf32():
    """The TF32 switches as a fresh process has them, after the test."""
    yield
    torch.backends.fp32_precision = "none"
    torch.set_float32_matmul_precision("highest")  # legacy and new in step
    torch.backends.cuda.matmul.fp32_precision = "none"
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.conv.fp32_precision = "tf32"


USER_TF32 = {
    "new matmul api": lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", "tf32"),
    "new conv api": lambda: setattr(torch.backends.cudnn.conv, "fp32_precision", "ieee"),
    "new generic api": lambda: setattr(torch.backends, "fp32_precision", "tf32"),
    "legacy flags": lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", True),
    "matmul precision high": lambda: torch.set_float32_matmul_precision("high"),
    "nothing set": lambda: None,
}


@pytest.mark.parametrize("user", sorted(USER_TF32))
@pytest.mark.parametrize("tf32", [False, True])
def test_tf32_settings_work_after_either_api_and_are_put_back(user, tf32, user_tf32) -> None:
    """Before, a session that set TF32 through PyTorch's newer API (fp32_precision) got
    "mix of the legacy and new APIs" from fedskew reading the legacy flag."""
    USER_TF32[user]()
    before = _tf32_readings()
    with settings_applied(ExecutionSettings(tf32=tf32, deterministic=False)):
        want = "tf32" if tf32 else "ieee"
        assert tf32_state() == (want, want)
        assert ExecutionSettings.current().tf32 is tf32
    assert _tf32_readings() == before


def test_a_run_after_the_new_tf32_api(user_tf32, tmp_path: Path) -> None:
    """The review's reproduction: fp32_precision set, then fedskew.run (on any device)."""
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    cfg = ExperimentConfig(
        rounds=1, num_clients=4, clients_per_round=2, local_epochs=1, out_dir=str(tmp_path),
        name="tf32", quiet=True, workers=0, device="cpu",
    )  # fmt: skip
    _, summary = run(cfg)
    assert summary["final_accuracy"] is not None
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**env, "PYTHONPATH": src + os.pathsep + env.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )


def test_importing_fedskew_sets_the_cublas_variable_before_any_cuda_work() -> None:
    """cuBLAS reads CUBLAS_WORKSPACE_CONFIG once, at the process's first matrix product: it
    must be in the environment from the import on, not from the first deterministic run (a
    CUDA run before it would make that one fail). A value the user chose is kept."""
    env = {k: v for k, v in os.environ.items() if k != CUBLAS_VARIABLE}
    code = (
        "import os, sys\n"
        "import fedskew.core.device\n"
        "assert not fedskew.core.cuda_environment.CUDA_BEFORE_IMPORT\n"
        "print(os.environ.get('CUBLAS_WORKSPACE_CONFIG'))"
    )
    done = _python(code, env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == CUBLAS_VALUE
    done = _python(code, {**env, CUBLAS_VARIABLE: ":16:8"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ":16:8"


def test_deterministic_cuda_is_refused_in_one_line_when_cublas_cannot_comply(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With CUDA (pretended here), a deterministic run is checked before it starts: a
    variable with a non-reproducible value, or CUDA used before fedskew was imported, is a
    UsageError naming the fix, not PyTorch's RuntimeError at the first matrix product."""
    import fedskew.core.cuda_environment as environment
    import fedskew.core.device as device

    settings = ExecutionSettings(tf32=False, deterministic=True)
    before = ExecutionSettings.current()
    monkeypatch.setattr(device, "cuda_count", lambda: 1)
    monkeypatch.setenv(CUBLAS_VARIABLE, ":0:0")
    with pytest.raises(UsageError, match="does not make cuBLAS reproducible"):
        device.apply_settings(settings)
    monkeypatch.setenv(CUBLAS_VARIABLE, CUBLAS_VALUE)
    monkeypatch.setattr(environment, "CUDA_BEFORE_IMPORT", True)
    with pytest.raises(UsageError, match="used CUDA before importing fedskew"):
        device.apply_settings(settings)
    assert ExecutionSettings.current() == before  # refused before any switch changed
    monkeypatch.setattr(environment, "CUDA_BEFORE_IMPORT", False)
    with settings_applied(settings):
        assert torch.are_deterministic_algorithms_enabled()
    # Without CUDA there is no cuBLAS: the same variable is no reason to refuse a CPU run.
    monkeypatch.setattr(device, "cuda_count", lambda: 0)
    monkeypatch.setenv(CUBLAS_VARIABLE, ":0:0")
    with settings_applied(settings):
        assert torch.are_deterministic_algorithms_enabled()


@pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)
def test_a_deterministic_cuda_run_after_an_ordinary_one_in_one_process(tmp_path: Path) -> None:
    """The review's crash: a fresh process (nothing set in its environment) does cuBLAS work,
    then a deterministic run. With the variable set at import, both run."""
    env = {k: v for k, v in os.environ.items() if k != CUBLAS_VARIABLE}
    code = (
        "import torch, fedskew.runs.loop as e\n"
        "from fedskew.config import ExperimentConfig\n"
        "a = torch.randn(64, 64, device='cuda'); (a @ a).sum().item()\n"
        "for det in (False, True):\n"
        "    e.run(ExperimentConfig(rounds=1, num_clients=4, clients_per_round=2, workers=0,\n"
        f"        device='cuda', deterministic=det, out_dir={str(tmp_path)!r},\n"
        "        name=f'det{det}', quiet=True))\n"
        "print('ok')"
    )
    done = _python(code, env)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_run_folder_records_the_device(tmp_path: Path) -> None:
    cfg = ExperimentConfig(
        rounds=1, num_clients=4, clients_per_round=2, local_epochs=1, out_dir=str(tmp_path),
        name="dev", quiet=True, workers=0, device="cpu", deterministic=True,
    )  # fmt: skip
    before = torch.are_deterministic_algorithms_enabled()
    folder, summary = run(cfg)
    assert torch.are_deterministic_algorithms_enabled() == before
    process = json.loads((folder / "processes.jsonl").read_text().splitlines()[0])
    assert process["device"] == "cpu" and process["device_name"] == "cpu"
    assert process["deterministic"] is True and process["tf32"] is False
    assert process["clients_together"] == "off"
    resolved = json.loads((folder / "config.json").read_text())["resolved"]
    assert resolved["device"] == "cpu"
    assert summary["final_accuracy"] is not None
    # No GPU memory to report on the CPU: the keys are absent.
    line = json.loads((folder / "metrics.jsonl").read_text().splitlines()[0])
    assert not set(PEAK_KEYS) & (set(line) | set(summary))


def test_gpu_memory_peaks_per_round_and_in_the_summary(monkeypatch, tmp_path: Path) -> None:
    """Each round's peaks reach metrics.jsonl and the run's largest the summary (the query
    monkeypatched: this machine may have no GPU)."""
    import fedskew.runs.loop as loop

    resets: list[torch.device] = []
    peaks = iter([(100.0, 128.0), (300.0, 512.0), (200.0, 512.0)])

    def measured(device: torch.device) -> dict[str, float]:
        allocated, reserved = next(peaks)
        return {"gpu_peak_mib": allocated, "gpu_reserved_peak_mib": reserved}

    monkeypatch.setattr(loop, "reset_peaks", resets.append)
    monkeypatch.setattr(loop, "memory_peaks", measured)
    cfg = ExperimentConfig(
        rounds=3, num_clients=4, clients_per_round=2, local_epochs=1, out_dir=str(tmp_path),
        name="peaks", quiet=True, workers=0, device="cpu",
    )  # fmt: skip
    folder, summary = run(cfg)
    lines = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [x["gpu_peak_mib"] for x in lines] == [100.0, 300.0, 200.0]
    assert [x["gpu_reserved_peak_mib"] for x in lines] == [128.0, 512.0, 512.0]
    assert (summary["gpu_peak_mib"], summary["gpu_reserved_peak_mib"]) == (300.0, 512.0)
    assert len(resets) == 3  # measured afresh every round


def test_memory_peaks_read_the_allocator_on_cuda(monkeypatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: 4 * 2**30 + 2**19)
    cuda = torch.device("cuda", 0)
    reset_peaks(cuda)
    assert calls == ["reset"]
    assert memory_peaks(cuda) == {"gpu_peak_mib": 3072.0, "gpu_reserved_peak_mib": 4096.5}
    reset_peaks(torch.device("cpu"))
    assert calls == ["reset"] and memory_peaks(torch.device("cpu")) == {}


# ---------------------------------------------------------------------------- meta default

# Every registered algorithm, the feature-matching plug-in on a few, the multi-exchange
# variants of FedCME, FedACD without mixup, and the loop's augmentation and clipping.
CASES: dict[str, dict] = {name: {"algorithm": name} for name in ALGORITHMS}
CASES["fedfm"]["params"] = {"lam": 5, "start_round": 1}
CASES["fedfm-lite"]["params"] = {"lam": 5, "start_round": 1, "a": 2}
CASES["creff"]["params"] = {"match_epochs": 3, "crt_epochs": 5}
CASES["fedfm-uniform-l2"] = {
    "algorithm": "fedfm",
    "params": {"lam": 5, "start_round": 0, "fm_loss": "l2", "anchor_agg": "uniform"},
}
for inner in ("fedavg", "scaffold", "fedcme"):
    CASES[f"{inner}+fm"] = {
        "algorithm": inner, "feature_matching": True, "params": {"lam": 5, "start_round": 1},
    }  # fmt: skip
CASES["fedcme-e2"] = {"algorithm": "fedcme", "local_epochs": 2}
CASES["fedcme-many-e2"] = {
    "algorithm": "fedcme", "local_epochs": 2, "params": {"matching": "many-to-one"},
}  # fmt: skip
CASES["fedacd-nomix"] = {"algorithm": "fedacd", "params": {"mixup": False}}
CASES["fedrod-eval"] = {"algorithm": "fedrod", "params": {"phead_init": "generic"}}
# BatchNorm buffers, the loop's augmentation, clipping and bf16 autocast.
CASES["fedavg-bn-augment-clip-bf16"] = {
    "algorithm": "fedavg", "model": TINY_BN, "augment": True, "grad_clip": 1.0,
    "precision": "bf16",
}  # fmt: skip
for name in ("scaffold", "moon", "fedrod", "fednh"):
    CASES[f"{name}-bn"] = {**CASES[name], "model": TINY_BN}


def _state(options: dict) -> RunState:
    options = {"local_epochs": 1, **options}
    cfg = ExperimentConfig(
        rounds=2, num_clients=6, clients_per_round=3, workers=0, quiet=True, device="cpu",
        **options,
    )  # fmt: skip
    prep = prepare(cfg)
    model, eval_model = new_model(prep), new_model(prep)
    setup = server_setup(prep, model)
    server = prep.algorithm.Server(prep.params, setup)
    engine = InProcessEngine.from_prepared(prep, prep.algorithm.Client(prep.params), model)
    return RunState(prep, setup, server, engine, eval_model, cfg.per_round())


def _two_rounds(options: dict, meta_round: int | None) -> tuple[list[dict], RunState]:
    state = _state(options)
    records = []
    for rnd in range(2):
        where = torch.device("meta") if rnd == meta_round else torch.device("cpu")
        with where:
            record = play_round(state, rnd)
            record.update(evaluate_global_model(state))
        record.pop("seconds")
        records.append(record)
    return records, state


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_algorithm_is_device_correct(case: str) -> None:
    """Round 2 (with the client state round 1 left: SCAFFOLD's c_k, MOON's previous model,
    FedCME's vectors, FedROD's head, ...) under a meta default device equals a plain run."""
    options = CASES[case]
    expected, plain = _two_rounds(options, None)
    got, meta = _two_rounds(options, 1)
    assert got == expected
    for name, value in plain.server.global_arrays.items():
        assert torch.equal(meta.server.global_arrays[name], value), name
    for cid, client_state in plain.engine.client_states.items():
        other = meta.engine.client_states[cid]
        assert other.scalars == client_state.scalars
        for name, value in client_state.arrays.items():
            assert other.arrays[name].device.type == "cpu"
            assert torch.equal(other.arrays[name], value), (cid, name)


# ---------------------------------------------------------------------------- per device


@pytest.mark.parametrize("device", DEVICES)
def test_runtime_keeps_messages_and_state_device_free(device: str) -> None:
    """The client runtime is the device boundary: replies and state come back in host
    memory, whatever the device the client trained on."""
    cfg = ExperimentConfig(
        algorithm="scaffold", num_clients=4, clients_per_round=2, local_epochs=1, workers=0,
        device=device,
    )  # fmt: skip
    prep = prepare(cfg)
    runtime = ClientRuntime.from_prepared(prep)
    assert runtime.model.head.weight.device.type == device
    assert prep.fed.x.device.type == device and prep.fed.client(0).indices.device.type == device
    arrays = {k: v.cpu() for k, v in new_model(prep).state_dict().items()}
    c = {f"c/{k}": torch.zeros_like(v) for k, v in arrays.items() if v.is_floating_point()}
    state = ClientState()
    for rnd in range(2):
        reply = runtime.handle(0, rnd, Message("train", arrays={**arrays, **c}), state)
        assert {t.device.type for t in reply.arrays.values()} == {"cpu"}
        assert state.arrays and {t.device.type for t in state.arrays.values()} == {"cpu"}


@pytest.mark.parametrize("device", DEVICES)
def test_same_device_and_settings_give_the_same_metrics(device: str, tmp_path: Path) -> None:
    def once(name: str) -> list[dict]:
        cfg = ExperimentConfig(
            algorithm="fedprox", rounds=2, num_clients=4, clients_per_round=2, local_epochs=1,
            out_dir=str(tmp_path), name=name, quiet=True, workers=0, device=device,
            deterministic=True,
        )  # fmt: skip
        folder, _ = run(cfg)
        lines = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
        for line in lines:
            # Timings, and the allocator's peaks: a process's first CUDA run also holds its
            # one-time allocations (cuBLAS's workspace), seen on an H200 (gpu_check).
            for key in ("seconds", "eval_seconds", *PEAK_KEYS):
                line.pop(key, None)
        return lines

    a, b = once("a"), once("b")
    differ = sorted({k for x, y in zip(a, b, strict=True) for k in x if x[k] != y.get(k)})
    assert a == b, f"metrics differ in {differ}"


@pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_cuda_curve_matches_the_cpu_curve(algorithm: str, tmp_path: Path) -> None:
    """fp32, 3 rounds: accuracy within 0.02 and loss within 2 % of the CPU run's (the
    tolerance docs/gpu.md states; benchmarks/gpu_check.sh reports the measured gaps)."""
    params = dict(CASES[algorithm].get("params", {}))
    curves = {}
    for device in ("cpu", "cuda"):
        cfg = ExperimentConfig(
            algorithm=algorithm, params=params, rounds=3, num_clients=6, clients_per_round=3,
            local_epochs=1, out_dir=str(tmp_path), name=device, quiet=True, workers=0,
            device=device, clients_together="off",
        )  # fmt: skip
        folder, _ = run(cfg)
        curves[device] = [
            json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()
        ]
    for cpu, cuda in zip(curves["cpu"], curves["cuda"], strict=True):
        assert abs(cpu["accuracy"] - cuda["accuracy"]) <= 0.02
        assert abs(cpu["loss"] - cuda["loss"]) <= 0.02 * abs(cpu["loss"]) + 1e-4


@pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)
@pytest.mark.parametrize("case", sorted(SYNC_CASES))
def test_cuda_local_steps_do_not_wait_for_the_host(case: str, tmp_path: Path) -> None:
    """Two more local epochs (2 against 4: one protocol for every case) add about 44 steps
    per client; they may add a sync per epoch at most, not several per step, as the
    per-batch host draws and boolean masks did (about 5 per step with augmentation). The
    same check on the CPU, with a proxy counter, catches a planted per-step sync
    (tests/test_host_syncs.py)."""
    short, long = sync_counts(cuda_syncs, SYNC_CASES[case], "cuda", tmp_path)
    assert not waits_per_step(short, long), (short, long)


# ---------------------------------------------------------------------------- several GPUs


def test_workers_spread_over_the_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    import fedskew.config as config
    import fedskew.engines.workers as workers

    monkeypatch.setattr(workers, "cuda_count", lambda: 2)
    assert [workers.worker_device("cuda", i) for i in range(3)] == ["cuda:0", "cuda:1", "cuda:0"]
    assert workers.worker_device("auto", 3) == "cuda:1"
    assert workers.worker_device("cuda:1", 0) == "cuda:1"  # one named GPU for all
    assert workers.worker_device("cpu", 1) == "cpu"
    monkeypatch.setattr(config, "cuda_count", lambda: 4)
    assert config.effective_workers(ExperimentConfig(device="cuda", clients_per_round=8)) == 4
    assert config.effective_workers(ExperimentConfig(device="auto", clients_per_round=3)) == 3
    assert config.effective_workers(ExperimentConfig(device="cuda:1", clients_per_round=8)) == 0
    assert config.effective_workers(ExperimentConfig(device="cuda", workers=2)) == 2
    monkeypatch.setattr(config, "cuda_count", lambda: 1)
    assert config.effective_workers(ExperimentConfig(device="cuda", clients_per_round=8)) == 0


def test_flower_simulation_gives_each_client_a_gpu_fraction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("flwr")
    import fedskew.apps.flower.simulation as flower_app

    assert flower_app.simulation_gpus_per_client(ExperimentConfig(device="cpu")) == 0.0
    with pytest.raises(UsageError, match="use --device cuda or auto"):
        flower_app.simulation_gpus_per_client(ExperimentConfig(device="cuda:1"))
    monkeypatch.setattr(flower_app, "resolve_device", lambda spec: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cfg = ExperimentConfig(device="cuda", num_clients=20, clients_per_round=8)
    assert flower_app.simulation_gpus_per_client(cfg) == 1 / 8
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 16)
    assert flower_app.simulation_gpus_per_client(cfg) == 1.0
    # 2 GPUs, 3 clients: 2/3 each would put one client per GPU (two 2/3 do not fit on one);
    # 1/2 each puts all three on the two GPUs at once.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cfg = ExperimentConfig(device="cuda", num_clients=20, clients_per_round=3)
    assert flower_app.simulation_gpus_per_client(cfg) == 0.5


def test_gpu_check_fails_fast_without_cuda() -> None:
    import subprocess

    if HAS_CUDA:
        pytest.skip("CUDA is available: gpu_check.sh would run its checks")
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.sh"
    # This interpreter, as the script's PYTHON: its default (.venv/bin/python, else python3)
    # may be one without torch where the suite runs from another environment.
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run([str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2
    assert "no CUDA device" in done.stderr and len(done.stderr.strip().splitlines()) == 1
