#!/usr/bin/env bash
# Correctness and speed of every Triton kernel in kernels/ against its torch reference, on one
# CUDA GPU (needs a python with torch + triton: $PYTHON, python3, or the project's .venv). Prints
# max abs / relative error per case and achieved GB/s or TFLOP/s next to torch's time; exits
# non-zero on any mismatch. Without a GPU it says so and exits 0.
#   PYTHONPATH=. benchmarks/kernels_gpu.sh            # fp32 checks + bf16 checks and timings
#   PYTHONPATH=. benchmarks/kernels_gpu.sh --quick    # fp32 checks only
set -euo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
# Interpreter: $PYTHON if set, else python3 when it has torch + triton, else the project's .venv.
PY="${PYTHON:-python3}"
if [ -z "${PYTHON:-}" ] && ! "$PY" -c "import torch, triton" 2>/dev/null && [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
fi
if ! "$PY" -c "import torch, triton" 2>/dev/null; then
    echo "kernels_gpu: $PY cannot import torch and triton; set PYTHON=/path/to/python or run 'make install'" >&2
    exit 2
fi
exec timeout 290 "$PY" benchmarks/kernels_gpu.py "$@"
