"""Prometheus metrics of the OpenAI front (``GET /metrics``), in a registry of their own.

Counters and histograms are recorded by the router as requests pass; the replica gauges (queue
depth, free KV blocks) and the replicas' speculative-decoding counters are refreshed from each
replica's ModelInfo right before a scrape. vLLM's names (``vllm:*``, one series per live replica)
are :mod:`cluster.frontend.vllm_metrics`'; a replica that leaves takes every per-replica series
with it (:meth:`ServeMetrics.forget_replica`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from shardserve.cluster.frontend.vllm_metrics import VllmMetrics
from shardserve.cluster.engine.speculative import SpecCollector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)


# ModelInfo fields the replica metrics read (gauges, then MTP speculative decoding).
REPLICA_INFO_FIELDS = ("model", "num_running", "num_waiting", "num_free_blocks", "num_blocks", "kv_capacity_tokens",
                       "attention_dp_size", "weights_version",
                       "worker_restarts", "collective", "dispatch", "coordinator_node", "num_nodes", "rank_nodes",
                       "rank_node_ips", "speculative_tokens", "spec_policy", "spec_num_drafts", "spec_num_draft_tokens",
                       "spec_num_accepted_tokens", "spec_acceptance_rate", "spec_mean_acceptance_length",
                       "spec_accepted_per_position", "spec_depth_steps")
_LIST_FIELDS = ("rank_nodes", "rank_node_ips", "spec_acceptance_rate", "spec_accepted_per_position",
                "spec_depth_steps")   # repeated fields: plain lists


def replica_info(model_info) -> dict:
    """The fields of a ``ModelInfoResponse`` (or its dict) that :meth:`ServeMetrics.set_replica` reads."""
    get = model_info.get if isinstance(model_info, dict) else lambda name: getattr(model_info, name)
    return {name: list(get(name) or []) if name in _LIST_FIELDS else get(name) for name in REPLICA_INFO_FIELDS}


class ServeMetrics:
    """Every metric the front exports; names start with ``shardserve_``.

    Request-level: ``requests_total{endpoint,status,outcome}`` (counted once, when the request
    ends; status 499 = the client left before the answer; outcome ``finished``, ``rejected``,
    ``cancelled``, ``timeout`` or ``error``), ``prompt_tokens_total``, ``generation_tokens_total``,
    ``time_to_first_token_seconds``, ``time_per_output_token_seconds``,
    ``e2e_request_latency_seconds``, ``requests_in_flight``.
    Per key (label ``key``: :func:`cluster.frontend.security.key_id`, 12 hex digits of the key's
    SHA-256, or ``anonymous``; never the key): ``key_requests_total{key,outcome}``,
    ``key_prompt_tokens_total``, ``key_generation_tokens_total``,
    ``rate_limited_total{key,limit}`` (``limit``: ``requests`` or ``tokens``). No prefix-cache
    counter is here: those are on the admin surface only (``/admin/status``).
    Routing (:mod:`cluster.routing`): ``routing_decisions_total{policy,reason}`` (reason ``cache``:
    the replica holding the longest cached prefix; ``load_guard``: that replica was too busy, the
    least-loaded one took it; ``least_loaded``: no cached prefix anywhere, or the least-loaded
    policy), ``routing_prompt_tokens_total`` and ``routing_expected_hit_tokens_total`` (prompt tokens
    routed, and those the chosen replica was known to hold: the router's expected hit rate), beside
    the replicas' own ``vllm:prefix_cache_hits_total``.
    Per replica (label ``replica``, the replica's Serve id): ``requests_routed_total``, ``queue_full_rejections_total``
    (admission control refused a call), ``outstanding_tokens``, ``num_requests_running``,
    ``num_requests_waiting`` (queue depth), ``kv_cache_free_blocks``, ``kv_cache_blocks``,
    ``replica_ready``, ``weights_version``, ``worker_restarts_total`` (shard or draft worker actors
    the replica replaced in place; reset when Serve replaces the replica); placement:
    ``replica_nodes`` (distinct Ray nodes of the coordinator and ranks),
    ``replica_info{collective,dispatch,coordinator_node}`` and ``rank_node_info{rank,node_id,node_ip}``
    (value 1, the labels carry the facts); for replicas with MTP speculation on:
    ``spec_drafts_total``, ``spec_draft_tokens_total``, ``spec_accepted_tokens_total``,
    ``spec_acceptance_rate{position}``, ``spec_mean_acceptance_length``, ``spec_depth_steps_total{depth}``,
    and vLLM's own names ``vllm:spec_decode_num_drafts_total``, ``..._num_draft_tokens_total``,
    ``..._num_accepted_tokens_total``, ``..._num_accepted_tokens_per_pos_total{position}`` (labels
    ``model_name``, ``engine`` = the replica; :func:`cluster.engine.speculative.spec_metric_families`).
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.vllm = VllmMetrics(model_name)
        reg.register(self.vllm)
        self.decisions = Counter("shardserve_routing_decisions", "Replica choices by routing policy and reason",
                                 ["policy", "reason"], registry=reg)
        self.routed_prompt_tokens = Counter("shardserve_routing_prompt_tokens", "Prompt tokens routed (first "
                                            "prompt of each request)", registry=reg)
        self.expected_hits = Counter("shardserve_routing_expected_hit_tokens", "Prompt tokens the chosen replica "
                                     "was known to hold in its prefix cache when the request was routed", registry=reg)
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
        self.key_requests = Counter("shardserve_key_requests", "Generation requests by API key id and outcome",
                                    ["key", "outcome"], registry=reg)
        self.key_prompt_tokens = Counter("shardserve_key_prompt_tokens", "Prompt tokens by API key id", ["key"],
                                         registry=reg)
        self.key_generation_tokens = Counter("shardserve_key_generation_tokens", "Generated tokens by API key id",
                                             ["key"], registry=reg)
        self.rate_limited = Counter("shardserve_rate_limited", "Requests refused by --rate-limit, by API key id and "
                                    "limit (requests or tokens)", ["key", "limit"], registry=reg)
        self.routed = Counter("shardserve_requests_routed", "Generation requests sent to each replica",
                              ["replica"], registry=reg)
        self.outstanding = Gauge("shardserve_outstanding_tokens", "Tokens routed to a replica and not yet done",
                                 ["replica"], registry=reg)
        self.running = Gauge("shardserve_num_requests_running", "Requests in the replica's running batch",
                             ["replica"], registry=reg)
        self.waiting = Gauge("shardserve_num_requests_waiting", "Requests queued on the replica",
                             ["replica"], registry=reg)
        self.free_blocks = Gauge("shardserve_kv_cache_free_blocks", "Free KV cache blocks", ["replica"], registry=reg)
        self.total_blocks = Gauge("shardserve_kv_cache_blocks", "KV cache blocks (over every attention group)",
                                  ["replica"], registry=reg)
        self.kv_capacity = Gauge("shardserve_kv_cache_capacity_tokens", "Tokens the replica's KV caches hold "
                                 "(blocks x block size over every attention group)", ["replica"], registry=reg)
        self.ready = Gauge("shardserve_replica_ready", "1 when the replica serves", ["replica"], registry=reg)
        self.weights_version = Gauge("shardserve_weights_version", "Weights served (1 at start, +1 per reload "
                                     "that changed a tensor)", ["replica"], registry=reg)
        self.worker_restarts: dict[str, int] = {}    # replica -> its count (a counter the replica keeps)
        reg.register(_ReplicaCounters(self))
        self.nodes = Gauge("shardserve_replica_nodes", "Distinct Ray nodes running a replica's coordinator and ranks",
                           ["replica"], registry=reg)
        self.replica_info = Gauge("shardserve_replica_info", "A replica's all-reduce backend, dispatch and "
                                  "coordinator node (value 1)", ["replica", "collective", "dispatch",
                                                                 "coordinator_node"], registry=reg)
        self.rank_node = Gauge("shardserve_rank_node_info", "Ray node of each tensor-parallel rank (value 1)",
                               ["replica", "rank", "node_id", "node_ip"], registry=reg)
        self._placement: dict[str, list[tuple]] = {}   # replica -> [(info gauge, label values)] last set
        self.spec_replicas: dict[str, dict] = {}   # replica -> its last ModelInfo fields (speculating ones)
        reg.register(SpecCollector(lambda: [(info.get("model") or "", label, info)
                                            for label, info in sorted(self.spec_replicas.items())]))

    def count(self, endpoint: str, status: int, outcome: str, key: str = "anonymous") -> None:
        """Count one request of API key id ``key`` that ended (``requests_total``, ``key_requests_total``)."""
        self.requests.labels(endpoint, str(status), outcome).inc()
        self.key_requests.labels(key, outcome).inc()

    def count_tokens(self, key: str, prompt_tokens: int, generated_tokens: int) -> None:
        """Tokens of one request of API key id ``key`` (totals and per key)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated_tokens)
        self.key_prompt_tokens.labels(key).inc(prompt_tokens)
        self.key_generation_tokens.labels(key).inc(generated_tokens)

    def observe_choice(self, started: float, first_token: float | None, finished: float, num_tokens: int) -> None:
        """Record one finished choice: TTFT from the request's arrival, TPOT over its later tokens."""
        if first_token is not None:
            self.ttft.observe(first_token - started)
            if num_tokens > 1:
                self.tpot.observe((finished - first_token) / (num_tokens - 1))

    def set_replica(self, label: str, ready: bool, outstanding: int, info: dict | None) -> None:
        """Refresh one replica's gauges (``info``: :func:`replica_info` of its ModelInfo, None when unknown)."""
        self.ready.labels(label).set(1 if ready else 0)
        self.outstanding.labels(label).set(outstanding)
        if info:
            self.running.labels(label).set(info.get("num_running", 0))
            self.waiting.labels(label).set(info.get("num_waiting", 0))
            self.free_blocks.labels(label).set(info.get("num_free_blocks", 0))
            self.total_blocks.labels(label).set(info.get("num_blocks", 0))
            self.kv_capacity.labels(label).set(info.get("kv_capacity_tokens") or 0)
            self.weights_version.labels(label).set(info.get("weights_version", 0))
            self.worker_restarts[label] = info.get("worker_restarts", 0)
            if info.get("collective"):
                self._set_placement(label, info)
            if info.get("speculative_tokens"):
                self.spec_replicas[label] = info

    def forget_replica(self, label: str) -> None:
        """The replica left (scaled down, replaced): every series labelled with it goes."""
        self.vllm.forget(label)
        for metric in (self.routed, self.queue_full, self.outstanding, self.running, self.waiting, self.free_blocks,
                       self.total_blocks, self.kv_capacity, self.ready, self.weights_version, self.nodes):
            try:
                metric.remove(label)
            except KeyError:
                pass
        for gauge, values in self._placement.pop(label, []):
            try:
                gauge.remove(*values)
            except KeyError:
                pass
        self.worker_restarts.pop(label, None)
        self.spec_replicas.pop(label, None)

    def _set_placement(self, label: str, info: dict) -> None:
        """Info-style series of one replica; the ones of a previous placement are removed."""
        series = [(self.replica_info, (label, info["collective"], info["dispatch"], info["coordinator_node"]))]
        series += [(self.rank_node, (label, str(rank), node, ip))
                   for rank, (node, ip) in enumerate(zip(info["rank_nodes"], info["rank_node_ips"]))]
        for gauge, values in self._placement.get(label, []):
            if (gauge, values) not in series:
                gauge.remove(*values)
        for gauge, values in series:
            gauge.labels(*values).set(1)
        self._placement[label] = series
        self.nodes.labels(label).set(info["num_nodes"])

    def render(self) -> bytes:
        """The text exposition format of every metric."""
        return generate_latest(self.registry)


class _ReplicaCounters:
    """Counters each replica keeps itself (read from its ModelInfo), exposed per replica label."""

    def __init__(self, metrics: ServeMetrics) -> None:
        self.metrics = metrics

    def collect(self):
        family = CounterMetricFamily("shardserve_worker_restarts", "Shard / draft worker actors replaced in place",
                                     labels=["replica"])
        for label, count in sorted(self.metrics.worker_restarts.items()):
            family.add_metric([label], count)
        yield family
