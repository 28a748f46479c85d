#!/usr/bin/env bash
# Install everything (idempotent) and run the whole test suite:
#   1. the schedule core, CLI and everything else on megatron-core 0.16.1;
#   2. the megatron-dependent tests again on megatron-core 0.19.2 (but those marked version_free:
#      megatron-zb's own process handling, e.g. the launch timeout's 45 s wait), and the training
#      entry point's tests (Megatron-LM's pretrain(), which only 0.19.2's wheel ships).
# The passes run as eight pytest processes side by side (MZB_TEST_SERIAL=1: one after the other):
# pass 1's single-process tests (-m "not dist": the schedule core's test_core_* in two halves by file
# name, and the others) and its
# multi-process ones (-m dist) in two halves by file name (test_a* to test_o*, test_p* to test_z*);
# pass 2's entry-point trainings (ENTRY_FILES: one torchrun job after another, test_pretrain_entry.py
# and the other three) and the rest of it. The multi-rank tests wait on each other's messages and on
# process start-up much of the time, so several streams keep a 2-core machine's cores busy where two
# left them idle; and a stream that runs one process at a time (the single-process tests, a torchrun
# job after another) gets a smaller share of the cores than one whose ranks run side by side, so
# those come in parts, none left alone at the end. Each stream's output is printed when all have
# finished, with its time. The entry-point stream starts no warm zygote servers (tests/conftest.py):
# its torchrun jobs import for themselves, and none of its tests launches through verify.
#   bash scripts/run_tests.sh                    # everything (what CI runs)
#   bash scripts/run_tests.sh tests/test_plan.py -k quick   # arguments: the two passes on what they select
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${MZB_SKIP_SETUP:-0}" = 1 ] || bash scripts/setup_env.sh  # MZB_SKIP_SETUP=1: the environment exists
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
PY=.venv/bin/python
# the package's and the tests' bytecode once, here: with PYTHONDONTWRITEBYTECODE set (as on these
# machines) every process of the suite (ranks, launchers, CLI calls: hundreds) would compile them again
$PY -m compileall -q -j 0 megatron_zb tests >/dev/null
# and pytest's own: it rewrites the asserts of every test module and of its plugins' packages
# (hypothesis's hundred modules) in each of its processes unless it may keep the result beside them
unset PYTHONDONTWRITEBYTECODE
ENTRY_FILES=(tests/test_pretrain_entry.py tests/test_pretrain_faults.py tests/test_varlen_entry.py tests/test_dropin.py)
PASS2_MARK="megatron and not version_free"

pass1() { $PY -m pytest -q -p no:cacheprovider "$@"; }
pass2() {
    local rc=0
    MZB_MCORE=0.19.2 $PY -m pytest -q -p no:cacheprovider -m "$PASS2_MARK" "$@" || rc=$?
    if [ "$rc" -eq 5 ]; then echo "(no megatron tests selected)"; rc=0; fi
    return "$rc"
}

if [ $# -gt 0 ]; then  # the caller's selection: each pass once on it
    NAMES=("megatron-core 0.16.1" "megatron-core 0.19.2: megatron tests")
    CMDS=("pass1 $(printf '%q ' "$@")" "pass2 $(printf '%q ' "$@")")
else
    ignore=(); for f in "${ENTRY_FILES[@]}"; do ignore+=("--ignore=$f"); done
    NAMES=("megatron-core 0.16.1: single-process tests of the schedule core a-o (test_core_[a-o]*)"
           "megatron-core 0.16.1: single-process tests of the schedule core p-z (test_core_[p-z]*)"
           "megatron-core 0.16.1: the other single-process tests"
           "megatron-core 0.16.1: multi-process tests a-o" "megatron-core 0.16.1: multi-process tests p-z"
           "megatron-core 0.19.2: training entry point (test_pretrain_entry)"
           "megatron-core 0.19.2: training entry point (faults, variable lengths, drop-in)"
           "megatron-core 0.19.2: the other megatron tests")
    CMDS=("pass1 -m 'not dist' tests/test_core_[a-o]*.py" "pass1 -m 'not dist' tests/test_core_[p-z]*.py"
          "pass1 -m 'not dist' tests --ignore-glob='tests/test_core_*'"
          "pass1 -m dist tests --ignore-glob='tests/test_[p-z]*'"
          "pass1 -m dist tests --ignore-glob='tests/test_[a-o]*'"
          "MZB_ZYGOTE_SERVER=0 pass2 ${ENTRY_FILES[0]}" "MZB_ZYGOTE_SERVER=0 pass2 ${ENTRY_FILES[*]:1}"
          "pass2 tests ${ignore[*]}")
fi

stream() {  # one stream: its command, then its exit code, time and CPU seconds (every process it waited for)
    local t=$SECONDS rc=0
    eval "$1" || rc=$?
    local f; f=$(mktemp)
    times >"$f"  # (a builtin's own output: in a subshell it would count none of this shell's processes)
    echo "== stream exit $rc after $((SECONDS - t)) s; CPU user and system: $(tail -1 "$f") =="
    rm -f "$f"
    return "$rc"
}
start=$SECONDS
logs=(); pids=(); rcs=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; rm -f "${logs[@]}"' EXIT
for i in "${!CMDS[@]}"; do
    logs+=("$(mktemp)")
    if [ "${MZB_TEST_SERIAL:-0}" = 1 ]; then
        rc=0; stream "${CMDS[$i]}" >"${logs[$i]}" 2>&1 || rc=$?; rcs[$i]=$rc
    else
        stream "${CMDS[$i]}" >"${logs[$i]}" 2>&1 &
        pids[$i]=$!
    fi
done
echo "== ${#CMDS[@]} test streams running: ${NAMES[*]} =="
status=0; summary=""
for i in "${!CMDS[@]}"; do
    if [ -n "${pids[$i]:-}" ]; then rc=0; wait "${pids[$i]}" || rc=$?; rcs[$i]=$rc; fi
    echo "== ${NAMES[$i]} =="
    cat "${logs[$i]}"
    [ "${rcs[$i]}" -eq 0 ] || status=1
    summary+="${NAMES[$i]}: exit ${rcs[$i]}; "
done
pids=()
echo "== test streams: ${summary}all in $((SECONDS - start)) s =="
exit "$status"
