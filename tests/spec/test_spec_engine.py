"""MTP speculative decoding in the single-process engine (TP=1) on tiny DeepSeek-V3.2 and GLM-5
checkpoints with an MTP layer: greedy output equals plain decoding token for token for k = 1..3,
stops inside an accepted run end the output where plain decoding does, caches roll back
consistently (the real MTP's drafts after rejections equal a from-scratch computation), blocks all
return to the pool and only accepted tokens are ever hashed into the prefix cache.
"""

from __future__ import annotations

import pytest
import torch

from shardserve.cluster.engine.request import SamplingParams
from spec_helpers import ARCHS, NUM_BLOCKS, StraightMTP, greedy, install_oracle, make_llm, prompts, record_preemptions
from tiny_checkpoints import tiny_token_text
from shardserve.workers.model_source import ModelFiles, load_config


@pytest.fixture(scope="module")
def plain_outputs(mtp_checkpoint):
    """Plain greedy decoding (speculation off) of the test prompts, per architecture."""
    cache = {}

    def get(arch: str, max_tokens: int = 20) -> dict[tuple, list[int]]:
        if (arch, max_tokens) not in cache:
            llm = make_llm(mtp_checkpoint(arch).path, 0)
            batch = prompts() + prompts((7,), seed=5)
            done = llm.generate(batch, greedy(max_tokens))
            cache[arch, max_tokens] = {tuple(p): d.token_ids for p, d in zip(batch, done)}
        return cache[arch, max_tokens]

    return get


def _assert_pool_empty(llm) -> None:
    bm = llm.core.block_manager
    assert bm.num_free_blocks == bm.num_blocks == NUM_BLOCKS, f"{bm.num_free_blocks} of {bm.num_blocks} free"
    assert all(b.ref_count == 0 for b in bm.blocks)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_plain_decoding(mtp_checkpoint, plain_outputs, arch, k):
    expected = plain_outputs(arch)
    llm = make_llm(mtp_checkpoint(arch).path, k)
    batch = prompts()
    done = llm.generate(batch, greedy())                              # batched, chunked prefill
    assert [d.token_ids for d in done] == [expected[tuple(p)] for p in batch]
    (single,) = llm.generate(prompts((7,), seed=5), greedy())         # one request alone
    assert single.token_ids == expected[tuple(prompts((7,), seed=5)[0])]
    stats = llm.core.speculator.stats
    assert stats.num_draft_tokens > 0 and len(stats.acceptance_rate_per_position) == k
    _assert_pool_empty(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_partial_acceptance_rolls_back_every_cache(mtp_checkpoint, plain_outputs, arch):
    """Drafts right up to a chosen point (oracle drafter): accepted runs of every length, a step
    budget that drops drafts (6 tokens for 3 requests x 4), and the real MTP's own drafts after each
    rollback equal the MTP computed from scratch on the accepted tokens."""
    ckpt = mtp_checkpoint(arch)
    truth = plain_outputs(arch, 24)
    llm = make_llm(ckpt.path, 3, max_num_batched_tokens=6)
    oracle = install_oracle(llm, truth, wrong=lambda index: index % 5 == 3)
    batch = prompts()
    done = llm.generate(batch, greedy(20))
    assert [d.token_ids for d in done] == [truth[tuple(p)][:20] for p in batch]
    stats = llm.core.speculator.stats
    print(f"{arch}: oracle acceptance per position {stats.acceptance_rate_per_position}, "
          f"mean acceptance length {stats.mean_acceptance_length:.2f}")
    assert 0 < stats.acceptance_rate_per_position[2] < 1 and stats.mean_acceptance_length > 2
    _assert_pool_empty(llm)

    straight = StraightMTP(arch, ckpt.path, load_config(ModelFiles(ckpt.path.name, ckpt.path)))
    compared = 0
    for context, real in oracle.real[::3]:
        expected = straight.greedy_drafts(ckpt.hf, context, len(real))
        for got, want in zip(real, expected):
            if want is not None:
                assert got == want, f"context {context}: MTP drafts {real}, from scratch {expected}"
                compared += 1
    assert compared >= 10


@pytest.mark.parametrize("kind", ["stop_string", "eos", "stop_token", "max_tokens"])
def test_stop_inside_accepted_run(mtp_checkpoint, plain_outputs, kind):
    """With perfect drafts every step accepts k=3 tokens (+1), so output index 6 lies inside the
    second run; the output must end exactly where plain decoding ends it."""
    arch = "deepseek_v32"
    truth = plain_outputs(arch, 24)
    prompt = prompts()[1]
    continuation = truth[tuple(prompt)]
    stop_at = next(i for i in range(6, 20) if continuation[i] not in continuation[:i])
    stop_token = continuation[stop_at]
    params = {"stop_string": greedy(20, stop=[tiny_token_text(stop_token)]),
              "eos": SamplingParams(max_tokens=20, temperature=0),     # EOS is made stop_token below
              "stop_token": greedy(20, stop_token_ids=[stop_token]),
              "max_tokens": greedy(stop_at + 1)}[kind]
    results = []
    for k in (0, 3):
        llm = make_llm(mtp_checkpoint(arch).path, k)
        if kind == "eos":
            llm.core.eos_token_ids = frozenset({stop_token})
        if k:
            install_oracle(llm, truth)
        (done,) = llm.generate([prompt], params)
        results.append((done.token_ids, done.text, done.finish_reason))
        _assert_pool_empty(llm)
        if k:
            stats = llm.core.speculator.stats   # every draft accepted: the stop lands inside a run
            assert stats.num_accepted_tokens == stats.num_draft_tokens >= 4
            if kind == "max_tokens":   # k is cut so that no draft could pass max_tokens: the
                # tokens after the first (from the prefill) are exactly the drafts + one per step
                assert stats.num_draft_tokens + stats.num_drafts == stop_at
    assert results[1] == results[0]
    token_ids, text, reason = results[0]
    assert len(token_ids) == stop_at + 1 and token_ids[-1] == stop_token
    assert reason == ("length" if kind == "max_tokens" else "stop")
    if kind == "stop_string":
        assert text.split() == [tiny_token_text(t) for t in continuation[:stop_at]]


def test_blocks_return_and_prefix_cache_hashes_only_accepted_tokens(mtp_checkpoint, plain_outputs):
    """Many requests (greedy and seeded sampling, shared prefixes so the prefix cache hits) with a
    random-weight MTP (mostly rejected drafts): the pool is whole again afterwards, every hashed
    block holds a block-aligned run of some request's final tokens, and greedy outputs still equal
    plain decoding."""
    arch = "glm_moe_dsa"
    llm = make_llm(mtp_checkpoint(arch).path, 3, max_num_batched_tokens=24)
    shared = prompts((8,), seed=9)[0]                                  # two full blocks
    batch = [shared + tail for tail in prompts((3, 6, 1, 4, 2, 5), seed=11)] + prompts((6, 10), seed=12)
    params = [greedy(12) if i % 2 == 0 else SamplingParams(max_tokens=12, temperature=0.9, seed=i, ignore_eos=True)
              for i in range(len(batch))]
    finals = []
    for _ in range(2):                                                 # the second round hits the cache
        done = llm.generate(batch, params)
        finals += [d.prompt_token_ids + d.token_ids for d in done]
    _assert_pool_empty(llm)
    assert llm.core.block_manager.prefix_hits > 0
    assert llm.core.speculator.stats.num_draft_tokens > 0
    bs = llm.core.block_manager.block_size
    aligned = {tuple(seq[i:i + bs]) for seq in finals for i in range(0, len(seq) - bs + 1, bs)}
    hashed = [b.token_ids for b in llm.core.block_manager.blocks if b.hash is not None]
    assert hashed and all(tokens in aligned for tokens in hashed)
    plain = make_llm(mtp_checkpoint(arch).path, 0, max_num_batched_tokens=24)
    expected = plain.generate(batch, params)
    for i in range(0, len(batch), 2):
        assert done[i].token_ids == expected[i].token_ids


def test_seeded_sampling_is_deterministic_with_speculation(mtp_checkpoint):
    """A seeded request gives the same tokens alone, in a batch, and on another engine."""
    path = mtp_checkpoint("deepseek_v32").path
    prompt = prompts()[0]
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=42, ignore_eos=True)
    alone = make_llm(path, 2).generate([prompt], params)[0].token_ids
    others = [SamplingParams(max_tokens=10, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2)]
    batched = make_llm(path, 2).generate(prompts()[1:] + [prompt], others + [params])[-1].token_ids
    assert alone == batched


def test_logprobs_with_speculation(mtp_checkpoint, plain_outputs):
    """Every emitted token, accepted draft or not, carries its logprob under the target."""
    arch = "deepseek_v32"
    truth = plain_outputs(arch, 24)
    prompt = prompts()[2]
    params = greedy(10, logprobs=2)
    plain = make_llm(mtp_checkpoint(arch).path, 0).generate([prompt], params)[0]
    llm = make_llm(mtp_checkpoint(arch).path, 3)
    install_oracle(llm, truth, wrong=lambda index: index % 4 == 2)
    spec = llm.generate([prompt], params)[0]
    assert spec.token_ids == plain.token_ids and len(spec.logprobs) == len(plain.logprobs) == 10
    for a, b in zip(spec.logprobs, plain.logprobs):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert torch.isfinite(torch.tensor([lp.logprob for lp in spec.logprobs])).all()


def test_preemption_with_drafts_in_flight(mtp_checkpoint, plain_outputs):
    """A pool too small for the batch: requests are preempted (drafts dropped, draft worker told to
    forget them) and recomputed; greedy output is unchanged and the pool ends whole."""
    arch = "deepseek_v32"
    expected = plain_outputs(arch)
    llm = make_llm(mtp_checkpoint(arch).path, 3, num_blocks=14)
    truth = plain_outputs(arch, 24)
    install_oracle(llm, truth, wrong=lambda index: index % 3 == 1)
    preempted = record_preemptions(llm)
    batch = prompts()
    done = llm.generate(batch, greedy())
    assert preempted, "the pool must be too small for the whole batch"
    assert [d.token_ids for d in done] == [expected[tuple(p)] for p in batch]
    bm = llm.core.block_manager
    assert bm.num_free_blocks == bm.num_blocks == 14


def test_cli_generate_with_speculation(mtp_checkpoint, capsys):
    """``shardserve generate --speculative-tokens 2`` prints what plain decoding prints."""
    from shardserve.cluster.cli import build_parser, main

    path = str(mtp_checkpoint("glm_moe_dsa").path)
    argv = ["generate", "--model", path, "--prompt", "w005 w017 w033 w090", "--max-tokens", "12",
            "--kv-cache-gib", "0.002", "--block-size", "4"]
    texts = []
    for extra in ([], ["--speculative-tokens", "2"]):
        assert main(argv + extra) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and len(texts[0].split()) == 12
    for command in ("generate", "serve-grpc"):
        ns = build_parser().parse_args([command, "--speculative-tokens", "3"] + (["--prompt", "x"] if command ==
                                                                                   "generate" else []))
        assert ns.speculative_tokens == 3
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "x", "--speculative-tokens", "5"])
