#!/usr/bin/env bash
# GPT pretraining with a megatron-zb pipeline schedule, launched with torchrun (one or many nodes).
#
#   SCHEDULE=zb-v PP=4 bash scripts/pretrain_gpt_zb.sh                 # one node
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 ... bash scripts/pretrain_gpt_zb.sh   # on each node
#   (SLURM: scripts/slurm/pretrain_gpt_zb.sbatch runs this script once per node)
#
# Everything is an environment variable, like Megatron's example scripts; anything else goes in
# EXTRA_ARGS (passed last, so it overrides). Without a GPU the defaults are a tiny GPT that trains
# on CPU in seconds (gloo, fp32); with GPUs a small bf16 GPT.
#
#   SCHEDULE      megatron-zb schedule (gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-h2, zb-auto, zb-v,
#                 v-half, v-min, v-auto, looped-bfs, dualpipe-v, gpipe-v, interleaved-zb, zeropp, bitpipe);
#                 "megatron" = Megatron's own schedules (no megatron-zb flag). Default zb-h1.
#   MEM_LIMIT     --zero-bubble-memory-limit (microbatches, or e.g. 20GB)
#   PP TP         pipeline / tensor parallel sizes (default 2 / 1)
#   NPROC         processes per node (default: the GPUs on this node, else PP x TP)
#   NNODES NODE_RANK MASTER_ADDR MASTER_PORT    static multi-node rendezvous (defaults 1 0 127.0.0.1 29500)
#   RDZV_ENDPOINT host:port -> torchrun's c10d rendezvous instead (RDZV_ID names the job)
#   NUM_LAYERS HIDDEN HEADS FFN SEQ_LEN VOCAB   model size (VOCAB: NullTokenizer vocabulary)
#   MBS GBS       micro / global batch size
#   ITERS LR MIN_LR WARMUP LOG_INTERVAL EVAL_INTERVAL EVAL_ITERS SEED
#   DATA_PATH     Megatron indexed dataset prefix(es) (default: Megatron's mock GPT data);
#                 TOKENIZER_TYPE / TOKENIZER_MODEL / VOCAB_FILE / MERGE_FILE for real data
#   SAVE LOAD SAVE_INTERVAL        checkpointing
#   PROFILE_WINDOW "START END"     --zero-bubble-profile-window (writes a profile JSON)
#   PRECISION     bf16 | fp16 | fp32 (default bf16 on GPU, fp32 on CPU)
#   LOG_DIR       also write the output to $LOG_DIR/pretrain_<schedule>_node<rank>_<timestamp>.log
#   LOG_FILE      ... or to exactly this file
#   MZB_MCORE     megatron-core to use: a version (<repo>/.venv/mcore-<version>) or a directory;
#                 default: the installed one if it has megatron.training, else .venv/mcore-0.19.2
#   PYTHON        interpreter (default: <repo>/.venv/bin/python if present, else python3)
#   DRY_RUN=1     print the command instead of running it
#   PREFLIGHT=0   skip the flag check that runs (one process, a few seconds) before torchrun
#
# The ZB authors' fork's variables work too: PIPELINE_SIZE, TP_SIZE, LAYERS, HIDDEN_SIZE,
# ATTENTION_HEADS, MICRO_BATCH_SIZE, GLOBAL_BATCH_SIZE, EXIT_INTERVAL (-> ITERS), ENABLE_ZERO_BUBBLE=1
# (--enable-zero-bubble), ZERO_BUBBLE_V_SCHEDULE=1 (--zero-bubble-v-schedule), ZERO_BUBBLE_MEM_LIMIT
# (--zero-bubble-max-pending-backward), ZERO_BUBBLE_TIMER_START/END, EXTRA_OPTIONS.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

if [ -z "${PYTHON:-}" ]; then
    if [ -x "$REPO/.venv/bin/python" ]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi

# -- megatron-core with megatron.training ------------------------------------------------------
if [ -n "${MZB_MCORE:-}" ] && [ "$MZB_MCORE" != "installed" ]; then
    if [ -d "$MZB_MCORE/megatron/core" ]; then MCORE_DIR=$MZB_MCORE; else MCORE_DIR="$REPO/.venv/mcore-$MZB_MCORE"; fi
    [ -d "$MCORE_DIR/megatron/core" ] || { echo "pretrain_gpt_zb.sh: MZB_MCORE=$MZB_MCORE: no megatron/core in $MCORE_DIR" >&2; exit 2; }
    export PYTHONPATH="$MCORE_DIR${PYTHONPATH:+:$PYTHONPATH}"
elif [ -z "${MZB_MCORE:-}" ] && ! "$PYTHON" -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('megatron.training') else 1)" 2>/dev/null \
        && [ -d "$REPO/.venv/mcore-0.19.2/megatron/training" ]; then
    export PYTHONPATH="$REPO/.venv/mcore-0.19.2${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

# -- GPU or CPU --------------------------------------------------------------------------------
GPUS=0
if command -v nvidia-smi >/dev/null 2>&1; then GPUS=$(nvidia-smi --list-gpus 2>/dev/null | wc -l || echo 0); fi
if [ "${FORCE_CPU:-0}" = 1 ]; then GPUS=0; export CUDA_VISIBLE_DEVICES=""; fi

# -- the fork's variable names -----------------------------------------------------------------
PP=${PP:-${PIPELINE_SIZE:-2}}
TP=${TP:-${TP_SIZE:-1}}
NUM_LAYERS=${NUM_LAYERS:-${LAYERS:-}}
HIDDEN=${HIDDEN:-${HIDDEN_SIZE:-}}
HEADS=${HEADS:-${ATTENTION_HEADS:-}}
MBS=${MBS:-${MICRO_BATCH_SIZE:-}}
GBS=${GBS:-${GLOBAL_BATCH_SIZE:-}}
ITERS=${ITERS:-${EXIT_INTERVAL:-}}
EXTRA_ARGS="${EXTRA_ARGS:-} ${EXTRA_OPTIONS:-}"
SCHEDULE_FLAGS=()
if [ "${ZERO_BUBBLE_V_SCHEDULE:-0}" = 1 ] || [ "${ENABLE_ZERO_BUBBLE:-0}" = 1 ]; then
    [ "${ZERO_BUBBLE_V_SCHEDULE:-0}" = 1 ] && SCHEDULE_FLAGS+=(--zero-bubble-v-schedule)
    [ "${ENABLE_ZERO_BUBBLE:-0}" = 1 ] && SCHEDULE_FLAGS+=(--enable-zero-bubble)
    [ -n "${ZERO_BUBBLE_MEM_LIMIT:-}" ] && SCHEDULE_FLAGS+=(--zero-bubble-max-pending-backward "$ZERO_BUBBLE_MEM_LIMIT")
    [ -n "${ZERO_BUBBLE_TIMER_START:-}" ] && SCHEDULE_FLAGS+=(--zero-bubble-pipeline-timers-start-iter "$ZERO_BUBBLE_TIMER_START")
    [ -n "${ZERO_BUBBLE_TIMER_END:-}" ] && SCHEDULE_FLAGS+=(--zero-bubble-pipeline-timers-end-iter "$ZERO_BUBBLE_TIMER_END")
    SCHEDULE=${SCHEDULE:-fork-flags}
else
    SCHEDULE=${SCHEDULE:-zb-h1}
    if [ "$SCHEDULE" != megatron ]; then SCHEDULE_FLAGS+=(--zero-bubble-schedule "$SCHEDULE"); fi
fi
[ -n "${MEM_LIMIT:-}" ] && SCHEDULE_FLAGS+=(--zero-bubble-memory-limit "$MEM_LIMIT")
[ -n "${PROFILE_WINDOW:-}" ] && SCHEDULE_FLAGS+=(--zero-bubble-profile-window $PROFILE_WINDOW)

# -- defaults: tiny CPU model, or a small GPU model ----------------------------------------------
NNODES=${NNODES:-1}; NODE_RANK=${NODE_RANK:-0}
if [ "$GPUS" -gt 0 ]; then
    NPROC=${NPROC:-$GPUS}
    NUM_LAYERS=${NUM_LAYERS:-$((4 * PP))}; HIDDEN=${HIDDEN:-1024}; HEADS=${HEADS:-16}; SEQ_LEN=${SEQ_LEN:-2048}
    VOCAB=${VOCAB:-32000}; MBS=${MBS:-1}; GBS=${GBS:-$((8 * PP))}; ITERS=${ITERS:-100}; LR=${LR:-3e-4}
    PRECISION=${PRECISION:-bf16}; LOG_INTERVAL=${LOG_INTERVAL:-10}
    export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
else
    NPROC=${NPROC:-$(( (PP * TP + NNODES - 1) / NNODES ))}  # one process per model-parallel rank
    NUM_LAYERS=${NUM_LAYERS:-$((2 * PP))}; HIDDEN=${HIDDEN:-64}; HEADS=${HEADS:-4}; SEQ_LEN=${SEQ_LEN:-32}
    VOCAB=${VOCAB:-128}; MBS=${MBS:-2}; GBS=${GBS:-$((8 * MBS))}; ITERS=${ITERS:-20}; LR=${LR:-2e-3}
    PRECISION=${PRECISION:-fp32}; LOG_INTERVAL=${LOG_INTERVAL:-1}
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    # CPU: no dropout, so schedules can be compared loss for loss; no data-loader worker processes
    # (Megatron's default is 2 per loader, forked from every rank that reads data): on a CPU they only
    # take cores from the ranks. EXTRA_ARGS comes after, so "--num-workers 2" there brings them back
    EXTRA_ARGS="--hidden-dropout 0 --attention-dropout 0 --num-workers 0 $EXTRA_ARGS"
fi
FFN=${FFN:-$((4 * HIDDEN))}
MIN_LR=${MIN_LR:-$(awk -v lr="$LR" 'BEGIN { printf "%g", lr / 10 }')}
WARMUP=${WARMUP:-0}
EVAL_INTERVAL=${EVAL_INTERVAL:-1000}; EVAL_ITERS=${EVAL_ITERS:-0}; SEED=${SEED:-1234}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}; MASTER_PORT=${MASTER_PORT:-29500}

ARGS=(
    --pipeline-model-parallel-size "$PP" --tensor-model-parallel-size "$TP"
    --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS" --ffn-hidden-size "$FFN"
    --seq-length "$SEQ_LEN" --max-position-embeddings "$SEQ_LEN"
    --micro-batch-size "$MBS" --global-batch-size "$GBS"
    --train-iters "$ITERS" --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine --lr-warmup-iters "$WARMUP"
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --init-method-std 0.02
    --log-interval "$LOG_INTERVAL" --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS" --seed "$SEED"
    --log-throughput
)
case "$PRECISION" in
    bf16) ARGS+=(--bf16) ;; fp16) ARGS+=(--fp16) ;; fp32) ;;
    *) echo "pretrain_gpt_zb.sh: PRECISION must be bf16, fp16 or fp32, got $PRECISION" >&2; exit 2 ;;
esac
if [ -n "${DATA_PATH:-}" ]; then
    ARGS+=(--data-path $DATA_PATH --split "${SPLIT:-98,2,0}" --tokenizer-type "${TOKENIZER_TYPE:-GPT2BPETokenizer}")
    [ -n "${TOKENIZER_MODEL:-}" ] && ARGS+=(--tokenizer-model "$TOKENIZER_MODEL")
    [ -n "${VOCAB_FILE:-}" ] && ARGS+=(--vocab-file "$VOCAB_FILE")
    [ -n "${MERGE_FILE:-}" ] && ARGS+=(--merge-file "$MERGE_FILE")
else
    ARGS+=(--mock-data --tokenizer-type NullTokenizer --vocab-size "$VOCAB")
fi
[ -n "${SAVE:-}" ] && ARGS+=(--save "$SAVE" --save-interval "${SAVE_INTERVAL:-$ITERS}")
[ -n "${LOAD:-}" ] && ARGS+=(--load "$LOAD")

if [ -n "${RDZV_ENDPOINT:-}" ]; then
    LAUNCH=(--nnodes "$NNODES" --nproc-per-node "$NPROC" --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT"
            --rdzv-id "${RDZV_ID:-megatron-zb}")
else
    LAUNCH=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC"
            --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
fi
# SCRIPT=path/to/pretrain_gpt.py: your own (e.g. a Megatron-LM checkout's), unmodified, through megatron_zb.run
if [ -n "${SCRIPT:-}" ]; then
    [ -f "$SCRIPT" ] || { echo "pretrain_gpt_zb.sh: SCRIPT=$SCRIPT: no such file" >&2; exit 2; }
    ENTRY=(-m megatron_zb.run "$SCRIPT"); PREFLIGHT=${PREFLIGHT:-0}
else
    ENTRY=(-m megatron_zb.megatron.pretrain_gpt)
fi
CMD=("$PYTHON" -m megatron_zb.megatron.torchrun "${LAUNCH[@]}" "${ENTRY[@]}"
     "${ARGS[@]}" "${SCHEDULE_FLAGS[@]}" $EXTRA_ARGS)

echo "megatron-zb: schedule=$SCHEDULE PP=$PP TP=$TP nodes=$NNODES procs/node=$NPROC gpus/node=$GPUS" \
     "layers=$NUM_LAYERS hidden=$HIDDEN seq=$SEQ_LEN mbs=$MBS gbs=$GBS iters=$ITERS"
if [ "${DRY_RUN:-0}" = 1 ]; then
    printf '%q ' "${CMD[@]}"; echo
    exit 0
fi
# one process checks the flags before torchrun starts the ranks: a bad input is one line, exit 2
if [ "${PREFLIGHT:-1}" != 0 ]; then
    "$PYTHON" -m megatron_zb.megatron.preflight --world-size $((NNODES * NPROC)) -- \
        "${ARGS[@]}" "${SCHEDULE_FLAGS[@]}" $EXTRA_ARGS || exit $?
fi
if [ -n "${LOG_FILE:-}" ] || [ -n "${LOG_DIR:-}" ]; then
    LOG=${LOG_FILE:-$LOG_DIR/pretrain_${SCHEDULE}_node${NODE_RANK}_$(date +%Y%m%d_%H%M%S).log}
    mkdir -p "$(dirname "$LOG")"
    echo "megatron-zb: log -> $LOG"
    "${CMD[@]}" 2>&1 | tee "$LOG"
    exit "${PIPESTATUS[0]}"
fi
exec "${CMD[@]}"
