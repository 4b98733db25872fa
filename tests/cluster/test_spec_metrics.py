"""The router's ``/metrics`` exports each replica's MTP speculative-decoding counters as the
replica reports them in its gRPC ``ModelInfo`` (the message the router reads before a scrape)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from shardserve.cluster.frontend.metrics import ServeMetrics, replica_info
from shardserve.cluster.engine.speculative import SpecStats
from shardserve.proto import inference_pb2 as pb


def _samples(metrics: ServeMetrics) -> dict[tuple, float]:
    text = metrics.render().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_spec_counters_per_replica():
    stats = SpecStats(2, "adaptive")
    for drafted, accepted in [(2, 2), (2, 1), (2, 0), (1, 1)]:
        stats.add(drafted, accepted)
    stats.depth_steps = [3, 1, 3]
    speculating = pb.ModelInfoResponse(model="m", num_running=3, num_blocks=64, num_free_blocks=60, **stats.as_dict())
    plain = pb.ModelInfoResponse(model="m", num_running=1, num_blocks=64, num_free_blocks=64)
    metrics = ServeMetrics()
    metrics.set_replica("0", True, 10, replica_info(speculating))
    metrics.set_replica("1", True, 0, replica_info(plain))
    samples = _samples(metrics)
    zero, one = (("replica", "0"),), (("replica", "1"),)
    assert samples["shardserve_spec_drafts_total", zero] == 4
    assert samples["shardserve_spec_draft_tokens_total", zero] == 7
    assert samples["shardserve_spec_accepted_tokens_total", zero] == 4
    assert samples["shardserve_spec_acceptance_rate", (("position", "1"), ("replica", "0"))] == 3 / 4
    assert abs(samples["shardserve_spec_acceptance_rate", (("position", "2"), ("replica", "0"))] - 1 / 3) < 1e-6
    assert abs(samples["shardserve_spec_mean_acceptance_length", zero] - 2.0) < 1e-6
    assert samples["shardserve_spec_depth_steps_total", (("depth", "2"), ("replica", "0"))] == 3
    assert ("shardserve_spec_drafts_total", one) not in samples             # replica 1 does not speculate
    assert samples["shardserve_num_requests_running", zero] == 3
    # vLLM's names and labels (engine = the replica, positions 0-based)
    engine = (("engine", "0"), ("model_name", "m"))
    assert samples["vllm:spec_decode_num_drafts_total", engine] == 4
    assert samples["vllm:spec_decode_num_draft_tokens_total", engine] == 7
    assert samples["vllm:spec_decode_num_accepted_tokens_total", engine] == 4
    assert [samples["vllm:spec_decode_num_accepted_tokens_per_pos_total", engine + (("position", str(p)),)]
            for p in (0, 1)] == [3, 1]
    # The coordinator's own exposition uses the same names (shardserve's without the replica label).
    text = stats.prometheus_text("m")
    assert "shardserve_spec_drafts_total 4.0" in text
    assert 'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 4.0' in text


def test_usage_carries_each_requests_acceptance():
    """OpenAI ``usage.spec_decode`` (extension field): the choices' counters summed, their acceptance
    length (tokens per verifying step); absent when the replica does not speculate."""
    from shardserve.cluster.frontend.openai_protocol import Choice, usage

    first = Choice(0, spec_decode=pb.SpecDecodeUsage(num_drafts=4, num_draft_tokens=8, num_accepted_tokens=5,
                                                     acceptance_length=2.25))
    second = Choice(1, spec_decode=pb.SpecDecodeUsage(num_drafts=2, num_draft_tokens=4, num_accepted_tokens=1,
                                                      acceptance_length=1.5))
    body = usage(10, 30, [first, second])
    assert body["spec_decode"] == {"num_drafts": 6, "num_draft_tokens": 12, "num_accepted_tokens": 6,
                                   "acceptance_length": 2.0}
    assert body["total_tokens"] == 40
    assert usage(3, 2, [Choice(0, spec_decode=pb.SpecDecodeUsage())])["spec_decode"]["acceptance_length"] is None
    assert "spec_decode" not in usage(3, 2, [Choice(0)])
