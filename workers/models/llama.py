"""Llama-family decoder (GQA, RoPE, RMSNorm, SwiGLU) on a paged KV cache, tensor-parallel.

Math follows transformers' ``models/llama/modeling_llama.py``; parity is tested against it.
Heads are split across ranks in units of one KV group (``num_heads / num_kv_heads`` query heads
plus their K and V head), possibly unevenly (``workers/partition.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from shardserve.kernels import silu_and_mul, store_kv_and_attend
from shardserve.workers.compilation import opaque_call
from shardserve.workers.distributed import get_tp_group
from shardserve.workers.forward_context import get_attention_metadata
from shardserve.workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shardserve.workers.layers.linear import ColumnParallelLinear, RowParallelLinear
from shardserve.workers.layers.norm import RMSNorm
from shardserve.workers.layers.rotary import RotaryEmbedding
from shardserve.workers.partition import split_rows, split_units


class LlamaAttention(nn.Module):
    """GQA self-attention over this rank's KV groups.

    Shapes: ``positions [T]``, ``hidden [T, hidden_size] -> [T, hidden_size]`` (all-reduced).
    ``kv_cache`` is set by the runner: ``(k_cache, v_cache)`` each
    ``[num_blocks, block_size, num_kv_heads_local, head_dim]``.
    """

    def __init__(self, config, kv_range: tuple[int, int], rotary: RotaryEmbedding, dtype: torch.dtype) -> None:
        super().__init__()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        group = config.num_attention_heads // config.num_key_value_heads
        kv_start, kv_count = kv_range
        self.num_heads, self.num_kv_heads = kv_count * group, kv_count
        q_full = config.num_attention_heads * self.head_dim
        kv_full = config.num_key_value_heads * self.head_dim
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, [
            (q_full, kv_start * group * self.head_dim, self.num_heads * self.head_dim),
            (kv_full, kv_start * self.head_dim, kv_count * self.head_dim),
            (kv_full, kv_start * self.head_dim, kv_count * self.head_dim),
        ], bias=bias, dtype=dtype)
        self.o_proj = RowParallelLinear(q_full, config.hidden_size, kv_start * group * self.head_dim,
                                        self.num_heads * self.head_dim, bias=bias, dtype=dtype)
        self.rotary = rotary
        self.scale = self.head_dim ** -0.5
        self.cache_dtype = dtype
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def cache_spec(self, num_blocks: int, block_size: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """``(shape, dtype)`` of this layer's K and V caches."""
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        return [(shape, self.cache_dtype), (shape, self.cache_dtype)]

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # Q and K heads side by side: one RoPE call rotates both ([T, H + Hkv, D]).
        (qk,) = self.rotary(positions, qkv[:, :q_size + kv_size].view(-1, self.num_heads + self.num_kv_heads,
                                                                      self.head_dim))
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, q_size + kv_size:].view(-1, self.num_kv_heads, self.head_dim)
        (out,) = opaque_call(self, (q, k, v))
        return self.o_proj(out.reshape(-1, q_size))

    def opaque_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor]:
        """Write this step's K/V into the paged caches and attend: ``q [T, H, D]``, ``k, v [T, Hkv, D]``
        -> ``([T, H, D],)`` (opaque to torch.compile: ``workers/compilation.py``)."""
        meta = get_attention_metadata()
        k_cache, v_cache = self.kv_cache
        return (store_kv_and_attend(q, k, v, k_cache, v_cache, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                                    meta.query_start_loc, self.scale, meta.max_query_len, meta.max_seq_len,
                                    meta.step_cache),)

    def opaque_fake(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.empty_like(q),)


class LlamaMLP(nn.Module):
    """SwiGLU MLP, intermediate dim split across ranks. ``[T, hidden] -> [T, hidden]`` (all-reduced)."""

    def __init__(self, config, inter_range: tuple[int, int], dtype: torch.dtype) -> None:
        super().__init__()
        start, size = inter_range
        inter = config.intermediate_size
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [(inter, start, size), (inter, start, size)],
                                                 bias=bias, dtype=dtype)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, start, size, bias=bias, dtype=dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(hidden)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm decoder block with the residual carried through fused RMSNorms."""

    def __init__(self, config, kv_range, inter_range, rotary, dtype) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, kv_range, rotary, dtype)
        self.mlp = LlamaMLP(config, inter_range, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, positions, hidden, residual):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config, tensor_split: list[float] | None, dtype: torch.dtype) -> None:
        super().__init__()
        group = get_tp_group()
        rank, size = group.tp_rank, group.tp_size
        kv_ranges = split_units(config.num_key_value_heads, size, tensor_split, "KV heads")
        inter_ranges = split_rows(config.intermediate_size, size, tensor_split)   # whole groups of 32
        vocab_ranges = split_units(config.vocab_size, size, tensor_split)
        self.vocab_ranges = vocab_ranges
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rotary = RotaryEmbedding(config, head_dim, config.max_position_embeddings)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, *vocab_ranges[rank], dtype=dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, kv_ranges[rank], inter_ranges[rank], rotary, dtype)
            for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Llama causal LM: ``forward(input_ids [T], positions [T]) -> hidden [T, hidden]``;
    ``compute_logits(hidden [N, hidden]) -> [N, vocab]`` float32 on every rank.

    Args:
        config: transformers ``LlamaConfig`` (from the HF folder or parsed from GGUF metadata).
        tensor_split: relative per-rank weights for uneven splits (None = even).
        dtype: parameter dtype (float32 on CPU).
    """

    # checkpoint sub-name -> (our packed parameter sub-name, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config, tensor_split: list[float] | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, tensor_split, dtype)
        rank = get_tp_group().tp_rank
        ranges = self.model.vocab_ranges
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, *ranges[rank],
                                      sizes=[size for _, size in ranges], dtype=dtype)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight  # one copy, same vocab partition

    def attention_layers(self) -> list[LlamaAttention]:
        """The modules that own a slice of the KV cache (each with ``cache_spec`` and a
        ``kv_cache`` setter), in layer order."""
        return [layer.self_attn for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
