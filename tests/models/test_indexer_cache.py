"""Indexer-key cache layout: per-layer cache specs (GLM "shared" layers own no indexer cache) and
the fp8 indexer cache and queries (DeepSeek-V3.2 format) against the model-dtype path."""

from __future__ import annotations

import shutil

import pytest
import torch

from shardserve.kernels.indexer import indexer_scores_ref, quantize_index_keys, select_topk
from plan_driver import PlanDriver, make_runner, recorded_indexer_calls
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
def test_fp8_cache_holds_the_quantized_keys(tiny_model, arch):
    """Layer 0's indexer keys do not depend on any selection, so its fp8 cache must hold exactly the
    quantized model-dtype keys."""
    path = tiny_model(arch).path
    runs = {}
    for cache_dtype in ("auto", "fp8"):
        runner = make_runner(path, indexer_cache_dtype=cache_dtype)
        layer = runner.model.attention_layers()[0]
        PlanDriver(runner).step({"a": PROMPT})
        blocks, size = runner.requests["a"].block_ids, runner.block_size
        slots = torch.tensor([blocks[pos // size] * size + pos % size for pos in range(len(PROMPT))])
        runs[cache_dtype] = layer.indexer.k_cache, slots
    (keys, slots), (fp8_keys, fp8_slots) = runs["auto"], runs["fp8"]
    assert fp8_keys.dtype == torch.uint8
    flat = keys.view(-1, keys.shape[-1])[slots]
    assert torch.equal(fp8_keys.view(-1, fp8_keys.shape[-1])[fp8_slots], quantize_index_keys(flat))


@pytest.mark.parametrize("arch", DSA_ARCHS)
def test_fp8_keys_and_queries_keep_the_selection(tiny_model, arch):
    """Top-k sets with fp8 keys and queries vs the float32 path on a random tiny checkpoint.

    How it is measured: layer 0 (its inputs do not depend on any selection, so both paths score
    the same q and k), 4 random 128-token prompts packed in one step, top-k 32, over the rows that
    choose: positions >= 32, 384 rows picking 32 of 33..128 keys (the rows that keep every key
    agree trivially and are left out). The float path has no tie at any of these rows' k-th score
    (16 indexer heads: asserted), so its top-k set is well defined. Agreement is the share of the
    float path's keys that the other path also selects. Measured:

        =============  ==================  ===================================
        checkpoint     fp8 keys + queries  fp8 keys, float queries (the bound)
        =============  ==================  ===================================
        DeepSeek-V3.2  98.1%               98.5%
        GLM-5          98.0%               98.6%
        =============  ==================  ===================================

    The 99% of issue 15 is out of reach with DeepSeek-V3.2's format itself, which the fp8 path
    follows bit for bit (Hadamard rotation, ``act_quant`` ue8m0 scales per 128 dims, fp32 scoring):
    e4m3 keeps 3 mantissa bits (~2.6% RMS relative error per value), which moves a score by a few
    percent of the spread of a row's scores, and random-weight scores are dense around the k-th.
    The fp8 keys alone (what the cache stores, whatever the queries) already lose 1.4-1.5%; the
    rotation changes little here (random q and k have no outliers to spread; +0.05% measured).
    (Rounding q and k to bf16 instead loses about 0.3%.) On the trained demo model
    ``bench_demo.py`` measures 96.0-98.2% per layer at top-64 of 2048 keys (fp8 keys alone
    96.7-98.5%); where margins are clear the selections are exact (the test below).
    """
    top_k, width = 32, 128
    prompts = {f"p{i}": torch.randint(2, 128, (width,), generator=torch.Generator().manual_seed(2 + i)).tolist()
               for i in range(4)}
    chosen = {}
    for cache_dtype in ("auto", "fp8"):
        runner = make_runner(tiny_model(arch).path, indexer_cache_dtype=cache_dtype, dsa_top_k=top_k, num_blocks=160)
        layer = runner.model.attention_layers()[0]
        layer.record_topk = True
        with recorded_indexer_calls() as calls:
            PlanDriver(runner).step(prompts)
        chosen[cache_dtype] = layer.last_topk
        if cache_dtype == "auto":
            (q, weights, k_cache, block_tables, seq_lens, _, query_start_loc, max_seq_len), _ = calls[0]   # layer 0
    logits = indexer_scores_ref(q, weights, k_cache, block_tables, seq_lens, query_start_loc, max_seq_len)
    assert torch.equal(select_topk(logits, top_k), chosen["auto"])
    packed = quantize_index_keys(k_cache.flatten(0, 1)).view(*k_cache.shape[:2], -1)
    chosen["fp8 keys"] = select_topk(indexer_scores_ref(q, weights, packed, block_tables, seq_lens, query_start_loc,
                                                        max_seq_len), top_k)
    rows = torch.arange(width).repeat(len(prompts)) >= top_k          # the rows that choose
    kth = logits[rows].gather(-1, chosen["auto"][rows].long()).amin(-1, keepdim=True)
    assert ((logits[rows] == kth).sum(-1) == 1).all()                  # no tie at the k-th score
    reference = selection_mask(chosen["auto"], width)[rows]
    assert torch.equal(reference.sum(-1), selection_mask(chosen["fp8"], width)[rows].sum(-1))    # k keys each
    share = {name: (reference & selection_mask(chosen[name], width)[rows]).sum().item() / reference.sum().item()
             for name in ("fp8", "fp8 keys")}
    print(f"{arch}: top-{top_k} agreement with the float path over {int(rows.sum())} choosing rows: "
          f"fp8 keys + queries {share['fp8']:.4f}, fp8 keys only {share['fp8 keys']:.4f}")
    assert share["fp8"] >= 0.978 and share["fp8 keys"] >= 0.983, share            # measured: see the table


def test_fp8_greedy_matches_transformers_where_the_margin_is_clear(tiny_model, tmp_path):
    """A checkpoint whose indexers score 8 marker tokens ~30 per head and every other token 0
    (``crafted_indexer.py``), prompts that open with the 8 markers: every top-k (k = 8) has a clear
    margin, and greedy decoding with fp8 keys and queries selects exactly the markers and equals
    transformers token for token (prefill and 16 decode steps). Where margins are not clear, the
    selections of the two paths differ as measured above, and so may greedy tokens."""
    from crafted_indexer import craft_marker_checkpoint
    from plan_driver import hf_logits
    from tiny_checkpoints import load_hf_model

    markers = list(range(2, 10))
    path = shutil.copytree(tiny_model("deepseek_v32").path, tmp_path / "markers")
    craft_marker_checkpoint(path, marker_ids=set(markers), never_emit=set(markers))
    hf = load_hf_model(path)
    runner = make_runner(path, indexer_cache_dtype="fp8")
    layers = [layer for layer in runner.model.attention_layers() if layer.indexer is not None]
    assert all(layer.indexer.k_cache.dtype == torch.uint8 for layer in layers)
    tail = torch.randint(10, 128, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    prompt = markers[3:] + markers[:3] + tail
    for layer in layers:
        layer.record_topk = True
    driver = PlanDriver(runner)
    first = driver.step({"a": prompt})["a"]
    assert all(sorted(row.tolist()) == list(range(8)) for layer in layers for row in layer.last_topk[8:])
    generated, _ = driver.greedy({"a": first}, 16)
    reference = hf_logits(hf, prompt + generated["a"][:-1])            # teacher-forced: greedy at every step
    assert reference[len(prompt) - 1:].argmax(-1).tolist() == generated["a"]


def test_unknown_indexer_cache_dtype_is_rejected(tiny_model):
    with pytest.raises(ValueError, match="'auto' or 'fp8'"):
        make_runner(tiny_model("deepseek_v32").path, indexer_cache_dtype="int4")
