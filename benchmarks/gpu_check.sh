#!/usr/bin/env bash
# Everything GPU-side in one call, on one CUDA GPU, in under 8 minutes: the Triton kernels against
# their references (timed), placement of every tensor on the GPU, parity with transformers (tiny
# Llama / DeepSeek-V3 / V3.2 / GLM-5 in fp32 and bf16, FP8 kept in FP8, SmolLM2 bf16), the NCCL
# communicator, CUDA-graph decode == eager, KV sizing by --gpu-memory-utilization, and decode
# tok/s at batch 1/32/256 with the fraction of HBM bandwidth. See benchmarks/gpu_check.py.
#
#   bash benchmarks/gpu_check.sh                 # on a GPU machine; exit 1 on any failure
#   bash benchmarks/gpu_check.sh --quick         # without the timed bf16 kernel cases and throughput
#   bash benchmarks/gpu_check.sh --cpu-dry-run   # the same script on CPU (tests/kernels/test_gpu_check.py)
#
# Python: $PYTHON, else python3 when it has torch + triton, else the project's .venv. Where shardserve
# is not installed (a bare GPU machine), a shim folder maps shardserve.{cluster,workers,kernels,proto}
# to this checkout. Wheels and the SmolLM2 file carried in .gpu_carry/ (benchmarks/gpu_prepare.sh)
# are installed/placed first.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
PY="${PYTHON:-python3}"
if [ -z "${PYTHON:-}" ] && ! "$PY" -c "import torch, triton" 2>/dev/null && [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
fi
if ! "$PY" -c "import torch, triton" 2>/dev/null; then
    echo "gpu_check: $PY cannot import torch and triton; set PYTHON=/path/to/python or run 'make install'" >&2
    exit 2
fi
if [ -d .gpu_carry/wheels ] && ls .gpu_carry/wheels/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_check_site \
        .gpu_carry/wheels/*.whl
    export PYTHONPATH="/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ls .gpu_carry/smollm2.part-* >/dev/null 2>&1; then
    export SHARDSERVE_CACHE="${SHARDSERVE_CACHE:-/tmp/gpu_check_cache}"
    mkdir -p "$SHARDSERVE_CACHE/smollm2-135m-instruct"
    cat .gpu_carry/smollm2.part-* > "$SHARDSERVE_CACHE/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
fi
if ! "$PY" -c "import shardserve.workers" 2>/dev/null; then
    SHIM="$(mktemp -d)/shim"
    mkdir -p "$SHIM/shardserve"
    for pkg in cluster workers kernels proto; do ln -s "$ROOT/$pkg" "$SHIM/shardserve/$pkg"; done
    export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
fi
if [[ " $* " == *" --cpu-dry-run "* ]]; then
    export TRITON_INTERPRET=1       # before Triton is first imported
else
    unset TRITON_INTERPRET
fi
export PYTHONUNBUFFERED=1
exec timeout 470 "$PY" benchmarks/gpu_check.py "$@"
