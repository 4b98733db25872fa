"""DeepSeek Sparse Attention (DSA) lightning indexer with a paged indexer-key cache.

Math follows transformers' ``DeepseekV32Indexer`` / ``GlmMoeDsaIndexer`` (the parity oracle),
which is DeepSeek-V3.2-Exp ``inference/model.py: Indexer`` without the FP8 scoring:

    q = wq_b(q_latent)                  [T, H_idx, D_idx]     (q_latent = q_a_layernorm(q_a_proj(x)))
    k = LayerNorm(wk(x))                [T, D_idx]            (one key head, LayerNorm with bias)
    RoPE on the first qk_rope_head_dim dims of q and k: half-split (rotate_half) for DeepSeek-V3.2,
        interleaved pairs for GLM-MoE-DSA
    w = weights_proj(x) * H_idx^-0.5    [T, H_idx]            (float32)
    score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s] * D_idx^-0.5)
    top-k over the causal keys of t's own sequence.

The key cache holds keys in the model dtype or, with ``cache_dtype="fp8"``, in DeepSeek-V3.2's fp8
format (e4m3 values + a power-of-two scale per 128 dims, packed per slot; see
:func:`kernels.indexer.quantize_index_keys`): 132 instead of 256 bytes per token for bf16
``index_head_dim=128``. With it the queries are quantized the same way and scored fp8 x fp8
(DeepSeek-V3.2's ``act_quant(q)`` + ``fp8_index``), so scores move by the e4m3 rounding of both.

``sink`` (``--dsa-sink``, default 0) keeps the first ``sink`` positions of each sequence in every
query's top-k (ik_llama.cpp's GLM-5.2 DSA port: an imperfect indexer that drops a sequence's
attention sink makes decoding collapse); see :func:`kernels.indexer.select_topk`.

Optionally (default on) q and k are rotated by the normalized Walsh-Hadamard matrix before the
key is cached, as DeepSeek's reference does (``rotate_activation``): ``(Hq).(Hk) = q.k`` so the
scores, and the top-k, are unchanged up to float rounding; transformers omits it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.kernels import apply_rotary, indexer_topk, store_cache
from shardserve.kernels.hadamard import hadamard_transform
from shardserve.kernels.indexer import fp8_row_bytes, quantize_index_keys, quantize_index_queries
from shardserve.workers.forward_context import AttentionMetadata
from shardserve.workers.layers.linear import ColumnParallelLinear

def selection_mask(topk: torch.Tensor, num_keys: int) -> torch.Tensor:
    """``[T, k]`` int positions (``-1`` = padding) -> ``[T, num_keys]`` bool (True = selected)."""
    index = torch.where(topk >= 0, topk.long(), num_keys)                  # padding -> a dropped column
    mask = torch.zeros(topk.shape[0], num_keys + 1, dtype=torch.bool, device=topk.device)
    return mask.scatter_(-1, index, True)[:, :num_keys]


class DSAIndexer(nn.Module):
    """Lightning indexer of one layer; replicated on every TP rank (DESIGN.md: top-k identical on
    all ranks without communication).

    Args:
        config: HF config with ``index_n_heads``, ``index_head_dim``, ``q_lora_rank``,
            ``qk_rope_head_dim``, ``hidden_size``.
        rope_interleaved: RoPE pair layout of the reference (False for DeepSeek-V3.2, True for GLM).
        hadamard: rotate q and k by the Walsh-Hadamard matrix (score-preserving).
        dtype: parameter dtype (``weights_proj`` stays float32, as HF keeps it).
        cache_dtype: ``"auto"`` (keys cached in ``dtype``) or ``"fp8"`` (packed fp8 rows, fp8 queries).
        sink: first positions of each sequence always selected (0 = plain top-k, as transformers).

    ``k_cache`` (shape and dtype from :meth:`cache_spec`) is set by the attention layer's cache setter.

    Raises:
        ValueError: an unknown ``cache_dtype``, a non-power-of-two ``index_head_dim`` with the
            Hadamard rotation on, an fp8 cache with ``index_head_dim % 4 != 0``, or ``sink < 0``.
    """

    def __init__(self, config, rope_interleaved: bool, hadamard: bool, dtype: torch.dtype,
                 cache_dtype: str = "auto", sink: int = 0) -> None:
        super().__init__()
        if cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"indexer cache dtype must be 'auto' or 'fp8', got {cache_dtype!r}")
        if sink < 0:
            raise ValueError(f"DSA sink must be >= 0, got {sink}")
        self.sink = sink
        self.num_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.rope_interleaved = rope_interleaved
        self.hadamard = hadamard
        if hadamard and self.head_dim & (self.head_dim - 1):
            raise ValueError(f"Hadamard rotation needs a power-of-two index_head_dim, got {self.head_dim}; "
                             f"turn it off (shardserve_hadamard=False)")
        hidden = config.hidden_size
        self.wq_b = ColumnParallelLinear(config.q_lora_rank, [(self.num_heads * self.head_dim, 0,
                                                               self.num_heads * self.head_dim)], dtype=dtype)
        self.wk = ColumnParallelLinear(hidden, [(self.head_dim, 0, self.head_dim)], dtype=dtype)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6, dtype=dtype)
        self.k_norm.requires_grad_(False)
        self.weights_proj = ColumnParallelLinear(hidden, [(self.num_heads, 0, self.num_heads)], dtype=torch.float32)
        self.cache_fp8 = cache_dtype == "fp8"
        self.param_dtype = dtype
        if self.cache_fp8:
            fp8_row_bytes(self.head_dim)               # raises for a head dim the format cannot pack
        self.k_cache: torch.Tensor | None = None

    def cache_spec(self, num_blocks: int, block_size: int) -> tuple[tuple[int, ...], torch.dtype]:
        """``(shape, dtype)`` of the indexer-key cache: ``[num_blocks, block_size, index_head_dim]``
        in the model dtype, or uint8 ``[num_blocks, block_size, fp8_row_bytes(index_head_dim)]``."""
        if self.cache_fp8:
            return (num_blocks, block_size, fp8_row_bytes(self.head_dim)), torch.uint8
        return (num_blocks, block_size, self.head_dim), self.param_dtype

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on the first ``rope_dim`` dims of ``x [T, heads, head_dim]``."""
        rot, rest = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat((apply_rotary(rot, cos, sin, self.rope_interleaved), rest), dim=-1)

    def forward(self, hidden: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, top_k: int) -> torch.Tensor | None:
        """Cache this step's indexer keys and select each query token's top-k keys.

        Scoring and selection run in :func:`kernels.indexer_topk` (Triton on GPU) over the paged
        indexer cache, in row chunks of bounded logits (memory independent of the context); ``n_heads^-0.5`` and the softmax scale ``D_idx^-0.5`` are folded into the
        weights (both positive, so ``w * relu(s * q.k) == (w * s) * relu(q.k)``).

        Args:
            hidden: ``[T, hidden_size]`` normed layer input.
            q_latent: ``[T, q_lora_rank]`` the MLA query latent (after ``q_a_layernorm``).
            cos, sin: ``[T, qk_rope_head_dim // 2]`` RoPE angles of the tokens' positions.
            meta: the step's attention metadata (slot mapping, block tables, sequence lengths).
            top_k: keys kept per query (the first ``sink`` positions of each sequence among them).

        Returns:
            ``[T, top_k]`` int32 positions within each token's own sequence, best first, ``-1``
            where a token sees fewer than ``top_k`` keys; or None when every sequence has at most
            ``top_k`` keys (the indexer is then an exact no-op: every key is kept).
        """
        num_tokens = hidden.shape[0]
        q = self.wq_b(q_latent).view(num_tokens, self.num_heads, self.head_dim)
        k = F.layer_norm(self.wk(hidden), (self.head_dim,), self.k_norm.weight, self.k_norm.bias, self.k_norm.eps)
        q = self._rope(q, cos, sin)
        k = self._rope(k[:, None, :], cos, sin)[:, 0]
        if self.hadamard:
            q, k = hadamard_transform(q), hadamard_transform(k)
        store_cache(quantize_index_keys(k) if self.cache_fp8 else k, self.k_cache, meta.slot_mapping)
        if meta.max_seq_len <= top_k:
            return None
        weights = self.weights_proj(hidden.float()) * (self.num_heads ** -0.5 * self.head_dim ** -0.5)   # [T, H_idx]
        q, q_scale = quantize_index_queries(q) if self.cache_fp8 else (q, None)
        decode = meta.max_query_len == 1               # one query per sequence: the batched decode path
        return indexer_topk(q, weights, self.k_cache, meta.block_tables, meta.seq_lens, top_k,
                            None if decode else meta.query_start_loc, meta.max_seq_len, q_scale=q_scale,
                            sink=self.sink, query_start_host=meta.query_start_host, seq_lens_host=meta.seq_lens_host)
