"""Prometheus metrics of the OpenAI front (``GET /metrics``), in a registry of their own.

Counters and histograms are recorded by the router as requests pass; the replica gauges (queue
depth, free KV blocks) are refreshed from each replica's ModelInfo right before a scrape.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServeMetrics:
    """Every metric the front exports; names start with ``shardserve_``.

    Request-level: ``requests_total{endpoint,status,outcome}`` (counted once, when the request
    ends; status 499 = the client left before the answer; outcome ``finished``, ``rejected``,
    ``cancelled``, ``timeout`` or ``error``), ``prompt_tokens_total``, ``generation_tokens_total``,
    ``time_to_first_token_seconds``, ``time_per_output_token_seconds``,
    ``e2e_request_latency_seconds``, ``requests_in_flight``.
    Per replica (label ``replica``): ``requests_routed_total``, ``queue_full_rejections_total``
    (admission control refused a call), ``outstanding_tokens``, ``num_requests_running``,
    ``num_requests_waiting`` (queue depth), ``kv_cache_free_blocks``, ``kv_cache_blocks``,
    ``replica_ready``.
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter("shardserve_requests", "Generation requests by endpoint, HTTP status and outcome",
                                ["endpoint", "status", "outcome"], registry=reg)
        self.queue_full = Counter("shardserve_queue_full_rejections", "Calls a replica refused: its waiting "
                                  "queue was full (--max-queued-requests)", ["replica"], registry=reg)
        self.prompt_tokens = Counter("shardserve_prompt_tokens", "Prompt tokens processed", registry=reg)
        self.generation_tokens = Counter("shardserve_generation_tokens", "Tokens generated", registry=reg)
        self.ttft = Histogram("shardserve_time_to_first_token_seconds", "Request arrival to first token (s)",
                              buckets=_LATENCY_BUCKETS, registry=reg)
        self.tpot = Histogram("shardserve_time_per_output_token_seconds",
                              "Mean time between output tokens after the first, per choice (s)",
                              buckets=_LATENCY_BUCKETS, registry=reg)
        self.latency = Histogram("shardserve_e2e_request_latency_seconds", "Request arrival to last byte (s)",
                                 buckets=_LATENCY_BUCKETS, registry=reg)
        self.in_flight = Gauge("shardserve_requests_in_flight", "Generation requests being served", registry=reg)
        self.routed = Counter("shardserve_requests_routed", "Generation requests sent to each replica",
                              ["replica"], registry=reg)
        self.outstanding = Gauge("shardserve_outstanding_tokens", "Tokens routed to a replica and not yet done",
                                 ["replica"], registry=reg)
        self.running = Gauge("shardserve_num_requests_running", "Requests in the replica's running batch",
                             ["replica"], registry=reg)
        self.waiting = Gauge("shardserve_num_requests_waiting", "Requests queued on the replica",
                             ["replica"], registry=reg)
        self.free_blocks = Gauge("shardserve_kv_cache_free_blocks", "Free KV cache blocks", ["replica"], registry=reg)
        self.total_blocks = Gauge("shardserve_kv_cache_blocks", "KV cache blocks", ["replica"], registry=reg)
        self.ready = Gauge("shardserve_replica_ready", "1 when the replica serves", ["replica"], registry=reg)

    def count(self, endpoint: str, status: int, outcome: str) -> None:
        """Count one request that ended (``requests_total``)."""
        self.requests.labels(endpoint, str(status), outcome).inc()

    def observe_choice(self, started: float, first_token: float | None, finished: float, num_tokens: int) -> None:
        """Record one finished choice: TTFT from the request's arrival, TPOT over its later tokens."""
        if first_token is not None:
            self.ttft.observe(first_token - started)
            if num_tokens > 1:
                self.tpot.observe((finished - first_token) / (num_tokens - 1))

    def set_replica(self, index: int, ready: bool, outstanding: int, info: dict | None) -> None:
        """Refresh one replica's gauges (``info``: its ModelInfo as a dict, None when unknown)."""
        label = str(index)
        self.ready.labels(label).set(1 if ready else 0)
        self.outstanding.labels(label).set(outstanding)
        if info:
            self.running.labels(label).set(info.get("num_running", 0))
            self.waiting.labels(label).set(info.get("num_waiting", 0))
            self.free_blocks.labels(label).set(info.get("num_free_blocks", 0))
            self.total_blocks.labels(label).set(info.get("num_blocks", 0))

    def render(self) -> bytes:
        """The text exposition format of every metric."""
        return generate_latest(self.registry)
