"""Tiny random checkpoints of DeepseekV3 / DeepseekV32 / GlmMoeDsa / Qwen3Next, written by transformers itself.

Each checkpoint is built with transformers' own config and model classes and saved with
``save_pretrained`` (so both engines read the same files, in the same per-expert layout real
checkpoints use). Weights are re-drawn at scales that make every part of the model matter
(norm weights near 1, router bias and LayerNorm bias non-zero, activations O(1)), so parity tests
are not passed by near-uniform logits. :func:`write_fp8_checkpoint` turns a checkpoint into the
DeepSeek-V3 FP8 format (``float8_e4m3fn`` weights + ``weight_scale_inv`` per block).

``mtp=True`` adds one Multi-Token Prediction layer the way DeepSeek-V3/V3.2 and GLM-5 ship it
(transformers does not build these): ``model.layers.{L}.*`` with ``L = num_hidden_layers`` holds
``enorm``, ``hnorm``, ``eh_proj``, a full decoder block (MLA with an indexer when the architecture
has DSA, MoE MLP) and ``shared_head.norm``; ``config.json`` gains ``num_nextn_predict_layers=1``.
The block is the layer of a one-layer transformers model of the same architecture
(:func:`mtp_block_model` rebuilds it: the test oracle). ``mtp_own_head=True`` also stores
``embed_tokens`` / ``shared_head.head`` (copies of the main ones, as DeepSeek-V3 does); without
them the MTP falls back to the main model's. ``tokenizer=True`` writes a word-level tokenizer
(token ``i`` <-> ``"w{i:03d}"``) so the engine front end (detokenizer, stop strings) can run.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path

import torch

ARCHS = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")
FP8_MAX = 448.0  # largest finite float8_e4m3fn

# Shared by all three: 4 heads, hidden 64, v_head_dim != qk_head_dim, 8 experts in 2 groups.
_COMMON = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
    n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
    kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24,
    max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
)
# YaRN as DeepSeek ships it, scaled down; mscale != mscale_all_dim also scales cos/sin.
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}
_DSA = dict(index_topk=8, index_head_dim=32, index_n_heads=16)  # 16 heads: no exact-zero score ties

TINY_CONFIGS: dict[str, dict] = {
    # q_proj path (q_lora_rank None), 3 layers (1 dense + 2 MoE), YaRN, 1 shared expert.
    "deepseek_v3": dict(_COMMON, num_hidden_layers=3, first_k_dense_replace=1, q_lora_rank=None,
                        n_shared_experts=1, rope_parameters=dict(_YARN), rope_interleave=True, num_mtp_layers=0),
    # 2 layers (1 dense + 1 MoE), YaRN, DSA on every layer.
    "deepseek_v32": dict(_COMMON, **_DSA, num_hidden_layers=2, first_k_dense_replace=1, q_lora_rank=48,
                         n_shared_experts=1, rope_parameters=dict(_YARN)),
    # 4 layers (1 dense + 3 MoE), IndexShare F F S F, default RoPE, 2 shared experts.
    "glm_moe_dsa": dict(_COMMON, **_DSA, num_hidden_layers=4, first_k_dense_replace=1, q_lora_rank=48,
                        n_shared_experts=2, rms_norm_eps=1e-5,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                        indexer_types=["full", "full", "shared", "full"]),
    # Hybrid: 4 gated-DeltaNet + 2 gated-attention layers; 4 KV groups and 4 key heads (2 value heads
    # each) so TP splits 3 + 1; partial RoPE on 4 of 16 dims; MoE on layers 1 and 3
    # (decoder_sparse_step=2, layer 5 forced dense by mlp_only_layers).
    "qwen3_next": dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                       layer_types=["linear_attention", "linear_attention", "full_attention",
                                    "linear_attention", "linear_attention", "full_attention"],
                       linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=8,
                       linear_num_key_heads=4, linear_num_value_heads=8,
                       num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, decoder_sparse_step=2, mlp_only_layers=[5],
                       max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}),
}


def _classes(arch: str):
    import transformers

    names = {"deepseek_v3": "DeepseekV3", "deepseek_v32": "DeepseekV32", "glm_moe_dsa": "GlmMoeDsa",
             "qwen3_next": "Qwen3Next"}[arch]
    return getattr(transformers, f"{names}Config"), getattr(transformers, f"{names}ForCausalLM")


def tiny_config(arch: str, **overrides):
    """The transformers config of the tiny ``arch`` model (eager attention, float32)."""
    config_cls, _ = _classes(arch)
    config = config_cls(**{**TINY_CONFIGS[arch], **overrides})
    config._attn_implementation = "eager"
    return config


@torch.no_grad()
def _redraw(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Re-draw every weight at a scale where it matters (see the module docstring)."""
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if "inv_freq" in name:
            continue
        noise = torch.randn(tensor.shape, generator=generator)
        if name.endswith("e_score_correction_bias"):
            tensor.copy_(0.05 * noise)
        elif name.endswith("norm.bias"):
            tensor.copy_(0.1 * noise)
        elif tensor.dim() == 1:               # RMSNorm / LayerNorm weights
            tensor.copy_(1.0 + 0.1 * noise)
        elif name.endswith("embed_tokens.weight"):
            tensor.copy_(noise)
        else:                                 # [.., out, in] linear weights: unit-variance outputs
            tensor.copy_(noise / math.sqrt(tensor.shape[-1]))
    if "qwen3_next" in type(model).__module__:
        _redraw_qwen3_next(model, generator)


@torch.no_grad()
def _redraw_qwen3_next(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Qwen3-Next: zero-centred RMSNorm weights (``x_hat * (1 + w)``; all but the DeltaNet's gated
    norm) near 0, and DeltaNet decays ``exp(-exp(A_log) * softplus(a + dt_bias))`` between about
    0.6 and 0.995 per token, so the recurrent state carries information across the test prompts."""
    for name, tensor in model.named_parameters():
        if name.endswith("A_log"):
            tensor.copy_(torch.empty(tensor.shape).uniform_(0.05, 1.0, generator=generator).log())
        elif name.endswith("dt_bias"):
            tensor.copy_(-2.0 + 0.5 * torch.randn(tensor.shape, generator=generator))
        elif name.endswith("norm.weight") and ".linear_attn.norm." not in name:
            tensor.copy_(0.1 * torch.randn(tensor.shape, generator=generator))


def build_hf_model(arch: str, seed: int = 0, **overrides):
    """A tiny transformers ``*ForCausalLM`` in eval mode with re-drawn random weights."""
    _, model_cls = _classes(arch)
    torch.manual_seed(seed)
    model = model_cls(tiny_config(arch, **overrides)).float().eval()
    _redraw(model, torch.Generator().manual_seed(seed))
    return model


def write_tiny_checkpoint(arch: str, path: str | Path, seed: int = 0, *, mtp: bool = False,
                          mtp_own_head: bool = False, tokenizer: bool = False, **overrides):
    """Build a tiny ``arch`` model and ``save_pretrained`` it to ``path``.

    Args:
        mtp: also write one MTP layer (see the module docstring).
        mtp_own_head: the MTP layer stores its own ``embed_tokens`` and ``shared_head.head``.
        tokenizer: write the word-level test tokenizer.

    Returns:
        the transformers model (the reference for parity tests).
    """
    model = build_hf_model(arch, seed, **overrides)
    model.save_pretrained(str(path))
    if mtp:
        _add_mtp_layer(arch, Path(path), model, seed, mtp_own_head, overrides)
    if tokenizer:
        write_tiny_tokenizer(path, model.config.vocab_size)
    return model


def write_tiny_llama(path: str | Path, seed: int = 0, tokenizer: bool = False, **overrides):
    """A tiny ``LlamaForCausalLM`` (GQA 4/2 heads, 2 layers) with re-drawn weights, saved to ``path``
    as safetensors; returns the transformers model (the oracle)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   bos_token_id=0, eos_token_id=1, tie_word_embeddings=False), **overrides})
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).float().eval()
    _redraw(model, torch.Generator().manual_seed(seed))
    model.save_pretrained(str(path))
    if tokenizer:
        write_tiny_tokenizer(path, config.vocab_size)
    return model


def mtp_block_model(arch: str, seed: int = 0, **overrides):
    """The one-layer transformers model whose layer 0 is the MTP block of a checkpoint written with
    ``mtp=True`` (same ``seed`` and ``overrides``): MoE MLP, own DSA indexer when ``arch`` has one."""
    layer = dict(num_hidden_layers=1, mlp_layer_types=["sparse"], first_k_dense_replace=0)
    if arch == "glm_moe_dsa":
        layer["indexer_types"] = ["full"]
    return build_hf_model(arch, seed + 1000, **{**overrides, **layer})


@torch.no_grad()
def _add_mtp_layer(arch: str, path: Path, model, seed: int, own_head: bool, overrides: dict) -> None:
    """Append ``model.layers.{L}.*`` MTP tensors to ``path/model.safetensors`` and set
    ``num_nextn_predict_layers=1`` in ``config.json``."""
    from safetensors.torch import load_file, save_file

    config = model.config
    num_layers, hidden = config.num_hidden_layers, config.hidden_size
    prefix = f"model.layers.{num_layers}."
    tensors = load_file(str(path / "model.safetensors"))
    with tempfile.TemporaryDirectory() as tmp:   # save_pretrained writes the per-expert layout
        mtp_block_model(arch, seed, **overrides).save_pretrained(tmp)
        for name, tensor in load_file(str(Path(tmp) / "model.safetensors")).items():
            if name.startswith("model.layers.0."):
                tensors[prefix + name[len("model.layers.0."):]] = tensor
    gen = torch.Generator().manual_seed(seed + 2000)
    tensors[prefix + "enorm.weight"] = 1.0 + 0.1 * torch.randn(hidden, generator=gen)
    tensors[prefix + "hnorm.weight"] = 1.0 + 0.1 * torch.randn(hidden, generator=gen)
    tensors[prefix + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) / math.sqrt(2 * hidden)
    tensors[prefix + "shared_head.norm.weight"] = 1.0 + 0.1 * torch.randn(hidden, generator=gen)
    if own_head:
        tensors[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


def tiny_token_text(token_id: int) -> str:
    """The text of token ``token_id`` in the test tokenizer."""
    return f"w{token_id:03d}"


def write_tiny_tokenizer(path: str | Path, vocab_size: int) -> None:
    """A word-level tokenizer over ``vocab_size`` tokens ``w000 w001 ...`` (space-separated when
    decoded); ``w000`` is BOS and ``w001`` EOS, matching the tiny configs."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tiny_token_text(i): i for i in range(vocab_size)}
    core = Tokenizer(models.WordLevel(vocab, unk_token=tiny_token_text(2)))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=tiny_token_text(0),
                                   eos_token=tiny_token_text(1), unk_token=tiny_token_text(2))
    fast.save_pretrained(str(path))


def load_hf_model(path: str | Path):
    """Load a checkpoint folder back with transformers (eager attention, float32)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager", dtype=torch.float32).eval()


def _fp8_eligible(name: str, tensor: torch.Tensor) -> bool:
    """Which tensors DeepSeek-V3 stores in FP8: linear weights inside the decoder layers, except
    the router (``mlp.gate``) and the indexer's ``weights_proj`` (kept in higher precision)."""
    return (tensor.dim() == 2 and name.startswith("model.layers.") and name.endswith(".weight")
            and not name.endswith("mlp.gate.weight") and "weights_proj" not in name)


def quantize_block_fp8(weight: torch.Tensor, block_size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block absmax FP8 quantization (DeepSeek-V3 ``weight_quant``).

    Returns:
        ``(float8_e4m3fn [out, in], weight_scale_inv float32 [ceil(out/bo), ceil(in/bi)])`` with
        ``weight ~= fp8 * scale_inv`` blockwise.
    """
    block_rows, block_cols = block_size
    rows, cols = weight.shape
    grid = (math.ceil(rows / block_rows), math.ceil(cols / block_cols))
    padded = torch.zeros(grid[0] * block_rows, grid[1] * block_cols)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(grid[0], block_rows, grid[1], block_cols)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX                   # [gr, gc]
    quant = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return quant.view(padded.shape)[:rows, :cols].contiguous(), scale


def dequantize_reference(quant: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int]) -> torch.Tensor:
    """Independent (test-side) block dequantization: expand the scales and multiply."""
    rows, cols = quant.shape
    expanded = scale_inv.repeat_interleave(block_size[0], 0).repeat_interleave(block_size[1], 1)
    return quant.float() * expanded[:rows, :cols]


def write_fp8_checkpoint(src: str | Path, dst: str | Path, block_size: tuple[int, int] = (32, 32),
                         dequantized_dst: str | Path | None = None) -> Path:
    """Copy checkpoint ``src`` to ``dst`` with FP8 block-scaled linear weights.

    ``config.json`` gains DeepSeek-V3's ``quantization_config`` (``weight_block_size``). When
    ``dequantized_dst`` is given, the dequantized float32 weights are also written there as a
    plain checkpoint: the reference transformers loads for FP8 parity.
    """
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, tensor in tensors.items():
        if _fp8_eligible(name, tensor):
            quant, scale = quantize_block_fp8(tensor, block_size)
            quantized[name], quantized[name[: -len("weight")] + "weight_scale_inv"] = quant, scale
            dequantized[name] = dequantize_reference(quant, scale, block_size)
        else:
            quantized[name] = dequantized[name] = tensor
    save_file(quantized, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    if dequantized_dst is not None:
        ddst = Path(dequantized_dst)
        ddst.mkdir(parents=True, exist_ok=True)
        save_file(dequantized, str(ddst / "model.safetensors"), metadata={"format": "pt"})
        (ddst / "config.json").write_text(json.dumps(config, indent=2))
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block_size)}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for extra in ("generation_config.json",):
        if (src / extra).is_file():
            shutil.copy(src / extra, dst / extra)
    return dst
