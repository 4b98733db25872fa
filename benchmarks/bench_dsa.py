"""DSA decode step time vs context length, DSA on vs off (dense MLA), on a tiny DeepSeek-V3.2
checkpoint written by transformers (index_topk 512), on CPU.

For each context (1k, 4k, 16k tokens) one sequence is prefilled in chunks, then ``--steps``
decode steps are timed. With DSA each query attends to at most 512 keys, so the attention part
stays flat while the indexer scan grows slowly; dense attention grows with the context. A third
run keeps the indexer keys in the fp8 cache format (``--indexer-cache-dtype fp8``); the cache
bytes per token of each variant are printed first.
Run with ``make bench``; not a test.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "models"))
from plan_driver import PlanDriver, make_runner  # noqa: E402
from tiny_checkpoints import write_tiny_checkpoint  # noqa: E402


BLOCK_SIZE = 64
VARIANTS = {"DSA on": {}, "DSA fp8 cache": {"indexer_cache_dtype": "fp8"}, "dense": {"dsa": False}}


def decode_ms(path: Path, context: int, steps: int, chunk: int = 512, **switches) -> float:
    runner = make_runner(path, block_size=BLOCK_SIZE, num_blocks=context // BLOCK_SIZE + 8, **switches)
    driver = PlanDriver(runner)
    prompt = torch.randint(2, 120, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    for start in range(0, context, chunk):
        last = driver.step({"s": prompt[start:start + chunk]})["s"]
    token = int(last.argmax())
    driver.step({"s": [token]})  # warm-up
    started = time.perf_counter()
    for _ in range(steps):
        token = int(driver.step({"s": [token]})["s"].argmax())
    return (time.perf_counter() - started) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--contexts", default="1024,4096,16384")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        # Head and indexer sizes keep DeepSeek-V3.2's ratio (attention per key >> indexer per key).
        write_tiny_checkpoint("deepseek_v32", tmp, seed=0, index_topk=512, max_position_embeddings=max(contexts) + 64,
                              hidden_size=256, num_attention_heads=32, num_key_value_heads=32, kv_lora_rank=256,
                              qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32, index_n_heads=4,
                              index_head_dim=64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        print(f"DeepSeek-V3.2 shape (32 heads, kv_lora 256, 4x64 indexer), 2 layers, index_topk 512, "
              f"torch threads {torch.get_num_threads()}")
        for name, switches in VARIANTS.items():
            per_token = make_runner(Path(tmp), block_size=BLOCK_SIZE, num_blocks=1, **switches).bytes_per_block
            print(f"{name:>14}: {per_token // BLOCK_SIZE} cache bytes per token (float32 latent)")
        print(f"{'context':>8} | " + " | ".join(f"{name + ' ms':>16}" for name in VARIANTS)
              + f" | {'dense / DSA':>11} | {'dense / fp8':>11}")
        for context in contexts:
            ms = {name: decode_ms(Path(tmp), context, args.steps, **switches) for name, switches in VARIANTS.items()}
            print(f"{context:>8} | " + " | ".join(f"{value:>16.2f}" for value in ms.values())
                  + f" | {ms['dense'] / ms['DSA on']:>10.2f}x | {ms['dense'] / ms['DSA fp8 cache']:>10.2f}x",
                  flush=True)


if __name__ == "__main__":
    main()
