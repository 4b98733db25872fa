"""The front door's settings and checks: who a caller is (API keys, the admin key, the router's
internal token), TLS files, bind addresses, admission, deadlines and the allowed model root.

One :class:`FrontConfig` travels from the CLI or ``ServeArgs`` to every server that accepts
requests (the OpenAI router's HTTP app and each replica's gRPC server), so both enforce the same
rules. Request-size, rate and work limits live in :mod:`cluster.frontend.limits`.

Roles (:func:`FrontConfig.identify` turns a request's ``Authorization: Bearer TOKEN`` into a
:class:`Caller`):

- ``client``: an inference key (``--api-key-file``, ``$SHARDSERVE_API_KEY``, ``--api-key``). Every
  route and method but ``GET /health`` / ``grpc.health.v1`` needs one when any is configured.
- ``admin``: an admin key (``--admin-api-key-file``, ``$SHARDSERVE_ADMIN_API_KEY``). It is the only
  credential of ``/admin/*`` and of gRPC admin methods (``ReloadWeights``); without one configured
  the admin surface is off (HTTP 404, gRPC UNIMPLEMENTED). Inference keys get 403 /
  PERMISSION_DENIED there. An admin key is accepted on the inference routes too.
- ``internal``: the token a replica generates at start-up and hands to the router (through its
  Serve deployment handle, never through init args, logs or metrics); the router uses it for every
  call to that replica, never a client's key. It may also name the tenant a request belongs to.
- ``anonymous``: no key configured, nothing required.

Keys never travel in clear past the process that reads them: servers keep SHA-256 digests
(``api_key_sha256`` / ``admin_api_key_sha256``), compared in constant time against every digest.
Metrics and rate limits name a key by :func:`key_id` (12 hex digits of its digest); the tenant
salt of the prefix cache is the whole digest, which nothing exposes.

Sources: vLLM's ``--api-key`` (OpenAI-style bearer keys, ``/health`` open) and its per-request
``cache_salt``; RFC 6750 (bearer scheme, case-insensitive); gRPC's ``authorization`` metadata.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from shardserve.cluster.frontend.limits import Limits

logger = logging.getLogger(__name__)

API_KEY_ENV = "SHARDSERVE_API_KEY"
ADMIN_KEY_ENV = "SHARDSERVE_ADMIN_API_KEY"
DEFAULT_MAX_QUEUED_REQUESTS = 256
DEFAULT_REQUEST_TIMEOUT_S = 600.0    # a request's whole life; 0 (CLI) / None turns the limit off
DEFAULT_RELOAD_DRAIN_TIMEOUT_S = 120.0
ANONYMOUS = "anonymous"


def key_digest(key: str) -> str:
    """Hex SHA-256 of a key (what servers keep and compare)."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def key_id(digest: str) -> str:
    """The public name of a key in metrics, logs and rate limits: ``key-`` + 12 hex digits of its digest."""
    return f"key-{digest[:12]}"


@dataclass(slots=True, frozen=True)
class Caller:
    """Who sent a request.

    Attributes:
        role: ``client``, ``admin``, ``internal`` (the router) or ``anonymous``.
        key_id: :func:`key_id` of its key, ``anonymous``, or ``internal``.
        tenant: prefix-cache salt source: the key's digest; empty for anonymous and internal callers
            (the router names the tenant in the request instead).
    """

    role: str
    key_id: str
    tenant: str = field(default="", repr=False)

    @property
    def privileged(self) -> bool:
        """The router (internal token) or an operator (admin key): may name a request's tenant."""
        return self.role in ("internal", "admin")


INTERNAL = Caller("internal", "internal")


@dataclass(slots=True)
class FrontConfig:
    """What every request-accepting server of one deployment enforces.

    Attributes:
        api_key_digests: SHA-256 (hex) of the accepted inference keys; empty = no authentication.
        admin_key_digests: SHA-256 (hex) of the admin keys; empty = no admin surface.
        internal_digest: SHA-256 of this replica's internal token (set by the replica itself).
        max_queued_requests: requests (not choices) that may wait per replica; one more is refused
            (HTTP 429, gRPC RESOURCE_EXHAUSTED).
        request_timeout: seconds a request may take from arrival to its last token; None = no limit
            (a gRPC client's own deadline still applies).
        grpc_tls_cert / grpc_tls_key: PEM files of the replicas' gRPC server (both or neither).
            The router trusts ``grpc_tls_cert`` when it dials a replica, so the file holds the
            self-signed certificate or the chain up to its CA, issued for the address dialled.
        allowed_model_root: the folder weight reloads may read from (None: the served model's folder).
        reload_drain_timeout: seconds a ``drain`` reload waits for running requests before it is
            refused (admission resumes, nothing changes).
        limits: request-size, work and rate limits (:class:`cluster.frontend.limits.Limits`).
    """

    api_key_digests: list[str] = field(default_factory=list, repr=False)
    admin_key_digests: list[str] = field(default_factory=list, repr=False)
    internal_digest: str | None = field(default=None, repr=False)
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS
    request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT_S
    grpc_tls_cert: str | None = None
    grpc_tls_key: str | None = None
    allowed_model_root: str | None = None
    reload_drain_timeout: float = DEFAULT_RELOAD_DRAIN_TIMEOUT_S
    limits: Limits = field(default_factory=Limits)

    @classmethod
    def from_keys(cls, api_keys: list[str] = (), admin_keys: list[str] = (), **kwargs) -> FrontConfig:
        """A config from keys in clear (hashed here; the keys themselves are not kept)."""
        return cls(api_key_digests=[key_digest(k) for k in api_keys],
                   admin_key_digests=[key_digest(k) for k in admin_keys], **kwargs)

    @property
    def requires_key(self) -> bool:
        """Inference routes need a key."""
        return bool(self.api_key_digests)

    @property
    def admin_enabled(self) -> bool:
        return bool(self.admin_key_digests)

    def validate(self) -> None:
        """Raises ValueError (bad values) or FileNotFoundError (a TLS file is missing)."""
        for digest in self.api_key_digests + self.admin_key_digests:
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ValueError("an API key digest must be 64 lowercase hex digits (SHA-256)")
        if set(self.api_key_digests) & set(self.admin_key_digests):
            raise ValueError("an admin API key must not also be an inference API key")
        if self.max_queued_requests < 1:
            raise ValueError(f"--max-queued-requests must be >= 1, got {self.max_queued_requests}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"--request-timeout must be > 0 seconds, got {self.request_timeout}")
        if not self.reload_drain_timeout > 0:
            raise ValueError(f"--reload-drain-timeout must be > 0 seconds, got {self.reload_drain_timeout}")
        self.limits.validate()
        check_tls_pair(self.grpc_tls_cert, self.grpc_tls_key, "--grpc-tls-cert", "--grpc-tls-key")

    def grpc_tls(self) -> tuple[bytes, bytes] | None:
        """``(certificate chain PEM, private key PEM)`` of the gRPC servers, or None (plaintext)."""
        if not self.grpc_tls_cert:
            return None
        return Path(self.grpc_tls_cert).read_bytes(), Path(self.grpc_tls_key).read_bytes()

    def identify(self, authorization: str | None) -> Caller | None:
        """The caller an ``Authorization`` value names; None when it names nobody and a key is
        required (the answer is then 401 / UNAUTHENTICATED). Every digest is compared, in constant
        time per digest, whether or not an earlier one matched."""
        token = bearer_token(authorization)
        digest = key_digest(token) if token is not None else "-" * 64
        internal = self.internal_digest is not None and hmac.compare_digest(digest, self.internal_digest)
        admin = _matches(digest, self.admin_key_digests)
        client = _matches(digest, self.api_key_digests)
        if internal:
            return INTERNAL
        if admin:
            return Caller("admin", key_id(digest), digest)
        if client:
            return Caller("client", key_id(digest), digest)
        return None if self.requires_key else Caller(ANONYMOUS, ANONYMOUS)


def _matches(digest: str, digests: list[str]) -> bool:
    matched = False
    for candidate in digests:
        matched |= hmac.compare_digest(digest, candidate)
    return matched


def bearer_token(authorization: str | None) -> str | None:
    """The token of ``Bearer TOKEN`` (scheme case-insensitive), or None."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def load_api_keys(keys: str | list[str] | None, key_file: str | None, env: dict | None = None,
                  env_name: str = API_KEY_ENV, flag: str = "--api-key") -> list[str]:
    """Every accepted key: ``keys`` (comma-separated, or a list) plus one per line of ``key_file``
    (blank lines and ``#`` comments skipped); ``$env_name`` when neither is given.

    Raises:
        FileNotFoundError: ``key_file`` does not exist.
        ValueError: a key given is empty (``--api-key ""``, ``a,,b``) or the file holds none.
    """
    env = os.environ if env is None else env
    if keys is None and key_file is None:
        keys = env.get(env_name)
    found: list[str] = []
    if keys is not None:
        parts = keys.split(",") if isinstance(keys, str) else list(keys)
        found += [str(part).strip() for part in parts]
        if any(not part for part in found):
            raise ValueError(f"{flag}: an API key must not be empty")
    if key_file is not None:
        path = Path(key_file).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"{flag}-file {key_file}: no such file")
        lines = [line.strip() for line in path.read_text().splitlines()]
        from_file = [line for line in lines if line and not line.startswith("#")]
        if not from_file:
            raise ValueError(f"{flag}-file {key_file}: the file holds no key")
        found += from_file
    return list(dict.fromkeys(found))


def load_admin_keys(keys: str | list[str] | None, key_file: str | None, env: dict | None = None) -> list[str]:
    """The admin keys: as :func:`load_api_keys`, from ``--admin-api-key(-file)`` or
    ``$SHARDSERVE_ADMIN_API_KEY``."""
    return load_api_keys(keys, key_file, env, ADMIN_KEY_ENV, "--admin-api-key")


def warn_key_on_command_line(flag: str) -> None:
    """A key given on the command line shows in ``ps`` and shell history: say so (it still works)."""
    logger.warning("%s on the command line is visible to every user of this machine (ps, shell history); "
                   "prefer %s-file FILE or the environment variable", flag, flag)


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


def refuse_exposed(host: str, requires_key: bool, allow_unauthenticated: bool, flag: str) -> None:
    """Secure default: a non-loopback bind needs an API key unless the operator says otherwise.

    Raises:
        ValueError: ``host`` is not loopback, no key is configured and ``allow_unauthenticated`` is off.
    """
    if requires_key or is_loopback(host):
        return
    if not allow_unauthenticated:
        raise ValueError(f"{flag} {host} would let anyone who reaches it use the model: set an API key "
                         f"(--api-key-file FILE or ${API_KEY_ENV}) or pass --allow-unauthenticated")
    logger.warning("%s %s binds without an API key (--allow-unauthenticated): anyone who can reach it can "
                   "use the model", flag, host)


def contained_path(candidate: str | os.PathLike, root: str | os.PathLike) -> Path | None:
    """``candidate`` resolved (symlinks followed) when it lies inside ``root`` (also resolved), else
    None. A path that leaves ``root`` lexically is refused before the file system is asked anything,
    so the answer does not tell whether it exists."""
    root = Path(root).expanduser()
    real_root = Path(os.path.realpath(root))
    lexical = Path(os.path.abspath(Path(candidate).expanduser()))
    if not any(_inside(lexical, r) for r in (Path(os.path.abspath(root)), real_root)):
        return None
    resolved = Path(os.path.realpath(lexical))
    return resolved if _inside(resolved, real_root) else None


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents
