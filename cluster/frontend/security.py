"""The front door's settings and checks: API keys, TLS files, bind addresses, admission and deadlines.

One :class:`FrontConfig` travels from the CLI or ``ServeArgs`` to every server that accepts
requests (the OpenAI router's HTTP app and each replica's gRPC server), so both enforce the same
rules:

- API keys: every request but ``GET /health`` (HTTP) and ``grpc.health.v1`` (gRPC) carries
  ``Authorization: Bearer KEY``. Keys are compared in constant time (``hmac.compare_digest``,
  against every key, so the time does not tell which key nearly matched) and never logged: the
  dataclass hides them from ``repr``.
- Bind addresses: servers bind 127.0.0.1 unless told otherwise; a non-loopback bind without a key
  logs a warning.
- Admission (``max_queued_requests`` waiting per replica) and deadlines (``request_timeout``) are
  enforced by the coordinator (``cluster/replica/coordinator.py``); the router maps them to 429 / 408.

Sources: vLLM's ``--api-key`` (OpenAI-style bearer keys, ``/health`` open), RFC 6750 (bearer
scheme, case-insensitive), gRPC's ``authorization`` metadata convention.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

API_KEY_ENV = "SHARDSERVE_API_KEY"
DEFAULT_MAX_QUEUED_REQUESTS = 256


@dataclass(slots=True)
class FrontConfig:
    """What every request-accepting server of one deployment enforces.

    Attributes:
        api_keys: accepted bearer keys; empty = no authentication. Hidden from ``repr``.
        max_queued_requests: requests that may wait (not yet running) per replica; one more is
            refused (HTTP 429, gRPC RESOURCE_EXHAUSTED).
        request_timeout: seconds a request may take from arrival to its last token; None = no limit
            (a gRPC client's own deadline still applies).
        grpc_tls_cert / grpc_tls_key: PEM files of the replicas' gRPC server (both or neither).
            The router trusts ``grpc_tls_cert`` when it dials a replica, so the file holds the
            self-signed certificate or the chain up to its CA, issued for the address dialled.
    """

    api_keys: list[str] = field(default_factory=list, repr=False)
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS
    request_timeout: float | None = None
    grpc_tls_cert: str | None = None
    grpc_tls_key: str | None = None

    def validate(self) -> None:
        """Raises ValueError (bad values) or FileNotFoundError (a TLS file is missing)."""
        if any(not key for key in self.api_keys):
            raise ValueError("an API key must not be empty")
        if self.max_queued_requests < 1:
            raise ValueError(f"--max-queued-requests must be >= 1, got {self.max_queued_requests}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"--request-timeout must be > 0 seconds, got {self.request_timeout}")
        check_tls_pair(self.grpc_tls_cert, self.grpc_tls_key, "--grpc-tls-cert", "--grpc-tls-key")

    def grpc_tls(self) -> tuple[bytes, bytes] | None:
        """``(certificate chain PEM, private key PEM)`` of the gRPC servers, or None (plaintext)."""
        if not self.grpc_tls_cert:
            return None
        return Path(self.grpc_tls_cert).read_bytes(), Path(self.grpc_tls_key).read_bytes()


def load_api_keys(keys: str | list[str] | None, key_file: str | None, env: dict | None = None) -> list[str]:
    """Every accepted key: ``keys`` (comma-separated, or a list) plus one per line of ``key_file``
    (blank lines and ``#`` comments skipped); ``$SHARDSERVE_API_KEY`` when neither is given.

    Raises:
        FileNotFoundError: ``key_file`` does not exist.
        ValueError: a key given is empty (``--api-key ""``, ``a,,b``) or the file holds none.
    """
    env = os.environ if env is None else env
    if keys is None and key_file is None:
        keys = env.get(API_KEY_ENV)
    found: list[str] = []
    if keys is not None:
        parts = keys.split(",") if isinstance(keys, str) else list(keys)
        found += [str(part).strip() for part in parts]
        if any(not part for part in found):
            raise ValueError("--api-key: an API key must not be empty")
    if key_file is not None:
        path = Path(key_file).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"--api-key-file {key_file}: no such file")
        lines = [line.strip() for line in path.read_text().splitlines()]
        from_file = [line for line in lines if line and not line.startswith("#")]
        if not from_file:
            raise ValueError(f"--api-key-file {key_file}: the file holds no key")
        found += from_file
    return list(dict.fromkeys(found))


def bearer_matches(authorization: str | None, keys: list[str]) -> bool:
    """True when ``authorization`` is ``Bearer <one of keys>`` (scheme case-insensitive).

    Every key is compared, in constant time per key, whether or not an earlier one matched.
    """
    if not authorization:
        return False
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    token_bytes = token.strip().encode("utf-8", "surrogateescape")
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(token_bytes, key.encode("utf-8"))
    return matched


def check_tls_pair(cert: str | None, key: str | None, cert_flag: str, key_flag: str) -> None:
    """Both or neither of a certificate and its key, and both files present.

    Raises:
        ValueError: one without the other. FileNotFoundError: a file is missing.
    """
    if bool(cert) != bool(key):
        given, missing = (cert_flag, key_flag) if cert else (key_flag, cert_flag)
        raise ValueError(f"{given} needs {missing} too")
    for path, flag in ((cert, cert_flag), (key, key_flag)):
        if path and not Path(path).expanduser().is_file():
            raise FileNotFoundError(f"{flag} {path}: no such file")


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``; False for ``0.0.0.0`` and any other address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_if_exposed(host: str, api_keys: list[str], what: str) -> bool:
    """Log a warning when ``what`` binds a non-loopback ``host`` without an API key; True if so."""
    if api_keys or is_loopback(host):
        return False
    logger.warning("%s binds %s without an API key: anyone who can reach it can run the model "
                   "(set --api-key or %s)", what, host, API_KEY_ENV)
    return True
