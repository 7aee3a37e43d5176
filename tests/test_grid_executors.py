"""`fedskew compare --executor ray|slurm`: the same runs as `--executor local`, on a real
two-node Ray cluster of this machine and through the Slurm array scripts executed by hand;
finished runs are skipped, killed ones resume, and the tables equal those of a local grid."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from fedskew.apps.cli import main
from fedskew.grid.executors.slurm_array import array_spec

ROOT = Path(__file__).resolve().parents[1]
SRC = str(ROOT / "src")

# 12 rounds: long enough to catch a run between two rounds and kill it there.
GRID = """
[compare]
out_dir = "{out}"
seeds = [0]
last = 5
threads = 1
jobs = 2

[experiment]
dataset = "digits"
num_clients = 4
clients_per_round = 2
rounds = 40
local_epochs = 1
batch_size = 64

[methods.fedavg]

[methods.prox]
algorithm = "fedprox"
params = {{ mu = 0.1 }}
"""
RUNS = ["fedavg-s0", "prox-s0"]
TIMING = ("seconds_per_round", "machines")  # where and how fast, not what was computed
METRIC_KEYS = ("round", "clients", "accuracy", "loss", "bytes_down", "bytes_up")


def grid_file(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / "grid.toml"
    file.write_text(GRID.format(out=folder / "out"))
    return file


def env_with_tree() -> dict[str, str]:
    """This tree's fedskew first, for the commands the tests start and their runs."""
    path = os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def fedskew(*args: str) -> list[str]:
    return [sys.executable, "-m", "fedskew", *args]


def comparison(out: Path) -> list[dict[str, str]]:
    rows = list(csv.DictReader((out / "comparison.csv").open()))
    return [{k: v for k, v in row.items() if k not in TIMING} for row in rows]


def metrics(folder: Path) -> list[dict]:
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    return [{k: r.get(k) for k in METRIC_KEYS} for r in rows]


def from_rounds(folder: Path) -> list[int]:
    lines = (folder / "processes.jsonl").read_text().splitlines()
    return [json.loads(x)["from_round"] for x in lines]


def rounds_done(unfinished: Path) -> int:
    try:
        return len((unfinished / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def run_pid(unfinished: Path) -> int | None:
    """The pid of the process training ``unfinished``, from its lock ("pid N on HOST")."""
    try:
        words = (unfinished / "lock").read_text().split()
    except OSError:
        return None
    return int(words[1]) if len(words) > 1 and words[1].isdigit() else None


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def wait_for_rounds(unfinished: Path, rounds: int, proc: subprocess.Popen, timeout=120) -> int:
    """Wait until ``unfinished`` has ``rounds`` rounds and a live trainer; its pid."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the command ended before the run could be killed"
        pid = run_pid(unfinished)
        if rounds_done(unfinished) >= rounds and pid is not None:
            return pid
        time.sleep(0.02)
    raise AssertionError(f"{unfinished} never reached round {rounds}")


def stop_in_reverse(started: list[subprocess.Popen]) -> None:
    """End the processes a fixture started, last first (daemons after their clients)."""
    for proc in reversed(started):
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def local_grid(tmp_path_factory) -> Path:
    """The grid run by `--executor local`: what the other executors must reproduce."""
    file = grid_file(tmp_path_factory.mktemp("local"))
    assert main(["compare", "-c", str(file), "--executor", "local"]) == 0
    return file.parent / "out"


def same_results(out: Path, local: Path) -> None:
    assert comparison(out) == comparison(local)
    for name in RUNS:
        assert metrics(out / name) == metrics(local / name), name


# --------------------------------------------------------------------------------- Ray


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A head node and a second node, each its own `ray start --block` process tree on
    loopback; stopped by ending those two processes (which stop what they started)."""
    pytest.importorskip("ray")
    ray_bin = Path(sys.executable).with_name("ray")
    if not ray_bin.is_file():
        pytest.skip("no ray command next to this Python")
    port = free_port()
    temp = tmp_path_factory.mktemp("ray")
    # Without this tree on its path: a task sees this tree only through compare's runtime_env.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    common = ["--block", "--node-ip-address=127.0.0.1", "--object-store-memory=80000000",
              "--min-worker-port=0", "--max-worker-port=0"]  # fmt: skip
    head = [str(ray_bin), "start", "--head", f"--port={port}", "--num-cpus=2",
            "--include-dashboard=false", f"--temp-dir={temp}", *common]  # fmt: skip
    node = [str(ray_bin), "start", f"--address=127.0.0.1:{port}", "--num-cpus=1", *common]
    started: list[subprocess.Popen] = []
    log = (temp / "start.log").open("w")
    try:
        # The second node waits for the head's GCS on its own.
        for cmd in (head, node):
            started.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=log))
        status = [str(ray_bin), "status", f"--address=127.0.0.1:{port}"]
        deadline = time.monotonic() + 90
        while True:
            time.sleep(1)
            shown = subprocess.run(status, env=env, capture_output=True, text=True).stdout
            if sum(x.strip().startswith("1 node_") for x in shown.splitlines()) == 2:
                break
            assert time.monotonic() < deadline, (temp / "start.log").read_text()[-2000:]
            assert all(p.poll() is None for p in started), (temp / "start.log").read_text()
        yield f"127.0.0.1:{port}"
    finally:
        stop_in_reverse(started)
        log.close()


# About a minute with its cluster's start: `pytest -m slow` (the default run's budget).
@pytest.mark.slow
def test_ray_grid_retries_killed_tasks_and_matches_local(ray_cluster, local_grid, tmp_path):
    """Two runs as Ray tasks over two nodes. The worker of one run is killed, and the run
    process of another: both tasks are retried and resume their runs from the rounds on
    disk. The tables and every run's metrics equal the local grid's; a second call skips
    every run."""
    file = grid_file(tmp_path)
    out = tmp_path / "out"
    cmd = fedskew("compare", "-c", str(file), "--executor", "ray", "--ray-address", ray_cluster)
    proc = subprocess.Popen(cmd, env=env_with_tree(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        # The Ray worker running fedavg-s0's task: its run dies with it.
        pid = wait_for_rounds(out / "fedavg-s0.incomplete", 2, proc)
        worker = parent_of(pid)
        assert b"ray" in Path(f"/proc/{worker}/cmdline").read_bytes()
        os.kill(worker, signal.SIGKILL)
        # prox-s0's run process alone (as the out-of-memory killer would).
        os.kill(wait_for_rounds(out / "prox-s0.incomplete", 2, proc), signal.SIGKILL)
        printed, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, printed
    assert "warning" not in printed  # the tasks ran this tree's fedskew
    for name in RUNS:
        assert f"{name}: resumed" in printed, printed
        first, then = from_rounds(out / name)
        assert first == 1 and then >= 3  # continued after the rounds on disk, not restarted
    same_results(out, local_grid)

    before = {n: (out / n / "metrics.jsonl").stat().st_mtime_ns for n in RUNS}
    again = subprocess.run(cmd, env=env_with_tree(), capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("done before") == len(RUNS), again.stdout
    assert before == {n: (out / n / "metrics.jsonl").stat().st_mtime_ns for n in RUNS}


def test_sigterm_cancels_the_ray_tasks(ray_cluster, tmp_path):
    """SIGTERM to compare (as Ctrl-C) cancels its tasks: the run process ends with its task,
    and its folder keeps its rounds, free for the next compare to resume."""
    file = grid_file(tmp_path)
    file.write_text(file.read_text().replace("rounds = 40", "rounds = 500"))
    out = tmp_path / "out"
    cmd = fedskew("compare", "-c", str(file), "--methods", "fedavg", "--executor", "ray",
                  "--ray-address", ray_cluster)  # fmt: skip
    proc = subprocess.Popen(cmd, env=env_with_tree(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        pid = wait_for_rounds(out / "fedavg-s0.incomplete", 2, proc)
        proc.send_signal(signal.SIGTERM)
        printed, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, printed
    assert "Ray tasks cancelled" in printed, printed
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists() and b"fedskew" in Path(f"/proc/{pid}/cmdline").read_bytes():
        assert time.monotonic() < deadline, "the run outlived its cancelled task"
        time.sleep(0.1)
    assert rounds_done(out / "fedavg-s0.incomplete") >= 2
    assert not (out / "fedavg-s0").exists()


def test_a_run_no_ray_node_can_take_is_one_line(ray_cluster, tmp_path):
    file = grid_file(tmp_path)
    cmd = fedskew("compare", "-c", str(file), "--executor", "ray", "--ray-address", ray_cluster)
    asked = subprocess.run([*cmd, "--gpus-per-run", "0.5"], env=env_with_tree(),
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert asked.returncode == 2, asked.stderr
    assert asked.stderr.count("\n") == 1 and "no node of the Ray cluster has 1 CPU and 0.5 GPU" \
        in asked.stderr, asked.stderr  # fmt: skip


TUNE_STUDY = """
[tune]
trials = 3
seeds = [100]
last = 2

[compare]
seeds = [0]
threads = 1

[experiment]
dataset = "digits"
num_clients = 4
clients_per_round = 2
rounds = 2

[methods.fedavg.search]
lr = { log = [0.01, 0.1] }
"""


def test_tune_on_ray_tasks_share_the_budget_without_running_a_trial_twice(ray_cluster, tmp_path):
    """Two Ray tasks (on the cluster's two nodes) work on one SQLite study as two tune
    processes would: together they finish the budget, each trial once, in one folder each."""
    pytest.importorskip("optuna")
    import optuna

    file = tmp_path / "study.toml"
    file.write_text(TUNE_STUDY)
    out = tmp_path / "tuned"
    cmd = fedskew("tune", "-c", str(file), "-o", str(out), "--executor", "ray", "--tasks", "2",
                  "--ray-address", ray_cluster)  # fmt: skip
    done = subprocess.run(cmd, env=env_with_tree(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    study = optuna.load_study(study_name="study.fedavg", storage=f"sqlite:///{out / 'study.db'}")
    states = [t.state for t in study.get_trials(deepcopy=False)]
    assert states == [optuna.trial.TrialState.COMPLETE] * 3
    folders = sorted(p.name for p in (out / "trials").iterdir())
    assert folders == [f"fedavg-t{n}-s100" for n in range(3)]
    for folder in folders:
        assert len((out / "trials" / folder / "processes.jsonl").read_text().splitlines()) == 1
    assert "2 Ray task(s) tune the study" in done.stdout
    assert json.loads((out / "tuned.json").read_text())["methods"]["fedavg"]["lr"] > 0


def test_ray_without_ray_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails as if not installed
    file = grid_file(tmp_path)
    assert main(["compare", "-c", str(file), "--executor", "ray"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--executor ray needs Ray" in err
    assert not (tmp_path / "out").exists()  # nothing written


@pytest.mark.parametrize("command", ["compare", "tune"])
def test_an_unreachable_ray_address_is_one_line_soon(tmp_path, command):
    """ray.init waits for an address nothing listens on for ever (and ignores SIGTERM
    meanwhile); compare and tune give up after a bounded wait, in one line."""
    pytest.importorskip("ray")
    if command == "tune":
        pytest.importorskip("optuna")
        file = tmp_path / "study.toml"
        file.write_text(TUNE_STUDY)
        args = ["tune", "-c", str(file), "-o", str(tmp_path / "tuned")]
    else:
        args = ["compare", "-c", str(grid_file(tmp_path))]
    address = f"127.0.0.1:{free_port()}"  # free: nothing listens there
    cmd = fedskew(*args, "--executor", "ray", "--ray-address", address)
    started = time.monotonic()
    done = subprocess.run(cmd, env=env_with_tree(), capture_output=True, text=True, timeout=90)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert f"cannot reach the Ray cluster at {address}" in done.stderr
    assert time.monotonic() - started < 60
    bad = fedskew(*args, "--executor", "ray", "--ray-address", "nohost")
    malformed = subprocess.run(bad, env=env_with_tree(), capture_output=True, text=True, timeout=90)
    assert malformed.returncode == 2 and "must be HOST:PORT or auto" in malformed.stderr


def session_processes(sid: int) -> list[int]:
    """The live processes of session ``sid`` (a command started with start_new_session)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


# Its own Ray cluster's start: some 20 s here.
@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_compare_leaves_no_ray_process_behind(tmp_path):
    """compare with a Ray cluster of its own, killed with SIGKILL while its runs train: Ray's
    dashboard and runtime-env agents used to live on (ignoring SIGTERM); now the cluster's
    watcher kills what is left."""
    pytest.importorskip("ray")
    file = grid_file(tmp_path)
    file.write_text(file.read_text().replace("rounds = 40", "rounds = 20000"))
    cmd = fedskew("compare", "-c", str(file), "--executor", "ray", "--progress-every", "0")
    proc = subprocess.Popen(cmd, env=env_with_tree(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        wait_for_rounds(tmp_path / "out" / "fedavg-s0.incomplete", 1, proc, timeout=240)
        assert len(session_processes(proc.pid)) > 3  # the cluster is up
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 60
        while session_processes(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = session_processes(proc.pid)
        names = [Path(f"/proc/{p}/cmdline").read_bytes()[:60] for p in left]
        assert left == [], names
    finally:
        for pid in session_processes(proc.pid):  # what the old code left
            os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------------------------- Slurm


def sbatch_options(script: Path) -> list[str]:
    return [x.split(" ", 1)[1] for x in script.read_text().splitlines() if x.startswith("#SBATCH")]


def array_task(script: Path, index: int) -> subprocess.Popen:
    env = {**env_with_tree(), "SLURM_ARRAY_TASK_ID": str(index), "SLURM_ARRAY_JOB_ID": "7"}
    return subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


def test_slurm_array_scripts_run_skip_and_resume(local_grid, tmp_path, capsys):
    """--dry-run writes the array script and the runs list; each array task, executed here
    as Slurm would (SLURM_ARRAY_TASK_ID set), runs its run; a second execution skips it; the
    USR1 before the time limit stops a run, which the requeued task resumes; the tables
    equal the local grid's."""
    file = grid_file(tmp_path)
    out = tmp_path / "out"
    args = ["compare", "-c", str(file), "--executor", "slurm", "--dry-run",
            "--slurm-time", "1:00:00", "--slurm-partition", "cpu", "--slurm-mem", "2G",
            "--slurm-extra=--qos=low"]  # fmt: skip
    assert main(args) == 0
    assert "2 array tasks" in capsys.readouterr().out
    script = out / "slurm" / "array.sbatch"
    assert sbatch_options(script) == [
        "--job-name=fedskew-out", f"--output={out}/slurm/logs/%A_%a.out", "--open-mode=append",
        "--partition=cpu", "--time=1:00:00", "--ntasks=1", "--cpus-per-task=1", "--mem=2G",
        "--requeue", "--signal=B:USR1@120", "--qos=low", "--array=0-1",
    ]  # fmt: skip
    tables = out / "slurm" / "tables.sbatch"
    assert "--report-only" in tables.read_text()
    listing = json.loads((out / "slurm" / "runs.json").read_text())
    assert [r["folder"] for r in listing["runs"]] == RUNS

    # Tasks 0 and 1 side by side, as two array tasks run; task 1 is told its time is
    # nearly up once it has 2 rounds.
    task, late = array_task(script, 0), array_task(script, 1)
    wait_for_rounds(out / "prox-s0.incomplete", 2, late)
    late.send_signal(signal.SIGUSR1)
    printed, _ = late.communicate(timeout=120)
    assert late.returncode != 0 and "requeueing 7_1" in printed, printed
    assert (out / "prox-s0.incomplete").is_dir() and not (out / "prox-s0").exists()
    printed, _ = task.communicate(timeout=120)
    assert task.returncode == 0 and "fedavg-s0: finished" in printed, printed
    # The requeued task resumes the run.
    again = array_task(script, 1)
    printed, _ = again.communicate(timeout=120)
    assert again.returncode == 0 and "prox-s0: resumed" in printed, printed
    first_round, then = from_rounds(out / "prox-s0")
    assert first_round == 1 and then >= 3
    # Every run finished: executing a task again changes nothing.
    before = (out / "fedavg-s0" / "metrics.jsonl").stat().st_mtime_ns
    printed, _ = array_task(script, 0).communicate(timeout=60)
    assert "fedavg-s0: done before" in printed
    assert (out / "fedavg-s0" / "metrics.jsonl").stat().st_mtime_ns == before

    tables_run = subprocess.run(["bash", str(tables)], env=env_with_tree(),
                                capture_output=True, text=True)  # fmt: skip
    assert tables_run.returncode == 0, tables_run.stderr
    same_results(out, local_grid)
    # Nothing left to submit: compare says so and writes the tables itself.
    assert main(args) == 0
    assert "nothing to submit" in capsys.readouterr().out


def test_slurm_without_sbatch_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch on it
    file = grid_file(tmp_path)
    assert main(["compare", "-c", str(file), "--executor", "slurm"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs sbatch" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--gpus-per-run", "-1"], "gpus-per-run must be a number >= 0"),
        (["--executor", "local", "--dry-run"], "goes with --executor slurm"),
        (["--executor", "slurm", "--slurm-mem", "lots"], "slurm-mem must look like 8G"),
        (["--executor", "slurm", "--slurm-extra", "x; rm -rf /"], "slurm-extra must look"),
    ],
)
def test_bad_executor_options_are_one_line(tmp_path, capsys, extra, message):
    file = grid_file(tmp_path)
    assert main(["compare", "-c", str(file), *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_executor_from_the_compare_file(tmp_path, capsys):
    file = grid_file(tmp_path)
    file.write_text(file.read_text().replace("jobs = 2", 'jobs = 2\nexecutor = "kubernetes"'))
    assert main(["compare", "-c", str(file)]) == 2
    assert "executor must be one of local, ray, slurm" in capsys.readouterr().err
    file.write_text(file.read_text().replace('"kubernetes"', '"slurm"\nslurm_cpus = 3'))
    assert main(["compare", "-c", str(file), "--dry-run"]) == 0
    assert "--cpus-per-task=3" in sbatch_options(tmp_path / "out" / "slurm" / "array.sbatch")


def test_array_spec():
    assert array_spec([0, 1, 2, 3, 5, 7, 8, 9]) == "0-3,5,7-9"
    assert array_spec([4]) == "4"


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_scancel_stops_without_requeue(tmp_path):
    """A plain SIGTERM (scancel) stops the run, which stays resumable, and requeues nothing."""
    file = grid_file(tmp_path)
    out = tmp_path / "out"
    assert main(["compare", "-c", str(file), "--executor", "slurm", "--dry-run"]) == 0
    task = array_task(out / "slurm" / "array.sbatch", 0)
    wait_for_rounds(out / "fedavg-s0.incomplete", 2, task)
    task.send_signal(signal.SIGTERM)
    printed, _ = task.communicate(timeout=120)
    assert task.returncode != 0 and "requeue" not in printed, printed
    assert rounds_done(out / "fedavg-s0.incomplete") >= 2


# ------------------------------------------------------------------ a real Slurm cluster

SLURM_CONF = """\
ClusterName=fedskewtest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={d}/munge.sock,cred_expire=5
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
SLURM_DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "scancel")


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """A one-node Slurm cluster of this machine (munged, slurmctld, slurmd in the foreground,
    children of this fixture, with a configuration of their own); the environment that
    points Slurm's commands at it."""
    missing = [c for c in SLURM_DAEMONS if shutil.which(c) is None]
    if missing:
        pytest.skip(f"no {missing[0]} (Debian: apt-get install slurm-wlm)")
    if os.geteuid() != 0:
        pytest.skip("the test cluster's daemons run as root")
    d = Path(tempfile.mkdtemp(prefix="fedskew-slurm-"))  # short: munge's socket path
    for sub in ("state", "spool"):
        (d / sub).mkdir()
    (d / "munge").mkdir(mode=0o700)
    key = d / "munge" / "munge.key"
    subprocess.run(["mungekey", "-c", "-k", str(key)], check=True, capture_output=True)
    host = socket.gethostname().split(".")[0]
    conf = d / "slurm.conf"
    conf.write_text(SLURM_CONF.format(host=host, d=d, ctld_port=free_port(),
                                      slurmd_port=free_port(), cpus=os.cpu_count()))  # fmt: skip
    env = {**env_with_tree(), "SLURM_CONF": str(conf)}
    munge = [f"--socket={d}/munge.sock", f"--key-file={key}", f"--pid-file={d}/munged.pid",
             f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed"]  # fmt: skip
    daemons = [["munged", "-F", "--force", *munge], ["slurmctld", "-D", "-i"], ["slurmd", "-D"]]
    started: list[subprocess.Popen] = []
    log = (d / "daemons.log").open("w")
    try:
        for cmd in daemons:
            started.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=log))
            time.sleep(1)
        deadline = time.monotonic() + 60
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%T"], env=env,
                                           capture_output=True, text=True).stdout:  # fmt: skip
            assert time.monotonic() < deadline, (d / "daemons.log").read_text()[-2000:]
            assert all(p.poll() is None for p in started), (d / "daemons.log").read_text()
            time.sleep(0.5)
        yield env
    finally:
        stop_in_reverse(started)
        log.close()
        shutil.rmtree(d, ignore_errors=True)


def squeue(env: dict[str, str]) -> list[str]:
    shown = subprocess.run(["squeue", "-h", "-o", "%i %T"], env=env, capture_output=True,
                           text=True)  # fmt: skip
    return shown.stdout.split("\n")[:-1]


def test_slurm_cluster_runs_requeues_and_writes_the_tables(slurm_cluster, local_grid, tmp_path):
    """Submitted for real: the array task's batch shell gets the time-limit signal (USR1,
    sent with scancel as slurmctld would), the task requeues itself, resumes its run, and
    the tables job after the array writes the tables; the run equals the local grid's."""
    env = slurm_cluster
    file = grid_file(tmp_path)
    out = tmp_path / "out"
    cmd = fedskew("compare", "-c", str(file), "--methods", "fedavg", "--executor", "slurm")
    submitted = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert submitted.returncode == 0, submitted.stderr
    assert "submitted job array" in submitted.stdout, submitted.stdout
    job = submitted.stdout.split("submitted job array ")[1].split()[0]
    deadline = time.monotonic() + 60
    while rounds_done(out / "fedavg-s0.incomplete") < 2:
        assert time.monotonic() < deadline, squeue(env)
        time.sleep(0.05)
    task = f"{job}_0"
    subprocess.run(["scancel", "--batch", "--signal=USR1", task], env=env, check=True)
    deadline = time.monotonic() + 180
    while not (out / "comparison.csv").is_file() or squeue(env):
        assert time.monotonic() < deadline, (squeue(env), list((out / "slurm/logs").iterdir()))
        time.sleep(0.5)
    logs = (out / "slurm" / "logs" / f"{task}.out").read_text()
    assert f"requeueing {task}" in logs and "fedavg-s0: resumed" in logs, logs
    first, then = from_rounds(out / "fedavg-s0")
    assert first == 1 and then >= 3
    assert metrics(out / "fedavg-s0") == metrics(local_grid / "fedavg-s0")


def test_hostile_names_never_leave_the_grid_or_reach_a_script(tmp_path, capsys):
    """An [axes] value of '..' would put run folders beside the grid; a newline in the grid
    folder's name would become a shell line of the generated Slurm script. Both are refused
    in one line, before anything is written."""
    file = grid_file(tmp_path)
    hostile = file.with_name("axes.toml")
    hostile.write_text(file.read_text() + '\n[axes]\npartition = ["..", "iid"]\n')
    assert main(["compare", "-c", str(hostile), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "setting" in err and "'..'" in err, err
    newline = tmp_path / "grid\ntouch PWNED"
    argv = ["compare", "-c", str(file), "--executor", "slurm", "--dry-run", "-o", str(newline)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "control character" in err, err
    assert not list(newline.glob("slurm/*.sbatch"))


# ---------------------------------------------------------------------------- local GPUs


def test_local_runs_take_turns_on_the_gpus(monkeypatch):
    """GpuSlots with a monkeypatched GPU count: runs on cuda or auto get a group of the
    visible GPUs each (least busy first, in turn), others keep the environment."""
    from fedskew.grid import launch

    monkeypatch.setattr(launch, "cuda_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    slots = launch.GpuSlots.visible(jobs=4)
    assert [slots.take(d) for d in ("auto", "cuda", "auto")] == ["0", "1", "0"]
    assert slots.take("cpu") is None and slots.take("cuda:1") is None
    slots.give("0")
    slots.give("0")
    assert slots.take("cuda") == "0"  # 0 idle again, 1 still busy
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")  # compare's own GPUs, as named
    slots = launch.GpuSlots.visible(jobs=2)
    assert [slots.take("auto"), slots.take("auto")] == ["3", "5"]
    monkeypatch.setattr(launch, "cuda_count", lambda: 8)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    slots = launch.GpuSlots.visible(jobs=2)  # more GPUs than jobs: several per run
    assert [slots.take("auto"), slots.take("auto")] == ["0,1,2,3", "4,5,6,7"]
    monkeypatch.setattr(launch, "cuda_count", lambda: 0)
    assert launch.GpuSlots.visible(jobs=2).take("auto") is None  # no GPU: nothing set


def test_compare_jobs_give_each_run_its_gpu(monkeypatch, tmp_path):
    """`compare --jobs 2` on a (pretended) 2-GPU machine: each run process gets
    CUDA_VISIBLE_DEVICES, the two at a time on different GPUs."""
    import threading

    from fedskew.grid import launch
    from fedskew.grid.plan import grid_from, plan, read_file

    file = grid_file(tmp_path)
    text = file.read_text().replace("[methods.fedavg]", "[methods.fedavg]\n[methods.avg2]\n"
                                    'algorithm = "fedavg"\nlr = 0.02\n[methods.avg3]\n'
                                    'algorithm = "fedavg"\nlr = 0.03')  # fmt: skip
    file.write_text(text)
    grid = grid_from(read_file(file), str(file), {"device": "auto"}, None, {})
    runs = plan(grid)
    assert len(runs) == 4 and grid.jobs == 2
    monkeypatch.setattr(launch, "cuda_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    envs: list[str] = []
    running: dict[str, int] = {}
    lock = threading.Lock()
    overlap: list[bool] = []

    def started(self, cmd, env):  # the run's process, not started: its environment kept
        with lock:
            envs.append(env["CUDA_VISIBLE_DEVICES"])
            running[env["CUDA_VISIBLE_DEVICES"]] = running.get(env["CUDA_VISIBLE_DEVICES"], 0) + 1
            overlap.append(running[env["CUDA_VISIBLE_DEVICES"]] > 1)
        time.sleep(0.3)
        with lock:
            running[env["CUDA_VISIBLE_DEVICES"]] -= 1
        return None

    monkeypatch.setattr(launch.Children, "start", started)
    lines: list[str] = []
    outcomes = launch.run_grid(grid, runs, lines.append)
    assert len(outcomes) == 4 and "gpus: 2 GPU(s), 1 per run (CUDA_VISIBLE_DEVICES)" in lines
    assert sorted(envs) == ["0", "0", "1", "1"] and not any(overlap)


def test_compare_packs_more_jobs_than_gpus_onto_them_and_each_run_says_so(monkeypatch, tmp_path):
    """`compare --jobs 4` on a (pretended) one-GPU machine: the four runs share the GPU at
    once, deliberately; each run's process is told how many at most (4) and how many were
    on it when it started (1 to 4), which its processes.jsonl records."""
    import threading

    from fedskew.core.gpu_sharing import RUNS_ON_GPU_VARIABLE, RUNS_PER_GPU_VARIABLE
    from fedskew.grid import launch
    from fedskew.grid.plan import grid_from, plan, read_file

    file = grid_file(tmp_path)
    text = file.read_text().replace("jobs = 2", "jobs = 4").replace(
        "[methods.fedavg]", '[methods.fedavg]\n[methods.avg2]\nalgorithm = "fedavg"\nlr = 0.02\n'
        '[methods.avg3]\nalgorithm = "fedavg"\nlr = 0.03'
    )  # fmt: skip
    file.write_text(text)
    grid = grid_from(read_file(file), str(file), {"device": "auto"}, None, {})
    runs = plan(grid)
    assert len(runs) == 4 and grid.jobs == 4
    monkeypatch.setattr(launch, "cuda_count", lambda: 1)
    monkeypatch.setattr(launch, "available_cores", lambda: 8)  # 4 jobs x 1 thread fit
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv(RUNS_PER_GPU_VARIABLE, "9")  # a stale value of the caller's: replaced
    envs: list[dict[str, str]] = []
    lock = threading.Lock()
    all_started = threading.Barrier(4, timeout=10)

    def started(self, cmd, env):  # the run's process, not started: its environment kept
        with lock:
            envs.append(env)
        all_started.wait()  # the four are on the GPU at once
        return None

    monkeypatch.setattr(launch.Children, "start", started)
    lines: list[str] = []
    launch.run_grid(grid, runs, lines.append)
    assert "gpus: 1 GPU(s), 1 per run (CUDA_VISIBLE_DEVICES); up to 4 runs at once on each, " \
        "round-robin" in lines  # fmt: skip
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0"] * 4
    assert [e[RUNS_PER_GPU_VARIABLE] for e in envs] == ["4"] * 4
    assert sorted(e[RUNS_ON_GPU_VARIABLE] for e in envs) == ["1", "2", "3", "4"]
    # Three GPUs, four jobs: ceil(4 / 3) = 2 at most on one, round-robin.
    monkeypatch.setattr(launch, "cuda_count", lambda: 3)
    slots = launch.GpuSlots.visible(jobs=4)
    taken = [slots.take("auto") for _ in range(4)]
    assert taken == ["0", "1", "2", "0"] and slots.runs_per_gpu == 2
    assert slots.sharing("0") == {RUNS_PER_GPU_VARIABLE: "2", RUNS_ON_GPU_VARIABLE: "2"}
    assert slots.sharing("1")[RUNS_ON_GPU_VARIABLE] == "1"
    assert launch.GpuSlots.visible(jobs=2).runs_per_gpu == 1  # fewer jobs: one each


def test_a_run_records_how_many_compare_runs_shared_its_gpu(monkeypatch, tmp_path):
    """processes.jsonl has compare's count of runs on the GPU (set by compare only; a value
    that is not a positive whole number is not recorded)."""
    from fedskew.config import ExperimentConfig
    from fedskew.core.gpu_sharing import (
        RUNS_ON_GPU_VARIABLE,
        RUNS_PER_GPU_VARIABLE,
        gpu_sharing_facts,
    )
    from fedskew.runs.loop import run

    monkeypatch.setenv(RUNS_PER_GPU_VARIABLE, "4")
    monkeypatch.setenv(RUNS_ON_GPU_VARIABLE, "3")
    cfg = ExperimentConfig(rounds=1, num_clients=4, clients_per_round=2, out_dir=str(tmp_path),
                           name="shared", quiet=True, workers=0, device="cpu")  # fmt: skip
    folder, _ = run(cfg)
    line = json.loads((folder / "processes.jsonl").read_text().splitlines()[0])
    assert line["compare_runs_per_gpu"] == 4 and line["compare_runs_on_gpu"] == 3
    assert gpu_sharing_facts({RUNS_PER_GPU_VARIABLE: "x", RUNS_ON_GPU_VARIABLE: "0"}) == {}
    assert gpu_sharing_facts({}) == {}
