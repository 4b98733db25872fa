"""Multi-head Latent Attention (DeepSeek-V2, arXiv:2405.04434, Sec. 2.1) on a paged latent cache,
optionally sparsified by the DSA indexer (DeepSeek-V3.2).

Math follows transformers' ``DeepseekV3Attention`` / ``DeepseekV32Attention`` /
``GlmMoeDsaAttention``:

    q        = q_b_proj(q_a_layernorm(q_a_proj(x)))  or  q_proj(x)       [T, H, nope + rope]
    c, k_pe  = split(kv_a_proj_with_mqa(x));  c = kv_a_layernorm(c)      [T, kv_lora], [T, rope]
    RoPE on q_pe and k_pe (interleaved pairs; DeepseekV3 only when ``config.rope_interleave``)
    k_nope, v = split(kv_b_proj(c))                                      [S, H, nope], [S, H, v]
    softmax scale = qk_head_dim^-0.5 * mscale^2 (YaRN, ``mscale_all_dim``)

The cache holds ``[c, k_pe]`` per token (``[num_blocks, block_size, kv_lora + rope]``, the same on
every rank; heads are split across ranks in whole heads, possibly unevenly). Two exact forms of
the same math: absorbed (``W_UK`` folded into the query, ``q_lat = q_nope W_UK``, scores against
the latent rows directly, ``W_UV`` after attention: the context is never expanded) for decode,
DSA's sparse prefill (each token reads only its top-k latent rows) and short query chunks; and
expanded (``k_nope, v = kv_b_proj(c)`` one key chunk at a time, FlashAttention's online softmax)
for long dense prefill chunks. No step allocates anything of size ``tokens x context``
(:mod:`kernels.workspace`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from shardserve.kernels import apply_rotary, store_cache
from shardserve.kernels.mla_attention import mla_attention
from shardserve.kernels.mla_prefill import mla_prefill_dense
from shardserve.workers.compilation import opaque_call
from shardserve.workers.forward_context import get_attention_metadata
from shardserve.workers.layers.linear import ColumnParallelLinear, RowParallelLinear
from shardserve.workers.layers.norm import RMSNorm
from shardserve.workers.layers.rotary import RotaryEmbedding
from shardserve.workers.models.dsa_indexer import DSAIndexer
from shardserve.workers.models.paged_batch import PagedBatch


def mla_softmax_scale(config) -> float:
    """``qk_head_dim^-0.5``, times ``mscale^2`` for YaRN with ``mscale_all_dim`` (HF ``yarn_apply_mscale``)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        mscale_all_dim = params.get("mscale_all_dim", 0)
        factor = params.get("factor", 1.0)
        if mscale_all_dim and factor > 1:
            mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale = scale * mscale * mscale
    return scale


def _replicated(in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> ColumnParallelLinear:
    return ColumnParallelLinear(in_features, [(out_features, 0, out_features)], bias=bias, dtype=dtype)


class MLAAttention(nn.Module):
    """MLA over this rank's heads, with an optional DSA indexer.

    Args:
        config: HF DeepseekV3 / DeepseekV32 / GlmMoeDsa config.
        head_range: ``(first_head, num_local_heads)`` on this rank.
        rotary: the model's RoPE table (``[max_positions, qk_rope_head_dim // 2]``).
        rope_interleaved: pair layout of the MLA RoPE.
        indexer: this layer's own indexer, or None.
        shares_topk: use the selection of the most recent layer with an indexer (GLM IndexShare).

    ``forward(positions [T], hidden [T, hidden], top_k) -> [T, hidden]``; the step's DSA selection
    passes from a layer with an indexer to the "shared" layers after it through the step's
    metadata (:meth:`opaque_forward`).
    ``kv_cache`` is set by the runner: ``(latent_cache[, indexer_cache])``.
    """

    def __init__(self, config, head_range: tuple[int, int], rotary: RotaryEmbedding, rope_interleaved: bool,
                 indexer: DSAIndexer | None, shares_topk: bool, dtype: torch.dtype) -> None:
        super().__init__()
        first, count = head_range
        self.num_heads = count
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        qk_dim = self.nope_dim + self.rope_dim
        hidden, bias = config.hidden_size, bool(getattr(config, "attention_bias", False))
        heads = config.num_attention_heads
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, [(heads * qk_dim, first * qk_dim, count * qk_dim)], dtype=dtype)
        else:
            self.q_a_proj = _replicated(hidden, self.q_lora_rank, bias, dtype)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6, dtype)   # HF: default eps, not rms_norm_eps
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, [(heads * qk_dim, first * qk_dim, count * qk_dim)],
                                                 dtype=dtype)
        self.kv_a_proj_with_mqa = _replicated(hidden, self.kv_lora_rank + self.rope_dim, bias, dtype)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6, dtype)
        kv_dim = self.nope_dim + self.v_dim
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, [(heads * kv_dim, first * kv_dim, count * kv_dim)],
                                              dtype=dtype)
        self.kv_b_proj.fp8_allowed = False   # absorbed decode reads its weight directly
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden, first * self.v_dim, count * self.v_dim,
                                        bias=bias, dtype=dtype)
        self.rotary = rotary
        self.rope_interleaved = rope_interleaved
        self.indexer = indexer
        self.shares_topk = shares_topk
        self.scale = mla_softmax_scale(config)
        self.cache_dtype = dtype
        self.latent_cache: torch.Tensor | None = None
        self.record_topk = False                         # tests: keep the last selection in `last_topk`
        self.last_topk: torch.Tensor | None = None

    def cache_spec(self, num_blocks: int, block_size: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """``(shape, dtype)`` of this layer's caches: the latent cache and, for a layer with its own
        indexer, the indexer-key cache (same blocks; a GLM "shared" layer has none)."""
        spec = [((num_blocks, block_size, self.kv_lora_rank + self.rope_dim), self.cache_dtype)]
        if self.indexer is not None:
            spec.append(self.indexer.cache_spec(num_blocks, block_size))
        return spec

    @property
    def kv_cache(self) -> tuple[torch.Tensor, ...]:
        """``(latent_cache,)`` or ``(latent_cache, indexer_cache)``."""
        if self.indexer is None:
            return (self.latent_cache,)
        return self.latent_cache, self.indexer.k_cache

    @kv_cache.setter
    def kv_cache(self, caches: tuple[torch.Tensor, ...]) -> None:
        assert len(caches) == 1 + (self.indexer is not None), \
            f"expected the tensors of cache_spec(), got {len(caches)}"
        self.latent_cache = caches[0]
        if self.indexer is not None:
            self.indexer.k_cache = caches[1]

    def _queries(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[T, H_local, nope + rope]`` queries and the q latent (None without q_lora_rank)."""
        if self.q_lora_rank is None:
            return self.q_proj(hidden).view(hidden.shape[0], self.num_heads, -1), None
        q_latent = self.q_a_layernorm(self.q_a_proj(hidden))
        return self.q_b_proj(q_latent).view(hidden.shape[0], self.num_heads, -1), q_latent

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, top_k: int | None) -> torch.Tensor:
        """``positions [T], hidden [T, hidden] -> [T, hidden]`` (all-reduced); ``top_k`` None = dense MLA.
        The projections, norms and RoPE are traced by ``--compile``; the cache writes, the indexer
        and attention are one opaque call (:meth:`opaque_forward`)."""
        q, q_latent = self._queries(hidden)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        c = self.kv_a_layernorm(c)
        cos, sin = self.rotary.cos[positions], self.rotary.sin[positions]
        q_pe = apply_rotary(q_pe, cos, sin, self.rope_interleaved)
        k_pe = apply_rotary(k_pe[:, None, :], cos, sin, self.rope_interleaved)[:, 0]
        latent = torch.cat((c, k_pe), dim=-1)
        q_latent = q_latent if q_latent is not None else latent   # (not read without an indexer)
        (out,) = opaque_call(self, (hidden, q_nope, q_pe, latent, cos, sin, q_latent), (top_k or 0,))
        return self.o_proj(out.reshape(hidden.shape[0], -1))

    def opaque_forward(self, hidden, q_nope, q_pe, latent, cos, sin, q_latent, top_k: int):
        """Cache writes, DSA selection and attention of one step: ``latent [T, kv_lora + rope]`` is
        written to the latent cache; ``top_k`` 0 = dense MLA; returns ``([T, H_local, v],)``.

        The selection (``[T, k]`` int32 positions, see :meth:`DSAIndexer.forward`, or None = all
        keys) of a layer with an indexer is kept in the step's ``step_cache["dsa_topk"]``, where a
        GLM "shared" layer, which runs after it, reads it (IndexShare)."""
        meta = get_attention_metadata()
        batch = PagedBatch.of_step(meta, self.latent_cache.shape[1])
        store_cache(latent, self.latent_cache, meta.slot_mapping)
        topk = meta.step_cache.get("dsa_topk") if self.shares_topk and top_k else None
        if self.indexer is not None and top_k:
            topk = meta.step_cache["dsa_topk"] = self.indexer(hidden, q_latent, cos, sin, meta, top_k)
        if self.record_topk:
            self.last_topk = topk
        if batch.max_query_len == 1:
            return (self._decode(q_nope, q_pe, meta, topk),)
        return (self._prefill(q_nope, q_pe, meta, batch, topk),)                                # [T, H_local, v]

    def opaque_fake(self, hidden, q_nope, q_pe, latent, cos, sin, q_latent, top_k: int):
        return (q_nope.new_empty(q_nope.shape[0], self.num_heads, self.v_dim),)

    def _decode(self, q_nope, q_pe, meta, topk: torch.Tensor | None) -> torch.Tensor:
        """Decode (one query per sequence): absorbed MLA over the paged latent cache; with DSA only
        the ``topk [T, k]`` selected positions are read, so the cost stays flat in the context
        length. Returns ``[T, H, v]``."""
        return self._absorbed(q_nope, q_pe, meta.block_tables, meta.seq_lens, None, topk, meta.max_seq_len)

    def _absorbed(self, q_nope, q_pe, block_tables, seq_lens, query_start_loc, topk, max_seq_len) -> torch.Tensor:
        """Absorbed MLA: ``W_UK`` folded into q, attention over the latent rows (all causal ones, or
        each token's ``topk``), ``W_UV`` after. ``query_start_loc`` None = decode. Returns ``[T, H, v]``."""
        w_kv = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w_kv.split([self.nope_dim, self.v_dim], dim=1)        # [H, nope, C], [H, v, C]
        q_absorbed = torch.einsum("thn,hnc->thc", q_nope, w_uk)
        out_latent = mla_attention(q_absorbed, q_pe, self.latent_cache, block_tables, seq_lens, self.scale,
                                   query_start_loc, topk_indices=topk, max_seq_len=max_seq_len)
        return torch.einsum("thc,hvc->thv", out_latent, w_uv)

    def _prefill(self, q_nope, q_pe, meta, batch: PagedBatch, topk: torch.Tensor | None) -> torch.Tensor:
        """Steps with several queries per sequence (prefill chunks, mixed and verify steps), in memory
        linear in the context. With a DSA selection: sparse prefill, each token attends to its
        ``topk`` latent rows only (absorbed, ``O(T x H x k)``). Without (dense MLA, or every context
        within top-k): per sequence the cheaper exact form, long chunks expanded through
        ``kv_b_proj`` one key chunk at a time (:func:`kernels.mla_prefill.mla_prefill_dense`), short
        ones absorbed. Returns ``[T, H, v]``."""
        if topk is not None:
            return self._absorbed(q_nope, q_pe, meta.block_tables, meta.seq_lens, meta.query_start_loc, topk,
                                  meta.max_seq_len)
        out = None
        for group in batch.dense_groups(self.kv_lora_rank, self.nope_dim, self.rope_dim, self.v_dim):
            rows = slice(None) if group.token_idx is None else group.token_idx
            if group.expanded:
                w_kv = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
                part = mla_prefill_dense(q_nope[rows], q_pe[rows], self.latent_cache, group.block_tables,
                                         group.seq_lens, group.query_start_loc, w_kv, self.scale,
                                         query_start_host=group.query_start_host, seq_lens_host=group.seq_lens_host)
            else:
                part = self._absorbed(q_nope[rows], q_pe[rows], group.block_tables, group.seq_lens,
                                      group.query_start_loc, None, group.max_seq_len)
            if group.token_idx is None:
                return part
            if out is None:
                out = part.new_empty(q_nope.shape[0], *part.shape[1:])
            out[group.token_idx] = part
        return out
