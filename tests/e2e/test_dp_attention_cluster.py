"""Data-parallel attention through the cluster (issue 29): a coordinator with two shard workers on
a local Ray cluster, each rank its own attention group (N = D = 2) with its own KV pool, the MoE
exchanging tokens between them. Concurrent requests land on both groups, one prompt is prefilled
in chunks (a small token budget), and the small KV pools force a preemption; every completion
equals transformers' greedy generation on the same checkpoint. The replica's KV capacity at the
same per-rank budget is N times plain TP's (the same per-rank budget gives the same blocks per rank).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from shardserve.cluster.config import EngineArgs
from shardserve.cluster.engine.request import SamplingParams
from shardserve.cluster.replica.worker_group import GroupConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from tiny_checkpoints import write_tiny_checkpoint  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]
BLOCK_SIZE, BLOCK_BYTES = 4, 4 * 640    # tiny V3.2: 640 cache bytes per token and rank (latent + indexer keys)
KV_CACHE_GIB = 12.5 * BLOCK_BYTES / 2**30   # the per-rank budget: 12 blocks = 48 tokens per attention group
_gen = torch.Generator().manual_seed(7)
PROMPTS = [torch.randint(2, 128, (n,), generator=_gen).tolist() for n in (30, 9, 12, 5)]
MAX_TOKENS = [10, 12, 12, 8]            # group 0 (placed 1st and 3rd): 40 + 24 tokens > 48: a preemption


@pytest.fixture(scope="module")
def dsa_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dp-v32")
    hf = write_tiny_checkpoint("deepseek_v32", folder, seed=0, tokenizer=True)
    return folder, hf


def plain_tp_kv_tokens(folder) -> int:
    """KV tokens of a plain TP=2 replica with the same per-rank budget (``shardserve plan --json``)."""
    import contextlib
    import io
    import json

    from shardserve.cluster.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["plan", str(folder), "--tensor-parallel-size", "2", "--device", "cpu", "--kv-cache-gib",
              str(KV_CACHE_GIB), "--block-size", str(BLOCK_SIZE), "--max-model-len", "48", "--json"])
    plan = json.loads(out.getvalue())
    assert [rank["kv_blocks"] for rank in plan["ranks"]] == [12, 12]
    return min(rank["kv_blocks"] for rank in plan["ranks"]) * BLOCK_SIZE


def hf_greedy(hf, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_dp_attention_cluster_greedy_equals_transformers(dsa_checkpoint, ray_cluster, replicas):
    folder, hf = dsa_checkpoint
    expected = [hf_greedy(hf, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    args = EngineArgs(model=str(folder), tensor_parallel_size=2, enable_dp_attention=True, block_size=BLOCK_SIZE,
                      kv_cache_gib=KV_CACHE_GIB, max_model_len=48, max_num_batched_tokens=16,
                      enable_prefix_caching=False)
    handle = replicas.launch(args, GroupConfig(cpus_per_worker=1))
    try:
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
        done = ray_cluster.get([handle.complete.remote(p, sp) for p, sp in zip(PROMPTS, params)])
        assert [d["token_ids"] for d in done] == expected
        info = ray_cluster.get(handle.model_info.remote())
        placed, preempted = ray_cluster.get(handle.__ray_call__.remote(
            lambda c: (c.core.num_placed, [core.scheduler.num_preemptions for core in c.core.cores])))
        assert placed == [2, 2]                  # least-loaded placement: requests on both groups
        assert preempted[0] >= 1 and info["num_preemptions"] == sum(preempted)
        # KV capacity: N = 2 times plain TP=2's at the same per-rank budget (what `shardserve plan`
        # gives every rank of a plain TP replica, the count its coordinator takes)
        assert info["num_blocks"] * info["block_size"] == info["kv_capacity_tokens"] == 2 * plain_tp_kv_tokens(folder)
        assert info["attention_dp_size"] == 2
        # ... and /metrics exports it (the front's gauges, from the ModelInfo proto the router reads)
        from shardserve.cluster.frontend.metrics import ServeMetrics, replica_info
        from shardserve.proto import inference_pb2 as pb

        metrics = ServeMetrics()
        fields = pb.ModelInfoResponse.DESCRIPTOR.fields_by_name
        proto_info = pb.ModelInfoResponse(**{k: v for k, v in info.items() if k in fields and k != "workers"})
        metrics.set_replica("0", True, 0, replica_info(proto_info))
        text = metrics.render().decode()
        assert f'shardserve_kv_cache_capacity_tokens{{replica="0"}} {float(info["kv_capacity_tokens"])}' in text
    finally:
        replicas.stop(handle)
