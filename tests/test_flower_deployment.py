"""A real Flower deployment on 127.0.0.1: a SuperLink and SuperNodes as separate processes,
the fedskew app started with ``flwr run``, as a user deploys it (see docs/flower.md,
"Deployment").

Each test starts its own federation on free ports, with one FLWR_HOME per process (as on
separate machines), and tears every process down afterwards, including the ``flwr-serverapp``
and ``flwr-clientapp`` processes Flower spawns, even when the test fails. The processes' logs
are kept in the test's tmp_path and printed on failure.

Every message starts a ``flwr-clientapp`` process that imports torch and loads the data, so a
round takes seconds here, not milliseconds: the runs are kept to a few rounds.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import math
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("flwr")

from fedskew.apps.cli import main as fedskew_main  # noqa: E402
from fedskew.apps.flower.server import machine_load  # noqa: E402
from fedskew.core.durable import read_jsonl
from fedskew.runs.checkpoint import load_checkpoint  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
APP_DIR = REPO / "flower"
BIN = Path(sys.executable).parent  # flower-superlink spawns flwr-serverapp etc. by name
START_SECONDS = 60.0  # until a process listens on its port
# One `flwr run`, start to end (a round is ~15 s on 2 cores), longer on a busier machine.
RUN_SECONDS = 300.0 * machine_load()
# Config keys that legitimately differ between the deployed run and the in-process one.
NOT_COMPARED = {"engine", "name", "out_dir", "quiet", "reply_timeout"}

if not (BIN / "flower-superlink").exists() or not (BIN / "flwr").exists():
    pytest.skip(f"Flower's commands are not installed in {BIN}", allow_module_level=True)


# ---------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``. Flower's SuperLink starts its ``flower-superexec`` in a
    session of its own, so killing the SuperLink's process group alone would leave it (and
    the ``flwr-serverapp`` it runs) behind."""
    children: dict[int, list[int]] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def kill_tree(proc: subprocess.Popen, sig: int = signal.SIGTERM, grace: float = 5.0) -> None:
    """Signal ``proc`` (a session leader), its descendants and their process groups; SIGKILL
    what is left after ``grace`` seconds."""
    if proc.returncode is not None:
        return  # reaped already: its pid may belong to another process by now
    pids = [proc.pid, *descendants(proc.pid)]
    groups = set()
    for pid in pids:
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            pass

    def send(signum: int) -> None:
        for group in groups:
            try:
                os.killpg(group, signum)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in pids:
            try:
                os.kill(pid, signum)
            except (ProcessLookupError, PermissionError):
                pass

    def gone(within: float) -> bool:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if proc.poll() is not None and not any(alive(p) for p in pids[1:]):
                return True
            time.sleep(0.1)
        return False

    send(sig)
    if sig != signal.SIGKILL and gone(grace):
        return
    send(signal.SIGKILL)
    gone(5.0)


def tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


class Federation:
    """A SuperLink and its SuperNodes on 127.0.0.1, and the ``flwr`` CLI configured for it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.logs = root / "logs"
        self.logs.mkdir(parents=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self.log_files: dict[str, Path] = {}
        self.port = 0
        self.tls: dict[str, Path] | None = None

    def env(self, home: str) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("FEDSKEW_OUTPUT_ROOT", None)  # only the SuperLink gets one, in start()
        flwr_home = self.root / "homes" / home
        flwr_home.mkdir(parents=True, exist_ok=True)
        env["FLWR_HOME"] = str(flwr_home)
        env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
        env["OMP_NUM_THREADS"] = "1"
        src = str(REPO / "src")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
        env.pop("NO_COLOR", None)
        return env

    def spawn(
        self,
        name: str,
        args: list[str],
        home: str | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> subprocess.Popen:
        log = self.logs / f"{name}.log"
        with open(log, "wb") as fh:
            proc = subprocess.Popen(
                args,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**self.env(home or name), **(extra_env or {})},
                cwd=self.root,
                start_new_session=True,  # its own process group, killed as one
            )
        self.procs[name] = proc
        self.log_files[name] = log
        return proc

    def start(self, nodes: int, output_root: Path, tls: dict[str, Path] | None = None) -> None:
        """The SuperLink (its ServerApp writes under ``output_root``, the operator's
        FEDSKEW_OUTPUT_ROOT) and ``nodes`` SuperNodes."""
        self.tls = tls
        output_root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        # The app's dependencies are the installed fedskew: no `uv sync` on the SuperLink.
        link_args = [
            "--host=127.0.0.1",
            f"--port={self.port}",
            "--disable-runtime-dependency-installation",
        ]
        if tls is None:
            link_args.append("--insecure")
        else:
            link_args += [
                f"--ssl-ca-certfile={tls['ca']}",
                f"--ssl-certfile={tls['cert']}",
                f"--ssl-keyfile={tls['key']}",
            ]
        self.spawn(
            "superlink",
            [str(BIN / "flower-superlink"), *link_args],
            extra_env={"FEDSKEW_OUTPUT_ROOT": str(output_root)},
        )
        self.wait_listening("superlink", self.port)
        trust = ["--insecure"] if tls is None else [f"--root-certificates={tls['ca']}"]
        node_ports = [free_port() for _ in range(nodes)]
        for pid, node_port in enumerate(node_ports):
            node_args = [
                f"--superlink=127.0.0.1:{self.port}",
                "--host=127.0.0.1",
                f"--port={node_port}",  # the node's own API, for its ClientApp processes
                f"--node-config=partition-id={pid}",
            ]
            self.spawn(f"node{pid}", [str(BIN / "flower-supernode"), *trust, *node_args])
        for pid, node_port in enumerate(node_ports):
            self.wait_listening(f"node{pid}", node_port)
        self.write_cli_config()

    def wait_listening(self, name: str, port: int) -> None:
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self.procs[name].poll() is not None:
                raise AssertionError(f"{name} exited at start:\n{tail(self.log_files[name])}")
            if listening(port):
                return
            time.sleep(0.2)
        raise AssertionError(f"{name} did not listen on {port}:\n{tail(self.log_files[name])}")

    def write_cli_config(self) -> None:
        """The ``flwr`` CLI's connection to this SuperLink, in its FLWR_HOME/config.toml."""
        trust = "insecure = true" if self.tls is None else f'root-certificates = "{self.tls["ca"]}"'
        home = self.root / "homes" / "cli"
        home.mkdir(parents=True, exist_ok=True)
        (home / "config.toml").write_text(
            "[superlink]\n"
            'default = "test"\n'
            "[superlink.test]\n"
            f'address = "127.0.0.1:{self.port}"\n'
            f"{trust}\n",
            encoding="utf-8",
        )

    def run_app(self, run_config: dict[str, Any]) -> subprocess.Popen:
        """``flwr run flower test --run-config '...' --stream``, in the background."""
        pairs = " ".join(f"{k}={toml_value(v)}" for k, v in run_config.items())
        return self.spawn(
            "flwr-run",
            [str(BIN / "flwr"), "run", str(APP_DIR), "test", "--run-config", pairs, "--stream"],
            home="cli",
        )

    def wait_app(self, proc: subprocess.Popen, timeout: float = RUN_SECONDS) -> int:
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            raise AssertionError(f"flwr run did not end in {timeout} s\n{self.report()}") from None

    def kill(self, name: str) -> None:
        """Crash a process: SIGKILL to it, its group and its children, no clean shutdown."""
        kill_tree(self.procs[name], signal.SIGKILL)

    def stop(self) -> None:
        # The CLI first, then the nodes, the SuperLink last (it owns the ServerApp).
        for name in sorted(self.procs, key=lambda n: (n == "superlink", n != "flwr-run")):
            kill_tree(self.procs[name])

    def report(self) -> str:
        return "\n".join(
            f"===== {name} ({path})\n{tail(path)}" for name, path in self.log_files.items()
        )


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string
    return str(value)


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


def run_config(name: str, **options: Any) -> dict[str, Any]:
    """No out-dir: run folders go straight into the SuperLink's output root."""
    return {**options, "name": name}


# ---------------------------------------------------------------------------- tests

OPTIONS_A = {"num-clients": 3, "clients-per-round": 3, "rounds": 2, "local-epochs": 1}


def test_deployment_trains_every_node_like_in_process(
    federation: Federation, tmp_path: Path
) -> None:
    out = tmp_path / "runs"
    federation.start(nodes=3, output_root=out)
    proc = federation.run_app(run_config("deployed", dataset="digits", **OPTIONS_A))
    assert federation.wait_app(proc) == 0, federation.report()
    deployed = finished_run(out, "deployed", federation)

    reference = in_process_run(tmp_path / "inprocess", dataset="digits", **OPTIONS_A)
    assert compared_config(deployed) == compared_config(reference)
    got, want = read_metrics(deployed / "metrics.jsonl"), read_metrics(reference / "metrics.jsonl")
    assert [r["round"] for r in got] == [1, 2]
    # The same seed and partition on separate processes: the same numbers, bit for bit.
    assert [r["accuracy"] for r in got] == [r["accuracy"] for r in want]
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    for row, ref in zip(got, want, strict=True):
        # every node replied and its reply was taken
        assert row["missing_replies"] == [] and row["rejected_replies"] == []
        assert (row["bytes_down"], row["bytes_up"]) == (ref["bytes_down"], ref["bytes_up"])
        assert row["samples"] == ref["samples"]
    summary = json.loads((deployed / "summary.json").read_text())
    assert summary["final_accuracy"] == want[-1]["accuracy"]


# Two minutes on 2 cores: outside the default run, with `pytest -m slow` (benchmarks/README.md).
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
    proc = federation.run_app(run_config("fault", dataset="digits", **options))
    metrics = out / "fault.incomplete" / "metrics.jsonl"
    deadline = time.monotonic() + RUN_SECONDS
    while not read_metrics(metrics):
        assert proc.poll() is None, f"the run ended before round 1\n{federation.report()}"
        assert time.monotonic() < deadline, f"no round 1\n{federation.report()}"
        time.sleep(0.2)
    before_kill = read_metrics(metrics)
    federation.kill("node2")
    assert federation.wait_app(proc) == 0, federation.report()
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


def test_serverapp_writes_only_under_the_operators_output_root(
    federation: Federation, tmp_path: Path
) -> None:
    """The SuperLink's FEDSKEW_OUTPUT_ROOT reaches the ServerApp; a run config that names a
    folder outside it is refused before anything is written."""
    out = tmp_path / "runs"
    elsewhere = tmp_path / "elsewhere"
    federation.start(nodes=1, output_root=out)
    options = {"num-clients": 1, "clients-per-round": 1, "rounds": 1, "local-epochs": 1}
    proc = federation.run_app({**options, "out-dir": str(elsewhere), "name": "escape"})
    federation.wait_app(proc)
    log = federation.log_files["flwr-run"].read_text(errors="replace")
    assert "must be a path relative to the output root" in log, federation.report()
    assert not elsewhere.exists()
    assert list(out.iterdir()) == []


# ---------------------------------------------------------------------------- TLS


def make_certificates(folder: Path) -> dict[str, Path]:
    """A CA, and a certificate it signs for the SuperLink at 127.0.0.1 (IP SAN)."""
    pytest.importorskip("cryptography")  # installed with flwr
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder.mkdir(parents=True)
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedskew test CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = {"ca": folder / "ca.pem", "cert": folder / "server.pem", "key": folder / "server.key"}
    paths["ca"].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return paths


@pytest.mark.slow  # a minute on 2 cores; `pytest -m slow`
def test_deployment_over_tls(federation: Federation, tmp_path: Path) -> None:
    tls = make_certificates(tmp_path / "certs")
    options = {"num-clients": 2, "clients-per-round": 2, "rounds": 1, "local-epochs": 1}
    out = tmp_path / "runs"
    federation.start(nodes=2, output_root=out, tls=tls)
    # The SuperLink really speaks TLS, with the certificate the CA signed for 127.0.0.1.
    context = ssl.create_default_context(cafile=str(tls["ca"]))
    with socket.create_connection(("127.0.0.1", federation.port), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as conn:
            assert conn.version() is not None
    proc = federation.run_app(run_config("tls", dataset="digits", **options))
    assert federation.wait_app(proc) == 0, federation.report()
    deployed = finished_run(out, "tls", federation)

    reference = in_process_run(tmp_path / "inprocess", dataset="digits", **options)
    got, want = read_metrics(deployed / "metrics.jsonl"), read_metrics(reference / "metrics.jsonl")
    assert [r["accuracy"] for r in got] == [r["accuracy"] for r in want]
    assert all(r["missing_replies"] == [] for r in got)
