#!/usr/bin/env bash
# Stress check of the test suite itself: run the tests that measure time (marker `timing`) with
# the host loaded by busy processes beside them, several rounds, and report every failure.
#
#   bash scripts/stress_tests.sh [-b BUSY] [-r ROUNDS] [-w WARMUP_S] [pytest args...]
#
#   -b BUSY     busy loops beside the tests (default 4 x the cores: 8 on a 2-core box)
#   -r ROUNDS   how many times the tests run (default 3)
#   -w WARMUP_S seconds the busy loops run before the first round (default 20)
#   pytest args replace the selection (default: -m timing tests), e.g. -k pairs tests/test_core_pairing.py
#
# MZB_MCORE=0.19.2 runs them against the second megatron-core, as the test script's second pass.
# Every busy process it started is killed when it ends (trap on EXIT, INT, TERM), and one whose
# script is gone (SIGKILL) ends by itself.
# The environment must exist already (scripts/setup_env.sh): this script installs nothing.
# Exit status: 0 when every round passed.
set -uo pipefail
cd "$(dirname "$0")/.."
CORES=$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)  # (nproc obeys OMP_NUM_THREADS: 1 here)
BUSY=$((4 * CORES)); ROUNDS=3; WARMUP=20
while getopts "b:r:w:" opt; do
    case $opt in
        b) BUSY=$OPTARG ;; r) ROUNDS=$OPTARG ;; w) WARMUP=$OPTARG ;;
        *) sed -n '2,15p' "$0"; exit 2 ;;
    esac
done
shift $((OPTIND - 1))
[ $# -gt 0 ] || set -- -m timing tests
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
PY=.venv/bin/python

BUSY_PIDS=()
stop_busy() {
    local p
    for p in "${BUSY_PIDS[@]}"; do kill "$p" 2>/dev/null; done
    for p in "${BUSY_PIDS[@]}"; do wait "$p" 2>/dev/null; done
    BUSY_PIDS=()
}
trap stop_busy EXIT
trap 'stop_busy; exit 130' INT
trap 'stop_busy; exit 143' TERM
for _ in $(seq "$BUSY"); do
    # spins; every ~0.1 s checks that this script still runs (ends itself even after a SIGKILL)
    bash -c 'while kill -0 "$1" 2>/dev/null; do for i in {1..20000}; do :; done; done' busy $$ &
    BUSY_PIDS+=($!)
done
echo "== stress: $BUSY busy loops on $CORES cores (pids ${BUSY_PIDS[*]}); $ROUNDS rounds of: pytest $* =="
sleep "$WARMUP"

LOGDIR=$(mktemp -d "${TMPDIR:-/tmp}/mzb-stress.XXXXXX")
failed_rounds=0
start=$SECONDS
for r in $(seq "$ROUNDS"); do
    t0=$SECONDS
    load0=$(cut -d' ' -f1-3 /proc/loadavg)
    rc=0
    $PY -m pytest -q -p no:cacheprovider -rf "$@" >"$LOGDIR/round$r.log" 2>&1 || rc=$?
    load1=$(cut -d' ' -f1-3 /proc/loadavg)
    summary=$(tail -n 1 "$LOGDIR/round$r.log")
    echo "round $r: exit $rc, $((SECONDS - t0)) s, load average $load0 -> $load1: $summary"
    if [ "$rc" -ne 0 ]; then
        failed_rounds=$((failed_rounds + 1))
        grep -E '^(FAILED|ERROR) ' "$LOGDIR/round$r.log" | sed 's/^/    /'
    fi
done
stop_busy
echo "== stress: $failed_rounds of $ROUNDS rounds failed, $((SECONDS - start)) s; logs in $LOGDIR =="
[ "$failed_rounds" -eq 0 ]
