#!/usr/bin/env bash
# Memory safety: every kernel family (scripts/sanitize_cases.py: tail shapes, the largest E, top_k
# and M, both formats and nibble orders, all activations, the batched path) under each of
# compute-sanitizer's four tools; prints a summary and exits 1 when any tool reports an error.
# Usage (GPU machine, repository root):  bash scripts/sanitize.sh [--only WORD]
# (--only: the cases whose name contains WORD; TOOLS="memcheck racecheck" picks the tools).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} CUPYMOE_LINEINFO=1 PYTHONUNBUFFERED=1
SAN=${COMPUTE_SANITIZER:-compute-sanitizer}
LOGS=${OUT:-/tmp}
status=0
summary="$LOGS/sanitize_summary.txt"
printf '%-10s %-7s %-6s %s\n' tool errors exit checks > "$summary"
for tool in ${TOOLS:-memcheck racecheck initcheck synccheck}; do
  log="$LOGS/sanitize_$tool.log"
  # racecheck did not finish the routing's cluster launch (M > 4 on sm_90+) in minutes on the
  # H200: under racecheck the decode routing runs as one block (CUPYMOE_CLUSTERS=0);
  # the other three tools check the cluster path.
  clusters=1
  if [ "$tool" = racecheck ]; then clusters=0; fi
  CUPYMOE_CLUSTERS=$clusters "$SAN" --tool "$tool" --print-limit 20 python3 scripts/sanitize_cases.py "$@" > "$log" 2>&1
  rc=$?
  errors=$(grep -Eo 'ERROR SUMMARY: [0-9]+' "$log" | awk '{s += $3} END {print s + 0}')
  checks=$(grep -E '^[0-9]+ failed checks' "$log" | tail -1)
  printf '%-10s %-7s %-6s %s\n' "$tool" "$errors" "$rc" "$checks" >> "$summary"
  if [ "$errors" != 0 ] || [ "$rc" != 0 ]; then status=1; fi
done
cat "$summary"
exit $status
