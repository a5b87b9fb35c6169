#!/usr/bin/env bash
# The GPU machine's check: every GPU test (in parallel workers, which also compile in parallel),
# then an optional benchmark command. Logs go to $OUT (or /tmp). Usage:
#   bash scripts/gpu_check.sh [pytest args...]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider "$@" 2>&1 | tee "$OUT/gpu_tests.log" | tail -60
