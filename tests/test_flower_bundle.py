"""The torch that the Flower app's environment gets: the bundle's pyproject pins the build
of the machine that submits it and takes it from PyTorch's index for that build, so that a
CPU server is not given a CUDA torch of several GB (issue 48: uv resolved fedskew's torch
range to 2.14.1+cu130 on a CPU SuperLink whose nodes ran 2.13.0+cpu).

What uv makes of the bundle is checked offline: ``uv lock`` (what Flower's ``uv sync`` starts
with) on the app's pyproject, with fedskew's dependency replaced by the torch range fedskew
itself declares, PyTorch's index replaced by a local folder of stand-in wheels of the same
names and versions, and a stand-in for the default index that serves, like PyPI, a newer
CUDA torch with its CUDA libraries."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from fedskew.apps.flower import app_config
from fedskew.apps.flower.app_config import DEFAULT_TORCH, TorchBuild, app_text, torch_build
from fedskew.core.errors import UsageError

REPO = Path(__file__).resolve().parents[1]


def _uv() -> str | None:
    beside = Path(sys.executable).parent / "uv"
    return str(beside) if beside.is_file() else shutil.which("uv")


def stand_in_wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> None:
    """A wheel with metadata only: what uv reads to resolve."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{name.replace('-', '_')}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    metadata += "".join(f"Requires-Dist: {r}\n" for r in requires)
    wheel = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    path = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{dist}/METADATA", metadata)
        zf.writestr(f"{dist}/WHEEL", wheel)
        zf.writestr(f"{dist}/RECORD", "")


def fedskew_torch_requirement() -> str:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(d for d in deps if d.replace(" ", "").startswith("torch"))


def resolve(app_pyproject: str, tmp_path: Path) -> dict[str, str]:
    """{package: version} as uv locks the app's environment, offline (see the module)."""
    default = tmp_path / "default-index"  # PyPI's Linux torch: CUDA, with its libraries
    for version in ("2.13.0", "2.14.1"):
        stand_in_wheel(default, "torch", version, ("nvidia-cublas>=13",))
    stand_in_wheel(default, "nvidia-cublas", "13.0.0")
    cpu = tmp_path / "pytorch-cpu"  # PyTorch's CPU index
    for version in ("2.13.0+cpu", "2.14.1+cpu"):
        stand_in_wheel(cpu, "torch", version)
    table = tomllib.loads(app_pyproject)
    deps = table["project"]["dependencies"]
    text = app_pyproject.replace(
        f'"{deps[0]}"', f'"{fedskew_torch_requirement()}"'
    )  # fedskew brings its torch range
    for index in table.get("tool", {}).get("uv", {}).get("index", []):
        text = text.replace(f'url = "{index["url"]}"', f'url = "{cpu}"\nformat = "flat"')
    project = tmp_path / "app"
    project.mkdir()
    (project / "pyproject.toml").write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("UV_")}
    env.update(UV_OFFLINE="1", UV_NO_CONFIG="1", UV_CACHE_DIR=str(tmp_path / "cache"),
               UV_FIND_LINKS=str(default), UV_DEFAULT_INDEX=(tmp_path / "none").as_uri(),
               UV_PYTHON=sys.executable)  # fmt: skip
    (tmp_path / "none").mkdir()
    proc = subprocess.run([_uv(), "lock"], cwd=project, env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lock = tomllib.loads((project / "uv.lock").read_text())
    return {p["name"]: p.get("version", "") for p in lock["package"]}


@pytest.mark.skipif(_uv() is None, reason="needs uv (Flower's runtime installation uses it)")
def test_the_bundle_gives_a_cpu_server_the_cpu_torch_it_pins(tmp_path):
    text = app_text(TorchBuild("2.13.0", "cpu"))
    table = tomllib.loads(text)
    assert "torch==2.13.0+cpu" in table["project"]["dependencies"]
    assert table["tool"]["uv"]["sources"]["torch"] == {"index": "pytorch-cpu"}
    assert table["tool"]["uv"]["index"] == [
        {"name": "pytorch-cpu", "url": "https://download.pytorch.org/whl/cpu", "explicit": True}
    ]
    packages = resolve(text, tmp_path)
    assert packages["torch"] == "2.13.0+cpu"
    assert not [p for p in packages if p.startswith("nvidia")]


@pytest.mark.skipif(_uv() is None, reason="needs uv (Flower's runtime installation uses it)")
def test_a_gpu_build_and_the_default_index_are_chosen_on_request(tmp_path):
    cuda = tomllib.loads(app_text(TorchBuild("2.13.0", "cu128")))
    assert "torch==2.13.0+cu128" in cuda["project"]["dependencies"]
    assert cuda["tool"]["uv"]["index"][0]["url"] == "https://download.pytorch.org/whl/cu128"
    # "index": the version pinned, the build what uv's default index serves (PyPI: CUDA)
    text = app_text(TorchBuild("2.13.0", ""))
    assert "uv" not in tomllib.loads(text)["tool"]
    packages = resolve(text, tmp_path)
    assert packages["torch"] == "2.13.0" and "nvidia-cublas" in packages


def test_the_torch_build_follows_the_one_installed_here(monkeypatch):
    monkeypatch.setattr(app_config.importlib.metadata, "version", lambda name: "2.12.1+cu126")
    assert torch_build() == TorchBuild("2.12.1", "cu126")
    assert torch_build("cpu") == TorchBuild("2.12.1", "cpu")
    assert torch_build("index") == TorchBuild("2.12.1", "")
    monkeypatch.setattr(app_config.importlib.metadata, "version", lambda name: "2.13.0")
    assert torch_build() == TorchBuild("2.13.0", "")  # PyPI's build: its index's
    with pytest.raises(UsageError, match="--torch 'gpu'"):
        torch_build("gpu")
    # The repository's app: CI's CPU torch.
    text = (REPO / "flower" / "pyproject.toml").read_text()
    assert text == app_text(DEFAULT_TORCH) and DEFAULT_TORCH.requirement in text


def test_fedskew_deploy_submits_the_torch_installed_here_or_the_one_asked_for(
    tmp_path, monkeypatch
):
    from fedskew.apps.flower import submit

    seen: list[str] = []

    class Submitted(Exception):
        pass

    def start_run(folder, *args, **kwargs):
        seen.append((folder / "pyproject.toml").read_text())
        raise Submitted

    monkeypatch.setattr(submit, "start_run", start_run)
    monkeypatch.setattr(app_config.importlib.metadata, "version", lambda name: "2.12.1+cpu")
    for choice, pinned in ((None, "torch==2.12.1+cpu"), ("cu126", "torch==2.12.1+cu126")):
        with pytest.raises(Submitted):
            submit.deploy("loopback", ["rounds=2"], torch=choice)
        assert f'"{pinned}"' in seen[-1]
    with pytest.raises(UsageError, match="not with --app"):
        submit.deploy("loopback", [], app=REPO / "flower", torch="cpu")


def test_app_config_writes_the_documented_dir_and_refuses_in_one_line(tmp_path, capsys):
    # flower.md: `python -m fedskew.apps.flower.app_config DIR/pyproject.toml --torch cu128`
    # writes an app for `flwr run DIR`; DIR did not exist and it ended in FileNotFoundError's
    # traceback, as did an unknown --torch (UsageError) and a path that cannot be written.
    target = tmp_path / "DIR" / "pyproject.toml"
    assert app_config.main([str(target), "--torch", "cu128"]) == 0
    assert '"torch==' in target.read_text() and "+cu128" in target.read_text()
    assert app_config.main([str(target), "--torch", "bogus"]) == 2
    assert capsys.readouterr().err.startswith("fedskew: error: --torch 'bogus'")
    (tmp_path / "afile").write_text("")
    assert app_config.main([str(tmp_path / "afile" / "pyproject.toml")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fedskew: error: cannot write") and err.count("\n") == 1
