#!/usr/bin/env bash
# The main job: install everything, train a tiny GPT for real with megatron-zb's ZB-V schedule
# (4 pipeline ranks; gloo processes on a CPU, NCCL when GPUs are present), then the same model,
# data and seed with 1F1B, and compare: loss curves, time per iteration, bubble, and a timeline
# picture of the schedule that ran (drawn with the F/B/W costs measured during the run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh >/dev/null
OUT=${OUT_DIR:-out/quickstart}
PP=${PP:-4}
ITERS=${ITERS:-30}
mkdir -p "$OUT"
rm -f "$OUT"/pretrain_*.log
for S in zb-v 1f1b; do
    echo "================ training with --zero-bubble-schedule $S (PP=$PP, $ITERS iterations) ================"
    SCHEDULE=$S PP=$PP ITERS=$ITERS LOG_DIR="$OUT" LOG_INTERVAL=${LOG_INTERVAL:-5} \
        EXTRA_ARGS="--zero-bubble-deterministic-init --zero-bubble-profile-window 10 $((ITERS - 5)) --zero-bubble-profile-path $OUT/profile_$S.json ${EXTRA_ARGS:-}" \
        bash scripts/pretrain_gpt_zb.sh 2>&1 | grep -v -i -E "warn|^\s*$" | grep -E "iteration +[0-9]+/|megatron-zb|error|Error" || true
done
echo
.venv/bin/python scripts/quickstart_report.py "$OUT"
