"""Tensor parallelism on a real Ray cluster (SmolLM2: 9 heads in 3 KV groups). On the exact float32
path TP=1, TP=2 (an uneven 2+1 split) and TP=2 with --tensor-split 1,2 give the single-process
engine's greedy tokens and logits within 1e-4 of TP=1. With the default packed weights (bfloat16),
TP=3 stays within bfloat16 noise of the single-process packed engine and picks the same tokens."""

from __future__ import annotations

import pytest

from shardserve.cluster.config import EngineArgs
from shardserve.cluster.engine.request import SamplingParams
from shardserve.cluster.replica.worker_group import GroupConfig

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Name three colors."}],
    "Once upon a time, in a small village,",
    "def fibonacci(n):\n    ",
]
NUM_TOKENS = 24
PACKED_TP_BOUND = 2.0   # bfloat16 rounding of activations and partial sums at |logit| ~25 (ulp 0.125): 0.80
                        # measured on an AVX-512 machine, 1.29 on one with AMX (its bf16 GEMMs round otherwise)


@pytest.fixture(scope="module")
def reference(smollm2_llm):
    """Single-process TP=1 engine: prompt ids, last-position logits, greedy tokens."""
    ids = [smollm2_llm.encode(p) for p in PROMPTS]
    logits = [smollm2_llm.core.prompt_logits(x) for x in ids]
    done = smollm2_llm.generate(ids, SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True))
    return ids, logits, [d.token_ids for d in done]


@pytest.mark.parametrize("tp,split,dispatch", [pytest.param(1, None, "calls", marks=pytest.mark.extended),
                                               pytest.param(2, None, "calls", marks=pytest.mark.extended),
                                               (2, [1.0, 2.0], "compiled")],
                         ids=["tp1", "tp2-uneven", "tp2-split-1,2-compiled"])
def test_tensor_parallel_matches_single_process(ray_cluster, replicas, smollm2_files, reference,
                                                 tp, split, dispatch):
    ids, ref_logits, ref_tokens = reference
    args = EngineArgs(model=str(smollm2_files.path), tensor_parallel_size=tp, tensor_split=split, kv_cache_gib=0.05,
                      dtype="float32")
    handle = replicas.launch(args, GroupConfig(cpus_per_worker=1, dispatch=dispatch))
    try:
        info = ray_cluster.get(handle.model_info.remote())
        assert info["tensor_parallel_size"] == tp and info["collective"] == ("none" if tp == 1 else "shm")
        assert info["step_transport"] == ("compiled-graph" if dispatch == "compiled" else "unix-socket")
        for prompt, expected in zip(ids, ref_logits):
            logits = ray_cluster.get(handle.prompt_logits.remote(prompt))
            diff = (logits - expected).abs().max().item()
            assert diff < 1e-4, f"TP={tp} split={split}: logits max-abs-diff {diff}"
        greedy = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
        done = ray_cluster.get([handle.complete.remote(prompt, greedy) for prompt in ids])  # one batch
        assert [d["token_ids"] for d in done] == ref_tokens
        info = ray_cluster.get(handle.model_info.remote())
        assert info["num_free_blocks"] == info["num_blocks"]
    finally:
        replicas.stop(handle)


def test_tensor_parallel_packed_weights(ray_cluster, replicas, smollm2_files, smollm2_llm_packed):
    """TP=3 on the default path: each rank packs its slice (whole rows; o_proj / down_proj slices
    of 192 / 512 input columns are whole groups of 32). Rank partial sums are rounded to bfloat16
    before the all-reduce, so logits differ from TP=1 by bfloat16 noise, not exactly (the
    top two logits of three of the four prompts are one bfloat16 ulp apart, e.g. 25.5 and 25.375:
    their order may flip)."""
    ids = [smollm2_llm_packed.encode(p) for p in PROMPTS]
    args = EngineArgs(model=str(smollm2_files.path), tensor_parallel_size=3, kv_cache_gib=0.05)
    handle = replicas.launch(args, GroupConfig(cpus_per_worker=1))
    try:
        # steps reach the three ranks over Unix sockets (one node), not as Ray calls
        assert ray_cluster.get(handle.model_info.remote())["step_transport"] == "unix-socket"
        for prompt in ids:
            expected = smollm2_llm_packed.core.prompt_logits(prompt)
            logits = ray_cluster.get(handle.prompt_logits.remote(prompt))
            diff = (logits - expected).abs().max().item()
            assert diff < PACKED_TP_BOUND, diff
            # greedy picks a token the reference also ranks within the noise of its best one
            assert expected[int(logits.argmax())] >= expected.max() - 2 * PACKED_TP_BOUND
    finally:
        replicas.stop(handle)
