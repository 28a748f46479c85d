#!/usr/bin/env bash
# Run scripts/slurm/pretrain_gpt_zb.sbatch for real on a one-node SLURM cluster started on this
# machine, and check that it trained (iterations logged, loss falling).
#
#   sudo bash scripts/slurm/run_local_slurm.sh              # zb-v, PP=2, tiny CPU GPT, 20 iterations
#   SCHEDULE=zb-h1 ITERS=10 bash scripts/slurm/run_local_slurm.sh
#
# Needs root (it installs Debian's slurm-wlm and munge with apt-get if they are missing, and runs
# munged, slurmctld and slurmd). Everything else lives in $SLURM_DIR (default /tmp/megatron-zb-slurm):
# slurm.conf, spool and state directories, daemon logs and the job's output. The daemons it started
# are stopped at the end (KEEP_CLUSTER=1 leaves them running); daemons that were already running
# are left alone. Exit status 0 only if the job completed and its log shows ITERS training
# iterations with a last loss below the first.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
SLURM_DIR=${SLURM_DIR:-/tmp/megatron-zb-slurm}
SCHEDULE=${SCHEDULE:-zb-v}
ITERS=${ITERS:-20}
PP=${PP:-2}
JOB_TIMEOUT=${JOB_TIMEOUT:-600}
CTLD_PORT=${CTLD_PORT:-6917}
SLURMD_PORT=${SLURMD_PORT:-6918}

log() { echo "run_local_slurm: $*"; }
die() { echo "run_local_slurm: error: $*" >&2; exit 1; }

# -- packages ----------------------------------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
    [ "$(id -u)" = 0 ] || die "slurm-wlm and munge are not installed and this is not root: install them (apt-get install slurm-wlm munge) or run as root"
    log "installing slurm-wlm and munge (apt-get)"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
fi
[ "$(id -u)" = 0 ] || die "starting munged/slurmctld/slurmd needs root"

mkdir -p "$SLURM_DIR"/{ctld,spool,jobs}
STARTED=()   # pid files of the daemons this script started
cleanup() {
    if [ "${KEEP_CLUSTER:-0}" = 1 ]; then
        log "KEEP_CLUSTER=1: leaving the cluster running (SLURM_CONF=$SLURM_DIR/slurm.conf)"
        return
    fi
    for pidfile in "${STARTED[@]}"; do
        if [ -s "$pidfile" ]; then
            pid=$(cat "$pidfile")
            kill "$pid" 2>/dev/null || true
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        fi
    done
}
trap cleanup EXIT

# -- munge -------------------------------------------------------------------------------------
MUNGE_SOCKET=/run/munge/munge.socket.2
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    [ -s /etc/munge/munge.key ] || { mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null \
        || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none; }
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    chmod 755 /run/munge
    log "starting munged"
    runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid
    STARTED+=(/run/munge/munged.pid)
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
    munge -n | unmunge >/dev/null || die "munged does not answer on $MUNGE_SOCKET"
fi

# -- slurm.conf for one node ---------------------------------------------------------------------
NODE=$(hostname -s)
CPUS=$(nproc)
MEM_MB=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 512 ))
export SLURM_CONF="$SLURM_DIR/slurm.conf"
cat > "$SLURM_CONF" <<EOF
# one-node cluster for megatron-zb's SLURM check (written by scripts/slurm/run_local_slurm.sh)
ClusterName=megatron-zb
SlurmctldHost=$NODE
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$SLURM_DIR/ctld
SlurmdSpoolDir=$SLURM_DIR/spool
SlurmctldPidFile=$SLURM_DIR/slurmctld.pid
SlurmdPidFile=$SLURM_DIR/slurmd.pid
SlurmctldLogFile=$SLURM_DIR/slurmctld.log
SlurmdLogFile=$SLURM_DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmdTimeout=300
InactiveLimit=0
KillWait=10
NodeName=$NODE CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=local Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF

# -- daemons -----------------------------------------------------------------------------------
if ! scontrol ping >/dev/null 2>&1; then
    log "starting slurmctld"
    rm -f "$SLURM_DIR/slurmctld.pid"
    slurmctld -f "$SLURM_CONF" -i
    STARTED+=("$SLURM_DIR/slurmctld.pid")
    for _ in $(seq 100); do scontrol ping >/dev/null 2>&1 && break; sleep 0.2; done
    scontrol ping >/dev/null 2>&1 || die "slurmctld did not come up (see $SLURM_DIR/slurmctld.log)"
fi
if [ ! -s "$SLURM_DIR/slurmd.pid" ] || ! kill -0 "$(cat "$SLURM_DIR/slurmd.pid")" 2>/dev/null; then
    log "starting slurmd"
    slurmd -f "$SLURM_CONF"
    STARTED=("$SLURM_DIR/slurmd.pid" "${STARTED[@]}")
fi
for _ in $(seq 150); do
    state=$(sinfo -h -n "$NODE" -o %T 2>/dev/null || true)
    case "$state" in idle*|mixed*|allocated*) break ;; esac
    sleep 0.2
done
log "node $NODE: ${state:-unknown} (sinfo: $(sinfo -h -o '%P %a %D %T' | tr '\n' ' '))"
case "$state" in idle*|mixed*|allocated*) ;; *) die "node $NODE is not up (see $SLURM_DIR/slurmd.log)";; esac

# -- the job -----------------------------------------------------------------------------------
OUT="$SLURM_DIR/jobs/pretrain_gpt_zb-%j.out"
JOBID=$(cd "$REPO" && sbatch --parsable --nodes=1 --output="$OUT" \
    --export=ALL,SCHEDULE="$SCHEDULE",ITERS="$ITERS",PP="$PP",MZB_REPO="$REPO",MASTER_PORT="${MASTER_PORT:-29531}" \
    scripts/slurm/pretrain_gpt_zb.sbatch)
OUT=${OUT//%j/$JOBID}
log "submitted job $JOBID (schedule $SCHEDULE, PP=$PP, $ITERS iterations); output: $OUT"
deadline=$(( $(date +%s) + JOB_TIMEOUT ))
while :; do
    state=$(scontrol show job "$JOBID" 2>/dev/null | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p' | head -n 1)
    case "$state" in
        COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|PREEMPTED|BOOT_FAIL|DEADLINE) break ;;
    esac
    if [ "$(date +%s)" -gt "$deadline" ]; then
        scancel "$JOBID" || true
        die "job $JOBID still $state after ${JOB_TIMEOUT}s (cancelled); output so far: $OUT"
    fi
    sleep 1
done
log "job $JOBID: $state"

# -- check the log -----------------------------------------------------------------------------
[ -f "$OUT" ] || die "no job output at $OUT"
losses=$(grep -o "iteration \+[0-9]\+/ \+[0-9]\+ |.*lm loss: [0-9.eE+-]*" "$OUT" | sed 's/.*lm loss: //' || true)
n=$(printf '%s\n' "$losses" | grep -c . || true)
first=$(printf '%s\n' "$losses" | head -n 1)
last=$(printf '%s\n' "$losses" | tail -n 1)
grep -o "megatron-zb: schedule .*installed.*" "$OUT" | head -n 1 || true
log "$n training iterations logged; lm loss $first -> $last"
[ "$state" = COMPLETED ] || { tail -n 30 "$OUT" >&2; die "job $JOBID ended $state"; }
[ "$n" -ge "$ITERS" ] || die "expected $ITERS logged iterations, found $n (see $OUT)"
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b + 0 < a + 0) }' || die "loss did not fall: $first -> $last"
log "OK: SLURM job trained with $SCHEDULE ($n iterations, loss $first -> $last)"
