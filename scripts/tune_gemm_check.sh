#!/usr/bin/env bash
# The GPU check of the measured GEMV/GEMM hand-over (about 2-3 minutes on an H200, most of it
# NVRTC compiles on a bare machine):
#   1. the tests of the choice, the tuning cache and the tuners (CPU and GPU), and the GPU tests
#      of the two backends either side of each hand-over;
#   2. `cupymoe tune --kernel gemm` of one preset's FC1 and FC2 at 2-128 rows per expert, into a
#      scratch cache (the user's ~/.cache/cupymoe/gemv_tune.json is left alone), with its table.
# Logs go to $OUT (or /tmp). Usage:
#   bash scripts/tune_gemm_check.sh [preset] [rows-per-expert list]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
PRESET=${1:-qwen3.6-35b-a3b}
ROWS=${2:-2,4,8,16,32,64,128}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
status=0

par=""
python3 -c "import xdist" 2>/dev/null && par="-n 4"  # parallel workers also compile in parallel
python3 -m pytest -q -p no:cacheprovider $par \
    tests/test_handover.py tests/test_tune.py \
    "tests/test_cli.py::test_tune_help_lists_the_gemm_options" \
    "tests/test_cli.py::test_tune_kernels_and_rows_per_expert" \
    "tests/test_cli.py::test_tune_rejects_bad_options" \
    "tests/test_gemm.py::test_backends_agree_at_the_hand_overs" \
    "tests/test_gemm.py::test_gemm_and_gemv_agree_on_both_sides_of_the_hand_over" \
    2>&1 | tee "$OUT/tune_gemm_tests.log" | tail -30
status=$((status | ${PIPESTATUS[0]}))

# A scratch tuning cache; the sm_90a cubins stay where they are kept between runs.
scratch=$(mktemp -d)
export CUPYMOE_KERNEL_CACHE=${CUPYMOE_KERNEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/cupymoe/kernels}
XDG_CACHE_HOME=$scratch timeout 400 python3 -m cupymoe.cli tune --preset "$PRESET" \
    --kernel gemm --rows-per-expert "$ROWS" --repeats 5 \
    2> "$OUT/tune_gemm_progress.log" | tee "$OUT/tune_gemm_table.txt"
status=$((status | ${PIPESTATUS[0]}))
tail -3 "$OUT/tune_gemm_progress.log"
cp "$scratch/cupymoe/gemv_tune.json" "$OUT/tune_gemm_cache.json" 2>/dev/null
XDG_CACHE_HOME=$scratch python3 -m cupymoe.cli info | grep '^tuning'
rm -rf "$scratch"
exit "$status"
