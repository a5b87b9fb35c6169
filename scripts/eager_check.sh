#!/usr/bin/env bash
# The eager path on the GPU machine (issue #24): its GPU tests, then bench_eager for the three
# presets at M = 1, 4, 8 with the cProfile of each preset's M = 1, the table on stdout and the
# JSON in $OUT (or /tmp). At most 4 minutes (two limits of 2), most of it compiling kernels;
# each step has a time limit so that the benchmark runs whatever the tests do. Usage:
#   bash scripts/eager_check.sh [pytest args...]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
workers=()
if python3 -c "import xdist" 2>/dev/null; then workers=(-n 4); fi  # compiles in parallel too
start=$SECONDS
timeout 120 python3 -m pytest -q -m gpu ${workers[@]+"${workers[@]}"} -p no:cacheprovider tests/test_eager.py "$@" \
  2>&1 | tee "$OUT/eager_tests.log" | tail -30
echo "tests: exit ${PIPESTATUS[0]} after $((SECONDS - start)) s (124: time limit)"
start=$SECONDS
timeout 120 python3 benchmarks/bench_eager.py --tokens 1,4,8 --calls 1000 --profile \
  --json "$OUT/h200_eager.json" 2> >(tee "$OUT/eager_bench.err" >&2) | tee "$OUT/eager_bench.md"
echo "bench: exit ${PIPESTATUS[0]} after $((SECONDS - start)) s; JSON in $OUT/h200_eager.json"
