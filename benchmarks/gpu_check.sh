#!/usr/bin/env bash
# Everything GPU-side in one call, on one CUDA GPU, in under 8 minutes, ending in a PASS / FAIL /
# NOT RUN table (every model and check in its own try block; NOT RUN is never a pass): tensor
# placement, parity with transformers, NCCL, CUDA-graph decode == eager for every model family and
# for seeded sampling, MTP speculation == none, the Ray worker group with async scheduling, KV sizing,
# a DeepSeek-V3.2 layer at 32K context, every Triton kernel against its reference and captured in a
# CUDA graph (timed, with its fraction of HBM bandwidth), decode throughput. See benchmarks/gpu_check.py.
#
#   bash benchmarks/gpu_check.sh                 # on a GPU machine; exit 1 on any FAIL
#   bash benchmarks/gpu_check.sh --quick         # without the timed bf16 kernel cases and throughput
#   bash benchmarks/gpu_check.sh --cpu-dry-run   # the same script on CPU (tests/kernels/test_gpu_check.py)
#   bash benchmarks/gpu_check.sh --only graphs,kernels --skip smollm2 ...   # see --help
#
# Python: $PYTHON, else python3 when it has torch + triton, else the project's .venv. Where shardserve
# is not installed (a bare GPU machine), a shim folder maps shardserve.{cluster,workers,kernels,proto}
# to this checkout. The packages and the SmolLM2 file carried in .gpu_carry/ (benchmarks/gpu_prepare.sh)
# are unpacked/placed first.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
PY="${PYTHON:-python3}"
# Finds the modules without importing them (importing torch costs seconds per probe).
has() { "$PY" -c "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in sys.argv[1:]))" "$@" 2>/dev/null; }
if [ -z "${PYTHON:-}" ] && ! has torch triton && [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
fi
if ! has torch triton; then
    echo "gpu_check: $PY cannot import torch and triton; set PYTHON=/path/to/python or run 'make install'" >&2
    exit 2
fi
# The carried packages are built for one CPython (the GPU image's): used only by that version.
SITE=".gpu_carry/site-cp$("$PY" -c 'import sys; print("%d%d" % sys.version_info[:2])').tar.xz"
if [ -f "$SITE" ]; then
    rm -rf /tmp/gpu_check_site && mkdir -p /tmp/gpu_check_site
    tar -C /tmp/gpu_check_site -xJf "$SITE"
    export PYTHONPATH="/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ls .gpu_carry/smollm2.part-* >/dev/null 2>&1; then
    export SHARDSERVE_CACHE="${SHARDSERVE_CACHE:-/tmp/gpu_check_cache}"
    mkdir -p "$SHARDSERVE_CACHE/smollm2-135m-instruct"
    cat .gpu_carry/smollm2.part-* > "$SHARDSERVE_CACHE/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
fi
if ! has shardserve.workers; then
    SHIM="$(mktemp -d)/shim"
    mkdir -p "$SHIM/shardserve"
    for pkg in cluster workers kernels proto; do ln -s "$ROOT/$pkg" "$SHIM/shardserve/$pkg"; done
    export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
if [[ " $* " == *" --cpu-dry-run "* ]]; then
    export TRITON_INTERPRET=1       # before Triton is first imported
    exec "$PY" benchmarks/gpu_check.py "$@"
fi
unset TRITON_INTERPRET
# Sections that would start after GPU_CHECK_BUDGET_S (420 s) are reported NOT RUN; this is the last resort.
rc=0
timeout 470 "$PY" benchmarks/gpu_check.py "$@" || rc=$?
if [ "$rc" = 124 ]; then
    echo "gpu_check: FAIL: killed at the 470 s limit; the table was not printed (see the lines above)"
    exit 1
fi
exit "$rc"
