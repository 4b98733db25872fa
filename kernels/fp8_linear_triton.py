"""Triton W8A16 GEMM for FP8 block-scaled weights. Contract: :mod:`kernels.fp8_linear` reference.

One program per ``BLOCK_M x BLOCK_N`` output tile (and K split) walks K in ``BLOCK_K`` steps;
``BLOCK_K`` divides the scale block's width, so a K step lies in one scale column and its partial
product is scaled by one float32 per output column (``scale_inv[n // bo, k // bi]``) before
accumulating.

Tile shapes come from :func:`gemm_config` (a table by shape, as vLLM keeps for its FP8 and MoE
GEMMs; no runtime autotuning, so the first call is not a benchmark and graph capture sees a fixed
launch): decode (``M <= 16``) uses 16-row tiles and splits K over programs when the output grid
leaves SMs idle (N = 576 at K = 7168 is 9 tiles), writing float32 partials that one sum reduces
(deterministic, no atomics); prefill uses 64 x 128 tiles with 8 warps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.kernels.triton_utils import check_launchable, interpreting, mma, pow2


@triton.jit
def _fp8_linear_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, M, N, K, k_per_split,
    stride_xm, stride_wn, stride_sn, stride_om, stride_os,
    SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):
    # Grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), splits); split s covers K in [s * k_per_split, ...).
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)                    # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None],
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)                    # [BLOCK_K, BLOCK_N] fp8
        scale = tl.load(s_ptr + (offs_n // SCALE_ROWS) * stride_sn + k0 // SCALE_COLS, mask=n_mask, other=0.0)
        acc += mma(a, w.to(a.dtype), UPCAST) * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + split * stride_os + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :], acc,
             mask=m_mask[:, None] & n_mask[None, :])


def gemm_config(num_rows: int, out_features: int, in_features: int, block_cols: int,
                device: torch.device) -> dict:
    """Tile sizes, warps, stages and K splits for ``[M, K] x [K, N]`` (see the module docstring).

    Returns:
        ``{"BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "split_k"}``; ``BLOCK_K``
        divides ``block_cols`` (the scale block width).
    """
    from shardserve.kernels.triton_utils import gemm_split_k

    block_k = min(block_cols, 128)
    while block_cols % block_k:
        block_k //= 2
    if num_rows <= 16:      # decode: memory-bound on the weight, fill the SMs
        block_m, block_n, warps, stages = 16, 64, 4, 4
    elif num_rows <= 64:
        block_m, block_n, warps, stages = pow2(num_rows, 16), 128, 4, 3
    else:                   # prefill: compute-bound, large tiles
        block_m, block_n, warps, stages = 64, 128, 8, 3
    tiles = triton.cdiv(num_rows, block_m) * triton.cdiv(out_features, block_n)
    split_k = gemm_split_k(tiles, triton.cdiv(in_features, block_k), device) if num_rows <= 64 else 1
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": warps, "num_stages": stages,
            "split_k": split_k}


def fp8_block_linear_triton(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                            block_size: tuple[int, int], bias: torch.Tensor | None = None, *,
                            split_k: int | None = None) -> torch.Tensor:
    """Triton :func:`kernels.fp8_linear.fp8_block_linear_ref`.

    Args:
        x: ``[T, K]`` activations (any leading dims are flattened).
        weight: ``[N, K]`` float8_e4m3fn, K contiguous.
        scale_inv: ``[ceil(N / bo), ceil(K / bi)]`` float32.
        block_size: ``(bo, bi)``; ``bi`` must be a multiple of 16.
        bias: optional ``[N]``.
        split_k: force this many K splits (default: :func:`gemm_config`'s).

    Returns:
        ``[..., N]`` in ``x.dtype`` (accumulated in float32).
    """
    check_launchable(x, weight, scale_inv)
    block_rows, block_cols = block_size
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    num_rows, in_features = x2.shape
    out_features = weight.shape[0]
    assert weight.dtype == torch.float8_e4m3fn and weight.shape[1] == in_features and weight.stride(-1) == 1, \
        f"weight {weight.dtype} {tuple(weight.shape)} vs x {tuple(x.shape)}"
    assert scale_inv.shape == (triton.cdiv(out_features, block_rows), triton.cdiv(in_features, block_cols)), \
        f"scale_inv {tuple(scale_inv.shape)} for weight {tuple(weight.shape)} and blocks {block_size}"
    assert block_cols % 16 == 0, f"scale block width {block_cols} must be a multiple of 16"
    scale_inv = scale_inv.float().contiguous()
    out = torch.empty(num_rows, out_features, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out.view(*lead, out_features)
    config = gemm_config(num_rows, out_features, in_features, block_cols, x.device)
    block_k = config["BLOCK_K"]
    splits = split_k or config["split_k"]
    k_per_split = triton.cdiv(triton.cdiv(in_features, splits), block_k) * block_k   # whole K steps
    splits = triton.cdiv(in_features, k_per_split)
    # One split writes the output; several write float32 partials [splits, M, N] (bias in split 0 only).
    dest = out if splits == 1 else torch.empty(splits, num_rows, out_features, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(num_rows, config["BLOCK_M"]), triton.cdiv(out_features, config["BLOCK_N"]), splits)
    _fp8_linear_kernel[grid](
        x2, weight, scale_inv, bias if bias is not None else scale_inv, dest, num_rows, out_features, in_features,
        k_per_split, x2.stride(0), weight.stride(0), scale_inv.stride(0), dest.stride(-2),
        dest.stride(0) if splits > 1 else 0,
        SCALE_ROWS=block_rows, SCALE_COLS=block_cols, HAS_BIAS=bias is not None and splits == 1,
        BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=block_k, UPCAST=interpreting(),
        num_warps=config["num_warps"], num_stages=config["num_stages"])
    if splits > 1:
        total = dest.sum(0)
        out.copy_(total if bias is None else total + bias.float())
    return out.view(*lead, out_features)
