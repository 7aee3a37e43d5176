#!/usr/bin/env bash
# The GPU checks on one CUDA GPU, in about 8 minutes:
#   1. the CUDA cases of tests/test_device.py and tests/test_together.py (a deterministic run
#      after ordinary CUDA work in one process, no host sync inside the training steps, the
#      clients-together path against one after another, ...);
#   2. CPU/CUDA equivalence per algorithm on ResNet-18 (BatchNorm, cuDNN) over the embedded
#      digits, one after another and clients together, with a learning check and
#   3. the throughput table (one after another, together, bare loop, Flower's simulation)
#      on issue 12's experiment (FedAvg, fedavg-cnn, Fashion-MNIST, 20 clients, Dir 0.1,
#      8 per round, E=5, b=64),
# written step by step to benchmarks/results/gpu_check.md (and .json) with the device's name:
# a step that fails is a red row, and a run cut short leaves the steps it finished. The exit
# status is non-zero when any row is red.
#
# Without CUDA it stops at once, saying so (exit 2). The Python half runs on a CPU as a dry
# run: python benchmarks/gpu_check.py --device cpu
#
# Data: the equivalence needs nothing (digits are embedded). The throughput table looks for
# Fashion-MNIST in GPU_CHECK_DATA_DIR, else in this checkout's data/ when it exists, then
# where fedskew's loader looks (/usr/share/datasets/fashion-mnist, $FEDSKEW_DATA, its cache,
# ../shared/data), then MNIST likewise, then uses a synthetic stand-in of the same shape
# (said in the report). A GPU machine without internet gets the real files carried in an
# ignored folder, e.g. `mkdir -p data/fmnist && cp /usr/share/datasets/fashion-mnist/*.gz
# data/fmnist/` here and data/ carried along.
# PYTHON chooses the interpreter (default: .venv/bin/python, else python3); fedskew is
# imported from src/ when it is not installed. Arguments are passed to gpu_check.py (e.g.
# --out DIR/gpu_check.md where only an output folder comes back).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
started=$(date +%s)

"$PY" - <<'PYEOF' || exit 2
import importlib.util, sys
try:
    import torch
except ImportError:
    sys.exit("gpu_check: torch is not installed for this Python (see README: Install)")
if not torch.cuda.is_available():
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    sys.exit(f"gpu_check: no CUDA device: torch {torch.__version__} ({build}) sees no GPU. "
             "Run it on a machine with an NVIDIA GPU and a CUDA build of torch; "
             "the dry run on a CPU is: python benchmarks/gpu_check.py --device cpu")
missing = [m for m in ("numpy", "sklearn", "pytest") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: missing Python packages: {', '.join(missing)} (pip install -e '.[dev]')")
print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)")
PYEOF

flower=()
if "$PY" -c "import flwr, ray" 2>/dev/null; then flower=(--flower); else
    echo "gpu_check: flwr/ray not installed: the throughput table leaves Flower out"; fi
data=()
if [ -n "${GPU_CHECK_DATA_DIR:-}" ]; then data=(--data-dir "$GPU_CHECK_DATA_DIR"); fi

log=$(mktemp /tmp/gpu_check_tests.XXXXXX)
echo "gpu_check: 1/3 CUDA tests"
# No CUBLAS_WORKSPACE_CONFIG here on purpose: importing fedskew must set it (the tests run a
# deterministic run after ordinary CUDA work in one process, as a user's session would).
env -u CUBLAS_WORKSPACE_CONFIG timeout 150 "$PY" -m pytest -q -p no:cacheprovider -rs \
    tests/test_device.py tests/test_together.py -k "cuda and not cuda_curve" >"$log" 2>&1
tests_rc=$?
tail -n 3 "$log"

echo "gpu_check: 2-3/3 equivalence and throughput"
timeout 390 "$PY" benchmarks/gpu_check.py --device cuda --tests-log "$log" --tests-rc "$tests_rc" \
    "${flower[@]}" "${data[@]}" "$@"
check_rc=$?
echo "gpu_check: $(( $(date +%s) - started )) s; tests exit $tests_rc, checks exit $check_rc"
[ "$tests_rc" -eq 0 ] && [ "$check_rc" -eq 0 ]
