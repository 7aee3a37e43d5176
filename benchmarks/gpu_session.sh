#!/usr/bin/env bash
# What a lent GPU machine runs, in order of need, inside one time budget (default 360 s: a
# lent machine's session has 15 minutes of device time, start and copies included):
#   1. benchmarks/graph_step_check.py (issue 47: the local step as a CUDA graph against eager,
#      bit for bit over 20 steps; samples/s and peak memory of fedskew's step eager and as a
#      graph, a bare CUDA-graph loop of the same model, precision and batches, fedskew rounds
#      one after another (--cuda-graphs off/on) and together (vmap, fused, fused + CUDA
#      graph), 4 replicas on 4 CUDA streams, and 2 and 4 processes at once on the GPU, 4 also
#      under a private MPS daemon (fp32 only); ResNet-18 and fedavg-cnn, fp32 and bf16), at most half the budget;
#   2. benchmarks/round_fixed_costs.py (issue 47: what a ResNet-18 FedAvg and FedFM round of
#      10 clients spends outside local training: aggregation, host<->device copies, model state
#      copies, checkpoint, evaluation, NaN/Inf checks, FedFM's anchor pass; as fractions of the
#      round and of the issue's 8 s goal round; FedAvg also with its replies brought to the
#      host, as before it averaged on the device), one measured round each, cut at 60 s and
#      skipped when under 60 s is left (each run written when it ends, FedAvg first);
#   3. benchmarks/gpu_check.sh (CUDA tests, CPU/CUDA curves per algorithm, throughput table);
#   4. benchmarks/gpu_table.py (one after another against together, fp32/TF32/bf16,
#      fedavg-cnn and ResNet-18, samples/s and peak memory);
#   5. benchmarks/precision_accuracy.py --device cuda --modes fp32 tf32 bf16 (TF32's and bf16's
#      accuracy cost, seeds 0-2, 10 rounds, three runs at a time on the one GPU: under 2 minutes
#      on an H200).
# Each step gets what is left of the budget (seconds) and is cut there (`timeout`), step 2 at
# most 60 s; steps 2, 4 and 5 are skipped when under a minute is left; every result lands in
# OUT_DIR (.md, .json, logs), step by step, so a run cut short keeps what it finished, and
# OUT_DIR.tgz packs the folder (no checkpoints).
#
#   benchmarks/gpu_session.sh OUT_DIR [BUDGET_SECONDS]
#   benchmarks/gpu_session.sh --dry-run OUT_DIR   # steps 1 and 2 at tiny size on the CPU
#       (seconds each); the other steps' own dry runs take minutes:
#       python benchmarks/gpu_check.py --device cpu
#
# Provenance: the machine may hold a stale copy of .git, so beside `git rev-parse HEAD` the
# script records the tree of the files it ran (`tree.txt`: `git write-tree` of the working
# tree through a temporary index); `git rev-parse COMMIT^{tree}` here names the commit it was.
# Fashion-MNIST for steps 3-5: carry data/fmnist (see gpu_check.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
dry_run=0
if [ "${1:-}" = "--dry-run" ]; then dry_run=1; shift; fi
out="${1:?usage: benchmarks/gpu_session.sh [--dry-run] OUT_DIR [BUDGET_SECONDS]}"
budget="${2:-360}"
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

if [ "$dry_run" = 1 ]; then
    "$PY" benchmarks/graph_step_check.py --dry-run --out "$out/graph_step.md" \
        >"$out/graph_step.log" 2>&1
    status=$?
    echo "gpu_session: graph_step_check (dry run, CPU) exit $status, $(left) s left"
    "$PY" benchmarks/round_fixed_costs.py --dry-run --out "$out/round_fixed_costs.md" \
        >"$out/round_fixed_costs.log" 2>&1
    fixed=$?
    echo "gpu_session: round_fixed_costs (dry run, CPU) exit $fixed, $(left) s left"
    echo "gpu_session: dry run: gpu_check, gpu_table and precision_accuracy not run"
    [ "$status" = 0 ] && status=$fixed
    exit "$status"
fi

# Step 1 first (issue 47: its report is what a lent GPU is wanted for now), half the budget:
# cut hard at budget/2 (180 s of the default 360) by `timeout`; inside, no cell starts after
# budget/2 - 20 s, and each finished cell is in graph_step.md at once.
# Worst case on one H100/H200, from the step counts of graph_step_check.settings() (batch 64)
# and the host cost per operator (30-90 us; docs/gpu.md): a ResNet-18 step eager <= 18 ms
# (about 200 operators; bf16 250: <= 22 ms), replayed as a graph <= 5 ms (fp32 GPU work);
# fedavg-cnn eager <= 3 ms. Per setting:
#   bit check 60 eager steps + 1 capture; eager 80; graph 80; bare loop 83    ResNet <= 5 s
#   5 fedskew runs (off, on, vmap, fused, fused + graph) x 3 rounds x 4 clients x 20
#     steps = 1200 steps, 1-2 s setup each, captures with graphs on           ResNet <= 37 s
#   streams: 4 replicas x 80 steps (GPU work serialised at worst) + 4 captures  <= 4 s
#   N processes (fp32 only): each process 240 steps, started at once (Python, torch and
#     fedskew imports and CUDA start: <= 8 s); N=2 <= 10 s, N=4 <= 12 s, N=4 MPS <= 13 s
# ResNet-18: fp32 <= 46 s + 35 s of processes, bf16 <= 52 s; fedavg-cnn (3 ms eager):
# fp32 <= 17 s + 30 s of processes, bf16 <= 17 s. In all <= 132 s in process + 65 s of
# processes = 197 s, above the 180 s cut at worst. So graph_step_check runs every setting's
# in-process cells first (<= 132 s, inside) and the N-process cells last: in the worst case
# the last of those (fedavg-cnn's 4 processes and the MPS rows) do not start after 160 s and
# their rows say "skipped: the budget was spent"; no model or precision loses its other rows.
# The MPS rows run last of all (after every setting's plain N-process rows): a measuring
# process that has not answered in 60 s (concurrent_paths.PROCESS_DEADLINE_S: an MPS server
# that never starts) is stopped and its row says so; the MPS daemon is quit on the way out,
# also on timeout's SIGTERM.
timeout $(( budget / 2 )) "$PY" benchmarks/graph_step_check.py --device cuda \
    --budget $(( budget / 2 - 20 )) --out "$out/graph_step.md" >"$out/graph_step.log" 2>&1
echo "gpu_session: graph_step_check exit $?, $(left) s left"

# Step 2: one warm-up and one measured round each of FedAvg, FedAvg with its replies brought
# to the host (the path before it averaged on the device) and FedFM, 10 clients x 2,000
# images (the per-round costs do not depend on it; FedFM's anchor pass, a forward over every
# client's images, grows with it). Worst case on one H100/H200: ResNet-18 fp32 trains at
# about 4,200 images/s there (benchmarks/results/gpu_table.md, H200: one after another 4,402,
# together 4,180), so a round's 20,000 images take <= 5 s, evaluating 10,000 <= 1 s, and
# FedFM's anchor pass adds <= 2 s: 2 x 6 s + 2 x 6 s + 2 x 8 s + start-up (imports, CUDA,
# data) <= 10 s = 50 s, cut at 60 s. Each run's report is written when it ends (FedFM's last).
if [ "$(left)" -gt 60 ]; then
    timeout 60 "$PY" benchmarks/round_fixed_costs.py --device cuda --rounds 1 --samples 2000 \
        --out "$out/round_fixed_costs.md" >"$out/round_fixed_costs.log" 2>&1
    echo "gpu_session: round_fixed_costs exit $?, $(left) s left"
else
    echo "gpu_session: round_fixed_costs skipped (under a minute left)"
fi

timeout "$(left)" bash benchmarks/gpu_check.sh --out "$out/gpu_check.md" \
    >"$out/gpu_check.log" 2>&1
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
