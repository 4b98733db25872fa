"""vLLM's metric names on the router's ``/metrics`` (issue 28): parsed back by prometheus_client's
own parser, one series per live replica with ``model_name``, gone when the replica leaves, and
every series the Grafana dashboard in ``k8s/grafana`` reads is one the router exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from shardserve.cluster.frontend.metrics import ServeMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "k8s" / "grafana" / "shardserve-dashboard.json"
SPEC_INFO = {"model": "tiny", "speculative_tokens": 2, "spec_num_drafts": 4, "spec_num_draft_tokens": 8,
             "spec_num_accepted_tokens": 5, "spec_acceptance_rate": [0.75, 0.5], "spec_mean_acceptance_length": 2.25,
             "spec_accepted_per_position": [3, 2], "spec_depth_steps": [0, 1, 3], "spec_policy": "fixed"}


def samples(metrics: ServeMetrics) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}


def value(parsed: dict, name: str, **labels) -> float:
    return sum(v for (n, lbl), v in parsed.items() if n == name and labels.items() <= dict(lbl).items())


def loaded_metrics() -> ServeMetrics:
    metrics = ServeMetrics("tiny")
    metrics.set_replica("r1", True, 0, SPEC_INFO)
    for replica, running, free in (("r1", 3, 30), ("r2", 1, 90)):
        metrics.vllm.set_replica(replica, running, 2, free, 100, prefix_queries=600, prefix_hits=450)
    metrics.vllm.observe_choice("r1", 10.0, 10.25, 11.25, 5)         # TTFT 0.25 s, 4 intervals of 0.25 s
    metrics.vllm.observe_request("r1", 1.25, 40, 5, ["length"])
    metrics.vllm.observe_times("r1", 0.125, 0.0625, 1.0)             # queue, prefill, decode (s)
    metrics.vllm.observe_request("r2", 0.5, 10, 1, ["stop", None])   # n=2, one choice left unfinished
    return metrics


def test_vllm_names_parse_with_model_and_replica_labels_and_leave_with_the_replica():
    metrics = loaded_metrics()
    parsed = samples(metrics)
    assert value(parsed, "vllm:num_requests_running", replica="r1", model_name="tiny") == 3
    assert value(parsed, "vllm:num_requests_waiting", replica="r2") == 2
    assert value(parsed, "vllm:kv_cache_usage_perc", replica="r1") == 0.7
    assert value(parsed, "vllm:prefix_cache_queries_total", replica="r2") == 600
    assert value(parsed, "vllm:prefix_cache_hits_total", replica="r2") == 450
    assert value(parsed, "vllm:prompt_tokens_total") == 50 and value(parsed, "vllm:generation_tokens_total") == 6
    assert value(parsed, "vllm:time_to_first_token_seconds_count", replica="r1") == 1
    assert value(parsed, "vllm:time_to_first_token_seconds_bucket", replica="r1", le="0.25") == 1
    assert value(parsed, "vllm:time_to_first_token_seconds_bucket", replica="r1", le="0.1") == 0
    assert value(parsed, "vllm:inter_token_latency_seconds_count", replica="r1") == 4
    assert value(parsed, "vllm:inter_token_latency_seconds_sum", replica="r1") == 1.0
    assert value(parsed, "vllm:e2e_request_latency_seconds_count") == 3   # one per choice, as vLLM's requests
    assert value(parsed, "vllm:request_success_total", finished_reason="length") == 1
    assert value(parsed, "vllm:request_success_total", finished_reason="abort", replica="r2") == 1
    assert value(parsed, "vllm:spec_decode_num_accepted_tokens_total") == 5
    for phase, seconds in (("queue", 0.125), ("prefill", 0.0625), ("decode", 1.0), ("inference", 1.0625)):
        assert value(parsed, f"vllm:request_{phase}_time_seconds_count", replica="r1") == 1
        assert value(parsed, f"vllm:request_{phase}_time_seconds_sum", replica="r1", model_name="tiny") == seconds
    assert value(parsed, "vllm:request_queue_time_seconds_bucket", replica="r1", le="0.3") == 1
    assert value(parsed, "vllm:request_decode_time_seconds_bucket", replica="r1", le="0.8") == 0
    metrics.forget_replica("r2")
    parsed = samples(metrics)
    assert not [key for key in parsed if ("replica", "r2") in key[1]]
    assert value(parsed, "vllm:num_requests_running", replica="r1") == 3


def test_every_series_the_dashboard_reads_is_exported():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    read = {name for expr in exprs for name in re.findall(r"\b((?:vllm:|shardserve_)[a-z_:]+)\{", expr)}
    metrics = loaded_metrics()
    metrics.decisions.labels("prefix-aware", "cache").inc()
    metrics.routed.labels("r1").inc()
    exported = {name for name, _ in samples(metrics)}
    assert read and read <= exported, read - exported
