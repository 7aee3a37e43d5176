#!/usr/bin/env bash
# The tuned FedFM-vs-FedAvg study of reproduction/fedfm-tuned.toml: two `fedskew tune`
# processes of one torch thread each share the study (SQLite in the study's folder), then the
# results are written once more from the finished study and the tuned methods are evaluated on
# the evaluation seeds (`fedskew compare` on tuned.json: 2 runs at a time, 1 thread each).
# Rerunning it continues a study that was cut off. PYTHON: the interpreter (default python).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python}
export OMP_NUM_THREADS=1
"$py" -m fedskew tune -c reproduction/fedfm-tuned.toml &
first=$!
sleep 30  # the first process creates the study's tables
"$py" -m fedskew tune -c reproduction/fedfm-tuned.toml &
second=$!
wait "$first"
wait "$second"
"$py" -m fedskew tune -c reproduction/fedfm-tuned.toml --results-only
"$py" -m fedskew compare -c reproduction/runs/fedfm-tuned/tuned.json
