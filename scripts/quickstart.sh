#!/usr/bin/env bash
# The main job (about 7 minutes on a 2-core CPU box from a fresh clone, set-up included: 6 min 55 s
# measured with the real-compute section's three rounds):
#   1. set-up (scripts/setup_env.sh; its output goes to $OUT/setup.log);
#   2. correctness: train a tiny GPT for real with megatron-zb's zb-v schedule on 4 pipeline ranks
#      (gloo processes on a CPU), then the same model, data and seed with 1f1b: identical losses;
#   3. speed, with emulated compute: the same pipeline on 4 real processes exchanging real
#      point-to-point messages, each pass waiting the F/B/W time one transformer layer took on an
#      H100 (benchmarks/results/fbw_h100_h4096_s4096.json): measured iteration time and speed-up
#      over 1f1b for 1f1b, zb-h1 and zb-v next to the simulator's prediction, and a timeline
#      picture of the zb-v iteration as it ran. Then vocabulary parallelism, emulated the same way:
#      for a GPT whose output layer has Llama-3.2-1B's share of the FLOPs (vocabulary 128256, hidden
#      2048, 16 layers, sequence 4096), Megatron's 1F1B with the best layout `megatron-zb plan` finds
#      for it against plan's best schedule with --enable-vocab-parallel (its VS/VT/VW passes wait
#      their costs too, its barriers are real gloo all-reduces), measured and simulated. It all runs
#      in the background during step 2 (its passes wait; they need almost no CPU).
#   4. speed, with real compute (CPU): Megatron's own 1F1B (no megatron-zb flag) and megatron-zb's
#      1f1b, zb-h1 and zb-v train a GPT of 8 layers (hidden 256, sequence 256, vocabulary 7168: its
#      output layer weighs about 2 layers) on 2 pipeline ranks, each a process on its own core, each
#      with the layout `megatron-zb plan` picks for it, in interleaved rounds: the median time per
#      iteration over the rounds with their spread, and the speed-up over Megatron's 1F1B next to
#      the simulator's prediction from each chunk's profiled F/B/W, each pass's handling and the
#      measured optimizer step (Megatron's own 1F1B: megatron-zb's 1f1b profile, the same order with
#      fused backwards), profiled in the iterations it times (3 to the one before the last; the last holds
#      the profile's end). REAL_ROUNDS (default 3), REAL_ITERS (8); REAL_ROUNDS=0 skips it.
# With at least $PP GPUs (nvidia-smi) steps 2 and 3 are one: 1f1b, zb-h1 and zb-v train a small
# bf16 GPT with real compute, and the report compares their measured iteration times with the
# simulator's prediction from each run's profiled F/B/W times (FORCE_CPU=1: the CPU path anyway).
#
#   OUT_DIR (default out/quickstart)  PP (4)  ITERS (20 on CPU, 60 on GPUs)  EXTRA_ARGS (more training flags)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT_DIR:-out/quickstart}
PP=${PP:-4}
mkdir -p "$OUT"
rm -f "$OUT"/train_*.log "$OUT"/profile_*.json "$OUT"/timeline_* "$OUT"/quickstart.json "$OUT"/emulated.json \
      "$OUT"/emulated_vocab.json \
      "$OUT"/real_*

echo "megatron-zb quickstart: setting up .venv (output in $OUT/setup.log)"
if ! bash scripts/setup_env.sh >"$OUT/setup.log" 2>&1; then
    echo "set-up failed; the last lines of $OUT/setup.log:"
    tail -n 20 "$OUT/setup.log"
    exit 1
fi

GPUS=0
if [ "${FORCE_CPU:-0}" != 1 ] && command -v nvidia-smi >/dev/null 2>&1; then
    GPUS=$(nvidia-smi --list-gpus 2>/dev/null | wc -l || echo 0)
fi
if [ "$GPUS" -ge "$PP" ]; then
    MODE=gpu; SCHEDULES="1f1b zb-h1 zb-v"; ITERS=${ITERS:-60}
else
    MODE=cpu; SCHEDULES="zb-v 1f1b"; ITERS=${ITERS:-20}
    export FORCE_CPU=1
fi

EMU=
if [ "$MODE" = cpu ]; then
    # The emulated run needs almost no CPU (its passes wait): it runs during the training.
    .venv/bin/python scripts/quickstart_report.py "$OUT" --emulate --pp "$PP" >"$OUT/emulate.log" 2>&1 &
    EMU=$!
    trap '[ -n "$EMU" ] && kill "$EMU" 2>/dev/null; true' EXIT
fi

# Megatron's iteration lines and megatron-zb's own lines; everything else stays in the log.
SHOW='^ *\[[^]]*\] iteration +[0-9]+/|^megatron-zb: '
for S in $SCHEDULES; do
    LOG="$OUT/train_$S.log"
    FLAGS="--zero-bubble-deterministic-init"
    if [ "$MODE" = gpu ]; then
        echo "== training a GPT with --zero-bubble-schedule $S on $PP GPUs (real compute, $ITERS iterations) =="
        FLAGS="$FLAGS --zero-bubble-profile-window 10 20 --zero-bubble-profile-path $OUT/profile_$S.json"
        SETUP=(env NPROC="$PP")
    else
        echo "== training the tiny GPT with --zero-bubble-schedule $S (CPU, $PP pipeline ranks, $ITERS iterations) =="
        SETUP=(nice -n 19)  # the emulated run beside it measures time: it gets the CPU first
    fi
    set +e
    env SCHEDULE="$S" PP="$PP" ITERS="$ITERS" LOG_FILE="$LOG" LOG_INTERVAL="${LOG_INTERVAL:-5}" \
        EXTRA_ARGS="$FLAGS ${EXTRA_ARGS:-}" "${SETUP[@]}" bash scripts/pretrain_gpt_zb.sh 2>&1 | grep --line-buffered -E "$SHOW"
    rc=${PIPESTATUS[0]}
    set -e
    if [ "$rc" -ne 0 ]; then
        echo "training with $S failed (exit $rc); the last lines of $LOG:"
        tail -n 30 "$LOG"
        exit 1
    fi
done
if [ -n "$EMU" ]; then
    echo "== waiting for the emulated-compute run (1f1b, zb-h1, zb-v; Megatron 1F1B against vocabulary parallelism; on $PP processes; log: $OUT/emulate.log) =="
    if ! wait "$EMU"; then
        EMU=
        echo "the emulated run failed; the last lines of $OUT/emulate.log:"
        tail -n 30 "$OUT/emulate.log"
        exit 1
    fi
    EMU=
fi
if [ "$MODE" = cpu ] && [ "${REAL_ROUNDS:-3}" -gt 0 ]; then
    # each schedule with the layout `megatron-zb plan` picks for this model (Megatron's own 1F1B: 1f1b's)
    eval "$(.venv/bin/python scripts/quickstart_report.py --real-layouts)"
    echo "== real compute (CPU): Megatron's own 1F1B and megatron-zb's 1f1b, zb-h1, zb-v on 2 pipeline ranks, layouts" \
         "$LAYOUT_megatron / $LAYOUT_1f1b / $LAYOUT_zb_h1 / $LAYOUT_zb_v, ${REAL_ROUNDS:-3} rounds (logs: $OUT/real_*.log) =="
    for R in $(seq 1 "${REAL_ROUNDS:-3}"); do
        for S in megatron 1f1b zb-h1 zb-v; do
            V="LAYOUT_${S//-/_}"
            FLAGS="--zero-bubble-deterministic-init --pipeline-model-parallel-layout ${!V}"
            if [ "$S" != megatron ]; then
                # profiled in the iterations it is timed in (3 on), so that a busy host's moments weigh on both
                FLAGS="$FLAGS --zero-bubble-profile-window 3 ${REAL_ITERS:-8} --zero-bubble-profile-path $OUT/real_profile_${S}_r$R.json"
            fi
            if ! env SCHEDULE="$S" PP=2 NUM_LAYERS=8 HIDDEN=256 HEADS=4 SEQ_LEN=256 MBS=1 GBS=8 VOCAB=7168 \
                    ITERS="${REAL_ITERS:-8}" LOG_INTERVAL=1 LOG_FILE="$OUT/real_${S}_r$R.log" PREFLIGHT=0 \
                    EXTRA_ARGS="$FLAGS" bash scripts/pretrain_gpt_zb.sh >/dev/null 2>&1; then
                echo "real-compute run $S (round $R) failed; the last lines of $OUT/real_${S}_r$R.log:"
                tail -n 30 "$OUT/real_${S}_r$R.log"
                exit 1
            fi
            printf '   round %s: %-8s %s\n' "$R" "$S" "$(grep -oE 'elapsed time per iteration \(ms\): [0-9.]+' \
                "$OUT/real_${S}_r$R.log" | tail -n 1 | grep -oE '[0-9.]+$') ms (last iteration)"
        done
    done
fi
echo
.venv/bin/python scripts/quickstart_report.py "$OUT" --mode "$MODE" --pp "$PP" --schedules $SCHEDULES
