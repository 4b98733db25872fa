"""Qwen3-Next causal LM: gated-DeltaNet and gated full-attention layers, MoE with a shared expert.

Math follows transformers' ``models/qwen3_next/modeling_qwen3_next.py`` (the parity oracle; see
``tests/models/test_qwen3_next.py``):

- ``config.layer_types``: ``"linear_attention"`` layers are :class:`GatedDeltaNet` (recurrent
  state per sequence in the slot pool of ``workers/state_cache.py``), ``"full_attention"`` layers
  are :class:`Qwen3NextAttention` on the paged KV cache: ``q_proj`` yields a query and an output
  gate per head (``[q_h, gate_h]`` rows), per-head RMSNorm on q and k, RoPE on the first
  ``partial_rotary_factor * head_dim`` dims only, and ``o = o_proj(attn * sigmoid(gate))``.
- Every RMSNorm outside the DeltaNet is zero-centred: ``x_hat * (1 + weight)``; the loader stores
  ``1 + weight`` in float32 and the fused RMSNorm kernel scales in float32 (:class:`OffsetRMSNorm`).
- MLP: :class:`Qwen3NextMoE` (softmax router, top-k, optionally renormalized; routed experts;
  a shared expert scaled by ``sigmoid(shared_expert_gate(x))``) on layer ``i`` when ``i`` is not in
  ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``; else a dense SwiGLU MLP.

Tensor parallel (DESIGN.md): attention in units of one KV group, DeltaNet in units of one key
head, routed experts whole, shared expert / dense MLP / vocabulary by rows, every split possibly
uneven; one all-reduce per attention, DeltaNet and MLP/MoE sublayer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.kernels import rms_norm, store_kv_and_attend
from shardserve.workers.checkpoint import LazyTensor
from shardserve.workers.compilation import opaque_call, tp_all_reduce
from shardserve.workers.distributed import get_tp_group
from shardserve.workers.forward_context import get_attention_metadata
from shardserve.workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shardserve.workers.layers.linear import ColumnParallelLinear, RowParallelLinear
from shardserve.workers.layers.norm import RMSNorm
from shardserve.workers.layers.rotary import RotaryEmbedding
from shardserve.workers.models.gated_deltanet import GatedDeltaNet
from shardserve.workers.models.moe import FusedExperts, GatedMLP
from shardserve.workers.partition import split_units


class OffsetRMSNorm(RMSNorm):
    """Qwen3-Next's ``Qwen3NextRMSNorm``: ``x_hat * (1 + w)`` with the product in float32 and one
    rounding to the activations' dtype, as transformers does. ``1 + w`` is loaded into a float32
    weight whatever the model's dtype (in bf16 it would round to steps of 2^-7: three times
    transformers' own bf16 logit error on a tiny checkpoint, found on an H200)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(hidden_size, eps, dtype, weight_dtype=torch.float32)
        self.weight.weight_loader = self._load

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return rms_norm(x, self.weight, self.eps, residual, scale_in_fp32=True)

    @staticmethod
    def _load(param: nn.Parameter, tensor: LazyTensor, shard_id: int = 0) -> None:
        tensor.check_shape(param.shape)
        param.data.copy_(1.0 + tensor.load().float())


class Qwen3NextAttention(nn.Module):
    """Gated GQA self-attention over this rank's KV groups.

    Shapes: ``positions [T]``, ``hidden [T, hidden_size] -> [T, hidden_size]`` (all-reduced).
    ``kv_cache`` (set by the runner): ``(k_cache, v_cache)``, each ``[num_blocks, block_size,
    num_kv_heads_local, head_dim]``.
    """

    def __init__(self, config, kv_range: tuple[int, int], rotary: RotaryEmbedding, rot_dim: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        group = config.num_attention_heads // config.num_key_value_heads
        kv_start, kv_count = kv_range
        self.num_heads, self.num_kv_heads = kv_count * group, kv_count
        hd = self.head_dim
        kv_full = config.num_key_value_heads * hd
        bias = config.attention_bias
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, [
            (2 * config.num_attention_heads * hd, 2 * kv_start * group * hd, 2 * self.num_heads * hd),   # q + gate
            (kv_full, kv_start * hd, kv_count * hd),
            (kv_full, kv_start * hd, kv_count * hd),
        ], bias=bias, dtype=dtype)
        self.o_proj = RowParallelLinear(config.num_attention_heads * hd, config.hidden_size, kv_start * group * hd,
                                        self.num_heads * hd, bias=bias, dtype=dtype)
        self.q_norm = OffsetRMSNorm(hd, config.rms_norm_eps, dtype)
        self.k_norm = OffsetRMSNorm(hd, config.rms_norm_eps, dtype)
        self.rotary, self.rot_dim = rotary, rot_dim
        self.cache_dtype = dtype
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def cache_spec(self, num_blocks: int, block_size: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """``(shape, dtype)`` of this layer's K and V caches."""
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        return [(shape, self.cache_dtype), (shape, self.cache_dtype)]

    def _rope(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Partial RoPE: rotate the first ``rot_dim`` dims of each head, keep the rest."""
        (rotated,) = self.rotary(positions, x[..., :self.rot_dim])
        return torch.cat((rotated, x[..., self.rot_dim:]), dim=-1)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        num_tokens, hd = hidden.shape[0], self.head_dim
        q_gate, k, v = self.qkv_proj(hidden).split([2 * self.num_heads * hd, self.num_kv_heads * hd,
                                                   self.num_kv_heads * hd], dim=-1)
        q, gate = q_gate.view(num_tokens, self.num_heads, 2 * hd).chunk(2, dim=-1)
        q = self.q_norm(q.reshape(-1, hd)).view(num_tokens, self.num_heads, hd)
        k = self.k_norm(k.reshape(-1, hd)).view(num_tokens, self.num_kv_heads, hd)
        q, k = self._rope(positions, q), self._rope(positions, k)
        v = v.reshape(num_tokens, self.num_kv_heads, hd)
        (out,) = opaque_call(self, (q, k, v))
        out = out.reshape(num_tokens, -1) * torch.sigmoid(gate.reshape(num_tokens, -1))
        return self.o_proj(out)

    def opaque_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor]:
        """Cache write and paged attention (opaque to ``--compile``), as :class:`LlamaAttention`'s."""
        meta = get_attention_metadata()
        k_cache, v_cache = self.kv_cache
        return (store_kv_and_attend(q, k, v, k_cache, v_cache, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                                    meta.query_start_loc, self.head_dim ** -0.5, meta.max_query_len, meta.max_seq_len,
                                    meta.step_cache),)

    def opaque_fake(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.empty_like(q),)


class Qwen3NextMoE(nn.Module):
    """Sparse MoE block (``Qwen3NextSparseMoeBlock``): this rank's routed experts plus its slice of
    the gated shared expert; one all-reduce.

    Args:
        config: the HF config (``num_experts``, ``num_experts_per_tok``, ``norm_topk_prob``,
            ``moe_intermediate_size``, ``shared_expert_intermediate_size``).
        expert_range: ``(first expert, count)`` on this rank.
        shared_range: ``(start, size)`` of this rank's rows of the shared expert.

    Shapes: ``[T, hidden] -> [T, hidden]``.
    """

    def __init__(self, config, expert_range: tuple[int, int], shared_range: tuple[int, int], dtype) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, bool(config.norm_topk_prob)
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, dtype=dtype),
                                        requires_grad=False)
        self.experts = FusedExperts(config.hidden_size, config.moe_intermediate_size, expert_range, dtype)
        self.shared_expert = GatedMLP(config.hidden_size, config.shared_expert_intermediate_size, shared_range,
                                      reduce_output=False, dtype=dtype)
        self.shared_expert_gate = nn.Module()
        self.shared_expert_gate.weight = nn.Parameter(torch.empty(1, config.hidden_size, dtype=dtype),
                                                      requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.gate.weight)
        probs = logits.softmax(dim=-1, dtype=torch.float32)                          # [T, E]
        weights, expert_ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.experts(hidden, weights.to(logits.dtype), expert_ids)
        # sigmoid(gate) * partial shared output sums to sigmoid(gate) * the whole one over ranks
        out = out + torch.sigmoid(F.linear(hidden, self.shared_expert_gate.weight)) * self.shared_expert(hidden)
        return tp_all_reduce(out)


class Qwen3NextDecoderLayer(nn.Module):
    """Pre-norm block, token mixer (DeltaNet or attention) then MLP/MoE, residual carried through
    the fused norms."""

    def __init__(self, config, mixer: nn.Module, mlp: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.is_linear = isinstance(mixer, GatedDeltaNet)
        if self.is_linear:   # checkpoint names: linear_attn.* / self_attn.*
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.mlp = mlp
        self.input_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if self.is_linear else self.self_attn

    def forward(self, positions, hidden, residual):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.linear_attn(hidden) if self.is_linear else self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


def _is_sparse(config, idx: int) -> bool:
    """transformers' rule for a MoE layer (``Qwen3NextDecoderLayer``)."""
    return (idx not in (config.mlp_only_layers or []) and config.num_experts > 0
            and (idx + 1) % config.decoder_sparse_step == 0)


class Qwen3NextModel(nn.Module):
    """Embedding, decoder layers, final norm (checkpoint prefix ``model.``)."""

    def __init__(self, config, tensor_split: list[float] | None, dtype: torch.dtype) -> None:
        super().__init__()
        group = get_tp_group()
        rank, size = group.tp_rank, group.tp_size
        kv_range = split_units(config.num_key_value_heads, size, tensor_split, "KV heads")[rank]
        k_range = split_units(config.linear_num_key_heads, size, tensor_split, "linear-attention key heads")[rank]
        self.vocab_ranges = split_units(config.vocab_size, size, tensor_split)
        rope = getattr(config, "rope_parameters", None) or {}
        rot_dim = int(config.head_dim * rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))
        rotary = RotaryEmbedding(config, rot_dim, config.max_position_embeddings)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, *self.vocab_ranges[rank],
                                                   dtype=dtype)
        self.layers = nn.ModuleList()
        for idx, kind in enumerate(config.layer_types):
            if kind == "linear_attention":
                mixer = GatedDeltaNet(config, k_range, dtype)
            elif kind == "full_attention":
                mixer = Qwen3NextAttention(config, kv_range, rotary, rot_dim, dtype)
            else:
                raise ValueError(f"layer {idx}: unknown layer type {kind!r}")
            if _is_sparse(config, idx):
                mlp = Qwen3NextMoE(config, split_units(config.num_experts, size, tensor_split)[rank],
                                   split_units(config.shared_expert_intermediate_size, size, tensor_split)[rank], dtype)
            else:
                mlp = GatedMLP(config.hidden_size, config.intermediate_size,
                               split_units(config.intermediate_size, size, tensor_split)[rank], reduce_output=True,
                               dtype=dtype)
            self.layers.append(Qwen3NextDecoderLayer(config, mixer, mlp, dtype))
        self.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen3NextForCausalLM(nn.Module):
    """Qwen3-Next causal LM, tensor-parallel. ``forward(input_ids [T], positions [T]) -> hidden
    [T, hidden]`` inside a forward context whose metadata carries ``state``
    (:class:`workers.state_cache.StateMetadata`); ``compute_logits(hidden [N, hidden]) -> [N, vocab]``
    float32 on every rank.

    Args:
        config: transformers ``Qwen3NextConfig``.
        tensor_split: relative per-rank weights (None = even).
        dtype: parameter dtype.
    """

    packed_modules_mapping = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config, tensor_split: list[float] | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen3NextModel(config, tensor_split, dtype)
        ranges = self.model.vocab_ranges
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, *ranges[get_tp_group().tp_rank],
                                      sizes=[count for _, count in ranges], dtype=dtype)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def attention_layers(self) -> list[Qwen3NextAttention]:
        """The full-attention modules (paged KV cache owners), in layer order."""
        return [layer.mixer for layer in self.model.layers if isinstance(layer.mixer, Qwen3NextAttention)]

    def state_layers(self) -> list[GatedDeltaNet]:
        """The gated-DeltaNet modules (recurrent-state slot owners), in layer order."""
        return [layer.mixer for layer in self.model.layers if isinstance(layer.mixer, GatedDeltaNet)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
