"""The Flower app's pyproject.toml (flower/pyproject.toml), written from code: its header,
its declared dependency (this fedskew, with the flower extra) and its run config table
(``[tool.flwr.app.config]``) from the option metadata of ExperimentConfig.
``python -m fedskew.apps.flower.app_config flower/pyproject.toml`` rewrites the file
(``--check``: exit 1 when it differs; a test compares the two). ``fedskew deploy`` and
``--engine flower-sim`` write the same file into a folder of their own (:func:`write_app`),
so the app they submit is the one ``flwr run flower`` submits, also where fedskew was
installed without its repository.

flwr refuses a ``--run-config`` key the app does not declare, so every option of
``fedskew run`` is declared here, with fedskew's default, except those whose metadata says
``flower=False``; then the keys only the ServerApp reads. The values are TOML: "" for "not
set" (None, an empty table or list), tables as strings of key=value pairs."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedskew.apps.flower.run_config import SERVER_KEY_NOTES
from fedskew.config import ExperimentConfig
from fedskew.core.errors import UsageError
from fedskew.version import __version__

TABLE = "[tool.flwr.app.config]"
# The app's own small federation (a first `flwr run` finishes in minutes), and its run
# folders directly in the output root.
APP_DEFAULTS: dict[str, Any] = {"num_clients": 4, "rounds": 10, "out_dir": None}
# config-file comes first: it is read before the other keys
FIRST = {"config-file": "relative to the output root"}
WIDTH = 100


def toml_value(value: Any) -> str:
    if value is None or value == {} or value == []:
        return '""'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    raise TypeError(f"no TOML form for the default {value!r}")


def _line(key: str, value: str, note: str | None) -> str:
    line = f"{key} = {value}"
    if not note:
        return line
    if len(f"{line}  # {note}") <= WIDTH:
        return f"{line}  # {note}"
    comment = textwrap.wrap(note, WIDTH - 2)
    return "\n".join([*(f"# {c}" for c in comment), line])


def render() -> str:
    """The table, from its header line to the end of the file."""
    lines = [TABLE]
    lines += [_line(k, '""', note) for k, note in FIRST.items()]
    for f in dataclasses.fields(ExperimentConfig):
        if f.metadata.get("flower", True) is False:
            continue
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        default = APP_DEFAULTS.get(f.name, default)
        key = f.name.replace("_", "-")
        lines.append(_line(key, toml_value(default), f.metadata.get("flower_note")))
    for key, (default, note) in SERVER_KEY_NOTES.items():
        lines.append(_line(key, toml_value(default), note))
    return "\n".join(lines) + "\n"


PYTORCH_INDEX = "https://download.pytorch.org/whl"


@dataclass(frozen=True)
class TorchBuild:
    """The torch the app's environment gets: a version, and a variant of PyTorch's own
    indexes ("cpu", "cu128", ...) or "" for whatever build uv's default index serves (on
    Linux, PyPI's is a CUDA build of several GB)."""

    version: str
    variant: str

    @property
    def requirement(self) -> str:
        return f"torch=={self.version}+{self.variant}" if self.variant else f"torch=={self.version}"

    @property
    def index_name(self) -> str:
        return f"pytorch-{self.variant}"

    def __str__(self) -> str:
        return f"{self.version}+{self.variant}" if self.variant else self.version


# The torch of the repository's flower/pyproject.toml: CI's (.ci/run), the CPU build.
# `fedskew deploy` writes the torch of the machine it runs on instead (local_torch).
DEFAULT_TORCH = TorchBuild("2.13.0", "cpu")
_VARIANT = re.compile(r"cpu|cu\d{2,4}|rocm\d+(\.\d+)*|xpu")


def local_torch() -> TorchBuild | None:
    """The torch installed here, as its package metadata says (no import: seconds)."""
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None
    base, _, variant = version.partition("+")
    return TorchBuild(base, variant if _VARIANT.fullmatch(variant) else "")


def torch_build(choice: str | None = None) -> TorchBuild:
    """The torch for the app: ``choice`` is a variant of PyTorch's indexes ("cpu",
    "cu128", ...) or "index" (uv's default index decides the build); None: the build
    installed here. The version is always the one installed here (DEFAULT_TORCH's where
    there is none), so that the server computes with the torch its user runs."""
    here = local_torch() or DEFAULT_TORCH
    if choice is None:
        return here
    if choice == "index":
        return TorchBuild(here.version, "")
    if not _VARIANT.fullmatch(choice):
        raise UsageError(
            f"--torch {choice!r}: give cpu, a CUDA variant of PyTorch's index (cu126, cu128, "
            "...), rocm<version>, xpu, or index (the build uv's default index serves)"
        )
    return TorchBuild(here.version, choice)


def header(torch: TorchBuild) -> str:
    """Everything above the run config table. The dependency pins this fedskew (the table
    below declares its options, and a node with another version may not understand them)
    and the torch build (fedskew itself accepts a range, which uv resolves to the newest
    torch of its default index: a CUDA build on a CPU server)."""
    if torch.variant:
        uv = f"""
# torch: {torch} from PyTorch's {torch.variant} index (only torch comes from it). Without
# access to it (a mirror, a wheel folder), UV_NO_SOURCES_PACKAGE=torch in the SuperLink's
# environment takes the same pinned build from uv's other indexes. `fedskew deploy --torch`
# chooses another build (docs/flower.md).
[tool.uv.sources]
torch = {{ index = "{torch.index_name}" }}

[[tool.uv.index]]
name = "{torch.index_name}"
url = "{PYTORCH_INDEX}/{torch.variant}"
explicit = true
"""
    else:
        uv = f"""
# torch: {torch}, the build uv's default index serves (`fedskew deploy --torch` chooses
# one of PyTorch's indexes instead, docs/flower.md).
"""
    return f"""\
# The fedskew Flower app. `flwr run flower <connection> --stream` (or `fedskew deploy
# <connection>`, which also exits non-zero when the run fails) bundles this folder into a
# Flower App Bundle (`flwr build --app flower` writes it) and runs it on the SuperLink and its
# SuperNodes. Its code is its one dependency, fedskew with the flower extra (and the privacy
# extra, whose accountant a DP run's ServerApp needs): the SuperLink
# installs it per run (Flower's runtime dependency installation, on by default; uv must find
# fedskew, see docs/flower.md), a SuperNode has it installed or installs it too
# (flower-supernode --allow-runtime-dependency-installation).
# Written by `python -m fedskew.apps.flower.app_config flower/pyproject.toml`: edit it there.
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "fedskew-flower"
version = "{__version__}"
description = "fedskew's federated algorithms on a Flower federation"
license = "Apache-2.0"
requires-python = ">=3.11"
dependencies = ["fedskew[flower,privacy]=={__version__}", "{torch.requirement}"]

[tool.hatch.build.targets.wheel]
bypass-selection = true  # the app's code is its dependency: the bundle holds no module
{uv}
[tool.flwr.app]
publisher = "fedskew"

[tool.flwr.app.components]
serverapp = "fedskew.apps.flower:server_app"
clientapp = "fedskew.apps.flower:client_app"

# Keys of `fedskew run`, set here or with `flwr run ... --run-config 'k=v'`.
# "" means the fedskew default. Tables are strings of key=value pairs: params = "lam=10".
# Each SuperNode needs `--node-config "partition-id=<i>"` (0 .. num-clients - 1) and may
# add `data-dir="<path>"` for its local copy of the dataset (the server reads its copy from
# $FEDSKEW_DATA or its cache: data-dir is not a run config key of a deployment).
# Paths are relative to the output root that the server operator sets in FEDSKEW_OUTPUT_ROOT
# (the SuperLink's environment); the ServerApp refuses to start without it (see SECURITY.md).
"""


def app_text(torch: TorchBuild = DEFAULT_TORCH) -> str:
    """The whole pyproject.toml of the Flower app, its environment getting ``torch``."""
    return header(torch) + render()


def write_app(folder: Path, torch: TorchBuild = DEFAULT_TORCH) -> Path:
    """The Flower app in ``folder`` (made if missing): its pyproject.toml, all a bundle
    holds. Returns the folder, for ``flwr run``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text(app_text(torch), encoding="utf-8")
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write the Flower app's pyproject.toml")
    parser.add_argument("pyproject", type=Path, help="flower/pyproject.toml")
    parser.add_argument("--check", action="store_true", help="exit 1 when the file differs")
    parser.add_argument(
        "--torch", help="the torch build: cpu, cu128, ..., or index (default: the "
        f"repository's, {DEFAULT_TORCH}); the version is the one installed here",
    )  # fmt: skip
    args = parser.parse_args(argv)
    text = args.pyproject.read_text(encoding="utf-8") if args.pyproject.exists() else ""
    try:
        build = DEFAULT_TORCH if args.torch is None else torch_build(args.torch)
    except UsageError as exc:
        print(f"fedskew: error: {exc}", file=sys.stderr)
        return exc.exit_code
    new = app_text(build)
    if args.check:
        if new != text:
            print(
                f"{args.pyproject}: it differs from the app fedskew writes (its {TABLE} "
                "from the option metadata)",
                file=sys.stderr,
            )
            return 1
        return 0
    try:  # DIR/pyproject.toml for `flwr run DIR`: the app's folder is made like write_app's
        args.pyproject.parent.mkdir(parents=True, exist_ok=True)
        args.pyproject.write_text(new, encoding="utf-8")
    except OSError as exc:
        print(f"fedskew: error: cannot write {args.pyproject}: {exc.strerror}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
