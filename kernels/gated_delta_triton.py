"""Triton gated delta rule over a state pool; contracts: :mod:`kernels.gated_delta` references.

Both kernels run one program per (sequence, value head, block of value dims): a program owns the
``[K, BLOCK_V]`` slice of one sequence's state and walks that sequence's tokens in order, so
sequences of any length share one launch (``cu_seqlens``) and no program touches another's slot.

- recurrent: one rank-1 delta update per token (decode, speculative verify).
- chunked: ``BLOCK_T = 64`` tokens at a time. In-chunk decays ``exp(G_i - G_j)`` (``G`` the
  cumulative log decay) weight ``A = (beta k) k^T`` and ``q k^T``; the unit lower-triangular
  system ``(I + strict_lower(A))`` is inverted on the tile by forward substitution in 16x16
  diagonal blocks merged with three matmuls (flash-linear-attention's ``solve_tril`` does the
  same), which gives the chunk's corrected values ``u - w S`` (the WY form of the delta rule) and
  then the outputs and the next state with three more matmuls.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.kernels.gated_delta import _check
from shardserve.kernels.triton_utils import check_launchable, interpreting, mma, pow2


@triton.jit
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_ptr, cu_ptr, slot_ptr,
    stride_qt, stride_qh, stride_vt, stride_vh, stride_gt, stride_ot, stride_oh,
    stride_ss, stride_sh, stride_sk,
    GROUP, K, V,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    seq, head, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(cu_ptr + seq)
    end = tl.load(cu_ptr + seq + 1)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    k_head = head // GROUP
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask, v_mask = offs_k < K, offs_v < V
    s_mask = k_mask[:, None] & v_mask[None, :]
    s_ptrs = state_ptr + slot * stride_ss + head * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    s = tl.load(s_ptrs, mask=s_mask, other=0.0)                                   # [BLOCK_K, BLOCK_V] fp32
    for t in range(start, end):
        q = tl.load(q_ptr + t * stride_qt + k_head * stride_qh + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t * stride_qt + k_head * stride_qh + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t * stride_vt + head * stride_vh + offs_v, mask=v_mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t * stride_gt + head).to(tl.float32)
        beta = tl.load(beta_ptr + t * stride_gt + head).to(tl.float32)
        s = s * tl.exp(g)
        delta = (v - tl.sum(s * k[:, None], 0)) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], 0)
        tl.store(out_ptr + t * stride_ot + head * stride_oh + offs_v, o, mask=v_mask)
    tl.store(s_ptrs, s, mask=s_mask)


@triton.jit
def _unit_lower_inverse(a, BLOCK_T: tl.constexpr, UPCAST: tl.constexpr):
    """``(I + a)^-1`` for a strictly lower-triangular ``[BLOCK_T, BLOCK_T]`` tile (``BLOCK_T = 64``).

    The four 16x16 diagonal blocks are inverted together by forward substitution (row ``i`` of each
    block is ``e_i - a_i @ inv`` over the rows above it: 15 steps), then merged: with ``D`` that
    block-diagonal inverse and ``N = D a_off`` (``a_off`` = ``a`` below the diagonal blocks),
    ``I + a = (I + a_diag)(I + N)`` and ``N`` is strictly block-lower over 4 blocks, so ``N^4 = 0``
    and ``(I + a)^-1 = (I - N)(I + N^2) D``.
    """
    rows = tl.arange(0, BLOCK_T)
    same_block = (rows[:, None] // 16) == (rows[None, :] // 16)
    eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    a_diag = tl.where(same_block, a, 0.0)
    inv = eye
    for i in range(1, 16):
        row_i = (rows % 16) == i
        inv = tl.where(row_i[:, None], eye - mma(tl.where(row_i[:, None], a_diag, 0.0), inv, UPCAST), inv)
    n = mma(inv, tl.where(same_block, 0.0, a), UPCAST)
    return mma(mma(eye - n, eye + mma(n, n, UPCAST), UPCAST), inv, UPCAST)


@triton.jit
def _chunk_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_ptr, cu_ptr, slot_ptr,
    stride_qt, stride_qh, stride_vt, stride_vh, stride_gt, stride_ot, stride_oh,
    stride_ss, stride_sh, stride_sk,
    GROUP, K, V,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, UPCAST: tl.constexpr,
):
    seq, head, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(cu_ptr + seq)
    end = tl.load(cu_ptr + seq + 1)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    k_head = head // GROUP
    offs_t = tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask, v_mask = offs_k < K, offs_v < V
    s_mask = k_mask[:, None] & v_mask[None, :]
    s_ptrs = state_ptr + slot * stride_ss + head * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    s = tl.load(s_ptrs, mask=s_mask, other=0.0)                                   # [BLOCK_K, BLOCK_V] fp32
    lower = offs_t[:, None] >= offs_t[None, :]
    strict = offs_t[:, None] > offs_t[None, :]
    for c0 in range(start, end, BLOCK_T):
        rows = c0 + offs_t
        t_mask = rows < end
        qk_off = rows[:, None] * stride_qt + k_head * stride_qh + offs_k[None, :]
        qk_mask = t_mask[:, None] & k_mask[None, :]
        q = tl.load(q_ptr + qk_off, mask=qk_mask, other=0.0).to(tl.float32)       # [BLOCK_T, BLOCK_K]
        k = tl.load(k_ptr + qk_off, mask=qk_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + rows[:, None] * stride_vt + head * stride_vh + offs_v[None, :],
                    mask=t_mask[:, None] & v_mask[None, :], other=0.0).to(tl.float32)   # [BLOCK_T, BLOCK_V]
        g = tl.load(g_ptr + rows * stride_gt + head, mask=t_mask, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + rows * stride_gt + head, mask=t_mask, other=0.0).to(tl.float32)
        cum = tl.cumsum(g, 0)                                                      # padded rows add 0
        cum_last = tl.sum(tl.where(offs_t == BLOCK_T - 1, cum, 0.0), 0)
        decay = tl.exp(tl.where(lower, cum[:, None] - cum[None, :], float("-inf")))   # [BLOCK_T, BLOCK_T]
        k_beta = k * beta[:, None]
        a = tl.where(strict, mma(k_beta, tl.trans(k), UPCAST) * decay, 0.0)
        inv = _unit_lower_inverse(a, BLOCK_T, UPCAST)
        u = mma(inv, v * beta[:, None], UPCAST)                                    # [BLOCK_T, BLOCK_V]
        w = mma(inv, k_beta * tl.exp(cum)[:, None], UPCAST)                        # [BLOCK_T, BLOCK_K]
        v_new = u - mma(w, s, UPCAST)
        intra = mma(q, tl.trans(k), UPCAST) * decay
        o = mma(q * tl.exp(cum)[:, None], s, UPCAST) + mma(intra, v_new, UPCAST)
        tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_v[None, :], o,
                 mask=t_mask[:, None] & v_mask[None, :])
        k_decayed = k * tl.exp(cum_last - cum)[:, None]
        s = s * tl.exp(cum_last) + mma(tl.trans(k_decayed), v_new, UPCAST)
    tl.store(s_ptrs, s, mask=s_mask)


def _launch_args(q, k, v, g, beta, cu_seqlens, state, slots):
    check_launchable(q, k, v, g, beta, cu_seqlens, state, slots)
    _check(q, k, v, g, beta, cu_seqlens, state, slots)
    assert q.stride() == k.stride() and q.stride(-1) == 1 and v.stride(-1) == 1, "q/k/v rows must be contiguous"
    assert g.stride() == beta.stride() and g.stride(-1) == 1, "g and beta must share a contiguous layout"
    assert state.stride(-1) == 1, "state rows must be contiguous"
    num_v_heads, k_dim, v_dim = state.shape[1:]
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    return out, num_v_heads // k.shape[1], k_dim, v_dim


def gated_delta_recurrent_triton(q, k, v, g, beta, cu_seqlens, state, slots) -> torch.Tensor:
    """Triton :func:`kernels.gated_delta.gated_delta_recurrent_ref` (same arguments and result);
    ``state`` is updated in place at ``slots``."""
    out, group, k_dim, v_dim = _launch_args(q, k, v, g, beta, cu_seqlens, state, slots)
    num_seqs = slots.shape[0]
    block_v = min(pow2(v_dim), 64)
    if num_seqs and v.shape[0]:
        _recurrent_kernel[(num_seqs, state.shape[1], triton.cdiv(v_dim, block_v))](
            q, k, v, g, beta, out, state, cu_seqlens, slots,
            q.stride(0), q.stride(1), v.stride(0), v.stride(1), g.stride(0), out.stride(0), out.stride(1),
            state.stride(0), state.stride(1), state.stride(2),
            group, k_dim, v_dim, BLOCK_K=pow2(k_dim), BLOCK_V=block_v, num_warps=4)
    return out


def gated_delta_chunk_triton(q, k, v, g, beta, cu_seqlens, state, slots) -> torch.Tensor:
    """Triton :func:`kernels.gated_delta.gated_delta_chunk_ref` (chunks of 64 tokens, same
    arguments and result); ``state`` is updated in place at ``slots``."""
    out, group, k_dim, v_dim = _launch_args(q, k, v, g, beta, cu_seqlens, state, slots)
    num_seqs = slots.shape[0]
    block_v = min(pow2(v_dim, 16), 32)   # the state slice, q/k/w tiles and the 64x64 inverse share registers
    if num_seqs and v.shape[0]:
        _chunk_kernel[(num_seqs, state.shape[1], triton.cdiv(v_dim, block_v))](
            q, k, v, g, beta, out, state, cu_seqlens, slots,
            q.stride(0), q.stride(1), v.stride(0), v.stride(1), g.stride(0), out.stride(0), out.stride(1),
            state.stride(0), state.stride(1), state.stride(2),
            group, k_dim, v_dim, BLOCK_T=64, BLOCK_K=pow2(k_dim, 16), BLOCK_V=block_v, UPCAST=interpreting(),
            num_warps=8)
    return out
