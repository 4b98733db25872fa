"""The replica-count, autoscaling, routing and gRPC-endpoint flags of ``serve`` and ``manifest``
(registered by :mod:`cluster.cli`; their ``ServeArgs`` fields are documented there).

- ``--data-parallel-size N``: N replicas, fixed. ``--min-replicas A --max-replicas B``: Serve's
  autoscaler keeps between A and B replicas, adding one when the replicas hold more than
  ``--target-ongoing-requests`` requests each on average (:mod:`cluster.autoscaling`), after
  ``--upscale-delay-s`` / ``--downscale-delay-s``. ``serve`` sizes its local Ray cluster for B.
- ``--routing {least-loaded,prefix-aware}`` and ``--routing-load-margin`` (:mod:`cluster.routing`).
- ``--grpc-port``: the app's one gRPC endpoint (the router's); ``--replica-grpc-port``: each
  replica's own server, for direct access.
"""

from __future__ import annotations

import argparse

from shardserve.cluster.cli_types import finite_float
from shardserve.cluster.routing import DEFAULT_LOAD_MARGIN, ROUTING_POLICIES


def tcp_port(text: str) -> int:
    """argparse type of a TCP port: an integer in [0, 65535]."""
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is in [0, 65535], got {port}")
    return port


def scaling_flags(parser: argparse.ArgumentParser) -> None:
    """Replica count or autoscaling bounds, routing policy, the gRPC endpoint's port."""
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                        help="model replicas (each a TP group), a fixed count")
    parser.add_argument("--min-replicas", type=int, default=None,
                        help="autoscaling: replicas kept at least (default with --max-replicas: 1)")
    parser.add_argument("--max-replicas", type=int, default=None,
                        help="autoscaling: Serve adds replicas up to this many as the load grows (default: off, "
                             "--data-parallel-size replicas)")
    parser.add_argument("--target-ongoing-requests", type=finite_float, default=None,
                        help="autoscaling: requests (running + waiting) per replica to aim at (default: half of "
                             "--max-num-seqs)")
    parser.add_argument("--upscale-delay-s", type=finite_float, default=30.0,
                        help="autoscaling: seconds the load must ask for more replicas before one is added")
    parser.add_argument("--downscale-delay-s", type=finite_float, default=600.0,
                        help="autoscaling: seconds the load must allow fewer replicas before one drains and stops")
    parser.add_argument("--autoscaling-look-back-s", type=finite_float, default=30.0,
                        help="autoscaling: seconds the replicas' load is averaged over")
    parser.add_argument("--routing", choices=ROUTING_POLICIES, default=None,
                        help="replica choice: the replica whose prefix cache holds the longest prefix of the prompt "
                             "unless it is busier than the least-loaded one by --routing-load-margin (prefix-aware), "
                             "or the least-loaded one (default: prefix-aware with more than one replica)")
    parser.add_argument("--routing-load-margin", type=int, default=DEFAULT_LOAD_MARGIN,
                        help="prefix-aware: outstanding requests the replica holding the prefix may have beyond the "
                             "least-loaded replica before the least-loaded one takes the request")
    parser.add_argument("--grpc-port", type=tcp_port, default=50051,
                        help="TCP port of the gRPC API (shardserve.v1.Inference, health, reflection), served by the "
                             "router and routed like HTTP; 0 = any free port")
    parser.add_argument("--replica-grpc-port", type=tcp_port, default=0,
                        help="TCP port of each replica's own gRPC server, for direct access to one replica; 0 = any "
                             "free port (listed on /admin/status)")


def scaling_args_fields(ns: argparse.Namespace) -> dict:
    """The ``ServeArgs`` fields of these flags."""
    return {"data_parallel_size": ns.data_parallel_size, "min_replicas": ns.min_replicas,
            "max_replicas": ns.max_replicas, "target_ongoing_requests": ns.target_ongoing_requests,
            "upscale_delay_s": ns.upscale_delay_s, "downscale_delay_s": ns.downscale_delay_s,
            "autoscaling_look_back_s": ns.autoscaling_look_back_s, "routing": ns.routing,
            "routing_load_margin": ns.routing_load_margin, "grpc_port": ns.grpc_port,
            "replica_grpc_port": ns.replica_grpc_port}
