"""Every Triton kernel in ``kernels/`` against its torch reference on one CUDA GPU: the kernel
section of ``benchmarks/gpu_check.sh``.

Each case is two checks: the kernel == its torch reference (max absolute error within the dtype's
tolerance, relative to the reference's largest magnitude), and the kernel captured in a CUDA graph
and replayed == its eager run (on CPU the stand-in: the launcher runs under
``workers/sync_guard.py``'s guard, which fails where a capture would). bf16 cases at serving shapes
are also timed: the Triton kernel replayed from a CUDA graph with L2 flushed (its GPU time, what a
captured decode step pays) and launched eagerly (GPU time or launch overhead, whichever is larger),
the torch reference eagerly; achieved GB/s (memory-bound ops: minimal bytes read + written) or
TFLOP/s (GEMM-like ops) and the fraction of the GPU's HBM bandwidth the kernel reaches (minimal
bytes / graph time / spec bandwidth): the number that says which kernel to fix first. fp32
cases are small and check correctness only. ``--cpu-dry-run``: small shapes under the interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from gpu_check_core import section

BF16, FP32 = torch.bfloat16, torch.float32
DEVICE = "cuda"  # "cpu" only for the dry run under TRITON_INTERPRET=1
# (atol, rtol): pass when max|out - ref| <= atol + rtol * max|ref|.
TOLERANCES = {FP32: (1e-4, 1e-4), BF16: (2e-2, 2e-2)}


@dataclass(slots=True)
class Case:
    """One kernel-vs-reference comparison."""

    name: str                       # op and shape
    dtype: torch.dtype
    run_triton: Callable[[], torch.Tensor]
    run_ref: Callable[[], torch.Tensor]
    unit: str = "GB/s"              # "GB/s" or "TFLOP/s"
    work: float = 0.0               # bytes or flops per call
    tol_scale: float = 1.0          # widen the dtype tolerance (long bf16 reductions)
    bytes: float = 0.0              # minimal bytes read + written per call (default: ``work`` of a GB/s case)

    @property
    def min_bytes(self) -> float:
        return self.bytes or (self.work if self.unit == "GB/s" else 0.0)


def _paged(seq_lens: list[int], block_size: int, row_shape: tuple[int, ...], dtype, num_caches: int = 1):
    """Random block tables and caches big enough for ``seq_lens`` (cache contents random)."""
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 1
    perm = torch.randperm(num_blocks, device=DEVICE).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device=DEVICE)
    start = 0
    for b, count in enumerate(blocks):
        table[b, :count] = perm[start:start + count]
        start += count
    caches = [torch.randn(num_blocks, block_size, *row_shape, dtype=dtype, device=DEVICE) for _ in range(num_caches)]
    return table, torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), caches


def elementwise_cases(dtype, small: bool) -> list[Case]:
    from shardserve.kernels.activation import silu_and_mul_ref
    from shardserve.kernels.activation_triton import silu_and_mul_triton
    from shardserve.kernels.hadamard import hadamard_transform_ref
    from shardserve.kernels.hadamard_triton import hadamard_transform_triton
    from shardserve.kernels.norm import rms_norm_ref
    from shardserve.kernels.norm_triton import rms_norm_triton
    from shardserve.kernels.rotary import apply_rotary_ref
    from shardserve.kernels.rotary_triton import apply_rotary_triton

    size = dtype.itemsize
    num_tokens, hidden = (37, 1000) if small else (4096, 7168)
    x, residual = (torch.randn(num_tokens, hidden, dtype=dtype, device=DEVICE) for _ in range(2))
    weight = torch.randn(hidden, dtype=dtype, device=DEVICE)
    heads, rot = (3, 64) if small else (128, 64)
    q = torch.randn(num_tokens, heads, rot, dtype=dtype, device=DEVICE)
    angle = torch.rand(num_tokens, rot // 2, device=DEVICE) * 100
    cos, sin = angle.cos(), angle.sin()
    inter = 300 if small else 18432
    gate_up = torch.randn(num_tokens, 2 * inter, dtype=dtype, device=DEVICE)
    hq = torch.randn(num_tokens, 4 if small else 64, 128, dtype=dtype, device=DEVICE)
    return [
        Case(f"rms_norm+residual T{num_tokens} D{hidden}", dtype, lambda: rms_norm_triton(x, weight, 1e-6, residual)[0],
             lambda: rms_norm_ref(x, weight, 1e-6, residual)[0], work=4 * x.numel() * size),
        Case(f"rotary interleaved T{num_tokens} H{heads} D{rot}", dtype, lambda: apply_rotary_triton(q, cos, sin, True),
             lambda: apply_rotary_ref(q, cos, sin, True), work=2 * q.numel() * size + 2 * cos.numel() * 4),
        Case(f"rotary half-split T{num_tokens} H{heads} D{rot}", dtype, lambda: apply_rotary_triton(q, cos, sin),
             lambda: apply_rotary_ref(q, cos, sin), work=2 * q.numel() * size + 2 * cos.numel() * 4),
        Case(f"silu_and_mul T{num_tokens} I{inter}", dtype, lambda: silu_and_mul_triton(gate_up),
             lambda: silu_and_mul_ref(gate_up), work=1.5 * gate_up.numel() * size),
        Case(f"hadamard T{num_tokens} H{hq.shape[1]} D128", dtype, lambda: hadamard_transform_triton(hq),
             lambda: hadamard_transform_ref(hq), work=2 * hq.numel() * size),
    ]


def store_cases(dtype, small: bool) -> list[Case]:
    from shardserve.kernels.paged_attention import store_cache_ref, store_kv_ref
    from shardserve.kernels.paged_attention_triton import store_cache_triton, store_kv_triton

    num_tokens, kv_heads, head_dim, latent = (19, 2, 64, 80) if small else (4096, 8, 128, 576)
    table, _, (k_cache, v_cache, l_cache) = _paged([num_tokens], 16, (kv_heads, head_dim), dtype, 3)
    l_cache = torch.randn(*l_cache.shape[:2], latent, dtype=dtype, device=DEVICE)
    slots = table[0, torch.arange(num_tokens, device=DEVICE) // 16].long() * 16 + torch.arange(num_tokens, device=DEVICE) % 16
    key, value = (torch.randn(num_tokens, kv_heads, head_dim, dtype=dtype, device=DEVICE) for _ in range(2))
    rows = torch.randn(num_tokens, latent, dtype=dtype, device=DEVICE)

    def kv(fn):
        fn(key, value, k_cache, v_cache, slots)
        return torch.cat([k_cache.view(-1, kv_heads, head_dim)[slots], v_cache.view(-1, kv_heads, head_dim)[slots]])

    def latent_rows(fn):
        fn(rows, l_cache, slots)
        return l_cache.view(-1, latent)[slots]

    return [
        Case(f"store_kv T{num_tokens} Hkv{kv_heads} D{head_dim}", dtype, lambda: kv(store_kv_triton), lambda: kv(store_kv_ref),
             work=4 * key.numel() * key.itemsize),
        Case(f"store_cache latent T{num_tokens} W{latent}", dtype, lambda: latent_rows(store_cache_triton),
             lambda: latent_rows(store_cache_ref), work=2 * rows.numel() * rows.itemsize),
    ]


def attention_cases(dtype, small: bool) -> list[Case]:
    from shardserve.kernels.mla_attention import mla_attention_ref
    from shardserve.kernels.mla_attention_triton import mla_attention_triton
    from shardserve.kernels.paged_attention import paged_attention_ref
    from shardserve.kernels.paged_attention_triton import paged_attention_triton

    size = dtype.itemsize
    cases = []
    # GQA decode: one query per sequence, long contexts (split-K when the batch is small).
    batch, ctx, heads, kv_heads, head_dim = (3, 200, 4, 2, 64) if small else (64, 4096, 32, 8, 128)
    for b in sorted({batch, 4}):
        table, lens, (kc, vc) = _paged([ctx - i for i in range(b)], 16, (kv_heads, head_dim), dtype, 2)
        q = torch.randn(b, heads, head_dim, dtype=dtype, device=DEVICE)
        qsl = torch.arange(b + 1, dtype=torch.int32, device=DEVICE)
        args = (q, kc, vc, table, lens, qsl, head_dim ** -0.5, 1, ctx)
        cases.append(Case(f"paged_attention decode B{b} ctx{ctx} H{heads}/{kv_heads} D{head_dim} bs16", dtype,
                          lambda a=args: paged_attention_triton(*a), lambda a=args: paged_attention_ref(*a),
                          work=2 * b * ctx * kv_heads * head_dim * size))
    if small:   # small contexts never split by themselves: force the split-K path and its combine kernel
        cases.append(Case(f"paged_attention decode B{b} ctx{ctx} H{heads}/{kv_heads} D{head_dim} bs16 3 splits", dtype,
                          lambda a=args: paged_attention_triton(*a, num_splits=3), lambda a=args: paged_attention_ref(*a),
                          work=2 * b * ctx * kv_heads * head_dim * size))
    # GQA varlen prefill (chunked): TFLOP/s.
    qlen, ctx_p, nseq = (5, 40, 2) if small else (512, 2048, 4)
    table, lens, (kc, vc) = _paged([ctx_p] * nseq, 64, (kv_heads, head_dim), dtype, 2)
    q = torch.randn(nseq * qlen, heads, head_dim, dtype=dtype, device=DEVICE)
    qsl = torch.arange(nseq + 1, dtype=torch.int32, device=DEVICE) * qlen
    args = (q, kc, vc, table, lens, qsl, head_dim ** -0.5, qlen, ctx_p)
    flops = 4 * nseq * heads * head_dim * qlen * (ctx_p - qlen / 2)
    cases.append(Case(f"paged_attention prefill B{nseq} q{qlen} ctx{ctx_p} bs64", dtype,
                      lambda: paged_attention_triton(*args), lambda: paged_attention_ref(*args), "TFLOP/s", flops))
    # MLA decode, dense and sparse (DeepSeek-V3.2: rank 512, rope 64, 16 heads per rank at TP 8).
    batch, ctx, heads, rank, rope, topk = (3, 150, 3, 64, 16, 32) if small else (64, 4096, 16, 512, 64, 2048)
    table, lens, (cache,) = _paged([ctx - i for i in range(batch)], 64, (rank + rope,), dtype)
    q_nope = torch.randn(batch, heads, rank, dtype=dtype, device=DEVICE)
    q_pe = torch.randn(batch, heads, rope, dtype=dtype, device=DEVICE)
    scale = (128 + rope) ** -0.5
    cases.append(Case(f"mla decode B{batch} ctx{ctx} H{heads} L{rank}+{rope} bs64", dtype,
                      lambda: mla_attention_triton(q_nope, q_pe, cache, table, lens, scale, max_seq_len=ctx),
                      lambda: mla_attention_ref(q_nope, q_pe, cache, table, lens, scale, max_seq_len=ctx),
                      work=batch * ctx * (rank + rope) * size))
    if small:
        cases.append(Case(f"mla decode B{batch} ctx{ctx} H{heads} L{rank}+{rope} bs64 3 splits", dtype,
                          lambda: mla_attention_triton(q_nope, q_pe, cache, table, lens, scale, max_seq_len=ctx,
                                                       num_splits=3),
                          lambda: mla_attention_ref(q_nope, q_pe, cache, table, lens, scale, max_seq_len=ctx),
                          work=batch * ctx * (rank + rope) * size))
    topk_idx = torch.stack([torch.randperm(ctx - i, device=DEVICE)[:topk] for i in range(batch)]).to(torch.int32)
    topk_idx[:, -3:] = -1
    cases.append(Case(f"mla sparse decode B{batch} topk{topk} H{heads}", dtype,
                      lambda: mla_attention_triton(q_nope, q_pe, cache, table, lens, scale, topk_indices=topk_idx),
                      lambda: mla_attention_ref(q_nope, q_pe, cache, table, lens, scale, topk_indices=topk_idx),
                      work=batch * topk * (rank + rope) * size))
    cases += long_prefill_cases(dtype, small)
    return cases


def _kernels(mode: str, fn):
    """Run ``fn()`` with ``SHARDSERVE_KERNELS=mode`` (ops that dispatch inside, e.g. the expanded prefill)."""
    import os

    saved = os.environ.get("SHARDSERVE_KERNELS")
    os.environ["SHARDSERVE_KERNELS"] = mode
    try:
        return fn()
    finally:
        os.environ.pop("SHARDSERVE_KERNELS") if saved is None else os.environ.__setitem__("SHARDSERVE_KERNELS", saved)


def long_prefill_cases(dtype, small: bool) -> list[Case]:
    """Issue 25's prefill: DSA's sparse prefill (a 2,048-token chunk, each token over its top-k) and
    dense MLA expanded per key chunk (DeepSeek-V3.2 ranks, 16 heads per rank at TP 8)."""
    from shardserve.kernels.mla_attention import mla_attention_ref
    from shardserve.kernels.mla_attention_triton import mla_attention_triton
    from shardserve.kernels.mla_prefill import mla_prefill_dense

    q_len, ctx, heads, rank, rope, nope, v, topk = ((6, 40, 3, 64, 16, 32, 32, 8) if small
                                                     else (2048, 8192, 16, 512, 64, 128, 128, 2048))
    table, lens, (cache,) = _paged([ctx], 64, (rank + rope,), dtype)
    qsl = torch.tensor([0, q_len], dtype=torch.int32, device=DEVICE)
    q_lat = torch.randn(q_len, heads, rank, dtype=dtype, device=DEVICE)
    q_pe = torch.randn(q_len, heads, rope, dtype=dtype, device=DEVICE)
    scale = (nope + rope) ** -0.5
    positions = torch.arange(ctx - q_len, ctx, device=DEVICE)
    topk_idx = torch.stack([torch.randperm(int(p) + 1, device=DEVICE)[:topk] for p in positions])
    topk_idx = torch.nn.functional.pad(topk_idx, (0, topk - topk_idx.shape[1]), value=-1).to(torch.int32)
    args = (q_lat, q_pe, cache, table, lens, scale, qsl, topk_idx, ctx)
    cases = [Case(f"mla sparse prefill q{q_len} ctx{ctx} topk{topk} H{heads}", dtype,
                  lambda: mla_attention_triton(*args), lambda: mla_attention_ref(*args), "TFLOP/s",
                  4 * q_len * heads * topk * (rank + rope))]
    q_nope = torch.randn(q_len, heads, nope, dtype=dtype, device=DEVICE)
    w_kv = (torch.randn(heads, nope + v, rank, device=DEVICE) * rank ** -0.5).to(dtype)

    def expanded():
        return mla_prefill_dense(q_nope, q_pe, cache, table, lens, qsl, w_kv, scale,
                                 query_start_host=[0, q_len], seq_lens_host=[ctx])

    flops = 2 * ctx * rank * heads * (nope + v) + 2 * q_len * heads * (ctx - q_len / 2) * (nope + rope + v)
    cases.append(Case(f"mla expanded prefill q{q_len} ctx{ctx} H{heads}", dtype, lambda: _kernels("triton", expanded),
                      lambda: _kernels("torch", expanded), "TFLOP/s", flops, tol_scale=2.0))
    return cases


def indexer_moe_cases(dtype, small: bool) -> list[Case]:
    from shardserve.kernels.fused_moe import fused_moe_ref
    from shardserve.kernels.fused_moe_triton import fused_moe_triton
    from shardserve.kernels.indexer import indexer_scores_ref, quantize_index_keys, quantize_index_queries
    from shardserve.kernels.indexer_triton import indexer_scores_triton

    cases = []
    batch, ctx, heads, dim = (3, 100, 4, 64) if small else (64, 8192, 64, 128)
    table, lens, (kc,) = _paged([ctx - i for i in range(batch)], 64, (dim,), dtype)
    q = torch.randn(batch, heads, dim, dtype=dtype, device=DEVICE)
    w = torch.randn(batch, heads, device=DEVICE) * heads ** -0.5
    cases.append(Case(f"indexer decode B{batch} ctx{ctx} H{heads} D{dim}", dtype,
                      lambda: indexer_scores_triton(q, w, kc, table, lens, max_seq_len=ctx),
                      lambda: indexer_scores_ref(q, w, kc, table, lens, max_seq_len=ctx),
                      work=batch * ctx * dim * dtype.itemsize + batch * ctx * 4))
    kc8 = quantize_index_keys(kc.reshape(-1, dim)).view(*kc.shape[:2], -1)        # packed fp8 rows
    cases.append(Case(f"indexer fp8-cache decode B{batch} ctx{ctx} H{heads} D{dim}", dtype,
                      lambda: indexer_scores_triton(q, w, kc8, table, lens, max_seq_len=ctx),
                      lambda: indexer_scores_ref(q, w, kc8, table, lens, max_seq_len=ctx),
                      work=batch * ctx * kc8.shape[-1] + batch * ctx * 4))
    q8, q8_scale = quantize_index_queries(q)                                      # fp8 x fp8 scoring
    cases.append(Case(f"indexer fp8-cache fp8-q decode B{batch} ctx{ctx} H{heads} D{dim}", dtype,
                      lambda: indexer_scores_triton(q8, w, kc8, table, lens, max_seq_len=ctx, q_scale=q8_scale),
                      lambda: indexer_scores_ref(q8, w, kc8, table, lens, max_seq_len=ctx, q_scale=q8_scale),
                      work=batch * ctx * kc8.shape[-1] + batch * ctx * 4))
    # Prefill chunk: q_len new tokens at the end of each context, causal within the chunk.
    q_len = 5 if small else 256
    starts = torch.arange(batch + 1, device=DEVICE, dtype=torch.int32) * q_len
    qp = torch.randn(batch * q_len, heads, dim, dtype=dtype, device=DEVICE)
    wp = torch.randn(batch * q_len, heads, device=DEVICE) * heads ** -0.5
    cases.append(Case(f"indexer prefill B{batch} q{q_len} ctx{ctx} H{heads} D{dim}", dtype,
                      lambda: indexer_scores_triton(qp, wp, kc, table, lens, starts, max_seq_len=ctx),
                      lambda: indexer_scores_ref(qp, wp, kc, table, lens, starts, max_seq_len=ctx),
                      "TFLOP/s", 2 * batch * q_len * ctx * heads * dim))
    qp8, qp8_scale = quantize_index_queries(qp)
    cases.append(Case(f"indexer fp8 prefill B{batch} q{q_len} ctx{ctx} H{heads} D{dim}", dtype,
                      lambda: indexer_scores_triton(qp8, wp, kc8, table, lens, starts, max_seq_len=ctx,
                                                    q_scale=qp8_scale),
                      lambda: indexer_scores_ref(qp8, wp, kc8, table, lens, starts, max_seq_len=ctx,
                                                 q_scale=qp8_scale),
                      "TFLOP/s", 2 * batch * q_len * ctx * heads * dim))
    tokens, experts, hidden, inter, top_k = (9, 4, 96, 80, 2) if small else (2048, 64, 2048, 1024, 8)
    for num_tokens in sorted({tokens, 4}):
        x = torch.randn(num_tokens, hidden, dtype=dtype, device=DEVICE)
        w13 = (torch.randn(experts, 2 * inter, hidden, device=DEVICE) * hidden ** -0.5).to(dtype)
        w2 = (torch.randn(experts, hidden, inter, device=DEVICE) * inter ** -0.5).to(dtype)
        ids = torch.rand(num_tokens, experts, device=DEVICE).topk(top_k, dim=-1).indices
        weights = torch.rand(num_tokens, top_k, device=DEVICE).softmax(-1)
        args = (x, w13, w2, weights, ids)
        flops = 2 * num_tokens * top_k * 3 * hidden * inter
        cases.append(Case(f"fused_moe T{num_tokens} E{experts} k{top_k} D{hidden} I{inter}", dtype,
                          lambda a=args: fused_moe_triton(*a), lambda a=args: fused_moe_ref(*a), "TFLOP/s", flops))
    return cases


def fp8_cases(dtype, small: bool) -> list[Case]:
    from shardserve.kernels.fp8_linear import fp8_block_linear_ref
    from shardserve.kernels.fp8_linear_triton import fp8_block_linear_triton

    cases = []
    block = (32, 32) if small else (128, 128)
    out_features, in_features = (96, 160) if small else (7168, 2048)
    grid = (-(-out_features // block[0]), -(-in_features // block[1]))
    weight = (torch.randn(out_features, in_features, device=DEVICE) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(grid, device=DEVICE) * 0.01 + 1e-3
    for num_rows in ((1, 7) if small else (1, 256)):
        x = torch.randn(num_rows, in_features, dtype=dtype, device=DEVICE)
        work = out_features * in_features + num_rows * (in_features + out_features) * dtype.itemsize
        cases.append(Case(f"fp8_linear T{num_rows} N{out_features} K{in_features} blk{block[0]}", dtype,
                          lambda x=x: fp8_block_linear_triton(x, weight, scale, block),
                          lambda x=x: fp8_block_linear_ref(x, weight, scale, block), work=work, tol_scale=2.0))
    cases.append(_fp8_moe_case(dtype, small, block))
    return cases


def _fp8_moe_case(dtype, small: bool, block: tuple[int, int]) -> Case:
    from shardserve.kernels.fused_moe import dequantize_fp8_experts, fused_moe_ref
    from shardserve.kernels.fused_moe_triton import fused_moe_triton

    tokens, experts, hidden, inter, top_k = (9, 4, 96, 64, 2) if small else (256, 64, 2048, 1024, 8)

    def stacked(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        values = (torch.randn(experts, rows, cols, device=DEVICE) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        grid = (experts, -(-rows // block[0]), -(-cols // block[1]))
        return values, (torch.rand(grid, device=DEVICE) + 0.5) * cols ** -0.5 / 100

    w13, s13 = stacked(2 * inter, hidden)
    w2, s2 = stacked(hidden, inter)
    x = torch.randn(tokens, hidden, dtype=dtype, device=DEVICE)
    ids = torch.rand(tokens, experts, device=DEVICE).topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, device=DEVICE).softmax(-1)
    exact13, exact2 = (dequantize_fp8_experts(w, s, block, torch.float32) for w, s in ((w13, s13), (w2, s2)))
    return Case(f"fp8 fused_moe T{tokens} E{experts} k{top_k} D{hidden} I{inter} blk{block[0]}", dtype,
                lambda: fused_moe_triton(x, w13, w2, weights, ids, s13, s2, block),
                lambda: fused_moe_ref(x.float(), exact13, exact2, weights, ids), "TFLOP/s",
                2 * tokens * top_k * 3 * hidden * inter, tol_scale=2.0)


def recurrent_cases(dtype, small: bool) -> list[Case]:
    """Qwen3-Next linear attention: gated delta rule (decode, chunked prefill) and the causal conv
    over a state pool. Each call copies the pool first (included in the times) so both sides
    start from the same states; the result is the output and the updated slots."""
    from shardserve.kernels.causal_conv1d import causal_conv1d_ref
    from shardserve.kernels.causal_conv1d_triton import causal_conv1d_triton
    from shardserve.kernels.gated_delta import gated_delta_chunk_ref, gated_delta_recurrent_ref
    from shardserve.kernels.gated_delta_triton import gated_delta_chunk_triton, gated_delta_recurrent_triton

    k_heads, v_heads, dim = (2, 4, 32) if small else (16, 32, 128)   # Qwen3-Next-80B at TP=1
    cases = []
    for name, lens, fns in (("decode", [1] * (3 if small else 64), (gated_delta_recurrent_triton, gated_delta_recurrent_ref)),
                            ("chunked prefill", [70, 5] if small else [1024] * 4, (gated_delta_chunk_triton, gated_delta_chunk_ref))):
        total, slots = sum(lens), torch.arange(len(lens), device=DEVICE, dtype=torch.int32)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
        q, k = (torch.nn.functional.normalize(torch.randn(total, k_heads, dim, device=DEVICE), dim=-1).to(dtype)
                for _ in range(2))
        v = torch.randn(total, v_heads, dim, device=DEVICE, dtype=dtype)
        g = -torch.rand(total, v_heads, device=DEVICE)
        beta = torch.rand(total, v_heads, device=DEVICE)
        pool = torch.randn(len(lens), v_heads, dim, dim, device=DEVICE) * 0.1

        def run(fn, a=(q * dim ** -0.5, k, v, g, beta, cu), pool=pool, slots=slots):
            state = pool.clone()
            return torch.cat([fn(*a, state, slots).flatten().float(), state.flatten()])
        cases.append(Case(f"gated_delta {name} B{len(lens)} T{total} H{k_heads}/{v_heads} D{dim}", dtype,
                          lambda f=fns[0], r=run: r(f), lambda f=fns[1], r=run: r(f), "TFLOP/s",
                          4 * total * v_heads * dim * dim))
    channels, width = (3 * k_heads * dim, 4) if small else (8192, 4)
    for name, lens in (("decode", [1] * (3 if small else 64)), ("prefill", [9, 2] if small else [1024] * 4)):
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
        x = torch.randn(sum(lens), channels, device=DEVICE, dtype=dtype)
        weight = torch.randn(channels, width, device=DEVICE, dtype=dtype) * 0.5
        windows = torch.randn(len(lens), channels, width - 1, device=DEVICE, dtype=dtype)
        slots = torch.arange(len(lens), device=DEVICE, dtype=torch.int32)

        def conv(fn, x=x, weight=weight, cu=cu, windows=windows, slots=slots):
            state = windows.clone()
            return torch.cat([fn(x, weight, cu, state, slots).flatten(), state.flatten()])
        cases.append(Case(f"causal_conv1d {name} B{len(lens)} T{sum(lens)} C{channels} W{width}", dtype,
                          lambda c=conv: c(causal_conv1d_triton), lambda c=conv: c(causal_conv1d_ref),
                          work=2 * x.numel() * x.itemsize))
    return cases


def decode_cases(dtype, small: bool) -> list[Case]:
    """Decode-sized GEMMs at DeepSeek-V3.2 shapes of one TP=8 rank: the FP8 linear layers (o_proj,
    q_b_proj, kv_a_proj) at T = 1 / 16 / 64 rows and the routed experts (32 local of 256, top-8,
    hidden 7168, I 2048) at T = 1 / 16 / 64 tokens, FP8 and bf16. Memory-bound: their HBM fraction
    is the number to read."""
    from shardserve.kernels.fp8_linear import fp8_block_linear_ref
    from shardserve.kernels.fp8_linear_triton import fp8_block_linear_triton
    from shardserve.kernels.fused_moe import dequantize_fp8_experts, fused_moe_ref
    from shardserve.kernels.fused_moe_triton import fused_moe_triton

    block = (32, 32) if small else (128, 128)
    linears = [(96, 160)] if small else [(7168, 2048), (3072, 1536), (576, 7168)]
    rows = (1, 5) if small else (1, 16, 64)
    cases = []
    for out_features, in_features in linears:
        grid = (-(-out_features // block[0]), -(-in_features // block[1]))
        weight = (torch.randn(out_features, in_features, device=DEVICE) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        scale = torch.rand(grid, device=DEVICE) * 0.01 + 1e-3
        for num_rows in rows:
            x = torch.randn(num_rows, in_features, dtype=dtype, device=DEVICE)
            nbytes = out_features * in_features + num_rows * (in_features + out_features) * dtype.itemsize
            cases.append(Case(f"fp8_linear decode T{num_rows} N{out_features} K{in_features}", dtype,
                              lambda x=x, w=weight, s=scale: fp8_block_linear_triton(x, w, s, block),
                              lambda x=x, w=weight, s=scale: fp8_block_linear_ref(x, w, s, block), work=nbytes,
                              tol_scale=2.0))
    experts, global_experts, hidden, inter, top_k = (4, 8, 96, 64, 2) if small else (32, 256, 7168, 2048, 8)
    values = {name: (torch.randn(experts, r, c, device=DEVICE) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
              for name, r, c in (("w13", 2 * inter, hidden), ("w2", hidden, inter))}
    scales = {name: (torch.rand(experts, -(-w.shape[1] // block[0]), -(-w.shape[2] // block[1]), device=DEVICE) + 0.5)
              * w.shape[2] ** -0.5 / 100 for name, w in values.items()}
    exact = {name: dequantize_fp8_experts(values[name], scales[name], block, torch.float32) for name in values}
    dense = {name: w.to(dtype) for name, w in exact.items()}
    for num_tokens in rows:
        x = torch.randn(num_tokens, hidden, dtype=dtype, device=DEVICE)
        ids = torch.rand(num_tokens, global_experts, device=DEVICE).topk(top_k, dim=-1).indices   # rank 0: ids < 32
        ids = torch.where(ids < experts, ids, -1)
        weights = torch.rand(num_tokens, top_k, device=DEVICE).softmax(-1)
        used = max(1, len(set(ids[ids >= 0].tolist())))
        pairs = int((ids >= 0).sum())
        for fp8 in (True, False):
            per_expert = 3 * hidden * inter * (1 if fp8 else dtype.itemsize)
            nbytes = used * per_expert + 2 * num_tokens * hidden * dtype.itemsize
            args = ((x, values["w13"], values["w2"], weights, ids, scales["w13"], scales["w2"], block) if fp8
                    else (x, dense["w13"], dense["w2"], weights, ids))
            ref_args = (x.float(), exact["w13"], exact["w2"], weights, ids) if fp8 else args
            cases.append(Case(f"{'fp8 ' if fp8 else ''}fused_moe decode T{num_tokens} E{experts}/{global_experts} "
                              f"k{top_k} D{hidden} I{inter} ({pairs} local pairs)", dtype,
                              lambda a=args: fused_moe_triton(*a), lambda a=ref_args: fused_moe_ref(*a),
                              "TFLOP/s", 2 * max(pairs, 1) * 3 * hidden * inter, tol_scale=2.0, bytes=nbytes))
    return cases


def _compare(case: Case, out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, str]:
    out, ref = out.float(), ref.float()
    finite = torch.isfinite(ref)
    same_inf = out.shape == ref.shape and torch.equal(finite, torch.isfinite(out))
    err = (out[finite] - ref[finite]).abs().max().item() if same_inf and finite.any() else 0.0
    peak = ref[finite].abs().max().item() if finite.any() else 0.0
    atol, rtol = (t * case.tol_scale for t in TOLERANCES[case.dtype])
    ok = same_inf and err <= atol + rtol * peak
    return ok, f"max_abs {err:9.2e} rel {err / max(peak, 1e-30):9.2e}" if same_inf else "shape or inf pattern differs"


def _captured(case: Case) -> torch.Tensor:
    """The Triton call captured in a CUDA graph (after a warm-up on a side stream: compilation and
    autotuning happen there) and replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        case.run_triton()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = case.run_triton()
    graph.replay()
    torch.cuda.synchronize()
    return out


def _eager_under_guard(case: Case) -> tuple[torch.Tensor, Exception | None]:
    """CPU: the Triton call under the host-sync guard (the stand-in of a capture: the interpreted
    kernel runs once for both checks); ``(output, the guard's error or None)``."""
    from shardserve.workers.sync_guard import HostSyncError, no_host_sync

    try:
        with torch.inference_mode(), no_host_sync(f"kernel {case.name}"):
            return case.run_triton().float().clone(), None
    except HostSyncError as exc:
        return case.run_triton().float().clone(), exc


def check(case: Case, bench: bool, report, hbm: float | None) -> None:
    """Compare, capture and (``bench``) time one case; each in its own attempt."""
    label = f"kernel: {case.name} {str(case.dtype)[6:]}"
    eager, guard_error = None, None
    with report.attempt(label):
        if DEVICE == "cuda":
            eager = case.run_triton().float().clone()
        else:
            eager, guard_error = _eager_under_guard(case)
        ok, detail = _compare(case, eager, case.run_ref())
        report.check(ok, label, detail)
    with report.attempt(f"{label} captured"):
        if DEVICE != "cuda":
            report.check(guard_error is None and eager is not None, f"{label} captured",
                         f"replay stand-in: {guard_error or 'no host sync in the launcher'}")
        else:
            ok, detail = _compare(case, _captured(case), eager if eager is not None else case.run_triton())
            report.check(ok, f"{label} captured", f"CUDA graph replay == eager: {detail}")
    if not bench:
        return
    with report.attempt(f"{label} timed"):
        from triton.testing import do_bench

        g_ms = _graph_ms(case.run_triton)
        t_ms = do_bench(case.run_triton, warmup=10, rep=50)
        r_ms = do_bench(case.run_ref, warmup=3, rep=30)
        scale = 1e-9 if case.unit == "GB/s" else 1e-12
        hbm_frac = f", {100 * case.min_bytes / (g_ms * 1e-3) / hbm:5.1f}% of HBM" if hbm and case.min_bytes else ""
        report.info(f"{label} timed",
                    f"triton graph {g_ms * 1e3:8.1f} us {case.work * scale / (g_ms * 1e-3):8.1f} {case.unit}{hbm_frac}"
                    f" | eager {t_ms * 1e3:8.1f} us | torch eager {r_ms * 1e3:8.1f} us")


def _graph_ms(fn: Callable[[], torch.Tensor], calls: int = 10, replays: int = 5) -> float:
    """Milliseconds of GPU time per call of ``fn`` with the host out of the way, L2 cold: ``calls``
    x (flush L2, ``fn``) captured in one CUDA graph, minus ``calls`` flushes alone, median of
    ``replays``. Eager timing (``do_bench``) of a decode-sized call measures its launch overhead
    (the GPU waits on the host); decode steps replay graphs, so this is the number they pay."""
    flush = torch.empty(256 * 2 ** 20, dtype=torch.int8, device="cuda")    # > any GPU's L2
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graphs = []
    for with_fn in (True, False):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                flush.zero_()
                if with_fn:
                    fn()
        graphs.append(graph)
    times = []
    for graph in graphs:
        graph.replay()
        samples = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        times.append(sorted(samples)[len(samples) // 2])
    del graphs
    return max(times[0] - times[1], 1e-6) / calls


def run_kernel_checks(report, interpret: bool = False, quick: bool = False, hbm: float | None = None) -> None:
    """Check (and on CUDA time) every case into ``report``.

    Args:
        report: the gpu_check report (``check`` / ``info`` / ``attempt``).
        interpret: CPU self-test: small fp32 and bf16 shapes under ``TRITON_INTERPRET=1`` (which
            must be set before Triton is first imported), no timing.
        quick: CUDA: the small fp32 checks only (no bf16 serving shapes, no timing).
        hbm: spec HBM bandwidth (bytes/s) for the fraction printed beside each timing.
    """
    global DEVICE
    DEVICE = "cpu" if interpret else "cuda"
    if not interpret:
        torch.backends.cuda.matmul.allow_tf32 = False  # references in true fp32
        torch.backends.cudnn.allow_tf32 = False
    # (dtype, small shapes, timed): fp32 checks tightly on small shapes, bf16 runs serving shapes.
    plans = [(FP32, True, False)]
    if interpret:
        plans.append((BF16, True, False))
    elif not quick:
        plans.append((BF16, False, True))
    for dtype, small, bench in plans:
        builders = [elementwise_cases, store_cases, attention_cases, long_prefill_cases, indexer_moe_cases, fp8_cases,
                    recurrent_cases]
        if not small:   # serving decode shapes (their small versions are the fp8 / fused_moe cases above)
            builders.append(decode_cases)
        for build in builders:
            torch.manual_seed(0)
            with report.attempt(f"kernel cases: {build.__name__} {str(dtype)[6:]}"):
                cases = build(dtype, small)
                for case in cases:
                    check(case, bench, report, hbm)
            if DEVICE == "cuda":
                torch.cuda.empty_cache()


@section("kernels", "kernels: every Triton kernel == its reference, captured, timed")
def kernels(ctx, report) -> None:
    run_kernel_checks(report, interpret=ctx.dry, quick=ctx.quick, hbm=ctx.hbm_bandwidth())
