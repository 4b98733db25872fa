"""Shared pieces of the Triton launchers: device checks, block sizes, split-K combine.

Imported lazily (only once a Triton path runs), so ``import kernels`` never imports Triton:
``TRITON_INTERPRET=1`` must be in the environment before Triton itself is imported, and the
tests set it in ``tests/kernels/conftest.py``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# NOTE: every matmul in kernels/ goes through `mma`: fp32 operands use input_precision="ieee"
# (no TF32 truncation), bf16/fp16 operands the tensor cores. fp32 is the checking dtype, not the
# fast path.


@triton.jit
def mma(a, b, UPCAST: tl.constexpr):
    """``tl.dot(a, b)`` with fp32 accumulation; ``UPCAST`` casts both operands to fp32 first.

    Launchers pass ``UPCAST=interpreting()``: Triton's CPU interpreter multiplies bf16 operands
    as their raw uint16 bits. bf16 x bf16 products are exact in fp32, so upcasting gives the
    same numbers the tensor cores give (up to summation order).
    """
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if a.dtype.is_fp32():
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def check_launchable(*tensors: torch.Tensor) -> None:
    """Fail early, with a clear message, when Triton cannot run on these tensors.

    Raises:
        RuntimeError: a CPU tensor without ``TRITON_INTERPRET=1``, or CUDA tensors under it.
    """
    on_cuda = [t.is_cuda for t in tensors]
    if interpreting():
        if any(on_cuda):
            raise RuntimeError("TRITON_INTERPRET=1 runs kernels on CPU tensors only; got CUDA tensors")
        if type(tl.sum).__name__ != "InterpretedFunction":  # decided once, when triton was imported
            raise RuntimeError("TRITON_INTERPRET=1 was set after triton was imported; set it before the "
                               "first import of triton (e.g. in the environment)")
    elif not all(on_cuda):
        raise RuntimeError("Triton kernels need CUDA tensors; on CPU set TRITON_INTERPRET=1 before "
                           "triton is imported, or use SHARDSERVE_KERNELS=torch")


def pow2(value: int, minimum: int = 1) -> int:
    """Smallest power of two ``>= max(value, minimum)`` (block sizes must be powers of two)."""
    return max(triton.next_power_of_2(max(int(value), 1)), minimum)


def token_metadata(query_start_loc: torch.Tensor | None, seq_lens: torch.Tensor,
                   num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 ``(token_seq, token_pos)`` for the kernels; see :func:`kernels.paged_attention.token_seq_and_pos`."""
    from shardserve.kernels.paged_attention import token_seq_and_pos

    token_seq, token_pos = token_seq_and_pos(query_start_loc, seq_lens, num_tokens)
    return token_seq.to(torch.int32).contiguous(), token_pos.to(torch.int32).contiguous()


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (4 under the interpreter: small grids still split)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def gemm_split_k(num_tiles: int, k_steps: int, device: torch.device, max_split: int = 16) -> int:
    """Split-K factor for a skinny GEMM whose output grid has ``num_tiles`` programs and whose K
    loop has ``k_steps`` steps: enough splits to give every SM about two programs (decode GEMMs
    have few output tiles: N = 7168 in 64-column tiles is 112 programs on 132 SMs, N = 576 only 9),
    never fewer than 4 K steps per split."""
    target = 2 * num_sms(device)
    if num_tiles >= target:
        return 1
    return max(1, min(-(-target // num_tiles), k_steps // 4, max_split))


def choose_splits(max_keys: int, num_programs: int, block_n: int, num_splits: int | None,
                  target_programs: int = 512, min_keys_per_split: int = 256) -> tuple[int, int]:
    """Split-K plan for a context of up to ``max_keys`` keys.

    Splits only when the other grid dims leave the GPU idle (fewer than ``target_programs``
    programs) and the context is long; ``num_splits`` forces a count (tests).

    Returns:
        ``(num_splits, keys_per_split)`` with ``keys_per_split`` a multiple of ``block_n``.
    """
    max_keys = max(int(max_keys), 1)
    if num_splits is None:
        by_length = triton.cdiv(max_keys, min_keys_per_split)
        by_idle = triton.cdiv(target_programs, max(num_programs, 1))
        num_splits = max(1, min(by_length, by_idle, 64))
    keys_per_split = triton.cdiv(triton.cdiv(max_keys, num_splits), block_n) * block_n
    return triton.cdiv(max_keys, keys_per_split), keys_per_split


@triton.jit
def _combine_splits_kernel(
    part_ptr, lse_ptr, out_ptr,
    stride_pt, stride_ph, stride_ps,
    stride_lt, stride_lh,
    stride_ot, stride_oh,
    num_splits, D,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per (token, head): merge the per-split softmax partials.
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < D
    lse = tl.load(lse_ptr + t * stride_lt + h * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty (sparse rows): output 0
    w = tl.exp2(lse - m)                                                     # [BLOCK_S]
    part = tl.load(part_ptr + t * stride_pt + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                   mask=s_mask[:, None] & d_mask[None, :], other=0.0)        # [BLOCK_S, BLOCK_D]
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * part, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, out, mask=d_mask)


def split_buffers(num_tokens: int, num_heads: int, num_splits: int, dim: int, out: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where a split-K attention kernel writes: ``(partials, lse, stride_split)``.

    With one split the kernel writes the final output directly (``stride_split`` 0);
    otherwise fp32 partials ``[T, H, S, D]`` and base-2 log-sum-exps ``[T, H, S]``.
    """
    lse = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=out.device)
    if num_splits == 1:
        return out.view(num_tokens, num_heads, 1, dim), lse, 0
    part = torch.empty(num_tokens, num_heads, num_splits, dim, dtype=torch.float32, device=out.device)
    return part, lse, part.stride(2)


def combine_splits(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> None:
    """Merge split-K partials into ``out [T, H, D]`` in place (no-op for one split).

    Args:
        part: ``[T, H, S, D]`` float32 partial outputs, each normalized by its own split's sum.
        lse: ``[T, H, S]`` float32 base-2 log-sum-exp of each split's scores, ``-inf`` if empty.
        out: ``[T, H, D]`` any float dtype.
    """
    num_tokens, num_heads, num_splits, dim = part.shape
    if num_splits == 1 or num_tokens == 0:
        return
    _combine_splits_kernel[(num_tokens, num_heads)](
        part, lse, out, part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), num_splits, dim,
        BLOCK_S=pow2(num_splits), BLOCK_D=pow2(dim))
