"""Triton fused MoE: expert-sorted grouped GEMMs (gate/up + SiLU-mul, then down + routing weight).

Pairs (token, slot) are sorted by expert and padded per expert to BLOCK_M rows
(:func:`kernels.fused_moe.moe_align`, no host sync), so every row tile of both GEMMs uses one
expert's weights. The down GEMM writes each pair's weighted row in float32; the k rows of a token
are summed by torch afterwards (deterministic, no atomics). Contract: :func:`kernels.fused_moe.fused_moe_ref`.

Decode batches have few row tiles (one per expert used), so the grid of either GEMM can leave SMs
idle (one expert's gate/up at I = 2048 in 64-column tiles is 32 programs): when the upper bound of
the grid is below about two programs per SM, K is split over programs that write float32
partials, summed by torch before the SiLU-mul (gate/up) or the token sum (down) (:func:`moe_config`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.kernels.fused_moe import moe_align
from shardserve.kernels.triton_utils import check_launchable, gemm_split_k, interpreting, mma, pow2


@triton.jit
def _moe_gate_up_kernel(
    hidden_ptr, w13_ptr, scale_ptr, sorted_ids_ptr, block_expert_ptr, inter_ptr,
    num_pairs, top_k, N, K, k_per_split,
    stride_ht, stride_we, stride_wn, stride_se, stride_sn, stride_ip, stride_is,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
    FP8: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, SPLIT: tl.constexpr,
):
    # Grid (row tiles, cdiv(I, BLOCK_N), splits): inter[pair, n] = silu(x . w_gate[n]) * (x . w_up[n]);
    # with SPLIT, the raw gate and up partial sums of this K split go to inter[split, pair, n] and [.., N + n].
    pid_m = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:  # a tile past the last expert's rows
        return
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = pair < num_pairs
    token = tl.where(m_mask, pair // top_k, 0).to(tl.int64)
    n_mask = offs_n < N
    w_base = w13_ptr + expert.to(tl.int64) * stride_we
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(hidden_ptr + token[:, None] * stride_ht + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)          # [BLOCK_M, BLOCK_K]
        w_mask = k_mask[:, None] & n_mask[None, :]
        w_gate = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None], mask=w_mask, other=0.0)
        w_up = tl.load(w_base + (offs_n + N)[None, :] * stride_wn + offs_k[:, None], mask=w_mask, other=0.0)
        if FP8:   # block-scaled FP8 weights: one scale per (row block, K step) of each tile column
            s_base = scale_ptr + expert.to(tl.int64) * stride_se + k0 // SCALE_COLS
            s_gate = tl.load(s_base + (offs_n // SCALE_ROWS) * stride_sn, mask=n_mask, other=0.0)
            s_up = tl.load(s_base + ((offs_n + N) // SCALE_ROWS) * stride_sn, mask=n_mask, other=0.0)
            acc_gate += mma(a, w_gate.to(a.dtype), UPCAST) * s_gate[None, :]
            acc_up += mma(a, w_up.to(a.dtype), UPCAST) * s_up[None, :]
        else:
            acc_gate += mma(a, w_gate.to(a.dtype), UPCAST)                      # [BLOCK_M, BLOCK_N]
            acc_up += mma(a, w_up.to(a.dtype), UPCAST)
    out_mask = m_mask[:, None] & n_mask[None, :]
    rows = inter_ptr + split * stride_is + tl.where(m_mask, pair, 0).to(tl.int64)[:, None] * stride_ip
    if SPLIT:
        tl.store(rows + offs_n[None, :], acc_gate, mask=out_mask)
        tl.store(rows + (offs_n + N)[None, :], acc_up, mask=out_mask)
    else:
        tl.store(rows + offs_n[None, :], acc_gate * tl.sigmoid(acc_gate) * acc_up, mask=out_mask)


@triton.jit
def _moe_down_kernel(
    inter_ptr, w2_ptr, scale_ptr, sorted_ids_ptr, block_expert_ptr, topk_weights_ptr, out_ptr,
    num_pairs, N, K, k_per_split,
    stride_ip, stride_we, stride_wn, stride_se, stride_sn, stride_op, stride_os,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
    FP8: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr,
):
    # Grid (row tiles, cdiv(hidden, BLOCK_N), splits): out[split, pair, n] = w_pair * (inter[pair] . w2[e, n])
    # over this split's K range.
    pid_m = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:  # a tile past the last expert's rows
        return
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = pair < num_pairs
    row = tl.where(m_mask, pair, 0).to(tl.int64)
    n_mask = offs_n < N
    w_base = w2_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(inter_ptr + row[:, None] * stride_ip + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None],
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if FP8:
            scale = tl.load(scale_ptr + expert.to(tl.int64) * stride_se + (offs_n // SCALE_ROWS) * stride_sn
                            + k0 // SCALE_COLS, mask=n_mask, other=0.0)
            acc += mma(a, w.to(a.dtype), UPCAST) * scale[None, :]
        else:
            acc += mma(a, w.to(a.dtype), UPCAST)
    weight = tl.load(topk_weights_ptr + row, mask=m_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + split * stride_os + row[:, None] * stride_op + offs_n[None, :], acc * weight[:, None],
             mask=m_mask[:, None] & n_mask[None, :])


def moe_config(num_pairs: int, num_experts: int, rows_out: int, k_in: int, scale_cols: int | None,
               device: torch.device, split_k: int | None = None) -> dict:
    """Tiles and K splits of one of the two grouped GEMMs (output width ``rows_out``, reduction
    ``k_in``); ``scale_cols``: the FP8 scale block width (``BLOCK_K`` divides it); ``split_k``
    forces the split count.

    Returns:
        ``{"BLOCK_M", "BLOCK_N", "BLOCK_K", "num_blocks", "split_k", "k_per_split"}`` where
        ``num_blocks`` is the row-tile bound of :func:`kernels.fused_moe.moe_align`.
    """
    block_m = 16 if num_pairs <= 256 else 64
    block_n = min(pow2(rows_out, 16), 64)
    block_k = min(pow2(k_in, 16), 64, scale_cols or 64)
    num_blocks = -(-(num_pairs + min(num_pairs, num_experts) * (block_m - 1)) // block_m)
    split_k = split_k or gemm_split_k(num_blocks * triton.cdiv(rows_out, block_n), triton.cdiv(k_in, block_k), device)
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "num_blocks": num_blocks, "split_k": split_k,
            "k_per_split": triton.cdiv(triton.cdiv(k_in, split_k), block_k) * block_k}


def fused_moe_triton(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                     block_size: tuple[int, int] | None = None, *, block_m: int | None = None,
                     split_k: int | None = None) -> torch.Tensor:
    """Triton :func:`kernels.fused_moe.fused_moe_ref` (same arguments and result).

    Args:
        hidden: ``[T, hidden]``.
        w13: ``[E, 2 * I, hidden]`` gate rows then up rows; cast to ``hidden.dtype`` on load.
        w2: ``[E, hidden, I]``.
        topk_weights: ``[T, k]``.
        topk_ids: ``[T, k]`` int; ids outside ``[0, E)`` are skipped.
        w13_scale, w2_scale, block_size: FP8 block scales when ``w13`` / ``w2`` are
            ``float8_e4m3fn`` (see :func:`kernels.fused_moe.fused_moe`); the kernels scale each
            tile's partial products, the weights stay FP8 in memory.
        block_m: rows per tile (default :func:`moe_config`'s: 16 for small batches, 64 otherwise).
        split_k: force this many K splits in both GEMMs (default :func:`moe_config`'s).

    Returns:
        ``[T, hidden]`` in ``hidden.dtype``; the SiLU-mul intermediate is rounded to
        ``hidden.dtype`` once, the k expert outputs are summed in float32.
    """
    check_launchable(hidden, w13, w2, topk_weights, topk_ids)
    num_tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = w13.shape
    inter_size = two_inter // 2
    assert w13.shape[2] == hidden_size and w2.shape == (num_experts, hidden_size, inter_size), \
        f"hidden {hidden_size}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}"
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == num_tokens, \
        f"topk_ids {tuple(topk_ids.shape)} topk_weights {tuple(topk_weights.shape)} tokens {num_tokens}"
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(hidden)
    fp8 = w13_scale is not None
    scale_rows, scale_cols = block_size if fp8 else (1, 1)
    if fp8:
        assert w13.dtype == w2.dtype == torch.float8_e4m3fn and w2_scale is not None and inter_size % scale_rows == 0, \
            f"FP8 experts: w13 {w13.dtype}, w2 {w2.dtype}, I={inter_size} vs blocks {block_size}"
        assert scale_cols % 16 == 0 and scale_cols & (scale_cols - 1) == 0, f"scale block width {scale_cols}"
        w13_scale, w2_scale = w13_scale.float().contiguous(), w2_scale.float().contiguous()
    s13 = w13_scale if fp8 else w13
    s2 = w2_scale if fp8 else w2
    scale_width = scale_cols if fp8 else None
    up = moe_config(num_pairs, num_experts, inter_size, hidden_size, scale_width, hidden.device, split_k)
    down = moe_config(num_pairs, num_experts, hidden_size, inter_size, scale_width, hidden.device, split_k)
    block_m = block_m or up["BLOCK_M"]
    sorted_ids, block_expert = moe_align(topk_ids, num_experts, block_m)
    num_blocks = block_expert.shape[0]
    upcast = interpreting()
    common = dict(BLOCK_M=block_m, UPCAST=upcast, FP8=fp8, SCALE_ROWS=scale_rows, SCALE_COLS=scale_cols, num_warps=4)

    splits = triton.cdiv(hidden_size, up["k_per_split"])
    if splits == 1:
        inter = torch.empty(num_pairs, inter_size, dtype=hidden.dtype, device=hidden.device)
    else:   # raw gate | up partial sums per split, float32
        inter = torch.empty(splits, num_pairs, 2 * inter_size, dtype=torch.float32, device=hidden.device)
    _moe_gate_up_kernel[(num_blocks, triton.cdiv(inter_size, up["BLOCK_N"]), splits)](
        hidden, w13, s13, sorted_ids, block_expert, inter, num_pairs, top_k, inter_size, hidden_size,
        up["k_per_split"], hidden.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1),
        inter.stride(-2), inter.stride(0) if splits > 1 else 0,
        BLOCK_N=up["BLOCK_N"], BLOCK_K=up["BLOCK_K"], SPLIT=splits > 1, **common)
    if splits > 1:
        gate, up_part = inter.sum(0).chunk(2, dim=-1)
        inter = (gate * torch.sigmoid(gate) * up_part).to(hidden.dtype)

    splits = triton.cdiv(inter_size, down["k_per_split"])
    pair_out = torch.zeros(splits, num_pairs, hidden_size, dtype=torch.float32, device=hidden.device)
    _moe_down_kernel[(num_blocks, triton.cdiv(hidden_size, down["BLOCK_N"]), splits)](
        inter, w2, s2, sorted_ids, block_expert, topk_weights.contiguous().view(-1), pair_out,
        num_pairs, hidden_size, inter_size, down["k_per_split"],
        inter.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), pair_out.stride(1),
        pair_out.stride(0), BLOCK_N=down["BLOCK_N"], BLOCK_K=down["BLOCK_K"], **common)
    pair_out = pair_out[0] if splits == 1 else pair_out.sum(0)
    return pair_out.view(num_tokens, top_k, hidden_size).sum(1).to(hidden.dtype)
