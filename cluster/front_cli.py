"""The front-door flags of ``serve``, ``serve-grpc`` and ``manifest`` and the start-up checks that
go with them (registered by :mod:`cluster.cli`):

- keys: ``--api-key-file`` / ``$SHARDSERVE_API_KEY`` (``--api-key`` still works, with a warning:
  the command line shows in ``ps``), ``--admin-api-key-file`` / ``$SHARDSERVE_ADMIN_API_KEY``;
- secure defaults: a non-loopback bind without a key is refused unless ``--allow-unauthenticated``
  (:func:`cluster.frontend.security.refuse_exposed`); ``--address`` refuses a Ray cluster whose
  token authentication is off unless ``--allow-ray-without-auth`` (:func:`check_ray_token_auth`);
- limits before work (:mod:`cluster.frontend.limits`), the request timeout, the reload root and
  drain timeout, gRPC TLS.

Every bad value is one line on stderr and exit code 2, before anything loads.
"""

from __future__ import annotations

import argparse
import logging

from shardserve.cluster.cli_types import finite_float
from shardserve.cluster.frontend.limits import (
    DEFAULT_MAX_CHOICES, DEFAULT_MAX_PROMPT_CHARS, DEFAULT_MAX_REQUEST_BODY_BYTES, Limits, parse_rate_limit)
from shardserve.cluster.frontend.security import (
    ADMIN_KEY_ENV, API_KEY_ENV, DEFAULT_MAX_QUEUED_REQUESTS, DEFAULT_RELOAD_DRAIN_TIMEOUT_S,
    DEFAULT_REQUEST_TIMEOUT_S, FrontConfig, key_digest, load_admin_keys, load_api_keys, warn_key_on_command_line)

logger = logging.getLogger(__name__)


def front_flags(parser: argparse.ArgumentParser) -> None:
    """Keys, roles, limits, deadlines, reload rules and gRPC TLS (``serve``, ``serve-grpc``, ``manifest``)."""
    parser.add_argument("--api-key-file", default=None,
                        help=f"file with one API key per line, sent as 'Authorization: Bearer KEY' (HTTP) or "
                             f"'authorization' metadata (gRPC) (default: ${API_KEY_ENV}, else none: no authentication)")
    parser.add_argument("--api-key", default=None,
                        help="API key(s), comma-separated; visible in ps: prefer --api-key-file or "
                             f"${API_KEY_ENV} (default: none)")
    parser.add_argument("--admin-api-key-file", default=None,
                        help="file with the admin key(s): the only credential of /admin/* and gRPC ReloadWeights "
                             f"(default: ${ADMIN_KEY_ENV}, else none: the admin API is off)")
    parser.add_argument("--admin-api-key", default=None,
                        help="admin key(s), comma-separated; visible in ps: prefer --admin-api-key-file (default: none)")
    parser.add_argument("--allow-unauthenticated", action="store_true",
                        help="let the servers bind a non-loopback address without an API key")
    parser.add_argument("--allow-ray-without-auth", action="store_true",
                        help="with --address: join a Ray cluster whose token authentication is off")
    parser.add_argument("--allowed-model-root", default=None,
                        help="folder weight reloads may read from, symlinks resolved (default: the served model's "
                             "folder)")
    parser.add_argument("--reload-drain-timeout", type=finite_float, default=DEFAULT_RELOAD_DRAIN_TIMEOUT_S,
                        help="seconds a drain reload waits for running requests before it is refused")
    parser.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help="largest HTTP body / gRPC message in bytes; larger gets 413 / RESOURCE_EXHAUSTED")
    parser.add_argument("--max-prompt-chars", type=int, default=DEFAULT_MAX_PROMPT_CHARS,
                        help="characters of all prompts of one request at most, checked before tokenizing (400)")
    parser.add_argument("--max-choices", type=int, default=DEFAULT_MAX_CHOICES,
                        help="prompts x n of one request at most (400)")
    parser.add_argument("--rate-limit", default=None, metavar="REQUESTS[,TOKENS]",
                        help="per API key and minute: requests, and optionally prompt + output tokens; over it "
                             "429 with Retry-After (default: no limit)")
    parser.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED_REQUESTS,
                        help="requests (not choices) that may wait per replica; more get HTTP 429 / "
                             "RESOURCE_EXHAUSTED")
    parser.add_argument("--request-timeout", type=finite_float, default=DEFAULT_REQUEST_TIMEOUT_S,
                        help="seconds a request may take before it is aborted with HTTP 408 / DEADLINE_EXCEEDED "
                             "(0: no limit)")
    parser.add_argument("--grpc-tls-cert", default=None,
                        help="PEM certificate (chain) of the gRPC servers (default: none, plaintext)")
    parser.add_argument("--grpc-tls-key", default=None, help="PEM private key of --grpc-tls-cert (default: none)")


def read_keys(ns: argparse.Namespace) -> tuple[list[str], list[str]]:
    """``(inference keys, admin keys)`` from the flags, files and environment (a key given on the
    command line logs a warning).

    Raises:
        ValueError / FileNotFoundError: an empty key, a missing or empty file, a key in both roles.
    """
    for flag, value in (("--api-key", ns.api_key), ("--admin-api-key", ns.admin_api_key)):
        if value is not None:
            warn_key_on_command_line(flag)
    api = load_api_keys(ns.api_key, ns.api_key_file)
    admin = load_admin_keys(ns.admin_api_key, ns.admin_api_key_file)
    if set(api) & set(admin):
        raise ValueError("an admin API key must not also be an inference API key")
    return api, admin


def _rates(ns: argparse.Namespace) -> tuple[int | None, int | None]:
    return parse_rate_limit(ns.rate_limit) if ns.rate_limit else (None, None)


def limits(ns: argparse.Namespace) -> Limits:
    requests, tokens = _rates(ns)
    return Limits(max_request_body_bytes=ns.max_request_body_bytes, max_prompt_chars=ns.max_prompt_chars,
                  max_choices=ns.max_choices, rate_limit_requests=requests, rate_limit_tokens=tokens)


def request_timeout(ns: argparse.Namespace) -> float | None:
    return ns.request_timeout or None


def front_config(ns: argparse.Namespace) -> FrontConfig:
    """What ``serve-grpc`` enforces, validated (keys read here and kept as digests).

    Raises:
        ValueError / FileNotFoundError: a bad value or a missing file.
    """
    api, admin = read_keys(ns)
    front = FrontConfig.from_keys(api, admin, max_queued_requests=ns.max_queued_requests,
                                  request_timeout=request_timeout(ns), grpc_tls_cert=ns.grpc_tls_cert,
                                  grpc_tls_key=ns.grpc_tls_key, allowed_model_root=ns.allowed_model_root,
                                  reload_drain_timeout=ns.reload_drain_timeout, limits=limits(ns))
    front.validate()
    return front


def serve_args_fields(ns: argparse.Namespace, read: bool = True) -> dict:
    """The ``ServeArgs`` fields of these flags; keys as digests (``read=False``: none, as
    ``manifest`` wants: its keys come from Secrets)."""
    fields = {"max_queued_requests": ns.max_queued_requests, "request_timeout": request_timeout(ns),
              "grpc_tls_cert": ns.grpc_tls_cert, "grpc_tls_key": ns.grpc_tls_key,
              "allow_unauthenticated": ns.allow_unauthenticated, "allowed_model_root": ns.allowed_model_root,
              "reload_drain_timeout": ns.reload_drain_timeout, "max_request_body_bytes": ns.max_request_body_bytes,
              "max_prompt_chars": ns.max_prompt_chars, "max_choices": ns.max_choices}
    requests, tokens = _rates(ns)
    fields.update(rate_limit_requests=requests, rate_limit_tokens=tokens)
    if read:
        api, admin = read_keys(ns)
        fields.update(api_key=[], admin_api_key=[], api_key_sha256=[key_digest(k) for k in api],
                      admin_api_key_sha256=[key_digest(k) for k in admin])
    return fields


_GCS_PROBE = "/ray.rpc.NodeInfoGcsService/CheckAlive"


def ray_token_auth_on(gcs_address: str) -> bool:
    """Whether the Ray cluster at ``gcs_address`` refuses a call that carries no token (the
    GCS's ``CheckAlive`` with an empty request, over a channel of our own)."""
    import grpc

    with grpc.insecure_channel(gcs_address) as channel:
        probe = channel.unary_unary(_GCS_PROBE, request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw)
        try:
            probe(b"", timeout=10)
        except grpc.RpcError as err:
            return err.code() == grpc.StatusCode.UNAUTHENTICATED
    return False


def check_ray_token_auth(allow_without: bool) -> None:
    """After joining ``--address``: refuse a cluster whose token authentication is off (anyone who
    reaches its GCS, dashboard or client port runs code on it) unless ``allow_without``.

    Raises:
        ValueError: auth is off and ``allow_without`` is not set.
    """
    import ray

    if ray_token_auth_on(ray.get_runtime_context().gcs_address):
        return
    if not allow_without:
        raise ValueError("the Ray cluster at --address has token authentication off: anyone who reaches it can "
                         "run code on it. Start it with `RAY_AUTH_MODE=token ray start ...` (and run this with "
                         "RAY_AUTH_MODE=token), or pass --allow-ray-without-auth")
    logger.warning("joining a Ray cluster without token authentication (--allow-ray-without-auth)")
