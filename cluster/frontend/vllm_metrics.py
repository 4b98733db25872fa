"""vLLM's metric names, per replica, beside shardserve's own (``GET /metrics``).

Dashboards, KEDA scalers and gateways (llm-d's scheduler, the Gateway API inference extension)
read vLLM's names, so the router exports them too, one series per live replica (labels
``model_name``, ``engine`` as vLLM names its engine, and ``replica``, both the replica's Serve id);
a replica that leaves (scaled down, replaced) takes its series with it (:meth:`VllmMetrics.forget`).

From the replicas (their routing stats, polled by Serve, or their ModelInfo):
``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (used
blocks / blocks, 0..1), ``vllm:prefix_cache_queries_total`` and ``vllm:prefix_cache_hits_total``
(prompt tokens looked up / found in the prefix cache, counted once per admission, as vLLM counts).
From the router as requests end: ``vllm:time_to_first_token_seconds``,
``vllm:inter_token_latency_seconds``, ``vllm:e2e_request_latency_seconds`` (histograms, vLLM's
buckets), ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``,
``vllm:request_success_total{finished_reason}`` (end-to-end latency and success once per choice, as vLLM
counts its engine requests; a choice that did not finish counts as ``abort``); from the replicas' final
responses (vLLM's
definitions, ``vllm/v1/metrics/stats.py``), where a request's time went inside its replica:
``vllm:request_queue_time_seconds`` (arrival to first scheduled), ``vllm:request_prefill_time_seconds``
(to the first token), ``vllm:request_decode_time_seconds`` (first to last token) and
``vllm:request_inference_time_seconds`` (first scheduled to last token); TTFT less queue and prefill
time is what the request spent in the router and in transit. MTP's ``vllm:spec_decode_*`` come from the
replicas' speculative-decoding counters (:mod:`cluster.frontend.metrics`).

The inter-token histogram gets a choice's ``n - 1`` intervals as ``n - 1`` observations of their
mean, added once when the choice ends (vLLM observes each interval as it happens): the count and
sum are vLLM's, the spread within one choice is not, and the stream pays nothing per token.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py), seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
LABELS = ["model_name", "engine", "replica"]
FINISHED_REASONS = ("stop", "length", "abort")


class _Histogram:
    """Per-replica histogram state that can add ``count`` observations of one value at once."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]) -> None:
        self.name, self.doc, self.buckets = name, doc, buckets
        self.series: dict[str, list] = {}   # replica -> [bucket counts..., +Inf count, sum]

    def observe(self, replica: str, value: float, count: int = 1) -> None:
        if count <= 0 or not math.isfinite(value):
            return
        state = self.series.setdefault(replica, [0] * (len(self.buckets) + 1) + [0.0])
        state[bisect.bisect_left(self.buckets, value)] += count
        state[-1] += value * count

    def family(self, model: str) -> HistogramMetricFamily:
        family = HistogramMetricFamily(self.name, self.doc, labels=LABELS)
        for replica, state in sorted(self.series.items()):
            cumulative, buckets = 0, []
            for bound, count in zip(list(self.buckets) + [math.inf], state[:-1]):
                cumulative += count
                buckets.append((floatToGoString(bound), cumulative))
            family.add_metric([model, replica, replica], buckets, state[-1])
        return family


class VllmMetrics:
    """The ``vllm:*`` families (a ``prometheus_client`` collector; register it in a registry).

    Args:
        model_name: the served model name (the ``model_name`` label).
    """

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.replicas: dict[str, dict] = {}   # replica -> last known gauges and counters
        self.ttft = _Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                               TTFT_BUCKETS)
        self.itl = _Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                              ITL_BUCKETS)
        self.e2e = _Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                              E2E_BUCKETS)
        self.phases = {phase: _Histogram(f"vllm:request_{phase}_time_seconds", doc, E2E_BUCKETS) for phase, doc in (
            ("queue", "Histogram of time spent in WAITING phase for request."),
            ("prefill", "Histogram of time spent in PREFILL phase for request."),
            ("decode", "Histogram of time spent in DECODE phase for request."),
            ("inference", "Histogram of time spent in RUNNING phase for request."))}
        self.tokens: dict[str, list[int]] = {}             # replica -> [prompt, generation]
        self.finished: dict[tuple[str, str], int] = {}     # (replica, reason) -> requests

    def set_replica(self, replica: str, running: int, waiting: int, free_blocks: int, num_blocks: int,
                    prefix_queries: int | None = None, prefix_hits: int | None = None) -> None:
        """A live replica's state (gauges; its prefix-cache counters when known)."""
        state = self.replicas.setdefault(replica, {})
        state.update(running=running, waiting=waiting,
                     usage=(1.0 - free_blocks / num_blocks) if num_blocks else 0.0)
        if prefix_queries is not None:
            state.update(queries=prefix_queries, hits=prefix_hits or 0)

    def observe_choice(self, replica: str, started: float, first_token: float | None, finished: float,
                       num_tokens: int) -> None:
        """One finished choice: TTFT from the request's arrival, its inter-token intervals."""
        if first_token is None:
            return
        self.ttft.observe(replica, first_token - started)
        if num_tokens > 1:
            self.itl.observe(replica, (finished - first_token) / (num_tokens - 1), num_tokens - 1)

    def observe_times(self, replica: str, queue_s: float, prefill_s: float, decode_s: float) -> None:
        """Where one finished choice's time went in its replica, seconds (queue, prefill, decode;
        inference = prefill + decode)."""
        for phase, seconds in (("queue", queue_s), ("prefill", prefill_s), ("decode", decode_s),
                               ("inference", prefill_s + decode_s)):
            self.phases[phase].observe(replica, seconds)

    def observe_request(self, replica: str, latency_s: float, prompt_tokens: int, generation_tokens: int,
                        finish_reasons: Iterable[str | None]) -> None:
        """One client request that ended on ``replica`` after ``latency_s`` seconds, its choices'
        finish reasons (None: the choice did not finish: the client left, a deadline or a failure).
        As vLLM counts its engine requests (one per choice): an end-to-end latency and a
        ``request_success`` per choice, an unfinished one as ``abort``."""
        counts = self.tokens.setdefault(replica, [0, 0])
        counts[0] += prompt_tokens
        counts[1] += generation_tokens
        for reason in finish_reasons:
            self.e2e.observe(replica, latency_s)
            reason = reason if reason in FINISHED_REASONS else "abort"
            self.finished[(replica, reason)] = self.finished.get((replica, reason), 0) + 1

    def forget(self, replica: str) -> None:
        """The replica left: its series go."""
        self.replicas.pop(replica, None)
        self.tokens.pop(replica, None)
        for histogram in (self.ttft, self.itl, self.e2e, *self.phases.values()):
            histogram.series.pop(replica, None)
        for key in [k for k in self.finished if k[0] == replica]:
            del self.finished[key]

    def collect(self):
        model = self.model_name
        gauges = [("vllm:num_requests_running", "Number of requests in model execution batches.", "running"),
                  ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "waiting"),
                  ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "usage")]
        for name, doc, field in gauges:
            family = GaugeMetricFamily(name, doc, labels=LABELS)
            for replica, state in sorted(self.replicas.items()):
                family.add_metric([model, replica, replica], state[field])
            yield family
        for name, doc, field in (("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
                                  "queried tokens.", "queries"),
                                 ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                                  "tokens.", "hits")):
            family = CounterMetricFamily(name, doc, labels=LABELS)
            for replica, state in sorted(self.replicas.items()):
                if field in state:
                    family.add_metric([model, replica, replica], state[field])
            yield family
        for name, doc, index in (("vllm:prompt_tokens", "Number of prefill tokens processed.", 0),
                                 ("vllm:generation_tokens", "Number of generation tokens processed.", 1)):
            family = CounterMetricFamily(name, doc, labels=LABELS)
            for replica in sorted(set(self.replicas) | set(self.tokens)):
                family.add_metric([model, replica, replica], self.tokens.get(replica, [0, 0])[index])
            yield family
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=LABELS + ["finished_reason"])
        for (replica, reason), count in sorted(self.finished.items()):
            success.add_metric([model, replica, replica, reason], count)
        yield success
        for histogram in (self.ttft, self.itl, self.e2e, *self.phases.values()):
            yield histogram.family(model)
