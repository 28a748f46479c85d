#!/usr/bin/env bash
# Create .venv with everything megatron-zb needs on a CPU machine of this kind:
#   torch 2.13.0 (pinned first: a local CPU wheel; never let pip pick another torch),
#   megatron-core 0.16.1 (installs normally on Python 3.11) and
#   megatron-core 0.19.2 in .venv/mcore-0.19.2 (declares Python>=3.12 but runs on 3.11;
#   put that folder first on PYTHONPATH to use it: MZB_MCORE=0.19.2 in the tests).
# Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
# Three installs at once (each keeps one core busy; they share no package): torch with its own
# dependencies, the libraries the tests and plots use, and megatron-core 0.19.2 into its folder.
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done' EXIT
$PIP install torch==2.13.0 & pids+=($!)
$PIP install "packaging>=24.2" numpy scipy matplotlib pytest hypothesis psutil & pids+=($!)
if [ ! -d "$VENV/mcore-0.19.2/megatron/core" ]; then
    $PIP install --no-deps --python-version 3.12 --only-binary=:all: --ignore-requires-python \
        --target "$VENV/mcore-0.19.2" megatron-core==0.19.2 & pids+=($!)
fi
for p in "${pids[@]}"; do wait "$p"; done  # (set -e: a failed install ends the script here)
pids=()
# then megatron-core 0.16.1 (it needs torch: already there, the pin keeps it) and this package
$PIP install "megatron-core==0.16.1" "packaging>=24.2" numpy typing_extensions psutil "torch==2.13.0" & pids+=($!)
$PIP install --no-deps -e . & pids+=($!)
for p in "${pids[@]}"; do wait "$p"; done
pids=()
# the package's bytecode, as pip writes it for an install that is not editable: every process that
# imports it (a plan, each rank of a run) then skips compiling its sources (0.1 CPU s of plan's 0.2 s
# of imports where PYTHONDONTWRITEBYTECODE is set, as on these machines)
"$VENV/bin/python" -m compileall -q -j 0 megatron_zb >/dev/null
echo "environment ready: $VENV (torch $($VENV/bin/python -c 'import torch; print(torch.__version__)'))"
