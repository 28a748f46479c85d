#!/usr/bin/env bash
# Every figure only a GPU gives, in one run of at most 8 minutes on one H100 (issue 36):
# benchmarks/gpu_check.py does the work; this script only finds Python and megatron-core.
#
#   bash scripts/gpu_check.sh --fetch-wheels     # here, with network: megatron-core for the GPU's Python into .whl/
#   bash scripts/gpu_check.sh --dry-run OUTDIR   # on a CPU: wheels, command lines, output paths (CI runs it)
#   bash scripts/gpu_check.sh OUTDIR [--sections offload,postval ...]   # on the GPU machine
#
# Writes OUTDIR/gpu_check.json, OUTDIR/gpu_check.md, OUTDIR/gpu_check.log. On a machine without
# megatron-core (the GPU machine: no network) the wheels in .whl/ (MZB_WHEELS) are installed into
# a private folder (MZB_SITE, default /tmp/mzb-site) first, no index, no dependencies.
# Environment: PYTHON (default .venv/bin/python, else python3), MZB_MCORE_VERSION for --fetch-wheels
# (default 0.19.2), MZB_GPU_PYTHON (default 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
WHEELS=${MZB_WHEELS:-.whl}
GPU_PY=${MZB_GPU_PYTHON:-3.12}

if [ "${1:-}" = "--fetch-wheels" ]; then
    [ $# -eq 1 ] || { echo "gpu_check.sh: --fetch-wheels takes no other argument" >&2; exit 2; }
    mkdir -p "$WHEELS"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$GPU_PY" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$WHEELS" "megatron-core==${MZB_MCORE_VERSION:-0.19.2}"
    ls -l "$WHEELS"
    exit 0
fi

if ! "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('megatron.core') is None)" >/dev/null 2>&1; then
    if compgen -G "$WHEELS/megatron_core-*.whl" >/dev/null; then
        SITE=${MZB_SITE:-/tmp/mzb-site}
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            "$WHEELS"/megatron_core-*.whl
        export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    fi
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONUNBUFFERED=1
exec "$PY" benchmarks/gpu_check.py "$@"
