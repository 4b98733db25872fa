"""Serve's autoscaling of the ``ModelReplica`` deployment on the requests the replicas hold.

Ray Serve's default policy counts the requests that went through Serve handles; generation goes
from the router to a replica over gRPC (no Ray object per token), so Serve never sees it. Each
replica therefore reports its own load (``record_autoscaling_stats``: ``ongoing_requests`` =
requests running in its batch + waiting in its queue, vLLM's ``num_requests_running +
num_requests_waiting``), and :func:`ongoing_requests_policy` asks for as many replicas as keep
the average at ``target_ongoing_requests`` (Serve's own rule, on this metric). Serve wraps the
policy with the config's bounds, ``upscale_delay_s`` / ``downscale_delay_s`` and scaling factors.

A replica Serve adds takes traffic once its model is loaded (Serve lists it only then, and the
router routes only to listed replicas); one Serve removes drains: the router stops sending to it
at once, it finishes its running requests (``drain_timeout_s``) and then stops.
"""

from __future__ import annotations

import math

ONGOING_REQUESTS = "ongoing_requests"   # the custom metric each replica reports
POLICY_PATH = "shardserve.cluster.autoscaling:ongoing_requests_policy"
PUSH_ENV = "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S"


def ongoing_requests_policy(ctx) -> tuple[float, dict]:
    """Replicas wanted: the sum of the replicas' ``ongoing_requests`` (averaged over
    ``look_back_period_s``) over ``target_ongoing_requests``, kept within the bounds.

    Args:
        ctx: Ray Serve's ``AutoscalingContext``.

    Returns:
        ``(desired replicas, policy state)`` (Serve applies the delays and scaling factors).
    """
    per_replica = (ctx.aggregated_metrics or {}).get(ONGOING_REQUESTS, {})
    if ctx.current_num_replicas == 0 or not per_replica:
        return ctx.target_num_replicas, {}
    target = ctx.config.get_target_ongoing_requests()
    desired = math.ceil(sum(per_replica.values()) / target - 1e-9)
    low, high = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
    return max(low, min(high, desired)), {}


def autoscaling_config(min_replicas: int, max_replicas: int, target_ongoing_requests: float,
                       upscale_delay_s: float, downscale_delay_s: float, look_back_s: float) -> dict:
    """The deployment's ``autoscaling_config`` (Serve's keys)."""
    return {"min_replicas": min_replicas, "max_replicas": max_replicas, "initial_replicas": min_replicas,
            "target_ongoing_requests": target_ongoing_requests, "upscale_delay_s": upscale_delay_s,
            "downscale_delay_s": downscale_delay_s, "look_back_period_s": look_back_s,
            "policy": {"policy_function": POLICY_PATH}}


def push_interval_env(look_back_s: float) -> dict:
    """The replicas' environment: push their load to Serve's controller five times per look-back
    window (Serve's default push period, 10 s, would lag short windows)."""
    return {PUSH_ENV: f"{max(0.2, min(10.0, look_back_s / 5)):g}"}
