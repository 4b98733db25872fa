"""The Ray path: a coordinator with TP=2 shard workers and the DraftWorker actor in rank 0's
placement bundle (no bundle of its own: TP=N with MTP needs N devices), sharing buffers with rank 0.
Greedy completions with speculation (fixed depths, and the adaptive policy) equal the
single-process engine's plain decoding (with structured outputs and penalties too), the acceptance
counters reach ModelInfo (also over gRPC), each response's usage and Prometheus text (vLLM's names
too), and every block returns to the pool. An adaptive policy that has gone cold is pipelined (async
scheduling) with unchanged tokens."""

from __future__ import annotations

import pytest

from shardserve.cluster.config import EngineArgs
from shardserve.cluster.engine.request import StructuredOutputs
from shardserve.cluster.replica.worker_group import GroupConfig
from spec_helpers import BLOCK_SIZE, NUM_BLOCKS, greedy, make_llm, prompts

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.mark.parametrize("arch,k,policy,split,dispatch", [
    pytest.param("deepseek_v32", 1, "fixed", [3.0, 1.0], "calls", marks=pytest.mark.extended),
    pytest.param("glm_moe_dsa", 2, "fixed", None, "compiled", marks=pytest.mark.extended),
    ("deepseek_v32", 3, "adaptive", None, "calls"),
], ids=["v32-k1-split3,1", "glm-k2-compiled", "v32-k3-adaptive"])
def test_coordinator_tp2_with_draft_actor(ray_cluster, replicas, mtp_checkpoint, arch, k, policy, split, dispatch):
    path = mtp_checkpoint(arch).path
    batch = prompts()
    plain = make_llm(path, 0)
    expected = [d.token_ids for d in plain.generate(batch, greedy())]
    controlled = [greedy(12, structured_outputs=StructuredOutputs.regex("(w0[1-4][0-9])+w05[0-9]")),
                  greedy(12, presence_penalty=1.0, repetition_penalty=1.5, logit_bias={7: 4.0}),
                  greedy(12, structured_outputs=StructuredOutputs.choice(["w003w004", "w009"]), frequency_penalty=1.0)]
    expected_controlled = [d.token_ids for d in plain.generate(batch, controlled)]
    args = EngineArgs(model=str(path), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_num_batched_tokens=16,
                      tensor_parallel_size=2, tensor_split=split, speculative_tokens=k, speculative_policy=policy)
    handle = replicas.launch(args, GroupConfig(cpus_per_worker=1, dispatch=dispatch))
    try:
        # coordinator + 2 shard bundles, nothing more: the draft actor takes a share of rank 0's
        assert replicas.groups[handle].bundle_specs == [{"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 1.0}]
        done = ray_cluster.get([handle.complete.remote(p, greedy()) for p in batch])   # one batch
        assert [d["token_ids"] for d in done] == expected
        # structured outputs and penalties (rank 0 of TP=2 masks and penalizes the verification rows)
        done = ray_cluster.get([handle.complete.remote(p, params) for p, params in zip(batch, controlled)])
        assert [d["token_ids"] for d in done] == expected_controlled
        info = ray_cluster.get(handle.model_info.remote())
        assert info["speculative_tokens"] == k and info["spec_policy"] == policy and info["spec_num_draft_tokens"] > 0
        assert len(info["spec_acceptance_rate"]) == k and info["spec_mean_acceptance_length"] >= 1.0
        assert info["num_free_blocks"] == info["num_blocks"] == NUM_BLOCKS
        metrics = ray_cluster.get(handle.speculative_metrics.remote())
        assert f"shardserve_spec_draft_tokens_total {float(info['spec_num_draft_tokens'])}" in metrics
        assert 'shardserve_spec_acceptance_rate{position="1"}' in metrics
        assert (f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="{path.name}"}} '
                f'{float(info["spec_num_draft_tokens"])}') in metrics

        import grpc

        from shardserve.proto import inference_pb2 as pb
        from shardserve.proto import inference_pb2_grpc as pb_grpc

        address = ray_cluster.get(handle.start_grpc.remote(0, "127.0.0.1"))
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.InferenceStub(channel)
            reply = stub.ModelInfo(pb.ModelInfoRequest(), timeout=30)
            *_, last = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=batch[0]), sampling=pb.SamplingParams(
                max_tokens=20, temperature=0, ignore_eos=True)), timeout=60)
        assert reply.speculative_tokens == k and reply.spec_num_draft_tokens == info["spec_num_draft_tokens"]
        assert len(reply.spec_acceptance_rate) == k and reply.spec_policy == policy
        assert last.finish_reason == "length" and last.usage.HasField("spec_decode")
        spec = last.usage.spec_decode
        assert spec.num_draft_tokens >= spec.num_accepted_tokens >= 0
        assert not spec.num_drafts or abs(spec.acceptance_length - (1 + spec.num_accepted_tokens / spec.num_drafts)) < 1e-6
        if policy == "fixed":
            assert spec.num_drafts > 0
        else:   # the random MTP's drafts are (almost) never accepted: the policy goes cold, and then its
            # steps are sent ahead (async scheduling) like plain decoding's, with the same tokens
            long = plain.generate([batch[1]], greedy(60))[0].token_ids
            before = ray_cluster.get(handle.model_info.remote())["steps_sent_ahead"]
            assert ray_cluster.get(handle.complete.remote(batch[1], greedy(60)))["token_ids"] == long
            info = ray_cluster.get(handle.model_info.remote())
            assert info["async_scheduling"] and info["steps_sent_ahead"] - before > 20, info["steps_sent_ahead"]
        _assert_draft_shares_rank0_bundle(ray_cluster, handle)
    finally:
        replicas.stop(handle)


def _assert_draft_shares_rank0_bundle(ray_cluster, handle, timeout_s: float = 60.0) -> None:
    """The replica's idle liveness check lists every worker process with its bundle: the draft's is
    rank 0's."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        workers = ray_cluster.get(handle.model_info.remote())["workers"]
        roles = {(w["role"], w["rank"]): w["bundle_index"] for w in workers}
        if ("draft", 0) in roles or time.monotonic() > deadline:
            break
        time.sleep(0.1)   # the next idle liveness check comes within LIVENESS_PERIOD_S (2 s)
    assert roles[("draft", 0)] == roles[("shard", 0)] == 1, roles
