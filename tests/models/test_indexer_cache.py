"""Indexer-key cache layout: per-layer cache specs (GLM "shared" layers own no indexer cache) and
the fp8 indexer cache (DeepSeek-V3.2 format) against the model-dtype cache on the same prompt."""

from __future__ import annotations

import pytest
import torch

from shardserve.kernels.indexer import quantize_index_keys
from plan_driver import PlanDriver, make_runner
from shardserve.workers.models.dsa_indexer import selection_mask

DSA_ARCHS = ["deepseek_v32", "glm_moe_dsa"]
PROMPT = torch.randint(2, 128, (40,), generator=torch.Generator().manual_seed(1)).tolist()


def expected_bytes_per_block(config, block_size: int, indexer_row_bytes: int) -> int:
    """Per layer: the latent row in float32, plus an indexer row for layers with their own indexer."""
    types = getattr(config, "indexer_types", None) or ["full"] * config.num_hidden_layers
    latent = (config.kv_lora_rank + config.qk_rope_head_dim) * 4
    return block_size * sum(latent + (indexer_row_bytes if kind == "full" else 0) for kind in types)


@pytest.mark.parametrize("arch", DSA_ARCHS)
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
def test_cache_bytes_count_only_real_caches(tiny_model, arch, cache_dtype):
    config = tiny_model(arch).hf.config
    runner = make_runner(tiny_model(arch).path, indexer_cache_dtype=cache_dtype)
    row = config.index_head_dim * 4 if cache_dtype == "auto" else config.index_head_dim + 4   # one scale per <=128
    assert runner.bytes_per_block == expected_bytes_per_block(config, runner.block_size, row)
    held = sum(t.numel() * t.element_size() for layer in runner.model.attention_layers() for t in layer.kv_cache)
    assert held == runner.cache_bytes == runner.num_blocks * runner.bytes_per_block
    if arch == "glm_moe_dsa":
        shared = [layer for layer in runner.model.attention_layers() if layer.shares_topk]
        assert shared and all(len(layer.kv_cache) == 1 for layer in shared)


@pytest.mark.parametrize("arch", DSA_ARCHS)
def test_fp8_cache_holds_the_quantized_keys_and_keeps_the_selection(tiny_model, arch):
    """Layer 0's indexer keys do not depend on any selection, so its fp8 cache must hold exactly the
    quantized model-dtype keys; its top-k over them may differ only where e4m3 rounding reorders
    near-equal scores (measured: 98-99% of the selected keys agree)."""
    path = tiny_model(arch).path
    runs = {}
    for cache_dtype in ("auto", "fp8"):
        runner = make_runner(path, indexer_cache_dtype=cache_dtype)
        layer = runner.model.attention_layers()[0]
        layer.record_topk = True
        driver = PlanDriver(runner)
        driver.step({"a": PROMPT})
        blocks, size = runner.requests["a"].block_ids, runner.block_size
        slots = torch.tensor([blocks[pos // size] * size + pos % size for pos in range(len(PROMPT))])
        runs[cache_dtype] = layer.indexer.k_cache, layer.last_topk, slots
    (keys, topk, slots), (fp8_keys, fp8_topk, fp8_slots) = runs["auto"], runs["fp8"]
    assert fp8_keys.dtype == torch.uint8
    flat = keys.view(-1, keys.shape[-1])[slots]
    assert torch.equal(fp8_keys.view(-1, fp8_keys.shape[-1])[fp8_slots], quantize_index_keys(flat))
    chosen, fp8_chosen = selection_mask(topk, len(PROMPT)), selection_mask(fp8_topk, len(PROMPT))
    assert torch.equal(chosen.sum(-1), fp8_chosen.sum(-1))                 # same number of keys per row
    assert (chosen & fp8_chosen).sum().item() >= 0.95 * chosen.sum().item()


def test_unknown_indexer_cache_dtype_is_rejected(tiny_model):
    with pytest.raises(ValueError, match="'auto' or 'fp8'"):
        make_runner(tiny_model("deepseek_v32").path, indexer_cache_dtype="int4")
