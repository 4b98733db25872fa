#!/usr/bin/env bash
# Correctness and speed of every Triton kernel in kernels/ against its torch reference, on one
# CUDA GPU (needs python3 with torch + triton). Prints max abs / relative error per case and
# achieved GB/s or TFLOP/s next to torch's time; exits non-zero on any mismatch. Without a GPU it
# says so and exits 0.
#   PYTHONPATH=. benchmarks/kernels_gpu.sh            # fp32 checks + bf16 checks and timings
#   PYTHONPATH=. benchmarks/kernels_gpu.sh --quick    # fp32 checks only
set -euo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 290 python3 benchmarks/kernels_gpu.py "$@"
