"""DeepSeek-V3, DeepSeek-V3.2 and GLM-MoE-DSA (GLM-5) causal LMs: MLA + DSA indexer + MoE.

Math follows transformers' ``deepseek_v3``, ``deepseek_v32`` and ``glm_moe_dsa`` modeling files
(the parity oracles; see ``tests/models``). The three differ only in:

- DSA indexer: none (V3); every layer (V3.2); GLM's ``indexer_types``, where a ``"shared"``
  layer has no indexer and reuses the top-k of the most recent ``"full"`` layer (IndexShare).
- Indexer RoPE layout: half-split for V3.2, interleaved for GLM. MLA RoPE is interleaved for
  V3.2/GLM and for V3 when ``config.rope_interleave`` (its default).
- Dense vs MoE MLP per layer: ``config.mlp_layer_types`` (V3.2, GLM) or the first
  ``first_k_dense_replace`` layers dense (V3).

Serving switches, read from optional attributes of the HF config (the runner sets them) or given
as constructor keywords: ``shardserve_dsa`` (default True; False = dense MLA, no indexer cache),
``shardserve_dsa_top_k`` (default: the checkpoint's ``index_topk``), ``shardserve_hadamard``
(default True: Walsh-Hadamard rotation of indexer q/k, score-preserving),
``shardserve_indexer_cache_dtype`` (``"auto"``: the model dtype, or ``"fp8"``; see
:class:`DSAIndexer`), ``shardserve_dsa_sink`` (default 0: first positions of each sequence always
in the top-k; see :class:`DSAIndexer`).
"""

from __future__ import annotations

import torch
from torch import nn

from shardserve.workers.distributed import get_expert_group, get_tp_group
from shardserve.workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shardserve.workers.layers.norm import RMSNorm
from shardserve.workers.layers.rotary import RotaryEmbedding
from shardserve.workers.models.dsa_indexer import DSAIndexer
from shardserve.workers.models.group_exchange import GroupGatedMLP, GroupLMHead, GroupVocabEmbedding
from shardserve.workers.models.mla import MLAAttention
from shardserve.workers.models.moe import DeepseekMoE, GatedMLP
from shardserve.workers.partition import split_units


def check_dsa_sink(sink: int, top_k: int | None) -> None:
    """Raises ValueError unless ``0 <= sink <= top_k`` (the sink positions must fit in the top-k)."""
    if sink < 0 or (top_k is not None and sink > top_k):
        raise ValueError(f"--dsa-sink {sink} must be in 0..{top_k if top_k is not None else 'top-k'} "
                         "(the always-kept first positions count toward each query's top-k)")


def _option(explicit, config, name: str, default):
    """A serving switch: the constructor keyword, else ``config.<name>``, else ``default``."""
    if explicit is not None:
        return explicit
    value = getattr(config, name, None)
    return default if value is None else value


class DeepseekDecoderLayer(nn.Module):
    """Pre-norm block: ``x + MLA(norm(x))``, then ``+ MLP/MoE(norm(.))``; residual carried through
    fused RMSNorms."""

    def __init__(self, config, attn: MLAAttention, mlp: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, positions, hidden, residual, top_k):
        """Returns ``(mlp_out [T, hidden], residual [T, hidden])`` (``top_k``: see :class:`MLAAttention`)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, top_k)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DeepseekModel(nn.Module):
    """Embedding, decoder layers and final norm (checkpoint prefix ``model.``).

    Args:
        config: the HF config.
        tensor_split: relative per-rank weights (None = even).
        dtype: parameter dtype.
        indexer_types: per layer ``"full"`` (own DSA indexer), ``"shared"`` (reuse the last full
            layer's top-k) or ``"none"`` (dense MLA).
        indexer_rope_interleaved / hadamard / indexer_cache_dtype / dsa_sink: indexer options (see
            :class:`DSAIndexer`).

    Under data-parallel attention (an expert group larger than the TP group, issue 29) MLA and the
    indexer are split over the TP group (the attention group), and the embedding, the dense MLPs,
    the routed and shared experts over the expert group, exchanging tokens between the groups
    (:mod:`workers.models.group_exchange`, :mod:`workers.models.moe_exchange`); ``vocab_rank`` is
    this rank's index into ``vocab_ranges`` (the LM head's split too).
    """

    def __init__(self, config, tensor_split: list[float] | None, dtype: torch.dtype, indexer_types: list[str],
                 indexer_rope_interleaved: bool, hadamard: bool, indexer_cache_dtype: str = "auto",
                 dsa_sink: int = 0) -> None:
        super().__init__()
        group, experts = get_tp_group(), get_expert_group()
        rank, size = group.tp_rank, group.tp_size
        head_range = split_units(config.num_attention_heads, size, tensor_split, "attention heads")[rank]
        # Data-parallel attention (issue 29): attention is split over this rank's attention group
        # (the TP group); everything else over all the replica's ranks (the expert group), with
        # tokens exchanged between the groups (workers/models/group_exchange.py, moe_exchange.py).
        exchange = None if experts is group else _option(None, config, "shardserve_moe_a2a", "allgather")
        if exchange is not None:
            rank, size, tensor_split = experts.tp_rank, experts.tp_size, None
        self.vocab_rank = rank
        inter_range = split_units(config.intermediate_size, size, tensor_split)[rank]
        expert_range = split_units(config.n_routed_experts, size, tensor_split)[rank]
        shared_size = config.moe_intermediate_size * (config.n_shared_experts or 0)
        shared_range = split_units(shared_size, size, tensor_split)[rank] if shared_size else None
        self.vocab_ranges = split_units(config.vocab_size, size, tensor_split)
        rotary = RotaryEmbedding(config, config.qk_rope_head_dim, config.max_position_embeddings)
        mla_interleaved = bool(getattr(config, "rope_interleave", True))
        mlp_types = getattr(config, "mlp_layer_types", None) or [
            "dense" if i < config.first_k_dense_replace else "sparse" for i in range(config.num_hidden_layers)]

        embedding, dense = (VocabParallelEmbedding, GatedMLP) if exchange is None else (GroupVocabEmbedding,
                                                                                          GroupGatedMLP)
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size, *self.vocab_ranges[rank], dtype=dtype)
        self.layers = nn.ModuleList()
        for idx in range(config.num_hidden_layers):
            indexer = None
            if indexer_types[idx] == "full":
                indexer = DSAIndexer(config, indexer_rope_interleaved, hadamard, dtype, indexer_cache_dtype, dsa_sink)
            attn = MLAAttention(config, head_range, rotary, mla_interleaved, indexer,
                                shares_topk=indexer_types[idx] == "shared", dtype=dtype)
            if mlp_types[idx] == "sparse":
                mlp = DeepseekMoE(config, expert_range, shared_range, dtype, exchange)
            else:
                mlp = dense(config.hidden_size, config.intermediate_size, inter_range, reduce_output=exchange is None,
                            dtype=dtype)
            self.layers.append(DeepseekDecoderLayer(config, attn, mlp, dtype))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, top_k: int | None) -> torch.Tensor:
        """``input_ids [T], positions [T] -> hidden [T, hidden_size]``; ``top_k`` None = dense MLA."""
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, top_k)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def idle_forward(self, counts: list[int]) -> None:
        """Data-parallel attention, a step where this rank's group has no tokens: join the
        embedding's, every dense layer's and every MoE layer's token exchange with zero rows, in
        layer order, so the other groups' collectives complete (``counts``: tokens of each
        attention group, this group's 0; ``workers/models/group_exchange.py``)."""
        param = self.norm.weight
        empty = torch.empty(0, param.shape[0], dtype=param.dtype, device=param.device)
        self.embed_tokens.exchange(torch.empty(0, dtype=torch.long, device=param.device), counts)
        for layer in self.layers:
            if isinstance(layer.mlp, GroupGatedMLP):
                layer.mlp.exchange(empty, counts)
            else:
                layer.mlp.exchange_forward(empty, counts)


class DeepseekV32ForCausalLM(nn.Module):
    """DeepSeek-V3.2 causal LM (MLA + DSA indexer on every layer + MoE), tensor-parallel.

    ``forward(input_ids [T], positions [T]) -> hidden [T, hidden_size]`` (inside a forward
    context); ``compute_logits(hidden [N, hidden_size]) -> [N, vocab]`` float32 on every rank.

    Args:
        config: the HF config.
        tensor_split: relative per-rank weights for uneven splits (None = even); heads, routed
            experts, MLP intermediate dims and the vocabulary are split in whole units.
        dtype: parameter and cache dtype.
        dsa_enabled / dsa_top_k / hadamard / indexer_cache_dtype / dsa_sink: serving switches (see the
            module docstring).

    Raises:
        ValueError: ``dsa_sink`` outside ``0..dsa_top_k``.
    """

    # checkpoint sub-name -> (our packed parameter sub-name, shard id)
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    indexer_rope_interleaved = False   # DeepseekV32Indexer: half-split RoPE

    def __init__(self, config, tensor_split: list[float] | None = None, dtype: torch.dtype = torch.float32, *,
                 dsa_enabled: bool | None = None, dsa_top_k: int | None = None, hadamard: bool | None = None,
                 indexer_cache_dtype: str | None = None, dsa_sink: int | None = None) -> None:
        super().__init__()
        self.config = config
        has_indexer = hasattr(config, "index_topk")
        self.dsa_enabled = has_indexer and bool(_option(dsa_enabled, config, "shardserve_dsa", True))
        self.dsa_top_k = int(_option(dsa_top_k, config, "shardserve_dsa_top_k", getattr(config, "index_topk", 0)))
        self.hadamard = bool(_option(hadamard, config, "shardserve_hadamard", True))
        self.indexer_cache_dtype = str(_option(indexer_cache_dtype, config, "shardserve_indexer_cache_dtype", "auto"))
        self.dsa_sink = int(_option(dsa_sink, config, "shardserve_dsa_sink", 0))
        assert not self.dsa_enabled or self.dsa_top_k > 0, f"dsa_top_k={self.dsa_top_k} must be > 0"
        check_dsa_sink(self.dsa_sink, self.dsa_top_k if self.dsa_enabled else None)
        indexer_types = self._indexer_types(config) if self.dsa_enabled else ["none"] * config.num_hidden_layers
        self.model = DeepseekModel(config, tensor_split, dtype, indexer_types, self.indexer_rope_interleaved,
                                   self.hadamard, self.indexer_cache_dtype, self.dsa_sink)
        ranges = self.model.vocab_ranges   # over the TP group, or all ranks under data-parallel attention
        head = GroupLMHead if isinstance(self.model.embed_tokens, GroupVocabEmbedding) else ParallelLMHead
        self.lm_head = head(config.vocab_size, config.hidden_size, *ranges[self.model.vocab_rank],
                            sizes=[count for _, count in ranges], dtype=dtype)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))

    def _indexer_types(self, config) -> list[str]:
        """Per layer: ``"full"`` (own indexer) or ``"shared"`` (reuse the last full layer's top-k)."""
        return ["full"] * config.num_hidden_layers

    def attention_layers(self) -> list[MLAAttention]:
        """The modules that own cache tensors (each with ``cache_spec`` and a ``kv_cache`` setter),
        in layer order."""
        return [layer.self_attn for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions, self.dsa_top_k if self.dsa_enabled else None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def idle_forward(self, counts: list[int], logit_counts: list[int]) -> None:
        """Data-parallel attention, an idle group: :meth:`DeepseekModel.idle_forward`, then the LM
        head's exchange with zero rows (``logit_counts``: rows that need logits in each group)."""
        self.model.idle_forward(counts)
        self.lm_head.exchange(torch.empty(0, self.config.hidden_size, dtype=self.model.norm.weight.dtype,
                                          device=self.model.norm.weight.device), logit_counts)


class DeepseekV3ForCausalLM(DeepseekV32ForCausalLM):
    """DeepSeek-V3 (dense MLA, no indexer; ``q_proj`` when ``q_lora_rank`` is null). See
    :class:`DeepseekV32ForCausalLM` for shapes and arguments."""


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    """GLM-MoE-DSA (GLM-5): interleaved indexer RoPE and IndexShare (``config.indexer_types``).
    See :class:`DeepseekV32ForCausalLM` for shapes and arguments."""

    indexer_rope_interleaved = True   # GlmMoeDsaIndexer: apply_rotary_pos_emb_interleave

    def _indexer_types(self, config) -> list[str]:
        types = list(getattr(config, "indexer_types", None) or ["full"] * config.num_hidden_layers)
        assert len(types) == config.num_hidden_layers and set(types) <= {"full", "shared"}, \
            f"indexer_types={types} must be 'full'/'shared' per layer ({config.num_hidden_layers} layers)"
        if types[0] != "full":
            raise ValueError(f"indexer_types={types}: a 'shared' layer needs an earlier 'full' layer")
        return types
