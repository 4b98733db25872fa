"""The CPU packed matmuls against a dense bfloat16 ``F.linear`` on the same weight, by row count.

The packed kernels (``kernels/packed_linear.py``: ``_weight_int4pack_mm_for_cpu``,
``_weight_int8pack_mm``) win at one row (decode at batch 1: they read 4 / 8 bits a weight), but
their time grows about linearly with the rows ``M`` of the input, while the dense GEMM (oneDNN; AMX
tiles where the CPU has them) barely grows: prefill chunks, verify steps and large decode batches
cross over. Prints ms per call for SmolLM2-135M's matrix shapes (QKV, O, gate/up, down and the
tied 49152 x 576 LM head) at ``M`` = 1, 8, 32, 128, one torch thread by default, and the ratio
dense / packed (below 1: dense is faster). Weights are random (the kernels' time does not depend on
the values). Not a test: ``python benchmarks/bench_packed_linear.py [--threads N]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shardserve.workers.layers.quantized import PackedWeight  # noqa: E402
from shardserve.workers.quantization import quantize_int4, quantize_int8  # noqa: E402

# SmolLM2-135M: hidden 576, 9 query + 3 KV heads of 64, intermediate 1536, vocab 49152
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}
ROWS = (1, 8, 32, 128)


def per_call_ms(fn, min_seconds: float = 0.2) -> float:
    """Mean ms per call of ``fn`` over at least ``min_seconds`` of calls (after one warm-up call)."""
    fn()
    calls, started = 0, time.perf_counter()
    while time.perf_counter() - started < min_seconds:
        fn()
        calls += 1
    return (time.perf_counter() - started) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"ms per call, {args.threads} thread(s); ratio = dense bf16 / packed (below 1: dense is faster)")
    print(f"{'weight':>8} {'kind':>5} " + " ".join(f"{'M=' + str(m):>22}" for m in ROWS))
    for name, (rows, cols) in SHAPES.items():
        weight = torch.randn(rows, cols) * 0.02
        dense = weight.to(torch.bfloat16)
        kind = "int8" if name == "lm_head" else "int4"   # GGUF Q8_0 embedding / head, Q4 layers
        packed = PackedWeight(quantize_int8(weight) if kind == "int8" else quantize_int4(weight), torch.bfloat16)
        cells = []
        for m in ROWS:
            x = torch.randn(m, cols).to(torch.bfloat16)
            p_ms, d_ms = per_call_ms(lambda: packed.matmul(x)), per_call_ms(lambda: F.linear(x, dense))
            cells.append(f"{p_ms:7.3f} / {d_ms:7.3f} {d_ms / p_ms:4.2f}")
        print(f"{name:>8} {kind:>5} " + " ".join(f"{c:>22}" for c in cells), flush=True)
    print("cells: packed ms / dense ms, ratio")


if __name__ == "__main__":
    main()
