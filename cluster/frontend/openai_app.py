"""The OpenAI front's HTTP app: its routes over a :class:`cluster.frontend.openai_router.RouterCore`, one
guard around the whole app, and OpenAI error bodies for every failure.

:func:`build_openai_app` makes the app Ray Serve runs (``OpenAIRouter.__serve_build_asgi_app__``)
and the one in-process tests drive, so tests see exactly what is served.

The guard (:class:`FrontGuard`, a pure ASGI middleware) sits outside routing, so it covers every
route, the ones added later included (admin routes, aliases), and paths that match none:

1. API keys: every request but ``GET``/``HEAD /health`` carries ``Authorization: Bearer KEY``, else 401
   with OpenAI's body (``code: "invalid_api_key"``) before any route runs; an unknown path gets
   401 too, so the answer does not tell which routes exist.
2. An unexpected exception becomes a 500 with a JSON body (Starlette would send plain text).

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

from shardserve.cluster.frontend.openai_protocol import OpenAIError, internal_error
from shardserve.cluster.frontend.security import bearer_matches

logger = logging.getLogger(__name__)
OPEN_ROUTES = frozenset({("GET", "/health"), ("HEAD", "/health")})   # (method, path) served without a key


def error_response(err: OpenAIError, headers: dict | None = None) -> JSONResponse:
    """``err`` as OpenAI sends it: its status and ``{"error": {...}}``."""
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def unauthorized() -> OpenAIError:
    return OpenAIError(401, "Missing or invalid API key: send the header 'Authorization: Bearer <key>'.",
                       "invalid_request_error", None, "invalid_api_key")


class FrontGuard:
    """ASGI middleware: API-key check (when ``api_keys`` is non-empty), then the app, turning any
    exception it raises before answering into a 500 JSON body.

    Args:
        app: the wrapped ASGI app.
        api_keys: accepted bearer keys; empty = no authentication.
    """

    def __init__(self, app: ASGIApp, api_keys: list[str]) -> None:
        self.app, self.api_keys = app, list(api_keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.api_keys and (scope["method"], scope["path"]) not in OPEN_ROUTES:
            if not bearer_matches(Headers(scope=scope).get("authorization"), self.api_keys):
                response = error_response(unauthorized(), {"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        started = False

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
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
        err = OpenAIError(404, f"Invalid URL ({method} {path})", "invalid_request_error", None, "not_found")
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        err = OpenAIError(405, f"Method {method} is not allowed on {path} (allowed: {allowed})",
                          "invalid_request_error", None, "method_not_allowed")
    else:
        err = OpenAIError(exc.status_code, str(exc.detail), "invalid_request_error")
    return error_response(err, exc.headers)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(OpenAIError(400, f"invalid request: {exc.errors()}", "invalid_request_error"))


def build_openai_app(core, api_keys: list[str] | None = None) -> FastAPI:
    """The HTTP app over ``core``.

    Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses``, ``GET /v1/models``,
    ``GET /v1/models/{model}``, ``GET /health``, ``GET /metrics``, ``POST /admin/reload_weights``
    (:mod:`cluster.frontend.admin`), and FastAPI's ``/docs``,
    ``/redoc`` and ``/openapi.json``. Add new routes here: the guard covers them either way.

    Args:
        core: a :class:`cluster.frontend.openai_router.RouterCore` (started by the caller).
        api_keys: accepted bearer keys; empty or None = no authentication.
    """
    app = FastAPI(title="shardserve", summary="OpenAI-compatible API of a shardserve cluster")
    app.add_middleware(FrontGuard, api_keys=list(api_keys or []))
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await core.generate("chat", await request.body())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await core.generate("completion", await request.body())

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await core.generate("responses", await request.body())

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

    return app
