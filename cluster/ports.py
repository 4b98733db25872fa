"""A TCP port that stays free until a server binds it a while later.

A port the kernel hands out for ``bind(port 0)`` comes from its ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default), the range every outgoing
connection takes its local port from as well. Between picking such a port and binding it for real
(HAProxy's stats page after Ray starts; a test's ``--grpc-port`` after a model loads, a minute
later) the hundreds of connections a starting Ray cluster opens can take it: the server then fails
to bind (seen once in a test run: ``cannot bind gRPC port 127.0.0.1:40555``). A port below the
ephemeral range and above Ray's worker ports (10002-19999, ``--min-worker-port`` /
``--max-worker-port``) is taken only by someone binding it on purpose.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Ray's default worker ports end at 19999; the kernel's ephemeral range starts at 32768 by default.
_LOW, _HIGH = 20000, 32767


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def unused_port(host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A TCP port free on ``host`` now, outside the kernel's ephemeral range and Ray's worker ports
    when that leaves any (random among them, so concurrent callers rarely pick the same one), else
    one the kernel picks.

    Raises:
        OSError: ``host`` cannot be bound at all.
    """
    low, high = _ephemeral_range()
    candidates = [p for p in range(_LOW, _HIGH + 1) if not low <= p <= high]
    for port in random.sample(candidates, min(attempts, len(candidates))):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
