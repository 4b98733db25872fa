"""Long-context prefill and decode on MLA / DSA (issue 25): seconds and peak memory vs context.

Two parts, each printing one row per context and the growth exponent ``d log(y) / d log(context)``
between consecutive contexts (1 = linear, 0 = flat, 2 = quadratic):

``layer``: one DeepSeek-V3.2-shaped attention layer, TP=8 slice (16 of 128 heads, kv_lora 512,
  rope 64, nope 128, v 128, q_lora 1536, hidden 7168; indexer 64 heads x 128, top-k 2048), random
  weights, float32 on CPU (bf16 on CUDA). Per context S: one prefill step of ``--chunk`` tokens at
  positions ``S - chunk .. S - 1`` (the last chunk of a long prompt; the cache holds random rows)
  and one decode step of ``--decode-batch`` sequences at context S, with DSA (sparse) and without
  (dense MLA: absorbed below 171 queries per sequence, expanded at or above). Peak memory is what
  the step allocates beyond the caches (CUDA: allocator peak; CPU: resident-set peak).
``short``: contexts within top-k, where DSA keeps every key and the dense path runs instead:
  dense vs sparse-over-every-key attention on the same inputs (is the fallback faster?). On CPU
  (float32, torch references) sparse over every key measured 3.4x the dense time at 256 tokens
  and 11x at 1,024, so the dense fallback stays.
``tiny``: the issue's setup, a tiny DeepSeek-V3.2 checkpoint (2 layers, index_topk 8) with a
  65,536-position RoPE table through the single-process engine (2,048-token steps, float32): a
  whole prompt of S tokens, prefill seconds and peak memory, DSA vs ``--no-dsa``. The issue
  measured the old dense-masked code here: 4,096 tokens 0.80 GiB / 1.6 s; 32,768 tokens 3.55 GiB /
  77.9 s.

    .venv/bin/python benchmarks/bench_long_context.py                      # CPU, both parts
    .venv/bin/python benchmarks/bench_long_context.py --part layer --device cuda --chunk 2048 \\
        --contexts 1024,4096,16384,65536,131072

Not a test: timings on a shared machine are noisy; compare rows of one run.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "models"))

from shardserve.workers.forward_context import AttentionMetadata, forward_context  # noqa: E402
from shardserve.workers.layers.rotary import RotaryEmbedding  # noqa: E402
from shardserve.workers.models.dsa_indexer import DSAIndexer  # noqa: E402
from shardserve.workers.models.mla import MLAAttention  # noqa: E402
from shardserve.workers.models.paged_batch import PagedBatch  # noqa: E402

BLOCK = 64
# DeepSeek-V3.2-Exp config.json (attention part).
V32 = dict(hidden_size=7168, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
           qk_rope_head_dim=64, v_head_dim=128, index_n_heads=64, index_head_dim=128, index_topk=2048,
           rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                            "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                            "mscale": 1.0, "mscale_all_dim": 1.0})
TP = 8


class Meter:
    """Seconds and peak bytes of a call (CUDA allocator peak, else the resident-set high-water mark)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @staticmethod
    def _status(key: str) -> int:
        return int(re.search(key + r":\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024

    def __call__(self, fn) -> tuple[float, int]:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            base = self._status("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")
        started = time.perf_counter()
        fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return time.perf_counter() - started, torch.cuda.max_memory_allocated() - base
        return time.perf_counter() - started, self._status("VmHWM") - base


def build_layer(dsa: bool, max_len: int, dtype: torch.dtype, device: torch.device) -> MLAAttention:
    """The V3.2 attention layer of rank 0 of 8, random weights (unit-variance outputs)."""
    from transformers import DeepseekV32Config

    config = DeepseekV32Config(**V32, num_hidden_layers=1, vocab_size=128, max_position_embeddings=max_len)
    rotary = RotaryEmbedding(config, config.qk_rope_head_dim, max_len).to(device)
    indexer = DSAIndexer(config, rope_interleaved=False, hadamard=True, dtype=dtype) if dsa else None
    layer = MLAAttention(config, (0, config.num_attention_heads // TP), rotary, True, indexer, False, dtype)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[-1]))
            else:
                param.fill_(0.0 if name.endswith("bias") else 1.0)
    return layer.to(device)


def attach_caches(layer: MLAAttention, max_len: int, num_seqs: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Caches for ``num_seqs`` sequences of ``max_len`` tokens holding random rows; returns the
    block tables ``[num_seqs, max_len / BLOCK]``."""
    blocks = -(-max_len // BLOCK)
    caches = []
    for shape, cache_dtype in layer.cache_spec(num_seqs * blocks, BLOCK):
        caches.append(torch.randn(shape, dtype=torch.float32, device=device).to(cache_dtype))
    layer.kv_cache = tuple(caches)
    return torch.arange(num_seqs * blocks, dtype=torch.int32, device=device).view(num_seqs, blocks)


def metadata(tables: torch.Tensor, seq_lens: list[int], query_lens: list[int], device) -> AttentionMetadata:
    positions = [p for length, q in zip(seq_lens, query_lens) for p in range(length - q, length)]
    seq_of = [b for b, q in enumerate(query_lens) for _ in range(q)]
    slots = [int(tables[b, p // BLOCK]) * BLOCK + p % BLOCK for b, p in zip(seq_of, positions)]
    query_start = [0]
    for q in query_lens:
        query_start.append(query_start[-1] + q)
    ints = lambda values: torch.tensor(values, dtype=torch.int64, device=device)  # noqa: E731
    return AttentionMetadata(ints(slots), ints(positions), ints(query_start), ints(seq_lens), tables,
                             max(query_lens), max(seq_lens), query_start_host=query_start, seq_lens_host=seq_lens)


@torch.inference_mode()
def layer_step(layer: MLAAttention, meta: AttentionMetadata, top_k: int | None, dtype, device) -> None:
    hidden = torch.randn(meta.positions.shape[0], V32["hidden_size"], dtype=dtype, device=device)
    with forward_context(meta):
        layer(meta.positions, hidden, PagedBatch.build(meta, BLOCK), None, top_k)


def exponents(xs: list[int], ys: list[float]) -> list[str]:
    out = [""]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        out.append(f"{math.log(max(y1, 1e-9) / max(y0, 1e-9)) / math.log(x1 / x0):+.2f}")
    return out


def run_layer(args, device: torch.device, dtype: torch.dtype) -> None:
    contexts = args.contexts
    print(f"\nV3.2 attention layer, TP={TP} slice ({V32['num_attention_heads'] // TP} heads), {dtype}, {device}, "
          f"prefill step of {args.chunk} tokens at the end of the context, decode batch {args.decode_batch}")
    meter = Meter(device)
    for dsa in (True, False):
        layer = build_layer(dsa, max(contexts) + 8, dtype, device)
        top_k = V32["index_topk"] if dsa else None
        tables = attach_caches(layer, max(contexts), args.decode_batch, dtype, device)
        rows = []
        for context in contexts:
            prefill = metadata(tables[:1], [context], [min(args.chunk, context)], device)
            layer_step(layer, prefill, top_k, dtype, device)                 # warm-up (Triton compiles)
            seconds, peak = meter(lambda: layer_step(layer, prefill, top_k, dtype, device))
            decode = metadata(tables, [context] * args.decode_batch, [1] * args.decode_batch, device)
            layer_step(layer, decode, top_k, dtype, device)
            decode_s = min(meter(lambda: layer_step(layer, decode, top_k, dtype, device))[0] for _ in range(3))
            rows.append((context, seconds, peak, decode_s))
        name = "DSA (sparse)" if dsa else "dense MLA"
        ctx = [r[0] for r in rows]
        exp_t, exp_m, exp_d = (exponents(ctx, [r[i] for r in rows]) for i in (1, 2, 3))
        print(f"{name:>13} {'context':>8} {'prefill s':>10} {'exp':>6} {'peak MiB':>9} {'exp':>6} "
              f"{'decode ms':>10} {'exp':>6}")
        for (context, seconds, peak, decode_s), et, em, ed in zip(rows, exp_t, exp_m, exp_d):
            print(f"{'':>13} {context:>8} {seconds:>10.3f} {et:>6} {peak / 2**20:>9.1f} {em:>6} "
                  f"{decode_s * 1e3:>10.2f} {ed:>6}")
        del layer, tables
        if device.type == "cuda":
            torch.cuda.empty_cache()


@torch.inference_mode()
def run_short(args, device: torch.device, dtype: torch.dtype) -> None:
    """Contexts within top-k (every key selected): the dense prefill DSA falls back to (absorbed
    under 171 queries per sequence, expanded from there) against the sparse form over a top-k list
    holding every causal key, on the same queries and cache (attention only, without projections)."""
    print(f"\nwithin top-k: one-shot prompt of C tokens, attention only (V3.2 layer slice, {dtype}, {device})")
    print(f"{'context':>8} {'dense s':>9} {'sparse s':>9} {'sparse/dense':>13}")
    meter = Meter(device)
    layer = build_layer(False, max(args.short_contexts) + 8, dtype, device)
    tables = attach_caches(layer, max(args.short_contexts), 1, dtype, device)
    for context in args.short_contexts:
        meta = metadata(tables[:1], [context], [context], device)
        batch = PagedBatch.build(meta, BLOCK)
        heads, nope, rope = layer.num_heads, layer.nope_dim, layer.rope_dim
        q_nope = torch.randn(context, heads, nope, dtype=dtype, device=device)
        q_pe = torch.randn(context, heads, rope, dtype=dtype, device=device)
        positions = torch.arange(context, device=device)
        every_key = torch.where(positions[None, :] <= positions[:, None], positions[None, :], -1).to(torch.int32)
        times = []
        for topk in (None, every_key):
            if device.type == "cuda":
                layer._prefill(q_nope, q_pe, meta, batch, topk)                          # warm-up (Triton compiles)
            times.append(meter(lambda: layer._prefill(q_nope, q_pe, meta, batch, topk))[0])
        print(f"{context:>8} {times[0]:>9.3f} {times[1]:>9.3f} {times[1] / times[0]:>13.2f}")


def run_tiny(args) -> None:
    from tiny_checkpoints import write_tiny_checkpoint

    from shardserve.cluster.config import EngineArgs
    from shardserve.cluster.engine.request import SamplingParams
    from shardserve.cluster.llm import LLM

    print("\ntiny DeepSeek-V3.2 (2 layers, index_topk 8), 65,536-position RoPE table, engine, 2,048-token steps, "
          "float32, CPU: whole-prompt prefill")
    meter = Meter(torch.device("cpu"))
    with tempfile.TemporaryDirectory() as tmp:
        write_tiny_checkpoint("deepseek_v32", tmp, seed=0, max_position_embeddings=65536, tokenizer=True)
        for dsa in (True, False):
            llm = LLM(EngineArgs(model=tmp, block_size=16, num_blocks=max(args.tiny_contexts) // 16 + 8, dsa=dsa,
                                 max_num_batched_tokens=2048), progress=False)
            params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
            rows = []
            for context in args.tiny_contexts:
                prompt = torch.randint(2, 128, (context,), generator=torch.Generator().manual_seed(context)).tolist()
                rows.append((context, *meter(lambda: llm.generate([prompt], params))))
            ctx = [r[0] for r in rows]
            print(f"{'DSA (sparse)' if dsa else 'dense MLA':>13} {'context':>8} {'prefill s':>10} {'exp':>6} "
                  f"{'peak MiB':>9} {'exp':>6}")
            for (context, seconds, peak), et, em in zip(rows, exponents(ctx, [r[1] for r in rows]),
                                                          exponents(ctx, [r[2] for r in rows])):
                print(f"{'':>13} {context:>8} {seconds:>10.2f} {et:>6} {peak / 2**20:>9.1f} {em:>6}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["layer", "short", "tiny", "all"], default="all")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--contexts", default=None,
                        help="layer contexts in tokens (default: 1024,4096,16384,65536; with cuda also 131072)")
    parser.add_argument("--chunk", type=int, default=None, help="prefill step tokens (default: 2048 cuda, 64 cpu)")
    parser.add_argument("--decode-batch", type=int, default=1, help="sequences per decode step")
    parser.add_argument("--tiny-contexts", default="1024,4096,16384", help="tiny-model prompt lengths in tokens")
    parser.add_argument("--short-contexts", default=None,
                        help="contexts within DSA's top-k (2048) for the dense-vs-sparse comparison "
                             "(default: 256,1024; with cuda also 2048)")
    args = parser.parse_args()
    device = torch.device(args.device)
    default = "1024,4096,16384,65536" + (",131072" if device.type == "cuda" else "")
    args.contexts = [int(c) for c in (args.contexts or default).split(",")]
    args.tiny_contexts = [int(c) for c in args.tiny_contexts.split(",")]
    short = "256,1024" + (",2048" if device.type == "cuda" else "")
    args.short_contexts = [int(c) for c in (args.short_contexts or short).split(",")]
    args.chunk = args.chunk or (2048 if device.type == "cuda" else 64)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    if args.part in ("layer", "all"):
        run_layer(args, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    if args.part in ("short", "all"):
        run_short(args, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    if args.part in ("tiny", "all"):
        run_tiny(args)


if __name__ == "__main__":
    main()
