#!/usr/bin/env bash
# What a lent GPU machine runs, in order of need, inside one time budget:
#   1. benchmarks/gpu_check.sh (CUDA tests, CPU/CUDA curves per algorithm, throughput table);
#   2. benchmarks/gpu_table.py (one after another against together, fp32/TF32/bf16,
#      fedavg-cnn and ResNet-18, samples/s and peak memory);
#   3. benchmarks/precision_accuracy.py --device cuda --modes fp32 tf32 bf16 (TF32's and bf16's
#      accuracy cost, seeds 0-2, 10 rounds, three runs at a time on the one GPU: under 2 minutes
#      on an H200).
# Each step gets what is left of the budget (seconds, default 540) and is skipped when under a
# minute is left; every result lands in OUT_DIR (.md, .json, logs), step by step, so a run
# cut short keeps what it finished, and OUT_DIR.tgz packs the folder (no checkpoints).
#
#   benchmarks/gpu_session.sh OUT_DIR [BUDGET_SECONDS]
#
# Provenance: the machine may hold a stale copy of .git, so beside `git rev-parse HEAD` the
# script records the tree of the files it ran (`tree.txt`: `git write-tree` of the working
# tree through a temporary index); `git rev-parse COMMIT^{tree}` here names the commit it was.
# Fashion-MNIST for steps 1-3: carry data/fmnist (see gpu_check.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: benchmarks/gpu_session.sh OUT_DIR [BUDGET_SECONDS]}"
budget="${2:-540}"
mkdir -p "$out"
started=$(date +%s)
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
export PYTHON="$PY"
# fedskew's loader does not look in the checkout's data/ (where a GPU machine gets it carried);
# the fedskew runs of step 3 find it through $FEDSKEW_DATA.
if [ -z "${FEDSKEW_DATA:-}" ] && [ -d data ]; then export FEDSKEW_DATA="$PWD/data"; fi

left() { echo $(( budget - ($(date +%s) - started) )); }

{
    echo "HEAD $(git rev-parse HEAD 2>/dev/null || echo unknown)"
    index=$(mktemp -u)  # a fresh index: git makes it
    if GIT_INDEX_FILE="$index" git add -A 2>/dev/null; then
        echo "tree $(GIT_INDEX_FILE="$index" git write-tree)"
    else
        echo "tree unknown"
    fi
    rm -f "$index"
} >"$out/tree.txt"
cat "$out/tree.txt"

bash benchmarks/gpu_check.sh --out "$out/gpu_check.md" >"$out/gpu_check.log" 2>&1
echo "gpu_session: gpu_check exit $?, $(left) s left"
cp /tmp/gpu_check_tests.* "$out/gpu_check_tests.log" 2>/dev/null

if [ "$(left)" -gt 60 ]; then
    timeout "$(left)" "$PY" benchmarks/gpu_table.py --device cuda --out "$out/gpu_table.md" \
        >"$out/gpu_table.log" 2>&1
    echo "gpu_session: gpu_table exit $?, $(left) s left"
else
    echo "gpu_session: gpu_table skipped (under a minute left)"
fi

if [ "$(left)" -gt 60 ]; then
    timeout "$(left)" "$PY" benchmarks/precision_accuracy.py --device cuda --modes fp32 tf32 bf16 \
        --rounds 10 --seeds 0 1 2 --jobs 3 --threads 4 --out "$out/precision-runs" \
        --report "$out/precision_accuracy_cuda.md" >"$out/precision_accuracy.log" 2>&1
    echo "gpu_session: precision_accuracy exit $?, $(left) s left"
else
    echo "gpu_session: precision_accuracy skipped (under a minute left)"
fi
echo "gpu_session: $(( $(date +%s) - started )) s"
# One file to bring back (run folders hold many): the folder without checkpoints.
tar czf "$out.tgz" --exclude=checkpoint.npz --exclude=partition.npz -C "$(dirname "$out")" \
    "$(basename "$out")" && echo "gpu_session: $out.tgz"
