"""The OpenAI front's HTTP app: its routes over a :class:`cluster.frontend.openai_router.RouterCore`, one
guard around the whole app, and OpenAI error bodies for every failure.

:func:`build_openai_app` makes the app Ray Serve runs (``OpenAIRouter.__serve_build_asgi_app__``)
and the one in-process tests drive, so tests see exactly what is served.

The guard (:class:`FrontGuard`, a pure ASGI middleware) sits outside routing, so it covers every
route, the ones added later included (admin routes, aliases), and paths that match none:

1. API keys: every request but ``GET``/``HEAD /health`` carries ``Authorization: Bearer KEY`` when
   keys are configured, else 401 with OpenAI's body (``code: "invalid_api_key"``) before any route
   runs; an unknown path gets 401 too, so the answer does not tell which routes exist.
2. Roles: ``/admin/*`` takes the admin key only: 404 when no admin key is configured (the admin
   surface is off), 403 for an inference key, 401 without a key.
3. Size: a body over ``max_request_body_bytes`` gets 413 before it is read (``Content-Length``) or
   once the bytes read pass the limit.
4. The caller (:class:`cluster.frontend.security.Caller`) is left in ``scope["state"]["caller"]``
   for the routes (per-key rates, usage and prefix-cache tenant).
5. An unexpected exception becomes a 500 with a JSON body (Starlette would send plain text).

Routing errors (404 unknown path, 405 wrong method) and FastAPI's 422 get OpenAI bodies as well.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from ray.exceptions import TaskCancelledError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shardserve.cluster.frontend.limits import LimitExceeded
from shardserve.cluster.frontend.openai_protocol import OpenAIError, internal_error, limit_error
from shardserve.cluster.frontend.security import ANONYMOUS, Caller, FrontConfig

logger = logging.getLogger(__name__)
OPEN_ROUTES = frozenset({("GET", "/health"), ("HEAD", "/health")})   # (method, path) served without a key
ADMIN_PREFIX = "/admin"


def error_response(err: OpenAIError, headers: dict | None = None) -> JSONResponse:
    """``err`` as OpenAI sends it: its status and ``{"error": {...}}``."""
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def unauthorized() -> OpenAIError:
    return OpenAIError(401, "Missing or invalid API key: send the header 'Authorization: Bearer <key>'.",
                       "invalid_request_error", None, "invalid_api_key")


def _not_found(method: str, path: str) -> OpenAIError:
    return OpenAIError(404, f"Invalid URL ({method} {path})", "invalid_request_error", None, "not_found")


def _forbidden() -> OpenAIError:
    return OpenAIError(403, "This route needs the admin API key.", "invalid_request_error", None, "admin_key_required")


def _is_admin(path: str) -> bool:
    return path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/")


class _BodyTooLarge(Exception):
    pass


def _length_refusal(content_length: str | None, limit: int) -> tuple[OpenAIError, None] | None:
    """413 for a declared body over ``limit`` bytes, 400 for a ``Content-Length`` that is no length."""
    if content_length is None:
        return None
    if not content_length.strip().isdigit():
        return OpenAIError(400, "the Content-Length header is not a number of bytes", "invalid_request_error"), None
    if int(content_length) > limit:
        too_large = LimitExceeded(f"the request body has more than {limit} bytes (--max-request-body-bytes)", 413)
        return limit_error(too_large), None
    return None


class FrontGuard:
    """ASGI middleware: who calls and may they (keys, roles), the body-size limit, then the app,
    turning any exception it raises before answering into a 500 JSON body.

    Args:
        app: the wrapped ASGI app.
        front: keys (digests), admin keys and limits.
    """

    def __init__(self, app: ASGIApp, front: FrontConfig) -> None:
        self.app, self.front = app, front

    def _refusal(self, method: str, path: str, caller: Caller | None) -> tuple[OpenAIError, dict | None] | None:
        """Why ``caller`` may not call ``method path`` (error, headers), or None when it may."""
        if (method, path) in OPEN_ROUTES:
            return None
        if caller is None:
            return unauthorized(), {"WWW-Authenticate": "Bearer"}
        if not _is_admin(path):
            return None
        if not self.front.admin_enabled:
            return _not_found(method, path), None
        if caller.role == ANONYMOUS:
            return unauthorized(), {"WWW-Authenticate": "Bearer"}
        return (_forbidden(), None) if caller.role != "admin" else None

    def _receive_at_most(self, receive: Receive, limit: int) -> Receive:
        """``receive`` that raises :class:`_BodyTooLarge` once the body passes ``limit`` bytes."""
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _BodyTooLarge
            return message

        return limited

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        caller = self.front.identify(headers.get("authorization"))
        refusal = self._refusal(scope["method"], scope["path"], caller)
        limit = self.front.limits.max_request_body_bytes
        if refusal is None:
            refusal = _length_refusal(headers.get("content-length"), limit)
        if refusal is not None:
            await error_response(*refusal)(scope, receive, send)
            return
        scope.setdefault("state", {})["caller"] = caller
        receive = self._receive_at_most(receive, limit)
        started = False

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except _BodyTooLarge:
            if not started:
                too_large = LimitExceeded(f"the request body has more than {limit} bytes (--max-request-body-bytes)", 413)
                await error_response(limit_error(too_large))(scope, receive, send)
        except (ClientDisconnect, TaskCancelledError):
            # The client left (before its body was read, or mid-stream: Serve then cancels the
            # handler); the request was counted as cancelled and its blocks freed. Nobody to answer.
            logger.info("client disconnected during %s %s", scope["method"], scope["path"])
        except Exception:  # noqa: BLE001 - the last line of defence: log it, answer JSON
            logger.exception("unexpected error answering %s %s", scope["method"], scope["path"])
            if not started:
                await error_response(internal_error())(scope, receive, send)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    method, path = request.method, request.url.path
    if exc.status_code == 404:
        err = _not_found(method, path)
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        err = OpenAIError(405, f"Method {method} is not allowed on {path} (allowed: {allowed})",
                          "invalid_request_error", None, "method_not_allowed")
    else:
        err = OpenAIError(exc.status_code, str(exc.detail), "invalid_request_error")
    return error_response(err, exc.headers)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(OpenAIError(400, f"invalid request: {exc.errors()}", "invalid_request_error"))


def _caller(request: Request) -> Caller:
    return getattr(request.state, "caller", None) or Caller(ANONYMOUS, ANONYMOUS)


def build_openai_app(core, front: FrontConfig | None = None) -> FastAPI:
    """The HTTP app over ``core``.

    Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses``, ``GET /v1/models``,
    ``GET /v1/models/{model}``, ``GET /health``, ``GET /metrics``, ``POST /admin/reload_weights``
    and ``GET /admin/status`` (:mod:`cluster.frontend.admin`; admin key only), and FastAPI's
    ``/docs``, ``/redoc`` and ``/openapi.json``. Add new routes here: the guard covers them either way.

    Args:
        core: a :class:`cluster.frontend.openai_router.RouterCore` (started by the caller).
        front: keys, admin keys and limits (default: ``core.front``).
    """
    app = FastAPI(title="shardserve", summary="OpenAI-compatible API of a shardserve cluster")
    app.add_middleware(FrontGuard, front=front or core.front)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await core.generate("chat", await request.body(), _caller(request))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await core.generate("completion", await request.body(), _caller(request))

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await core.generate("responses", await request.body(), _caller(request))

    @app.get("/v1/models")
    async def models() -> Response:
        return await core.models()

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        return await core.models(model)

    @app.get("/health")
    @app.head("/health", include_in_schema=False)   # load balancers probe with either; one schema entry
    async def health() -> Response:
        return await core.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return await core.metrics_text()

    @app.post("/admin/reload_weights")
    async def reload_weights(request: Request) -> Response:
        return await core.reload_weights(await request.body())

    @app.get("/admin/status")
    async def admin_status() -> Response:
        return await core.admin_status()

    return app
