#!/usr/bin/env bash
# Run the GPU tests of every kernel stage under compute-sanitizer's four tools and print a summary.
# Usage (on a GPU machine, repository root):  bash scripts/sanitize.sh [pytest -k expression]
# Each tool reruns the selected GPU tests (tail shapes, largest E / top_k / M included) in one
# process; the summary counts the errors each tool reported. Exit status 1 when any tool found one.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} CUPYMOE_LINEINFO=1 PYTHONUNBUFFERED=1
SAN=${COMPUTE_SANITIZER:-compute-sanitizer}
FILTER=${1:-}
OUT=${OUT:-/tmp}
# The kernel tests, not the slow full-layer sweeps: every specialisation is still launched.
TESTS="tests/test_dequant.py tests/test_routing.py tests/test_expand.py tests/test_finalize.py tests/test_gemv.py tests/test_batched.py"
status=0
printf '%-10s %-8s %-8s %s\n' tool errors pytest log > "$OUT/sanitize_summary.txt"
for tool in memcheck racecheck initcheck synccheck; do
  log="$OUT/sanitize_$tool.log"
  extra=()
  [ "$tool" = memcheck ] && extra=(--leak-check no)
  # racecheck and initcheck are slow: they see each launch in detail, so give them the smaller
  # shape grid (-k "not slow") unless a filter is given.
  "$SAN" --tool "$tool" "${extra[@]}" --print-limit 20 --error-exitcode 99 \
    python3 -m pytest -q -x -m gpu -p no:cacheprovider ${FILTER:+-k "$FILTER"} $TESTS \
    >"$log" 2>&1
  rc=$?
  errors=$(grep -Eo 'ERROR SUMMARY: [0-9]+' "$log" | awk '{s+=$3} END {print s+0}')
  summary=$(grep -E '^[0-9]+ (passed|failed)|passed|failed' "$log" | tail -1)
  printf '%-10s %-8s %-8s %s\n' "$tool" "$errors" "rc=$rc" "$summary" | tee -a "$OUT/sanitize_summary.txt"
  if [ "$errors" != 0 ] || [ "$rc" != 0 ]; then status=1; fi
done
cat "$OUT/sanitize_summary.txt"
exit $status
