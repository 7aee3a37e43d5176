"""README.md opens with two commands that work on a fresh CPU machine (one runs the main job on
the embedded dataset, one runs the tests), and .ci/run, which CI runs on a fresh machine,
installs and tests what they do."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"


def _first_block() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block, "README.md has no bash block"
    return block.group(1).split("\n")


def _commands(lines: list[str]) -> list[str]:
    return [line for line in lines if line.strip() and not line.lstrip().startswith("#")]


def _ci() -> str:
    return (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_the_first_block_is_two_commands_run_then_test() -> None:
    setup, tests = _commands(_first_block())  # exactly two
    assert setup.rstrip().endswith("&& fedskew run")
    assert tests.strip() == "python -m pytest -q"


def test_the_first_command_installs_the_cpu_torch_and_says_where_the_gpu_line_is() -> None:
    # PyPI's torch on Linux is the CUDA build (GBs of CUDA libraries): a laptop without a GPU
    # must get the CPU wheel from the first command already.
    lines = _first_block()
    setup = _commands(lines)[0]
    pins = re.findall(r"pip install torch==(\S+) " + re.escape(CPU_INDEX) + r"(?:\s|$)", setup)
    assert len(pins) == 1, setup
    comments = " ".join(line for line in lines if line.lstrip().startswith("#"))
    assert "GPU" in comments and "Install: CPU or CUDA" in comments
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "\n## Install: CPU or CUDA\n" in readme
    gpu_section = readme.split("\n## Install: CPU or CUDA\n", 1)[1].split("\n## ", 1)[0]
    assert f"pip install torch=={pins[0]}\n" in gpu_section  # the GPU line, PyPI's CUDA build


def test_ci_installs_and_runs_what_the_readme_says() -> None:
    setup, tests = _commands(_first_block())
    ci = _ci()
    readme_pin = re.search(r"torch==(\S+)", setup).group(1)
    assert re.search(rf"^pip install -q torch=={re.escape(readme_pin)}$", ci, re.M), (
        "README and .ci/run pin different torch versions"
    )
    readme_extras = set(re.search(r'-e "\.\[([^\]]*)\]"', setup).group(1).split(","))
    ci_extras = set(re.search(r'-e "\.\[([^\]]*)\]"', ci).group(1).split(","))
    assert readme_extras <= ci_extras
    assert re.search(rf"^{re.escape(tests.strip())}$", ci, re.M)
