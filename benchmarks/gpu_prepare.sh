#!/usr/bin/env bash
# Fill .gpu_carry/ (ignored by git) with what a bare GPU machine without network lacks for
# benchmarks/gpu_check.sh. The GPU image (Python 3.12) has torch, triton, cupy, tokenizers,
# safetensors and huggingface_hub, but not Ray or jsonschema, and older protobuf/grpcio/transformers
# than this checkout's generated code and tiny checkpoints need. So:
#
# - site-cp312.tar.xz (~34 MB; gpu_check.sh unpacks it only under Python 3.12): this checkout's
#   versions of transformers, gguf, protobuf, grpcio and Ray (+ jsonschema, which Ray imports) as
#   CPython 3.12 manylinux wheels, unpacked; Ray without its Java jars, dashboard UI and libraries
#   (data, train, tune, rllib, serve, llm), binaries stripped.
#   One call carries it with the checkout (64 MiB in all):
#     carry [".gpu_carry/site-cp312.tar.xz"], command "bash benchmarks/gpu_check.sh"
# - smollm2.part-* (98 MB in two parts), only with --smollm2: the SmolLM2 GGUF for the parity and
#   throughput rows that need a real model. It needs two more calls before the one that runs (the
#   machine keeps carried ignored paths while it stays warm, about 30 s):
#     call 1: carry [".gpu_carry/smollm2.part-aa"], command "true"
#     call 2: carry [".gpu_carry/smollm2.part-ab"], command "true"
#     call 3: carry [".gpu_carry/site-cp312.tar.xz"], command "bash benchmarks/gpu_check.sh"
#   Without them gpu_check reports the SmolLM2 rows NOT RUN and says why.
#
#   bash benchmarks/gpu_prepare.sh [--smollm2]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
rm -rf .gpu_carry && mkdir -p .gpu_carry "$WORK/wheels" "$WORK/site"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$WORK/wheels" "transformers==$(version transformers)" "gguf==$(version gguf)" \
    "protobuf==$(version protobuf)" "grpcio==$(version grpcio)" "ray==$(version ray)" \
    "jsonschema==$(version jsonschema)" "jsonschema-specifications==$(version jsonschema-specifications)" \
    "referencing==$(version referencing)" "rpds-py==$(version rpds-py)"
for wheel in "$WORK"/wheels/*.whl; do "$PY" -m zipfile -e "$wheel" "$WORK/site"; done
(cd "$WORK/site/ray" && rm -rf jars dashboard/client/build data train tune rllib serve llm)
find "$WORK/site" -type f \( -name '*.so' -o -path '*/ray/core/src/ray/*' \) -exec strip --strip-unneeded {} + 2>/dev/null || true
chmod -R u+rwX,go+rX "$WORK/site"
find "$WORK/site/ray/core/src/ray" -type f -exec chmod +x {} +
tar -C "$WORK/site" -cf - . | xz -T0 -6 > .gpu_carry/site-cp312.tar.xz
if [ "${1:-}" = "--smollm2" ]; then
    MODEL="$("$PY" -c "from shardserve.workers.model_source import resolve_model; print(resolve_model('smollm2-135m-instruct').path)")"
    split -b 50m "$MODEL" .gpu_carry/smollm2.part-
fi
du -sh .gpu_carry/*
