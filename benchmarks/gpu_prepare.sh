#!/usr/bin/env bash
# Fill .gpu_carry/ (ignored by git) with what a bare GPU machine without network lacks for
# benchmarks/gpu_check.sh: the pure-Python wheels of this checkout's transformers and gguf versions
# (the GPU image has torch, triton, cupy, tokenizers, safetensors, huggingface_hub), and the SmolLM2
# GGUF (98 MB) cut in two parts, since one call may carry 64 MiB:
#
#   bash benchmarks/gpu_prepare.sh
#   call 1: carry [".gpu_carry/wheels", ".gpu_carry/smollm2.part-aa"], command "true" (the machine
#           keeps ignored paths while it stays warm, about 30 s)
#   call 2: carry [".gpu_carry/smollm2.part-ab"], command "bash benchmarks/gpu_check.sh"
#
# Without the model parts gpu_check skips the SmolLM2 sections (and says so); everything else runs
# from the wheels alone (one call).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
rm -rf .gpu_carry && mkdir -p .gpu_carry/wheels
"$PY" -m pip download -q --no-deps --only-binary=:all: -d .gpu_carry/wheels \
    "transformers==$(version transformers)" "gguf==$(version gguf)"
MODEL="$("$PY" -c "from shardserve.workers.model_source import resolve_model; print(resolve_model('smollm2-135m-instruct').path)")"
split -b 50m "$MODEL" .gpu_carry/smollm2.part-
du -sh .gpu_carry/wheels .gpu_carry/smollm2.part-*
