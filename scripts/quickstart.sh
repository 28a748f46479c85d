#!/usr/bin/env bash
# The main job: install megatron-zb and show which schedule to run for a realistic setting
# (8 pipeline stages, 32 microbatches, measured-looking costs with a heavier loss stage),
# then draw the timeline of the best zero-bubble schedule.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh >/dev/null
MZB=.venv/bin/megatron-zb
OUT=${OUT_DIR:-out}
mkdir -p "$OUT"
COSTS=(--stages 8 --microbatches 32 --cost-f 1.0,1,1,1,1,1,1,1.3 --cost-b 1.0,1,1,1,1,1,1,1.4
       --cost-w 0.8 --cost-comm 0.05 --mem-w 0.6)
echo "== megatron-zb compare (P=8, M=32) =="
$MZB compare "${COSTS[@]}"
echo
echo "== the same under 1F1B's activation memory (8 microbatches per rank) =="
$MZB compare "${COSTS[@]}" --memory-limit 8
echo
$MZB plot --schedule zb-h2 "${COSTS[@]}" --out "$OUT/zb-h2.png" "$OUT/zb-h2.svg" "$OUT/zb-h2.trace.json"
$MZB plot --schedule 1f1b "${COSTS[@]}" --out "$OUT/1f1b.png"
echo "timelines written to $OUT/ (open the .trace.json in Perfetto or chrome://tracing)"
