"""Do the shell commands of docs/tracking.md, docs/privacy.md and docs/flower.md give what the
pages say, copied into a fresh shell?

Takes every fenced ``bash`` block of the three pages, splits it into commands (a line ending
in a backslash goes on, a heredoc belongs to its command, comments are dropped) and looks each
up in ``PLAN`` below: a command is run, in order, in one temporary working folder with the
environment this script runs in (its ``bin`` first on PATH, as an activated venv), and the
lines or files its page promises are looked for; a long-running server is started, asked over
HTTP for what the page says it shows, and ended; any other command is skipped with the reason
written beside it. A command of the pages that ``PLAN`` does not know, or a ``PLAN`` entry no
page has any more, is an error: the check follows the pages.

    python benchmarks/docs_walkthrough.py            # writes benchmarks/results/docs_walkthrough.md
    python benchmarks/docs_walkthrough.py --deployment   # also runs flower.md's walk-through test

Run it with a Python whose environment has fedskew installed as the README says (the CPU torch,
then ``pip install -e ".[dev,flower,privacy,track]"``). Exit status 0 when every command run
exited 0 and every promised line or file was found, 1 otherwise. tests/test_docs_walkthrough.py
checks (fast) that every command of the pages is planned.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = ("docs/tracking.md", "docs/privacy.md", "docs/flower.md")
OUT = ROOT / "benchmarks" / "results" / "docs_walkthrough.md"


@dataclasses.dataclass(frozen=True)
class Check:
    """What the page promises: ``kind`` "output" (a regex in what the command printed),
    "path" (a glob, relative to the working folder, that matches something) or "http"
    (``target`` is "PATH REGEX": GET of the server's PATH answers text matching REGEX;
    ``{run}`` in PATH is replaced by the first run name the server lists)."""

    kind: str
    target: str
    doc_says: str
    value: float | None = None  # an output check's first group, rounded to 1 decimal, is this


@dataclasses.dataclass(frozen=True)
class Plan:
    checks: tuple[Check, ...] = ()
    skip: str = ""  # the reason, where the command is not run
    server_port: int = 0  # a long-running server listening there: started, asked, ended
    timeout: int = 600


def out(regex: str, says: str) -> Check:
    return Check("output", regex, says)


def accuracy(percent: float) -> Check:
    """The summary line's final accuracy, as the privacy page's table rounds it (0.1 %)."""
    return Check("output", r"final accuracy (\d+\.\d+) %", f"{PRIVACY_TABLE}: {percent} %", percent)


def path(pattern: str, says: str) -> Check:
    return Check("path", pattern, says)


def http(target: str, says: str) -> Check:
    return Check("http", target, says)


DEPLOYMENT_TEST = (
    "tests/test_flower_deployment.py::test_documented_deployment_runs_from_a_fresh_clone"
)
WALKED_BY_TEST = (
    f"flower.md's deployment walk-through (SuperLink, SuperNodes, connection, fedskew deploy): "
    f"long-running processes in terminals of their own; {DEPLOYMENT_TEST} runs these blocks "
    "as written (--deployment runs it)"
)
TLS = (
    "needs ca.pem/server.pem/server.key, which the page does not make, and long-running "
    "servers; tests/test_flower_deployment.py runs a federation over TLS with node "
    "authentication (slow)"
)
INSTALL = (
    "installs into the environment, which this check already runs in (the README's CPU torch "
    "and the extras); the environment's extras are checked before the commands run"
)
# Each privacy example's summary line: the table's accuracy and epsilon (seed 0, the default).
PRIVACY_TABLE = "the table under the examples"

PLAN: dict[str, Plan] = {
    # ---------------------------------------------------------------- tracking.md
    "fedskew run --track mlflow": Plan(
        (
            path("runs/mlflow.db", "SQLite database runs/mlflow.db"),
            path("runs/mlartifacts/*", "artifacts runs/mlartifacts"),
        )
    ),
    "mlflow ui --backend-store-uri sqlite:///runs/mlflow.db": Plan(
        (
            http(
                '/ajax-api/2.0/mlflow/experiments/search?max_results=10 "name"',
                "the MLflow UI over the database: its experiments",
            ),
        ),
        server_port=5000,
    ),
    "fedskew run --track tensorboard": Plan(
        (path("runs/tensorboard/*/events.out.tfevents.*", "event files in runs/tensorboard/<run>"),)
    ),
    "tensorboard --logdir runs/tensorboard": Plan(
        (
            http('/data/plugin/scalars/tags "accuracy"', "the runs' scalars (accuracy)"),
            http(
                "/data/plugin/scalars/scalars?run={run}&tag=accuracy \\[\\s*\\[",
                "accuracy's values per round",
            ),
        ),
        server_port=6006,
    ),
    "fedskew run --track wandb": Plan(
        (path("runs/wandb/offline-run-*", "offline (runs/wandb/offline-run-*)"),)
    ),
    "wandb sync runs/wandb/offline-run-*": Plan(
        skip="uploads to W&B's servers: needs an account (WANDB_API_KEY) and the network"
    ),
    "cat > grid.toml <<'EOF'": Plan(),
    "fedskew compare -c grid.toml --track mlflow --track tensorboard": Plan(
        (
            path("runs/grid/mlflow.db", "the trackers' files in the grid folder"),
            path(
                "runs/grid/tensorboard/*/events.out.tfevents.*",
                "TensorBoard one folder per run under <grid>/tensorboard/",
            ),
        )
    ),
    # ---------------------------------------------------------------- privacy.md
    "fedskew run -a fedavg -n 20 -r 30 --secure-aggregation": Plan((accuracy(94.7),)),
    "pip install -e '.[privacy]'": Plan(skip=INSTALL),
    "fedskew run -a fedavg -n 100 --clients-per-round 20 --dp central --dp-clip 0.5 "
    "--dp-noise 1.0": Plan(
        (
            accuracy(80.8),
            out(r"epsilon 52\.2 at delta 1e-05", PRIVACY_TABLE + ": epsilon 52.2"),
            out(r"above 10 the guarantee bounds little", "warns before it starts"),
        )
    ),
    "fedskew run -a fedavg -n 100 --clients-per-round 20 --dp central --dp-clip 0.5 "
    "--dp-target-epsilon 8": Plan(
        (
            accuracy(45.3),
            out(r"epsilon 8 at delta 1e-05", PRIVACY_TABLE + ": epsilon 8"),
            out(r"noise 3\.21", PRIVACY_TABLE + ": noise multiplier 3.21"),
        )
    ),
    "fedskew run -a fedprox -n 100 --clients-per-round 20 --secure-aggregation --dp central "
    "--dp-clipping adaptive": Plan(
        (
            accuracy(56.7),
            out(r"epsilon 52\.2 at delta", PRIVACY_TABLE + ": epsilon 52.2"),
            out(r"clip 1 adapted to 1\.87", 'the summary line says "clip 1 adapted to 1.87"'),
        )
    ),
    "fedskew run -a fedavg --dp local --dp-clip 0.5 --dp-noise 0.3": Plan(
        (
            accuracy(67.8),
            out(r"epsilon 588 at delta", PRIVACY_TABLE + ": epsilon 588"),
        )
    ),
    # ---------------------------------------------------------------- flower.md
    'pip install ".[flower]"': Plan(skip=INSTALL),
    "pip wheel --no-deps --wheel-dir ~/fedskew-wheels .": Plan(skip=WALKED_BY_TEST),
    "FEDSKEW_OUTPUT_ROOT=$HOME/fedskew-runs UV_FIND_LINKS=$HOME/fedskew-wheels "
    "flower-superlink --insecure --port 9093": Plan(skip=WALKED_BY_TEST),
    "flower-supernode --insecure --superlink 127.0.0.1:9093 --port 9094 --node-config "
    "'partition-id=0'": Plan(skip=WALKED_BY_TEST),
    "flower-supernode --insecure --superlink 127.0.0.1:9093 --port 9095 --node-config "
    "'partition-id=1'": Plan(skip=WALKED_BY_TEST),
    "mkdir -p ~/.flwr && cat >> ~/.flwr/config.toml <<'EOF'": Plan(skip=WALKED_BY_TEST),
    'fedskew deploy loopback --run-config \'algorithm="fedcme" num-clients=2 '
    'clients-per-round=2 local-epochs=2 rounds=3 name="cme"\'': Plan(skip=WALKED_BY_TEST),
    "ls ~/fedskew-runs/cme": Plan(skip=WALKED_BY_TEST),
    "FEDSKEW_OUTPUT_ROOT=$HOME/fedskew-runs UV_FIND_LINKS=$HOME/fedskew-wheels flower-superlink "
    "--ssl-ca-certfile ca.pem --ssl-certfile server.pem --ssl-keyfile server.key --port 9093": Plan(
        skip=TLS
    ),
    "flower-supernode --root-certificates ca.pem --superlink 127.0.0.1:9093 --port 9094 "
    "--node-config 'partition-id=0'": Plan(skip=TLS),
    'ssh-keygen -t ecdsa -b 384 -N "" -f node0': Plan(
        (path("node0", "writes node0 (private)"), path("node0.pub", "and node0.pub"))
    ),
    "FEDSKEW_OUTPUT_ROOT=$HOME/fedskew-runs UV_FIND_LINKS=$HOME/fedskew-wheels flower-superlink "
    "--ssl-ca-certfile ca.pem --ssl-certfile server.pem --ssl-keyfile server.key --port 9093 "
    "--enable-supernode-auth": Plan(skip=TLS),
    "flwr supernode register node0.pub secure": Plan(skip=TLS),
    "flower-supernode --root-certificates ca.pem --superlink 127.0.0.1:9093 --port 9094 "
    "--node-config 'partition-id=0' --auth-supernode-private-key node0": Plan(skip=TLS),
}

# The extras the commands need, checked before any runs (a missing one would make every
# tracker command fail for a reason the pages already state: install the extra).
NEEDED_MODULES = ("mlflow", "tensorboard", "wandb", "dp_accounting", "flwr")


@dataclasses.dataclass
class Command:
    page: str
    key: str  # the first line, continuations joined: PLAN's key
    text: str  # the whole command as bash runs it (continuations, heredoc body)


def _uncommented(line: str) -> str:
    # a comment after a command is the page's note to the reader, not bash's
    return re.sub(r"\s+#\s.*$", "", line).rstrip()


def commands(page: Path) -> list[Command]:
    """The commands of ``page``'s fenced bash blocks, in order."""
    found: list[Command] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() != "```bash":
            i += 1
            continue
        i += 1
        block: list[str] = []
        while lines[i].strip() != "```":
            block.append(lines[i])
            i += 1
        i += 1
        j = 0
        while j < len(block):
            line = block[j]
            j += 1
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            code = _uncommented(line)
            while code.endswith("\\") and j < len(block):
                code = code[:-1].rstrip() + " " + _uncommented(block[j]).strip()
                j += 1
            key, text = code, code
            heredoc = re.search(r"<<'?(\w+)'?", code)
            if heredoc:
                body = []
                while j < len(block) and block[j].strip() != heredoc.group(1):
                    body.append(block[j])
                    j += 1
                j += 1
                text = "\n".join([code, *body, heredoc.group(1)])
            found.append(Command(str(page.relative_to(ROOT)), key, text))
    return found


def all_commands() -> list[Command]:
    return [c for p in PAGES for c in commands(ROOT / p)]


def unplanned() -> tuple[list[Command], list[str]]:
    """The pages' commands PLAN does not know, and PLAN's keys no page has."""
    cmds = all_commands()
    keys = {c.key for c in cmds}
    return [c for c in cmds if c.key not in PLAN], [k for k in PLAN if k not in keys]


@dataclasses.dataclass
class Result:
    command: Command
    plan: Plan
    code: int | None = None
    seconds: float = 0.0
    found: list[tuple[Check, bool, str]] = dataclasses.field(default_factory=list)
    output: str = ""


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _get(port: int, url_path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{url_path}", timeout=30) as r:
        return r.read().decode("utf-8", "replace")


def _end(proc: subprocess.Popen[str]) -> None:
    """End the server and whatever it started (its own process group), by its id."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _serve(cmd: Command, plan: Plan, work: Path, env: dict[str, str], res: Result) -> None:
    if _port_open(plan.server_port):
        res.output = f"port {plan.server_port} already in use: not started"
        res.code = -1
        return
    log = work / f"server-{plan.server_port}.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(
            ["bash", "-c", cmd.text], cwd=work, env=env, stdout=sink, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not _port_open(plan.server_port) and time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            time.sleep(1)
        run_name = ""
        for check in plan.checks:
            url_path, regex = check.target.split(" ", 1)
            if "{run}" in url_path:
                if not run_name:  # the first run TensorBoard lists
                    try:
                        run_name = next(iter(json.loads(_get(plan.server_port, "/data/runs"))))
                    except Exception as exc:  # noqa: BLE001 - the page's promise not kept
                        res.found.append((check, False, f"no runs listed: {exc}"))
                        continue
                url_path = url_path.replace("{run}", urllib.request.quote(run_name))
            try:
                body = _get(plan.server_port, url_path)
                ok = re.search(regex, body) is not None
                res.found.append((check, ok, body[:160].replace("\n", " ")))
            except Exception as exc:  # noqa: BLE001 - an unanswered request is a finding
                res.found.append((check, False, f"{type(exc).__name__}: {exc}"))
        res.code = 0 if proc.poll() is None else proc.returncode  # still serving: as promised
    finally:
        _end(proc)
        res.output = log.read_text(errors="replace")


def walk(work: Path, env: dict[str, str]) -> list[Result]:
    results = []
    for cmd in all_commands():
        plan = PLAN[cmd.key]
        res = Result(cmd, plan)
        results.append(res)
        if plan.skip:
            continue
        print(f"$ {cmd.key}", flush=True)
        start = time.monotonic()
        if plan.server_port:
            _serve(cmd, plan, work, env, res)
        else:
            try:
                done = subprocess.run(
                    ["bash", "-c", cmd.text], cwd=work, env=env, capture_output=True,
                    text=True, timeout=plan.timeout,
                )  # fmt: skip
                res.code, res.output = done.returncode, done.stdout + done.stderr
            except subprocess.TimeoutExpired as exc:
                res.code, res.output = 124, f"timed out after {exc.timeout} s"
            for check in plan.checks:
                if check.kind == "output":
                    hit = re.search(check.target, res.output)
                    ok = hit is not None and (
                        check.value is None or round(float(hit.group(1)), 1) == check.value
                    )
                    res.found.append((check, ok, hit.group(0) if hit else ""))
                else:
                    hits = sorted(glob.glob(str(work / check.target)))
                    shown = ", ".join(str(Path(h).relative_to(work)) for h in hits[:2])
                    res.found.append((check, bool(hits), shown))
        res.seconds = time.monotonic() - start
        print(f"  exit {res.code}, {sum(ok for _, ok, _ in res.found)}/{len(res.found)} found, "
              f"{res.seconds:.0f} s", flush=True)  # fmt: skip
    return results


def deployment_test(env: dict[str, str]) -> tuple[int, str, float]:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "slow", DEPLOYMENT_TEST], cwd=ROOT, env=env,
        capture_output=True, text=True,
    )  # fmt: skip
    tail = (done.stdout + done.stderr).strip().splitlines()[-1:]
    return done.returncode, tail[0] if tail else "", time.monotonic() - start


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(results: list[Result], deployment: tuple[int, str, float] | None, seconds: float) -> str:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from machine import load1, machine_facts

    facts = machine_facts()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    import torch

    import fedskew

    ran = [r for r in results if not r.plan.skip]
    good = [r for r in ran if r.code == 0 and all(ok for _, ok, _ in r.found)]
    lines = [
        "# The documentation's commands, walked through",
        "",
        "Written by `python benchmarks/docs_walkthrough.py"
        + (" --deployment" if deployment else "")
        + "`: every shell command of docs/tracking.md, docs/privacy.md and docs/flower.md, in "
        "order, in one fresh working folder, with fedskew installed as the README says; a "
        "server is started, asked over HTTP and ended.",
        "",
        f"Machine: {facts.get('cpu', 'unknown CPU')}, {os.cpu_count()} cores, load "
        f"{load1()} at the end; Python {sys.version.split()[0]}, torch {torch.__version__}, "
        f"fedskew {fedskew.__version__} at commit {commit}; {seconds:.0f} s in all.",
        "",
        f"{len(ran)} commands run, {len(good)} gave everything their page says; "
        f"{len(results) - len(ran)} skipped, each with its reason.",
        "",
        "| page | command | ran | exit | what the page says | found |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        cmd = f"`{_cell(r.command.key)}`"
        page = r.command.page.removeprefix("docs/")
        if r.plan.skip:
            lines.append(f"| {page} | {cmd} | skipped: {_cell(r.plan.skip)} | | | |")
            continue
        if not r.found:
            lines.append(f"| {page} | {cmd} | yes ({r.seconds:.0f} s) | {r.code} | - | - |")
        for i, (check, ok, seen) in enumerate(r.found):
            head = (
                f"| {page} | {cmd} | yes ({r.seconds:.0f} s) | {r.code} |"
                if i == 0
                else ("| | | | |")
            )
            verdict = ("found" if ok else "NOT FOUND") + (f": {_cell(seen)}" if seen else "")
            lines.append(f"{head} {_cell(check.doc_says)} | {verdict} |")
    if deployment is not None:
        code, tail, secs = deployment
        lines += [
            "",
            f"flower.md's deployment walk-through: `{DEPLOYMENT_TEST}` exited {code} after "
            f"{secs:.0f} s (`{_cell(tail)}`).",
        ]
    failed = [r for r in ran if r not in good]
    if failed:
        lines += ["", "## What failed", ""]
        for r in failed:
            # the progress bar's redraws say nothing a reader needs
            kept = [x for x in r.output.strip().splitlines() if "round/s" not in x]
            tail = "\n".join(kept[-15:])
            lines += [f"`{r.command.key}` (exit {r.code}):", "", "```", tail, "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deployment", action="store_true", help=f"also run {DEPLOYMENT_TEST}")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    missing_cmds, stale = unplanned()
    if missing_cmds or stale:
        for c in missing_cmds:
            print(f"{c.page}: a command this check does not plan: {c.key}", file=sys.stderr)
        for k in stale:
            print(f"planned but on no page any more: {k}", file=sys.stderr)
        return 2
    import importlib.util

    absent = [m for m in NEEDED_MODULES if importlib.util.find_spec(m) is None]
    if absent:
        print(f"install the extras first (missing: {', '.join(absent)})", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("WANDB_API_KEY", None)  # the page's offline case: no account
    env.pop("MLFLOW_TRACKING_URI", None)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fedskew-docs-") as tmp:
        results = walk(Path(tmp), env)
    deployment = deployment_test(env) if args.deployment else None
    text = render(results, deployment, time.monotonic() - start)
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out}")
    ok = all(r.code == 0 and all(f for _, f, _ in r.found) for r in results if not r.plan.skip)
    return 0 if ok and (deployment is None or deployment[0] == 0) else 1


if __name__ == "__main__":
    sys.exit(main())
