#!/usr/bin/env bash
# The test suite on the oldest torch pyproject.toml accepts: proof for the lower bound.
#
# Makes a fresh virtual environment with torch at pyproject.toml's lower bound (CPU build by
# default: the suite's CUDA tests skip without a GPU either way), installs fedskew and its
# dev extras into it (so pip also checks that the bound admits that torch), runs the default
# suite (`pytest -q`: the slow tests are left out, as in CI) and records the outcome in
# benchmarks/results/oldest_torch.md (torch, Python, machine, pytest's last line, date).
# The exit status is pytest's (or pip's when installing failed).
#
#   benchmarks/oldest_torch.sh [VENV_DIR]           # default: .venv-oldest-torch (ignored)
#
# Environment: PYTHON (default python3) makes the venv; TORCH_INDEX is the package index of
# the torch wheel (default PyTorch's CPU index; set it to https://pypi.org/simple for PyPI's
# CUDA build, several GB); TORCH_VERSION overrides the version taken from pyproject.toml.
# Needs network access for the installs. The suite takes about 40 min on 2 cores.
set -uo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-oldest-torch}"
bound=$(sed -n 's/.*"torch>=\([0-9.]*\).*/\1/p' pyproject.toml | head -n 1)
version="${TORCH_VERSION:-$bound}"
index="${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
if [ -z "$version" ]; then
    echo "oldest_torch: no torch>= bound found in pyproject.toml" >&2
    exit 2
fi
echo "oldest_torch: torch $version.* from $index into $venv"
"${PYTHON:-python3}" -m venv "$venv" || exit 2
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip || exit 2
"$py" -m pip install -q "torch==$version.*" --index-url "$index" || exit 2
# Without a new index pip keeps the torch installed above if the bound admits it, and
# fails if it does not: that is the check of pyproject.toml's bound.
"$py" -m pip install -q -e ".[dev]" || exit 2
log=$(mktemp /tmp/oldest_torch.XXXXXX)
started=$(date +%s)
"$py" -m pytest -q -p no:cacheprovider 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
minutes=$(( ($(date +%s) - started) / 60 ))
facts=$("$py" -c 'import platform, torch; print(f"torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()}")')
cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo 2>/dev/null | head -n 1)
mkdir -p benchmarks/results
cat >benchmarks/results/oldest_torch.md <<EOF
# The suite on the oldest supported torch

Written by \`benchmarks/oldest_torch.sh\` on $(date '+%Y-%m-%d %H:%M %Z'): pyproject.toml's
bound \`torch>=$bound\`, installed $facts from $index, on ${cpu:-an unknown CPU} ($(nproc) cores);
commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown).

\`pytest -q\` (the default suite, slow tests left out), exit status $rc, $minutes min:

    $(tail -n 1 "$log")
EOF
echo "oldest_torch: exit $rc; benchmarks/results/oldest_torch.md written"
exit "$rc"
