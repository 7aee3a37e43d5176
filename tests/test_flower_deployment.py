"""A real Flower deployment on 127.0.0.1: a SuperLink and SuperNodes as separate processes,
the fedskew app submitted with ``fedskew deploy`` (which runs ``flwr run``), as a user deploys
it (docs/flower.md, "Deployment"; the processes in tests/flower_federation.py).

Every message starts a ``flwr-clientapp`` process that imports torch and loads the data, so a
round takes seconds here, not milliseconds: the runs are kept to a few rounds, and every test
that starts a federation is marked ``slow`` (``pytest -m slow``; minutes each on 2 busy cores).
The default run keeps ``fedskew deploy``'s handling of Flower's answers, against a stand-in
``flwr`` command (seconds).
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import signal
import socket
import ssl
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("flwr")

from flower_federation import (  # noqa: E402
    BIN,
    REPO,
    Federation,
    free_port,
    fresh_clone,
    listening,
    make_certificates,
    make_node_key,
    uv_index_env,
)

import fedskew.apps.flower.submit as submit  # noqa: E402
from fedskew.apps.cli import main as fedskew_main  # noqa: E402
from fedskew.apps.flower.server import machine_load  # noqa: E402
from fedskew.core.durable import read_jsonl  # noqa: E402
from fedskew.core.errors import UsageError  # noqa: E402
from fedskew.runs.checkpoint import load_checkpoint  # noqa: E402

DOC = REPO / "docs" / "flower.md"
# One run, start to end (a round is ~15 s on 2 cores), longer on a busier machine.
RUN_SECONDS = 300.0 * machine_load()
# Config keys that legitimately differ between the deployed run and the in-process one.
NOT_COMPARED = {"engine", "name", "out_dir", "quiet", "reply_timeout"}

needs_flower_commands = pytest.mark.skipif(
    not (BIN / "flower-superlink").exists() or not (BIN / "flwr").exists(),
    reason=f"Flower's commands are not installed in {BIN}",
)


@pytest.fixture
def federation(tmp_path: Path) -> Iterator[Federation]:
    fed = Federation(tmp_path / "federation")
    try:
        yield fed
    finally:
        fed.stop()
        # Shown by pytest only when the test failed (captured teardown output).
        print(fed.report())


# ---------------------------------------------------------------------------- helpers


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return read_jsonl(path)


def finished_run(out_dir: Path, name: str, fed: Federation) -> Path:
    folder = out_dir / name
    assert (folder / "summary.json").is_file(), f"no finished run {folder}\n{fed.report()}"
    assert not (out_dir / f"{name}.incomplete").exists()
    return folder


def in_process_run(out_dir: Path, **options: Any) -> Path:
    args = ["run", "-q", "-o", str(out_dir), "--name", "inprocess"]
    for key, value in options.items():
        args += [f"--{key}", str(value)]
    assert fedskew_main(args) == 0
    return out_dir / "inprocess"


def compared_config(folder: Path) -> dict[str, Any]:
    config = json.loads((folder / "config.json").read_text())
    return {k: v for k, v in config.items() if k not in NOT_COMPARED}


def error_line(log: str) -> str:
    """fedskew deploy's one-line error (the last line of its output)."""
    lines = [line for line in log.splitlines() if line.startswith("fedskew: error: ")]
    assert lines, log[-3000:]
    return lines[-1]


# ---------------------------------------------------------------------------- the walk-through


def walkthrough(text: str) -> list[tuple[str, bool]]:
    """The commands of docs/flower.md's walk-through, in order: (command, long-running).
    A command is a line with its ``\\`` continuations and here-documents; the SuperLink and
    SuperNodes are long-running (a terminal each), the rest run to their end."""
    start = text.index("<!-- walk-through")
    end = text.index("<!-- end of the walk-through -->")
    blocks = re.findall(r"```bash\n(.*?)```", text[start:end], flags=re.S)
    assert blocks, "docs/flower.md has no walk-through"
    commands: list[tuple[str, bool]] = []
    for block in blocks:
        lines = block.splitlines()
        while lines:
            line = lines.pop(0)
            while line.endswith("\\") and lines:
                line = line[:-1] + " " + lines.pop(0).strip()
            heredoc = re.search(r"<<'?(\w+)'?", line)
            if heredoc:
                body = []
                while lines and lines[0] != heredoc.group(1):
                    body.append(lines.pop(0))
                line = "\n".join([line, *body, lines.pop(0) if lines else heredoc.group(1)])
            words = shlex.split(line.split("\n")[0], comments=True)
            if not words:
                continue
            program = next(w for w in words if "=" not in w or w.startswith("-"))
            commands.append((line, program in ("flower-superlink", "flower-supernode")))
    return commands


@needs_flower_commands
@pytest.mark.slow
def test_documented_deployment_runs_from_a_fresh_clone(tmp_path: Path) -> None:
    """docs/flower.md's walk-through, command by command, in a fresh copy of the repository:
    the SuperLink installs the bundle's dependency (a wheel of this fedskew) the Flower way,
    two SuperNodes train FedCME, which exchanges classifiers every round."""
    clone = fresh_clone(tmp_path / "fedskew")
    home = tmp_path / "home"  # ~ of the walk-through: its ~/.flwr, runs and wheels
    home.mkdir()
    fed = Federation(tmp_path / "federation", clone)
    # The doc's ports, made free ones; the rest as written.
    ports = {"9093": str(free_port()), "9094": str(free_port()), "9095": str(free_port())}
    env = {k: v for k, v in fed.env("walk-through").items() if k != "FLWR_HOME"}
    env["HOME"] = str(home)
    # uv's cache stays the machine's (the first install of torch & co. is the slow part),
    # and uv resolves from the index pip was configured with.
    uv_cache = subprocess.run(
        [sys.executable, "-m", "uv", "cache", "dir"], capture_output=True, text=True
    ).stdout.strip()
    env.setdefault("UV_CACHE_DIR", uv_cache)
    indexes = uv_index_env()
    env.update(indexes)
    # The doc's UV_FIND_LINKS (the fedskew wheel) replaces the machine's: where pip finds
    # wheels in a folder of its own (this CI's CPU torch), uv is given both.
    machine_links = indexes.get("UV_FIND_LINKS")
    try:
        steps = walkthrough(DOC.read_text())
        for n, (command, long_running) in enumerate(steps):
            for doc_port, port in ports.items():
                command = re.sub(rf"\b{doc_port}\b", port, command)
            if machine_links:
                command = command.replace(
                    "UV_FIND_LINKS=$HOME/fedskew-wheels",
                    f"UV_FIND_LINKS=$HOME/fedskew-wheels,{machine_links}",
                )
            name = f"step{n}"
            if long_running:
                fed.procs[name] = proc = subprocess.Popen(
                    ["bash", "-c", command], cwd=clone, env=env, start_new_session=True,
                    stdin=subprocess.DEVNULL, stdout=open(fed.logs / f"{name}.log", "wb"),
                    stderr=subprocess.STDOUT,
                )  # fmt: skip
                fed.log_files[name] = fed.logs / f"{name}.log"
                port = int(re.search(r"--port (\d+)", command).group(1))
                deadline = time.monotonic() + 60
                while not listening(port):
                    assert proc.poll() is None, f"{command}\n{fed.report()}"
                    assert time.monotonic() < deadline, f"{command}\n{fed.report()}"
                    time.sleep(0.2)
            else:
                done = subprocess.run(
                    ["bash", "-euo", "pipefail", "-c", command], cwd=clone, env=env,
                    capture_output=True, text=True, timeout=RUN_SECONDS,
                )  # fmt: skip
                (fed.logs / f"{name}.log").write_text(done.stdout + done.stderr)
                fed.log_files[name] = fed.logs / f"{name}.log"
                assert done.returncode == 0, f"{command}\n{fed.report()}"
                output = done.stdout + done.stderr
        # The last command listed the run folder.
        folder = home / "fedskew-runs" / "cme"
        assert "summary.json" in output and (folder / "summary.json").is_file(), fed.report()
        rows = read_metrics(folder / "metrics.jsonl")
        assert [r["round"] for r in rows] == [1, 2, 3]
        for row in rows:
            assert row["clients"] == [0, 1] and row["missing_replies"] == []
            assert row["exchanged"] == 2  # the two clients swapped classifiers
        deploy_step = next(i for i, (c, _) in enumerate(steps) if "fedskew deploy" in c)
        deploy_log = fed.log(f"step{deploy_step}")
        # The ServerApp ran the fedskew that Flower installed from the bundle's dependency.
        assert re.search(r"Installed: \[.*fedskew==0\.1\.0", deploy_log), deploy_log[-3000:]
        assert "fedskew: Flower run" in deploy_log and "completed" in deploy_log
    finally:
        fed.stop()
        print(fed.report())


# ---------------------------------------------------------------------------- deployments

OPTIONS_A = {"num-clients": 3, "clients-per-round": 3, "rounds": 2, "local-epochs": 1}


@needs_flower_commands
@pytest.mark.slow
def test_tls_node_authentication_and_every_node_trains_like_in_process(
    federation: Federation, tmp_path: Path
) -> None:
    """Over TLS with Flower's node authentication: the registered nodes train, bit for bit
    like the in-process engine; a node whose key is not registered is refused."""
    tls = make_certificates(tmp_path / "certs")
    keys = [make_node_key(tmp_path / "keys", f"node{i}") for i in range(4)]
    out = tmp_path / "runs"
    federation.start_superlink(out, tls=tls, node_auth=True)
    # The SuperLink really speaks TLS, with the certificate the CA signed for 127.0.0.1.
    context = ssl.create_default_context(cafile=str(tls["ca"]))
    with socket.create_connection(("127.0.0.1", federation.port), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as conn:
            assert conn.version() is not None
    for _private, public in keys[:3]:  # the operator registers three nodes' public keys
        registered = federation.cli("supernode", "register", str(public), "test")
        assert registered.returncode == 0, registered.stdout + registered.stderr
    for partition in range(3):
        federation.start_node(partition, key=keys[partition][0])
    intruder = federation.start_node(3, key=keys[3][0], name="intruder", wait=False)
    proc = federation.deploy({**OPTIONS_A, "name": "deployed", "dataset": "digits"})
    assert federation.wait(proc, RUN_SECONDS) == 0, federation.report()
    deployed = finished_run(out, "deployed", federation)

    reference = in_process_run(tmp_path / "inprocess", dataset="digits", **OPTIONS_A)
    assert compared_config(deployed) == compared_config(reference)
    got, want = read_metrics(deployed / "metrics.jsonl"), read_metrics(reference / "metrics.jsonl")
    assert [r["round"] for r in got] == [1, 2]
    # The same seed and partition on separate processes: the same numbers, bit for bit.
    assert [r["accuracy"] for r in got] == [r["accuracy"] for r in want]
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    for row, ref in zip(got, want, strict=True):
        assert row["missing_replies"] == [] and row["rejected_replies"] == []
        assert (row["bytes_down"], row["bytes_up"]) == (ref["bytes_down"], ref["bytes_up"])
        assert row["samples"] == ref["samples"]
    # The unregistered node never joined: refused, it exits ("Failed to activate SuperNode").
    deadline = time.monotonic() + 60
    while federation.procs[intruder].poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert federation.procs[intruder].returncode not in (None, 0), federation.log(intruder)
    assert "Failed to activate SuperNode" in federation.log(intruder)


@needs_flower_commands
@pytest.mark.slow
def test_killed_node_is_missing_and_no_round_is_lost(
    federation: Federation, tmp_path: Path
) -> None:
    out = tmp_path / "runs"
    rounds = 3
    federation.start(nodes=3, output_root=out)
    # The timeout bounds a round with a dead node (the SuperLink notices a dead node only
    # after ~60 s of missing heartbeats); a live client replies in ~10-20 s on 2 idle cores,
    # and takes longer in proportion on a busy machine (load 9 on 2 cores: over 30 s).
    options = {**OPTIONS_A, "rounds": rounds, "reply-timeout": 30.0 * machine_load()}
    proc = federation.deploy({**options, "name": "fault", "dataset": "digits"})
    metrics = out / "fault.incomplete" / "metrics.jsonl"
    deadline = time.monotonic() + RUN_SECONDS
    while not read_metrics(metrics):
        assert proc.poll() is None, f"the run ended before round 1\n{federation.report()}"
        assert time.monotonic() < deadline, f"no round 1\n{federation.report()}"
        time.sleep(0.2)
    before_kill = read_metrics(metrics)
    federation.kill("node2")
    assert federation.wait(proc, RUN_SECONDS) == 0, federation.report()
    folder = finished_run(out, "fault", federation)

    rows = read_metrics(folder / "metrics.jsonl")
    assert [r["round"] for r in rows] == list(range(1, rounds + 1))  # no round lost
    done = len(before_kill)
    assert done < rounds, "the node was killed after the last round: nothing tested"
    assert rows[:done] == before_kill  # finished rounds are kept as they were
    for row in rows[:done]:
        assert row["missing_replies"] == []
    per_reply, rest = divmod(before_kill[0]["bytes_up"], 3)  # FedAvg: equal replies
    assert rest == 0
    # The round running at the kill may have had node 2's reply; the later ones cannot.
    for row in rows[done:]:
        assert row["clients"] == [0, 1, 2]
        assert row["rejected_replies"] == []
        assert "skipped" not in row
        if row["round"] == done + 1 and not row["missing_replies"]:
            assert row["bytes_up"] == 3 * per_reply
        else:
            assert row["missing_replies"] == [2]
            assert row["bytes_up"] == 2 * per_reply  # the two live clients' replies arrived
    assert rows[-1]["missing_replies"] == [2]
    assert all(math.isfinite(r["accuracy"]) and math.isfinite(r["loss"]) for r in rows)
    assert (folder / "checkpoint.npz").is_file()
    assert load_checkpoint(folder / "checkpoint.npz")[0] == rounds


@needs_flower_commands
@pytest.mark.slow
def test_failed_runs_exit_non_zero_with_one_line(federation: Federation, tmp_path: Path) -> None:
    """What a user of the walk-through met: an output root that cannot be made, and a
    SuperLink restarted under its nodes (which do not come back); each run fails with status
    1 and one line saying what is wrong, not a traceback and status 0."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    federation.start_superlink(blocker / "runs")  # cannot be created: a file is in the way
    node = federation.start_node(0)
    small = {"num-clients": 1, "clients-per-round": 1, "rounds": 1, "local-epochs": 1}
    proc = federation.deploy({**small, "name": "r1"}, name="deploy1")
    assert federation.wait(proc, RUN_SECONDS) == 1, federation.report()
    line = error_line(federation.log("deploy1"))
    assert re.fullmatch(
        r"fedskew: error: Flower run \d+ failed: FEDSKEW_OUTPUT_ROOT=\S+/a-file/runs: "
        r"cannot create the output root \(Not a directory\); create it, writable by the "
        r"SuperLink's account",
        line,
    ), line

    # A SuperLink restart: its node does not come back (Flower 1.42: the new SuperLink does
    # not know it, its heartbeat is refused with 401 and stops), the next run says so.
    federation.kill("superlink", signal.SIGTERM)
    federation.start_superlink(tmp_path / "runs")

    def dropped() -> bool:  # refused by the new SuperLink (or gone: the issue saw it exit)
        return federation.procs[node].poll() is not None or "401" in federation.log(node)

    deadline = time.monotonic() + 120
    while not dropped() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert dropped(), federation.report()
    proc = federation.deploy({**small, "name": "r2", "node-wait": 2.0}, name="deploy2")
    assert federation.wait(proc, RUN_SECONDS) == 1, federation.report()
    line = error_line(federation.log("deploy2"))
    assert re.match(
        r"fedskew: error: Flower run \d+ failed: no SuperNode is connected to the SuperLink "
        r"\(waited 2 s: node-wait\)",
        line,
    ), line
    assert not (tmp_path / "runs" / "r2").exists()


@needs_flower_commands
@pytest.mark.slow
def test_serverapp_writes_only_under_the_operators_output_root(
    federation: Federation, tmp_path: Path
) -> None:
    """The SuperLink's FEDSKEW_OUTPUT_ROOT reaches the ServerApp; a run config that names a
    folder outside it is refused before anything is written."""
    out = tmp_path / "runs"
    elsewhere = tmp_path / "elsewhere"
    federation.start(nodes=1, output_root=out)
    options = {"num-clients": 1, "clients-per-round": 1, "rounds": 1, "local-epochs": 1}
    proc = federation.deploy({**options, "out-dir": str(elsewhere), "name": "escape"})
    assert federation.wait(proc, RUN_SECONDS) == 1
    assert "must be a path relative to the output root" in error_line(federation.log("deploy"))
    assert not elsewhere.exists()
    assert list(out.iterdir()) == []


# ---------------------------------------------------------------------------- fedskew deploy


FAKE_FLWR = textwrap.dedent(
    """\
    #!{python}
    # A stand-in for Flower's `flwr`: answers as flwr 1.42 does, the run's fate from $FAKE_RUN.
    import json, os, sys
    args, fate = sys.argv[1:], os.environ["FAKE_RUN"]
    with open(os.environ["FAKE_CALLS"], "a") as calls:
        calls.write(json.dumps(args) + "\\n")
    if args[0] == "run":
        if fate == "unreachable":
            print(json.dumps({{"success": False, "error-message": "Using SuperLink: x\\n"
                  "Connection to the SuperLink is unavailable."}}, indent=2))
        elif fate == "undeclared":  # what the SuperLink answers a key the app lacks
            print(json.dumps({{"success": False,
                  "error-message": "[code: 15] Invalid run configuration."}}, indent=2))
        else:
            print(json.dumps({{"success": True, "run-id": "42"}}, indent=2))
    elif args[0] == "log":
        print("INFO : round 1 ...")
    elif args[0] == "ls":
        status = {{"ok": "finished:completed", "failed": "finished:failed"}}[fate]
        details = "" if fate == "ok" else (
            "ServerApp failed with exception: FEDSKEW_OUTPUT_ROOT=/srv/runs: cannot create")
        print(json.dumps({{"success": True, "runs": [{{"run-id": "42", "status": status,
              "status-details": details}}]}}, indent=2))
    """
)


@pytest.mark.parametrize(
    "fate,status,message",
    [
        ("ok", 0, "fedskew: Flower run 42 completed"),
        (
            "failed",
            1,
            "fedskew: error: Flower run 42 failed: FEDSKEW_OUTPUT_ROOT=/srv/runs: cannot create",
        ),
        (
            "unreachable",
            1,
            "fedskew: error: flwr run could not start the run on loopback: Connection to the "
            "SuperLink is unavailable.",
        ),
    ],
)
def test_deploy_exits_non_zero_with_one_line_when_the_run_fails(
    tmp_path, monkeypatch, capsys, fate, status, message
):
    fake = tmp_path / "flwr"
    fake.write_text(FAKE_FLWR.format(python=sys.executable))
    fake.chmod(0o755)
    monkeypatch.setattr(submit, "flower_command", lambda name: str(fake))
    monkeypatch.setenv("FAKE_RUN", fate)
    monkeypatch.setenv("FAKE_CALLS", str(tmp_path / "calls"))
    code = fedskew_main(["deploy", "loopback", "--run-config", 'algorithm="fedcme" rounds=3'])
    err = capsys.readouterr().err
    assert code == status
    assert err.splitlines()[-1] == message
    calls = [json.loads(line) for line in (tmp_path / "calls").read_text().splitlines()]
    run_call = calls[0]
    assert run_call[:1] == ["run"] and run_call[2:] == [
        "loopback", "--format", "json", "--run-config", 'algorithm="fedcme" rounds=3'
    ]  # fmt: skip
    # The app submitted is the one this fedskew writes, the same as the repository's.
    if fate != "unreachable":
        assert [c[0] for c in calls] == ["run", "log", "ls"]
        assert calls[1] == ["log", "42", "loopback", "--stream"]


@pytest.mark.parametrize(
    "run_config,said",
    [
        ("num_clients=2 rounds=3", "run config key 'num_clients' is not one the Flower app "
         "declares; did you mean 'num-clients'?"),
        ('rounds=3 algoritm="fedcme"', "run config key 'algoritm' is not one the Flower app "
         "declares; did you mean 'algorithm'?"),
        ('data-dir="/data"', "run config key 'data-dir': a Flower deployment does not take it: "
         "the server reads datasets"),
    ],
)  # fmt: skip
def test_deploy_names_a_run_config_key_the_app_does_not_declare(
    tmp_path, monkeypatch, capsys, run_config, said
):
    """flwr's SuperLink refuses an undeclared key with "Invalid run configuration." and no
    name (issue 48): fedskew deploy names it, before anything is submitted."""
    fake = tmp_path / "flwr"
    fake.write_text(FAKE_FLWR.format(python=sys.executable))
    fake.chmod(0o755)
    monkeypatch.setattr(submit, "flower_command", lambda name: str(fake))
    monkeypatch.setenv("FAKE_RUN", "undeclared")
    monkeypatch.setenv("FAKE_CALLS", str(tmp_path / "calls"))
    code = fedskew_main(["deploy", "loopback", "--run-config", run_config])
    err = capsys.readouterr().err
    assert code != 0
    assert said in err.splitlines()[-1], err
    assert not (tmp_path / "calls").exists()  # nothing submitted
    # A TOML file as flwr run takes it is read alike; declared keys pass.
    (tmp_path / "rc.toml").write_text("num_clients = 2\n")
    with pytest.raises(UsageError, match="'num_clients'"):
        submit.check_run_config_keys(REPO / "flower", [str(tmp_path / "rc.toml")])
    submit.check_run_config_keys(REPO / "flower", ['algorithm="fedcme" num-clients=2 name="a b"'])


def test_walkthrough_parses_into_the_documented_commands():
    commands = walkthrough(DOC.read_text())
    programs = [shlex.split(c.split("\n")[0])[0] for c, _ in commands]
    long_running = [c for c, background in commands if background]
    assert len(long_running) == 3  # a SuperLink and two SuperNodes
    assert "flower-superlink" in long_running[0] and "FEDSKEW_OUTPUT_ROOT=" in long_running[0]
    assert programs[-2:] == ["fedskew", "ls"] and "deploy loopback" in commands[-2][0]
    assert any("<<'EOF'" in c and c.endswith("EOF") for c, _ in commands)


def test_the_app_fedskew_submits_is_the_repositorys(tmp_path):
    from fedskew.apps.flower.app_config import write_app

    written = write_app(tmp_path / "app") / "pyproject.toml"
    assert written.read_text() == (REPO / "flower" / "pyproject.toml").read_text()
    assert os.listdir(tmp_path / "app") == ["pyproject.toml"]
