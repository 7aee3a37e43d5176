"""A Flower federation on 127.0.0.1 for the deployment tests: a SuperLink and SuperNodes as
separate processes, on free ports, each with its own FLWR_HOME (as on separate machines),
torn down with everything Flower spawned (``flower-superexec``, ``flwr-serverapp``,
``flwr-clientapp``) even when a test fails. Their logs stay in the test's tmp_path and are
printed on failure.

Also: a copy of the repository's tracked files (what a fresh clone holds), certificates and
node keys made on the spot, and the package index pip is configured with, for uv."""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fedskew.apps.flower.submit import config_pairs

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # Flower's commands, and the processes they spawn by name
START_SECONDS = 60.0  # until a process listens on its port


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


# ---------------------------------------------------------------------------- environment


def fresh_clone(dest: Path) -> Path:
    """The repository's files as a commit of the work tree would hold them (tracked, and new
    ones not ignored: no build output, no local runs, no caches), copied to ``dest``: what a
    fresh clone holds."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.split(b"\0")  # fmt: skip
    for name in filter(None, listed):
        source = REPO / os.fsdecode(name)
        if source.is_file():  # a file deleted in the work tree is not in a fresh clone either
            target = dest / os.fsdecode(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return dest


def uv_index_env() -> dict[str, str]:
    """The package indexes pip is configured with, for uv (which reads no pip.conf): the
    SuperLink's runtime dependency installation then resolves from where this environment
    was installed from (PyPI where pip is not configured). Variables already set win."""
    try:
        listed = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"],
            capture_output=True, text=True, timeout=60,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return {}
    pip: dict[str, str] = {}
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        pip[key.split(".", 1)[-1]] = value.strip().strip("'\"")
    env: dict[str, str] = {}
    if pip.get("index-url"):
        env["UV_DEFAULT_INDEX"] = pip["index-url"]
    if pip.get("extra-index-url"):
        env["UV_INDEX"] = pip["extra-index-url"]
        env["UV_INDEX_STRATEGY"] = "unsafe-best-match"  # pip takes the best of all indexes
    if pip.get("find-links"):
        env["UV_FIND_LINKS"] = ",".join(pip["find-links"].split())
    if env:
        # The app pins torch's build and takes it from PyTorch's index: where pip has
        # indexes of its own (a mirror, offline), the same pinned build comes from them
        # (docs/flower.md).
        env["UV_NO_SOURCES_PACKAGE"] = "torch"
    return {k: v for k, v in env.items() if k not in os.environ}


# ---------------------------------------------------------------------------- federation


class Federation:
    """A SuperLink and its SuperNodes on 127.0.0.1, and the ``flwr`` CLI configured for it.
    ``clone`` is the fedskew checkout the processes run (its ``src`` first on PYTHONPATH, as
    ``pip install`` of it would give)."""

    def __init__(self, root: Path, clone: Path = REPO) -> None:
        self.root = root
        self.clone = clone
        self.logs = root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self.log_files: dict[str, Path] = {}
        self.port = 0
        self.tls: dict[str, Path] | None = None

    def env(self, home: str) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("FEDSKEW_OUTPUT_ROOT", None)  # only the SuperLink gets one
        flwr_home = self.root / "homes" / home
        flwr_home.mkdir(parents=True, exist_ok=True)
        env["FLWR_HOME"] = str(flwr_home)
        env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
        env["OMP_NUM_THREADS"] = "1"
        src = str(self.clone / "src")
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
        with open(log, "ab") as fh:
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

    def start_superlink(
        self,
        output_root: Path | None,
        tls: dict[str, Path] | None = None,
        node_auth: bool = False,
        install: bool = False,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        """The SuperLink (its ServerApp writes under ``output_root``, the operator's
        FEDSKEW_OUTPUT_ROOT); ``install``: Flower's runtime dependency installation, else
        the ServerApp runs the fedskew of this environment."""
        self.tls = tls
        self.port = self.port or free_port()  # a restart keeps the port the nodes know
        link_args = ["--host=127.0.0.1", f"--port={self.port}"]
        if not install:
            link_args.append("--disable-runtime-dependency-installation")
        if tls is None:
            link_args.append("--insecure")
        else:
            link_args += [
                f"--ssl-ca-certfile={tls['ca']}",
                f"--ssl-certfile={tls['cert']}",
                f"--ssl-keyfile={tls['key']}",
            ]
        if node_auth:
            link_args.append("--enable-supernode-auth")
        env = dict(extra_env or {})
        if output_root is not None:
            env["FEDSKEW_OUTPUT_ROOT"] = str(output_root)
        self.spawn("superlink", [str(BIN / "flower-superlink"), *link_args], extra_env=env)
        self.wait_listening("superlink", self.port)
        self.write_cli_config()

    def start_node(
        self, partition: int, key: Path | None = None, name: str = "", wait: bool = True
    ) -> str:
        """A SuperNode holding ``partition``; ``key``: its private key (node authentication);
        ``wait``: until it listens (one the SuperLink refuses may exit first). Returns its
        process name."""
        name = name or f"node{partition}"
        trust = ["--insecure"] if self.tls is None else [f"--root-certificates={self.tls['ca']}"]
        node_port = free_port()
        node_args = [
            f"--superlink=127.0.0.1:{self.port}",
            "--host=127.0.0.1",
            f"--port={node_port}",  # the node's own API, for its ClientApp processes
            f"--node-config=partition-id={partition}",
        ]
        if key is not None:
            node_args.append(f"--auth-supernode-private-key={key}")
        self.spawn(name, [str(BIN / "flower-supernode"), *trust, *node_args])
        if wait:
            self.wait_listening(name, node_port)
        return name

    def start(self, nodes: int, output_root: Path, tls: dict[str, Path] | None = None) -> None:
        """The SuperLink and ``nodes`` SuperNodes (partitions 0 .. nodes - 1)."""
        self.start_superlink(output_root, tls)
        for partition in range(nodes):
            self.start_node(partition)

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
        """The ``flwr`` CLI's connection "test" to this SuperLink, in its
        FLWR_HOME/config.toml."""
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

    def cli(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        """A ``flwr`` command against this SuperLink (as its operator), to its end."""
        return subprocess.run(
            [str(BIN / "flwr"), *args],
            capture_output=True, text=True, timeout=timeout, env=self.env("cli"),
            cwd=self.root,
        )  # fmt: skip

    def deploy(self, run_config: dict[str, Any], name: str = "deploy") -> subprocess.Popen:
        """``fedskew deploy test --run-config '...'`` in the background."""
        command = [sys.executable, "-m", "fedskew.apps.cli", "deploy", "test"]
        return self.spawn(name, [*command, "--run-config", config_pairs(run_config)], home="cli")

    def wait(self, proc: subprocess.Popen, timeout: float) -> int:
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            raise AssertionError(f"not ended in {timeout:.0f} s\n{self.report()}") from None

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Crash a process (SIGKILL: no clean shutdown) with its group and children."""
        kill_tree(self.procs[name], sig)

    def stop(self) -> None:
        # The CLI first, then the nodes, the SuperLink last (it owns the ServerApp).
        for name in sorted(self.procs, key=lambda n: (n == "superlink", n.startswith("node"))):
            kill_tree(self.procs[name])

    def log(self, name: str) -> str:
        return self.log_files[name].read_text(errors="replace")

    def report(self) -> str:
        return "\n".join(
            f"===== {name} ({path})\n{tail(path)}" for name, path in self.log_files.items()
        )


# ---------------------------------------------------------------------------- keys


def make_certificates(folder: Path) -> dict[str, Path]:
    """A CA, and a certificate it signs for the SuperLink at 127.0.0.1 (IP SAN)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder.mkdir(parents=True, exist_ok=True)
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


def make_node_key(folder: Path, name: str) -> tuple[Path, Path]:
    """A SuperNode's key pair as ``ssh-keygen -t ecdsa -b 384 -N "" -f NAME`` writes it
    (OpenSSH private key, ``.pub`` public key): what Flower's node authentication reads."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    private, public = folder / name, folder / f"{name}.pub"
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )
    )
    private.chmod(0o600)
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
        + b"\n"
    )
    return private, public
