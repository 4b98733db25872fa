"""A TCP port that stays free until a server binds it a while later.

A port the kernel hands out for ``bind(port 0)`` comes from its ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default), the range every outgoing
connection takes its local port from as well. Between picking such a port and binding it for real
(HAProxy's stats page after Ray starts; a test's ``--grpc-port`` after a model loads, a minute
later) the hundreds of connections a starting Ray cluster opens can take it: the server then fails
to bind (seen once in a test run: ``cannot bind gRPC port 127.0.0.1:40555``). A port below the
ephemeral range and above Ray's worker ports (10002-19999, ``--min-worker-port`` /
``--max-worker-port``) is taken only by someone binding it on purpose, and Ray Serve does just that
in part of it: with the HAProxy ingress every replica's own HTTP server takes the lowest free port of
30000-31000 (``RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT`` / ``..._MAX_HTTP_PORT``; gRPC 40000-41000),
so those ranges are left out too.
"""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Collection
from pathlib import Path

# Ray's default worker ports end at 19999; the kernel's ephemeral range starts at 32768 by default.
_LOW, _HIGH = 20000, 32767
# Ray Serve's direct-ingress port ranges (ray/serve/_private/constants.py), as its processes read them.
_SERVE_RANGES = (("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", 30000, "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT", 31000),
                 ("RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT", 40000, "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT", 41000))


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _serve_ranges() -> list[tuple[int, int]]:
    ranges = []
    for low_name, low, high_name, high in _SERVE_RANGES:
        try:
            ranges.append((int(os.environ.get(low_name, low)), int(os.environ.get(high_name, high))))
        except ValueError:
            ranges.append((low, high))
    return ranges


def unused_port(host: str = "127.0.0.1", attempts: int = 200, avoid: Collection[int] = ()) -> int:
    """A TCP port free on ``host`` now, outside the kernel's ephemeral range, Ray's worker ports and
    Ray Serve's direct-ingress ranges when that leaves any (random among them, so concurrent callers
    rarely pick the same one), else one the kernel picks; never one of ``avoid`` (ports the caller
    picked already and binds later).

    Raises:
        OSError: ``host`` cannot be bound at all.
    """
    low, high = _ephemeral_range()
    taken = [(low, high), *_serve_ranges()]
    candidates = [p for p in range(_LOW, _HIGH + 1)
                  if p not in avoid and not any(start <= p <= end for start, end in taken)]
    for port in random.sample(candidates, min(attempts, len(candidates))):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    while True:
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port not in avoid:
            return port
