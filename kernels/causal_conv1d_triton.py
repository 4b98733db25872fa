"""Triton causal depthwise conv1d with window states; contract: :func:`kernels.causal_conv1d.causal_conv1d_ref`.

One program per (sequence, block of channels) walks the sequence's tokens; each tap reads the
input either from ``x`` (inside this call) or from the window state (before it), by two masked
loads. The new window is written last, in increasing tap order: tap ``j`` reads old entry
``j + L`` (``L >= 1`` tokens) before anything at or after it is overwritten.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.kernels.causal_conv1d import _check
from shardserve.kernels.triton_utils import check_launchable, pow2


@triton.jit
def _causal_conv1d_kernel(
    x_ptr, w_ptr, out_ptr, state_ptr, cu_ptr, slot_ptr,
    stride_xt, stride_ot, stride_wc, stride_ss, stride_sc, C,
    WIDTH: tl.constexpr, SILU: tl.constexpr, BLOCK_C: tl.constexpr,
):
    seq, cb = tl.program_id(0), tl.program_id(1)
    start = tl.load(cu_ptr + seq)
    end = tl.load(cu_ptr + seq + 1)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = offs_c < C
    state_row = state_ptr + slot * stride_ss + offs_c * stride_sc
    for t in range(start, end):
        acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
        for j in tl.static_range(WIDTH):
            rel = t - start - (WIDTH - 1) + j          # input position relative to the sequence start
            from_x = c_mask & ((rel + offs_c * 0) >= 0)
            from_state = c_mask & ((rel + offs_c * 0) < 0)
            x_val = tl.load(x_ptr + (start + tl.maximum(rel, 0)) * stride_xt + offs_c, mask=from_x, other=0.0)
            s_val = tl.load(state_row + (WIDTH - 1 + tl.minimum(rel, -1)), mask=from_state, other=0.0)
            w = tl.load(w_ptr + offs_c * stride_wc + j, mask=c_mask, other=0.0)
            acc += w.to(tl.float32) * (x_val.to(tl.float32) + s_val.to(tl.float32))
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(out_ptr + t * stride_ot + offs_c, acc, mask=c_mask)
    length = end - start
    for j in tl.static_range(WIDTH - 1):
        rel = length - (WIDTH - 1) + j
        from_x = c_mask & ((rel + offs_c * 0) >= 0)
        from_state = c_mask & ((rel + offs_c * 0) < 0)
        x_val = tl.load(x_ptr + (start + tl.maximum(rel, 0)) * stride_xt + offs_c, mask=from_x, other=0.0)
        s_val = tl.load(state_row + (WIDTH - 1 + tl.minimum(rel, -1)), mask=from_state, other=0.0)
        tl.store(state_row + j, tl.where(from_x, x_val, s_val), mask=c_mask)


def causal_conv1d_triton(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, conv_state: torch.Tensor,
                         slots: torch.Tensor, silu: bool = True) -> torch.Tensor:
    """Triton :func:`kernels.causal_conv1d.causal_conv1d_ref` (same arguments and result);
    ``conv_state`` is updated in place at ``slots``."""
    check_launchable(x, weight, cu_seqlens, conv_state, slots)
    _check(x, weight, cu_seqlens, conv_state, slots)
    assert x.stride(1) == 1 and weight.stride(1) == 1 and conv_state.stride(2) == 1, \
        "x rows, weight rows and each channel's window must be contiguous"
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    channels, width = weight.shape
    block_c = min(pow2(channels), 256)
    if slots.shape[0] and x.shape[0]:
        _causal_conv1d_kernel[(slots.shape[0], triton.cdiv(channels, block_c))](
            x, weight, out, conv_state, cu_seqlens, slots,
            x.stride(0), out.stride(0), weight.stride(0), conv_state.stride(0), conv_state.stride(1), channels,
            WIDTH=width, SILU=silu, BLOCK_C=block_c, num_warps=4)
    return out
