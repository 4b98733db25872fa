"""Multi-Token Prediction (MTP) module of DeepSeek-V3 / V3.2 and GLM-5, used as the draft model.

Math: DeepSeek-V3 technical report (arXiv:2412.19437), Sec. 2.2, as the released checkpoints and
vLLM's ``deepseek_mtp.py`` apply it. For position ``t`` with main-model hidden state ``h_t`` (the
target's final-normed output) and the next token ``x_{t+1}``:

    h'_t   = eh_proj(concat(enorm(embed(x_{t+1})), hnorm(h_t)))           [T, hidden]
    o_t    = block(h'_t)        one decoder layer: MLA (+ its DSA indexer), MoE or dense MLP
    logits = shared_head.head(shared_head.norm(o_t))                       predicts x_{t+2}

``o_t`` (the block output before ``shared_head.norm``) is what chained drafting feeds back as the
next step's ``h`` (vLLM's convention). The layer is stored as ``model.layers.{L}.*`` with
``L = num_hidden_layers`` (``num_nextn_predict_layers`` of them; we load the first). When the
checkpoint has no ``embed_tokens`` / ``shared_head.head`` for it, the main model's
``model.embed_tokens`` / ``lm_head`` are used (DeepSeek shares them).

The MTP attention keeps its own paged latent (and indexer-key) cache on the target's block
tables: the entry for position ``t`` sits in the slot of position ``t``. The draft runs whole on
one process (no tensor parallelism: it is one layer).
"""

from __future__ import annotations

import torch
from torch import nn

from shardserve.workers.checkpoint import Checkpoint, CheckpointError
from shardserve.workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shardserve.workers.layers.linear import ColumnParallelLinear
from shardserve.workers.layers.norm import RMSNorm
from shardserve.workers.layers.rotary import RotaryEmbedding
from shardserve.workers.models.deepseek_v32 import (DeepseekDecoderLayer, DeepseekV32ForCausalLM, _option,
                                                   check_dsa_sink)
from shardserve.workers.models.dsa_indexer import DSAIndexer
from shardserve.workers.models.mla import MLAAttention
from shardserve.workers.models.moe import DeepseekMoE, GatedMLP


def num_mtp_layers(config) -> int:
    """``num_nextn_predict_layers`` of an HF config (``num_mtp_layers`` in transformers' DeepseekV3)."""
    value = getattr(config, "num_nextn_predict_layers", None)
    if value is None:
        value = getattr(config, "num_mtp_layers", 0)
    return int(value or 0)


class SharedHead(nn.Module):
    """``shared_head.norm`` + ``shared_head.head``: ``[N, hidden] -> [N, vocab]`` float32 logits."""

    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        vocab = config.vocab_size
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.head = ParallelLMHead(vocab, config.hidden_size, 0, vocab, sizes=[vocab], dtype=dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(hidden))


class DeepseekMTPLayer(DeepseekDecoderLayer):
    """One MTP depth: the decoder block plus ``embed_tokens``, ``enorm``, ``hnorm``, ``eh_proj`` and
    ``shared_head``; parameter names match the checkpoint below ``model.layers.{L}.``.

    Args:
        config: HF DeepseekV3 / V32 / GlmMoeDsa config.
        indexer: the block's DSA indexer, or None (dense MLA).
        moe: the block's MLP is an MoE (else a dense SwiGLU MLP of ``intermediate_size``).
        dtype: parameter dtype.
    """

    def __init__(self, config, indexer: DSAIndexer | None, moe: bool, dtype: torch.dtype) -> None:
        heads, hidden = config.num_attention_heads, config.hidden_size
        rotary = RotaryEmbedding(config, config.qk_rope_head_dim, config.max_position_embeddings)
        attn = MLAAttention(config, (0, heads), rotary, bool(getattr(config, "rope_interleave", True)), indexer,
                            shares_topk=False, dtype=dtype)
        if moe:
            shared = config.moe_intermediate_size * (config.n_shared_experts or 0)
            mlp = DeepseekMoE(config, (0, config.n_routed_experts), (0, shared) if shared else None, dtype)
        else:
            mlp = GatedMLP(hidden, config.intermediate_size, (0, config.intermediate_size), reduce_output=True,
                           dtype=dtype)
        super().__init__(config, attn, mlp, dtype)
        vocab = config.vocab_size
        self.embed_tokens = VocabParallelEmbedding(vocab, hidden, 0, vocab, dtype=dtype)
        self.enorm = RMSNorm(hidden, config.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps, dtype)
        self.eh_proj = ColumnParallelLinear(2 * hidden, [(hidden, 0, hidden)], dtype=dtype)
        self.shared_head = SharedHead(config, dtype)

    def mtp_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, prev_hidden: torch.Tensor,
                    top_k: int | None) -> torch.Tensor:
        """``input_ids [T]`` (token ``t+1``), ``positions [T]`` (``t``), ``prev_hidden [T, hidden]``
        (``h_t``) -> block output ``o_t [T, hidden]`` (before ``shared_head.norm``)."""
        fused = self.eh_proj(torch.cat((self.enorm(self.embed_tokens(input_ids)), self.hnorm(prev_hidden)), dim=-1))
        out, residual = self(positions, fused, None, top_k)
        return out + residual


class DeepseekMTPModel(nn.Module):
    """The draft model: the first MTP layer of a DeepSeek-V3/V3.2/GLM-5 checkpoint.

    ``forward(input_ids [T], positions [T], prev_hidden [T, hidden]) -> [T, hidden]`` inside a
    forward context (see :meth:`DeepseekMTPLayer.mtp_forward`); ``compute_logits(o [N, hidden])
    -> [N, vocab]`` float32.

    Args:
        config: the HF config of the whole checkpoint (``num_nextn_predict_layers >= 1``).
        ckpt_names: the checkpoint's tensor names, any container answering ``name in ckpt_names``
            (decides indexer, MoE and head fallbacks).
        dtype: parameter and cache dtype.

    Raises:
        ValueError: the checkpoint has no MTP layer.
    """

    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config, ckpt_names, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if num_mtp_layers(config) < 1:
            raise ValueError("this checkpoint has no MTP layers (num_nextn_predict_layers is 0 or unset); "
                             "speculative decoding needs them")
        from shardserve.workers.models.registry import model_class

        self.config = config
        self.layer_idx = config.num_hidden_layers
        self.prefix = f"model.layers.{self.layer_idx}."
        target_cls = model_class(config)
        dsa = hasattr(config, "index_topk") and bool(_option(None, config, "shardserve_dsa", True))
        has_indexer = dsa and f"{self.prefix}self_attn.indexer.wk.weight" in ckpt_names
        self.top_k = int(_option(None, config, "shardserve_dsa_top_k", getattr(config, "index_topk", 0))) \
            if has_indexer else None
        indexer = None
        if has_indexer:
            sink = int(_option(None, config, "shardserve_dsa_sink", 0))
            check_dsa_sink(sink, self.top_k)
            indexer = DSAIndexer(config, getattr(target_cls, "indexer_rope_interleaved",
                                                 DeepseekV32ForCausalLM.indexer_rope_interleaved),
                                 bool(_option(None, config, "shardserve_hadamard", True)), dtype,
                                 str(_option(None, config, "shardserve_indexer_cache_dtype", "auto")), sink)
        moe = f"{self.prefix}mlp.gate.weight" in ckpt_names
        self.mtp = DeepseekMTPLayer(config, indexer, moe, dtype)

    def attention_layers(self) -> list[MLAAttention]:
        return [self.mtp.self_attn]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, prev_hidden: torch.Tensor) -> torch.Tensor:
        return self.mtp.mtp_forward(input_ids, positions, prev_hidden, self.top_k)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.mtp.shared_head(hidden)

    def checkpoint_name(self, param_name: str, names) -> str:
        """Checkpoint tensor for parameter ``mtp.<sub>`` (before unpacking ``gate_up_proj``), with
        the main model's embedding / LM head as fallbacks."""
        sub = param_name.removeprefix("mtp.")
        name = self.prefix + sub
        if sub == "embed_tokens.weight" and name not in names:
            return "model.embed_tokens.weight"
        if sub == "shared_head.head.weight" and name not in names:
            return "lm_head.weight" if "lm_head.weight" in names else "model.embed_tokens.weight"
        return name


def build_mtp_meta_model(config, ckpt: Checkpoint, dtype: torch.dtype = torch.float32) -> DeepseekMTPModel:
    """The draft model on the ``meta`` device (nothing allocated): what :func:`build_mtp_model`
    materializes, and what ``workers/plan.py`` counts.

    Raises:
        ValueError: no MTP layer in the checkpoint.
    """
    with torch.device("meta"):
        return DeepseekMTPModel(config, ckpt, dtype)   # the checkpoint answers `name in ckpt`


@torch.no_grad()
def build_mtp_model(config, ckpt: Checkpoint, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> tuple[DeepseekMTPModel, int]:
    """Build the draft model on the meta device, allocate it on ``device`` and load its weights
    (FP8 block-scaled tensors are dequantized: the draft is one layer).

    Returns:
        ``(model in eval mode, weight bytes)``.

    Raises:
        ValueError: no MTP layer in the checkpoint.
        CheckpointError: a tensor is missing or has the wrong shape.
    """
    from shardserve.workers.fp8 import dequantizing_checkpoint
    from shardserve.workers.weight_loader import checkpoint_sources, default_weight_loader, materialize

    ckpt = dequantizing_checkpoint(ckpt, config)
    model = build_mtp_meta_model(config, ckpt, dtype)
    materialize(model, device)
    total = 0
    for name, param in model.named_parameters():
        loader = getattr(param, "weight_loader", default_weight_loader)
        for ckpt_name, shard_id in checkpoint_sources(model, model.checkpoint_name(name, ckpt), ckpt, param):
            if ckpt_name not in ckpt:
                raise CheckpointError(f"{ckpt.path}: missing MTP tensor {ckpt_name!r}")
            loader(param, ckpt.get(ckpt_name), shard_id)
        total += param.numel() * param.element_size()
    return model.eval(), total
