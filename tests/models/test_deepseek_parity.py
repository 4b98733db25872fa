"""DeepseekV3 / DeepseekV32 / GlmMoeDsa through our runner vs transformers (eager, float32).

Tiny random checkpoints (``tiny_checkpoints.py``): index_topk 8, so a 5-token prompt keeps the
indexer an exact no-op until decode passes 8 tokens, and a 20-token prompt makes it select from
the start. transformers runs each full sequence without a cache (teacher forcing): its logits at
position p equal incremental decoding's, so one forward checks all 16 decode steps.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from plan_driver import PlanDriver, hf_logits, make_runner
from tiny_checkpoints import ARCHS
from shardserve.workers.models.dsa_indexer import selection_mask

TOL = 1e-4
DSA_ARCHS = ("deepseek_v32", "glm_moe_dsa")


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(2, 128, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run_single(runner, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Prefill (all rows) then ``steps`` greedy decode steps; ``(generated, prefill [P, V], decode [steps, V])``."""
    driver = PlanDriver(runner)
    prefill = driver.step_all_rows({"a": prompt})["a"]
    generated, decode = driver.greedy({"a": prefill[-1]}, steps)
    return generated["a"], prefill, decode["a"]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}"
    return (a - b).abs().max().item()


@contextlib.contextmanager
def hf_index_topk(hf_model, top_k: int):
    """Temporarily change the top-k of every transformers indexer (a huge k = dense MLA)."""
    indexers = [layer.self_attn.indexer for layer in hf_model.model.layers if layer.self_attn.indexer is not None]
    saved = [idx.index_topk for idx in indexers]
    for idx in indexers:
        idx.index_topk = top_k
    try:
        yield
    finally:
        for idx, k in zip(indexers, saved):
            idx.index_topk = k


@pytest.mark.parametrize("prompt_len", [5, 20], ids=["short", "long"])
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_greedy_decode_match_transformers(tiny_model, arch, prompt_len):
    tiny = tiny_model(arch)
    prompt = _prompt(prompt_len, seed=prompt_len)
    generated, prefill, decode = _run_single(make_runner(tiny.path), prompt, steps=16)
    reference = hf_logits(tiny.hf, prompt + generated[:-1])         # [P + 16, V]
    assert _max_diff(prefill, reference[:prompt_len]) < TOL
    assert _max_diff(decode, reference[prompt_len:]) < TOL
    # transformers' greedy choice at every step is ours (so its generate would produce the same text).
    assert reference[prompt_len - 1:].argmax(-1).tolist() == generated


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_of_three_matches_each_alone(tiny_model, arch):
    """3 sequences in one plan (one prefilled in two chunks while the others decode) == alone."""
    tiny = tiny_model(arch)
    prompts = {"a": _prompt(3, 1), "b": _prompt(11, 2), "c": _prompt(19, 3)}
    driver = PlanDriver(make_runner(tiny.path), seed=1)
    first = driver.step({"a": prompts["a"], "b": prompts["b"], "c": prompts["c"][:9]})
    second = driver.step({"a": [int(first["a"].argmax())], "b": [int(first["b"].argmax())], "c": prompts["c"][9:]})
    generated = {"a": [int(first["a"].argmax()), int(second["a"].argmax())],
                 "b": [int(first["b"].argmax()), int(second["b"].argmax())],
                 "c": [int(second["c"].argmax())]}
    batched = {"a": [first["a"], second["a"]], "b": [first["b"], second["b"]], "c": [second["c"]]}
    for _ in range(6):
        out = driver.step({req: [ids[-1]] for req, ids in generated.items()})
        for req, logits in out.items():
            batched[req].append(logits)
            generated[req].append(int(logits.argmax()))
    for req, prompt in prompts.items():
        alone_generated, alone_prefill, alone_decode = _run_single(make_runner(tiny.path), prompt,
                                                                   steps=len(generated[req]) - 1)
        assert alone_generated == generated[req], f"request {req}: batched tokens differ from alone"
        alone = torch.cat((alone_prefill[-1:], alone_decode))
        assert _max_diff(torch.stack(batched[req]), alone) < 1e-5, f"request {req}"
        reference = hf_logits(tiny.hf, prompt + generated[req][:-1])[len(prompt) - 1:]
        assert _max_diff(torch.stack(batched[req]), reference) < TOL, f"request {req}"


def _record_topk(runner) -> list:
    layers = runner.model.attention_layers()
    for layer in layers:
        layer.record_topk = True
    return layers


def _selection(topk: torch.Tensor, num_keys: int) -> torch.Tensor:
    """``[Q, k]`` positions (row q sees keys <= q; ``-1`` = none) -> ``[Q, num_keys]`` causal bool selection."""
    return selection_mask(topk, num_keys) & torch.ones(num_keys, num_keys, dtype=torch.bool).tril()[: topk.shape[0]]


@pytest.mark.parametrize("arch", DSA_ARCHS)
def test_indexer_topk_matches_transformers(tiny_model, arch):
    """Per layer, the keys each prompt token selects are transformers' (and IndexShare reuses)."""
    tiny = tiny_model(arch)
    prompt = _prompt(20, seed=7)
    hf_topk: dict[int, torch.Tensor] = {}
    hooks = [layer.self_attn.indexer.register_forward_hook(
        lambda module, args, out, idx=idx: hf_topk.__setitem__(idx, out[0]))
        for idx, layer in enumerate(tiny.hf.model.layers) if layer.self_attn.indexer is not None]
    try:
        hf_logits(tiny.hf, prompt)
    finally:
        for hook in hooks:
            hook.remove()
    runner = make_runner(tiny.path)
    layers = _record_topk(runner)
    PlanDriver(runner).step({"a": prompt})
    last_full = None
    for idx, layer in enumerate(layers):
        if layer.indexer is None:          # GLM "shared" layer: the very tensor of the last full layer
            assert tiny.hf.config.indexer_types[idx] == "shared"
            assert layer.shares_topk and layer.last_topk is last_full
            continue
        last_full = layer.last_topk
        ours = _selection(layer.last_topk, len(prompt))
        theirs = _selection(hf_topk[idx], len(prompt))
        assert torch.equal(ours, theirs), f"layer {idx}: rows {(ours != theirs).any(-1).nonzero().flatten().tolist()}"
    if arch == "glm_moe_dsa":
        assert [layer.shares_topk for layer in layers] == [t == "shared" for t in tiny.hf.config.indexer_types]
        assert any(layer.shares_topk for layer in layers)


@pytest.mark.parametrize("arch", DSA_ARCHS)
def test_hadamard_rotation_keeps_topk_and_logits(tiny_model, arch):
    """Hadamard on (default) vs off: same selections at every step (the data has no exact score
    ties: 16 indexer heads), logits equal to float rounding, and the cached keys really differ."""
    tiny = tiny_model(arch)
    prompt = _prompt(20, seed=11)
    results = {}
    for hadamard in (True, False):
        runner = make_runner(tiny.path, hadamard=hadamard)
        layers = _record_topk(runner)
        driver = PlanDriver(runner)
        steps, logits = [], []
        out = driver.step({"a": prompt})["a"]
        steps.append([layer.last_topk for layer in layers])
        for _ in range(4):
            logits.append(out)
            out = driver.step({"a": [int(out.argmax())]})["a"]
            steps.append([layer.last_topk for layer in layers])
        key_cache = next(layer.indexer.k_cache for layer in layers if layer.indexer is not None)
        results[hadamard] = steps, torch.stack(logits), key_cache.clone()
    (steps_on, logits_on, keys_on), (steps_off, logits_off, keys_off) = results[True], results[False]
    for step_on, step_off in zip(steps_on, steps_off):
        for idx, (on, off) in enumerate(zip(step_on, step_off)):
            assert (on is None) == (off is None)
            if on is not None:
                assert torch.equal(on.sort(-1).values, off.sort(-1).values), f"layer {idx}"
    assert _max_diff(logits_on, logits_off) < 1e-5
    assert _max_diff(keys_on, keys_off) > 1e-2, "Hadamard rotation did not change the cached keys"


@pytest.mark.parametrize("arch", DSA_ARCHS)
def test_dsa_off_is_dense_mla(tiny_model, arch):
    """``shardserve_dsa=False``: no indexer, latent cache only, logits == transformers with the
    indexer keeping every key; and the indexer does bite on this prompt when on."""
    tiny = tiny_model(arch)
    prompt = _prompt(20, seed=5)
    runner = make_runner(tiny.path, dsa=False)
    assert all(layer.indexer is None for layer in runner.model.attention_layers())
    assert all(len(layer.cache_spec(4, 4)) == 1 for layer in runner.model.attention_layers())
    generated, prefill, decode = _run_single(runner, prompt, steps=8)
    with hf_index_topk(tiny.hf, 10**6):
        dense_reference = hf_logits(tiny.hf, prompt + generated[:-1])
    assert _max_diff(torch.cat((prefill, decode)), dense_reference) < TOL
    _, sparse_prefill, _ = _run_single(make_runner(tiny.path), prompt, steps=0)
    assert _max_diff(sparse_prefill, prefill) > 1e-2, "top-k 8 of 20 keys should change the logits"


@pytest.mark.parametrize("arch", DSA_ARCHS)
def test_dsa_top_k_override(tiny_model, arch):
    """``shardserve_dsa_top_k=4`` == transformers with ``index_topk=4``."""
    tiny = tiny_model(arch)
    prompt = _prompt(12, seed=9)
    generated, prefill, decode = _run_single(make_runner(tiny.path, dsa_top_k=4), prompt, steps=6)
    with hf_index_topk(tiny.hf, 4):
        reference = hf_logits(tiny.hf, prompt + generated[:-1])
    assert _max_diff(torch.cat((prefill, decode)), reference) < TOL
