"""Dense causal MLA prefill, expanded through ``kv_b_proj`` one key chunk at a time.

For prefill chunks of many tokens the expanded form is cheaper than the absorbed one of
:mod:`kernels.mla_attention` (per query, key and head: ``nope + rope + v`` multiply-adds instead
of ``2 * kv_lora_rank + rope``, for one expansion per key and head amortized over the queries;
see :func:`expanded_is_cheaper`). The context is read back from the paged latent cache in
chunks of ``C`` positions, expanded to ``k_nope`` / ``v`` (``[B, C, H, nope + v]``) and attended
with FlashAttention's online softmax (Dao et al. 2022; vLLM's MLA prefill reads its cached
context in bounded chunks the same way): nothing of size ``tokens x context`` is allocated and
the chunk buffer is bounded by :data:`kernels.workspace.WORKSPACE_ELEMENTS`, so memory does not
grow with the context (only the cache itself does). Math: transformers' ``DeepseekV3Attention``

    q = [q_nope, q_pe];  k = [c W_UK, k_pe];  v = c W_UV;  out = softmax(q k^T * scale + causal) v
"""

from __future__ import annotations

import torch

from shardserve.kernels.dispatch import use_triton
from shardserve.kernels.paged_attention import token_seq_and_pos
from shardserve.kernels.workspace import WORKSPACE_ELEMENTS


def expanded_is_cheaper(query_len: int, kv_lora_rank: int, nope_dim: int, rope_dim: int, v_dim: int) -> bool:
    """Whether a sequence computing ``query_len`` tokens costs fewer multiply-adds expanded than
    absorbed: ``q (nope + rope + v) + kv_lora (nope + v) < q (2 kv_lora + rope)`` per key and head
    (the expansion of each key is shared by the sequence's ``q`` queries). DeepSeek-V3's ranks
    (512, 128, 64, 128) switch at 171 tokens; one decode token is always absorbed."""
    expanded = query_len * (nope_dim + rope_dim + v_dim) + kv_lora_rank * (nope_dim + v_dim)
    return expanded < query_len * (2 * kv_lora_rank + rope_dim)


def expanded_chunk_keys(num_seqs: int, num_heads: int, kv_dim: int, row_width: int, block_size: int,
                        budget: int = WORKSPACE_ELEMENTS) -> int:
    """Key positions per chunk of :func:`mla_prefill_dense`: the expanded ``[B, C, H, nope + v]``
    and the gathered ``[B, C, L + R]`` stay within ``budget`` elements (at least one block)."""
    return max(block_size, budget // max(1, num_seqs * max(num_heads * kv_dim, row_width)))


def mla_prefill_dense(q_nope: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                      w_kv: torch.Tensor, scale: float, *, query_start_host: list[int], seq_lens_host: list[int],
                      budget: int = WORKSPACE_ELEMENTS) -> torch.Tensor:
    """Causal dense MLA over each sequence's whole context, expanded per key chunk.

    Args:
        q_nope: ``[T, H, qk_nope_head_dim]`` packed queries (not absorbed).
        q_pe: ``[T, H, qk_rope_head_dim]`` RoPE'd query part.
        latent_cache: ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``, this step's
            rows already stored.
        block_tables: ``[B, max_blocks]`` int.
        seq_lens: ``[B]`` int, context lengths after this step.
        query_start_loc: ``[B + 1]`` cumulative query counts; query i of sequence b is at position
            ``seq_lens[b] - q_len_b + i`` and sees positions ``<=`` its own.
        w_kv: ``[H, qk_nope_head_dim + v_head_dim, kv_lora_rank]`` this rank's ``kv_b_proj`` weight
            per head (``W_UK`` rows, then ``W_UV`` rows).
        scale: softmax scale.
        query_start_host, seq_lens_host: host copies of ``query_start_loc`` / ``seq_lens``.
        budget: elements of the expanded chunk ``[B, C, H, nope + v]`` (and of the reference's
            score tiles).

    Returns:
        ``[T, H, v_head_dim]`` in ``q_nope.dtype``.
    """
    num_tokens, num_heads, nope_dim = q_nope.shape
    kv_dim, kv_lora_rank = w_kv.shape[1], w_kv.shape[2]
    block_size, row_width = latent_cache.shape[1], latent_cache.shape[2]
    assert w_kv.shape[0] == num_heads and row_width == kv_lora_rank + q_pe.shape[-1], \
        f"w_kv {tuple(w_kv.shape)} / latent rows {row_width} vs q {tuple(q_nope.shape)} + {tuple(q_pe.shape)}"
    num_seqs, max_len = len(seq_lens_host), max(seq_lens_host, default=0)
    chunk = expanded_chunk_keys(num_seqs, num_heads, kv_dim, row_width, block_size, budget)
    weight = w_kv.reshape(num_heads * kv_dim, kv_lora_rank)
    cache_rows = latent_cache.view(-1, row_width)
    state = PrefillState.empty(num_tokens, num_heads, kv_dim - nope_dim, q_nope.device)
    _, token_pos = token_seq_and_pos(query_start_loc, seq_lens, num_tokens)
    triton_chunk = None
    if use_triton(q_nope):
        from shardserve.kernels.mla_prefill_triton import attend_chunk_triton as triton_chunk
    for lo in range(0, max_len, chunk):
        pos = torch.arange(lo, min(lo + chunk, max_len), device=q_nope.device)
        slots = block_tables[:, pos // block_size].long() * block_size + pos % block_size          # [B, C]
        latent = cache_rows[slots]                                                           # [B, C, L + R]
        kv = (latent[..., :kv_lora_rank].to(weight.dtype) @ weight.T).view(num_seqs, -1, num_heads, kv_dim)
        k_pe = latent[..., kv_lora_rank:]                                                    # [B, C, R]
        if triton_chunk is not None:
            triton_chunk(q_nope, q_pe, kv, k_pe, lo, state, query_start_loc, seq_lens, scale,
                         max(b - a for a, b in zip(query_start_host[:-1], query_start_host[1:])))
        else:
            _attend_chunk_ref(q_nope, q_pe, kv, k_pe, lo, state, token_pos, query_start_host, seq_lens_host,
                              scale, budget)
    return state.output(q_nope.dtype)


class PrefillState:
    """Running online-softmax state of every (query token, head): ``acc [T, H, v]`` (unnormalized
    float32 sum of ``p * v``), ``row_max [T, H]`` and ``denom [T, H]`` (float32)."""

    __slots__ = ("acc", "row_max", "denom")

    def __init__(self, acc: torch.Tensor, row_max: torch.Tensor, denom: torch.Tensor) -> None:
        self.acc, self.row_max, self.denom = acc, row_max, denom

    @classmethod
    def empty(cls, num_tokens: int, num_heads: int, v_dim: int, device: torch.device) -> PrefillState:
        return cls(torch.zeros(num_tokens, num_heads, v_dim, dtype=torch.float32, device=device),
                   torch.full((num_tokens, num_heads), float("-inf"), dtype=torch.float32, device=device),
                   torch.zeros(num_tokens, num_heads, dtype=torch.float32, device=device))

    def output(self, dtype: torch.dtype) -> torch.Tensor:
        """``acc / denom`` in ``dtype`` (every causal row has at least its own key)."""
        return (self.acc / self.denom.clamp(min=1e-30)[..., None]).to(dtype)


def _attend_chunk_ref(q_nope, q_pe, kv, k_pe, lo, state: PrefillState, token_pos, query_start_host, seq_lens_host,
                      scale, budget) -> None:
    """Torch reference of one key chunk (keys at positions ``lo..lo+C-1`` of every sequence):
    per sequence, query sub-chunks whose ``[rows, H, C]`` scores fit ``budget``; natural-log
    online softmax in float32."""
    num_heads, nope_dim = q_nope.shape[1:]
    chunk = kv.shape[1]
    rows_per_tile = max(1, budget // max(1, num_heads * chunk))
    for seq, (first, end) in enumerate(zip(query_start_host[:-1], query_start_host[1:])):
        num_keys = min(chunk, seq_lens_host[seq] - lo)
        first_pos = seq_lens_host[seq] - (end - first)
        if num_keys <= 0:
            continue
        k_nope = kv[seq, :num_keys, :, :nope_dim].float()                        # [C, H, nope]
        value = kv[seq, :num_keys, :, nope_dim:].float()                         # [C, H, v]
        key_pe = k_pe[seq, :num_keys].float()                                    # [C, R]
        key_pos = torch.arange(lo, lo + num_keys, device=q_nope.device)
        for start in range(first, end, rows_per_tile):
            stop = min(start + rows_per_tile, end)
            if lo > first_pos + (stop - 1 - first):                              # chunk after these rows
                continue
            rows = slice(start, stop)
            scores = (torch.einsum("qhn,khn->qhk", q_nope[rows].float(), k_nope)
                      + torch.einsum("qhr,kr->qhk", q_pe[rows].float(), key_pe)) * scale
            scores.masked_fill_((key_pos[None, :] > token_pos[rows, None])[:, None, :], float("-inf"))
            new_max = torch.maximum(state.row_max[rows], scores.amax(-1))
            safe_max = torch.where(new_max == float("-inf"), 0.0, new_max)
            probs = torch.exp(scores - safe_max[..., None])
            rescale = torch.exp(state.row_max[rows] - safe_max)
            state.denom[rows] = state.denom[rows] * rescale + probs.sum(-1)
            state.acc[rows] = state.acc[rows] * rescale[..., None] + torch.einsum("qhk,khv->qhv", probs, value)
            state.row_max[rows] = new_max
