"""Data-parallel attention through the cluster (issue 29): a coordinator and its shard workers on a
local Ray cluster, the ranks in attention groups each with its own KV pool, the MoE exchanging
tokens between them. Concurrent requests land on both groups, one prompt is prefilled in chunks (a
small token budget), and the small KV pools force a preemption; every completion equals
transformers' greedy generation on the same checkpoint. At the same per-rank KV budget the
replica's capacity (ModelInfo and ``/metrics``) is D times a plain TP replica's at N ranks.

``make test`` runs DeepSeek-V3.2 at N = D = 2 (allgather); the ``extended`` cases run GLM-5 and
DeepSeek-V3 with alltoall, and N = 4 as two groups of two TP ranks.
"""

from __future__ import annotations

import contextlib
import io
import json
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
BLOCK_SIZE, BLOCKS_PER_GROUP, MAX_MODEL_LEN = 4, 12, 48
_gen = torch.Generator().manual_seed(7)
# Prompts of 18-24 tokens (prefilled in chunks of at most 16) fit two to a group (<= 12 blocks), but
# any two of them decoding to the end need 15-16 blocks: each group must preempt one.
PROMPTS = [torch.randint(2, 128, (n,), generator=_gen).tolist() for n in (24, 20, 22, 18)]
MAX_TOKENS = [8, 10, 8, 10]


def plan_json(folder, world: int, kv_cache_gib: float) -> dict:
    """``shardserve plan --json`` of a plain TP replica on ``world`` CPU ranks."""
    from shardserve.cluster.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["plan", str(folder), "--tensor-parallel-size", str(world), "--device", "cpu", "--kv-cache-gib",
              str(kv_cache_gib), "--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN), "--json"])
    return json.loads(out.getvalue())


def hf_greedy(hf, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch, mode, world, num_groups", [
    ("deepseek_v32", "allgather", 2, 2),
    pytest.param("glm_moe_dsa", "alltoall", 2, 2, marks=pytest.mark.extended),
    pytest.param("deepseek_v3", "alltoall", 2, 2, marks=pytest.mark.extended),
    pytest.param("deepseek_v32", "alltoall", 4, 2, marks=pytest.mark.extended),
])
def test_dp_attention_cluster_greedy_equals_transformers(tmp_path, ray_cluster, replicas, arch, mode, world,
                                                         num_groups):
    folder = tmp_path / arch
    hf = write_tiny_checkpoint(arch, folder, seed=0, tokenizer=True)
    expected = [hf_greedy(hf, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    # the per-rank budget that holds BLOCKS_PER_GROUP blocks (cache bytes per token from the plan)
    rank = plan_json(folder, world, 1.0)["ranks"][0]
    kv_cache_gib = (BLOCKS_PER_GROUP + 0.5) * BLOCK_SIZE * rank["kv_bytes_per_token"] / 2**30
    plain = plan_json(folder, world, kv_cache_gib)
    assert [r["kv_blocks"] for r in plain["ranks"]] == [BLOCKS_PER_GROUP] * world
    args = EngineArgs(model=str(folder), tensor_parallel_size=world, enable_dp_attention=True,
                      attention_dp_size=num_groups, moe_a2a=mode, block_size=BLOCK_SIZE, kv_cache_gib=kv_cache_gib,
                      max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=16, enable_prefix_caching=False)
    handle = replicas.launch(args, GroupConfig(cpus_per_worker=1))
    try:
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
        done = ray_cluster.get([handle.complete.remote(p, sp) for p, sp in zip(PROMPTS, params)])
        assert [d["token_ids"] for d in done] == expected
        info = ray_cluster.get(handle.model_info.remote())
        placed, preempted = ray_cluster.get(handle.__ray_call__.remote(
            lambda c: (c.core.num_placed, [core.scheduler.num_preemptions for core in c.core.cores])))
        assert placed == [2, 2]                  # least-loaded placement: requests on both groups
        assert min(preempted) >= 1 and info["num_preemptions"] == sum(preempted)
        # KV capacity: D times plain TP's at the same per-rank budget (`shardserve plan` gives every
        # rank of the plain replica its blocks; its coordinator takes the smallest count)
        assert info["attention_dp_size"] == num_groups
        assert info["num_blocks"] * info["block_size"] == info["kv_capacity_tokens"] == num_groups * plain["kv_tokens"]
        # ... and /metrics exports it (the front's gauges, from the ModelInfo proto the router reads)
        from shardserve.cluster.frontend.metrics import ServeMetrics, replica_info
        from shardserve.proto import inference_pb2 as pb

        metrics, fields = ServeMetrics(), pb.ModelInfoResponse.DESCRIPTOR.fields_by_name
        metrics.set_replica("0", True, 0, replica_info(pb.ModelInfoResponse(
            **{k: v for k, v in info.items() if k in fields and k != "workers"})))
        text = metrics.render().decode()
        assert f'shardserve_kv_cache_capacity_tokens{{replica="0"}} {float(info["kv_capacity_tokens"])}' in text
    finally:
        replicas.stop(handle)
