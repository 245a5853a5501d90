"""The FastAPI application of the API process.

:func:`create_app` wires the :class:`EngineClient`, the metrics and the
OpenAI handlers, then calls the ``fdx_add_routes`` hook once.  Every error
leaves as the OpenAI envelope (FastAPI's 422 becomes a 400).  When
``config.api_key`` is set, every ``/v1/*`` route (plugin routes included)
needs ``Authorization: Bearer <key>``; ``/health``, ``/version`` and
``/metrics`` stay open.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

import fdx
from fdx.core.config import EngineConfig
from fdx.core.errors import RequestError
from fdx.server.client import EngineClient
from fdx.server.control import add_control_routes
from fdx.server.metrics import CONTENT_TYPE, Metrics
from fdx.server.protocol import error_body, validation_error
from fdx.server.serving import OpenAIServing

log = logging.getLogger("fdx.server")


def error_response(message: str, code: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, code, param), status_code=code)


class _ApiKeyMiddleware:
    """Pure ASGI (never buffers a stream): checks the bearer key on /v1/*."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope.get("method") != "OPTIONS":
            auth = b""
            for k, v in scope.get("headers", ()):
                if k == b"authorization":
                    auth = v
                    break
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                msg = "missing API key (send 'Authorization: Bearer <key>')" if not auth else "invalid API key"
                resp = JSONResponse(error_body(msg, 401, None, "authentication_error"), status_code=401,
                                    headers={"www-authenticate": "Bearer"})
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(
    config: EngineConfig,
    client: EngineClient,
    *,
    plugins: Any = None,
    metrics: Metrics | None = None,
    load_tokenizer: Callable[[], tuple[Any, Any]] | None = None,
    on_startup_failure: Callable[[str], None] | None = None,
    on_serving: Callable[[], None] | None = None,
) -> FastAPI:
    """Build the app.  ``load_tokenizer()`` (run in a thread at start-up)
    returns ``(tokenizer, token_processor)``; ``on_startup_failure(msg)`` is
    called if it raises; ``on_serving()`` once both the tokenizer and the
    engine are ready."""
    metrics = metrics or client.metrics or Metrics(config.model_name, lambda: client.stats)
    client.metrics = metrics
    serving = OpenAIServing(config, client, metrics)
    started = time.time()

    def maybe_serving() -> None:
        if serving.tokenizer is not None and client.alive and on_serving is not None:
            on_serving()

    client.on_ready.append(lambda _msg: maybe_serving())

    async def _load() -> None:
        if load_tokenizer is None:
            return
        try:
            tok, proc = await asyncio.to_thread(load_tokenizer)
        except Exception as exc:  # noqa: BLE001
            msg = f"cannot load the tokenizer of {config.model!r}: {exc}"
            log.error("%s", msg)
            if on_startup_failure is not None:
                on_startup_failure(msg)
            return
        serving.set_tokenizer(tok, proc)
        log.info("tokenizer loaded (vocab %d)", tok.vocab_size)
        maybe_serving()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await client.start()
        loader = asyncio.get_running_loop().create_task(_load())
        try:
            yield
        finally:
            loader.cancel()
            await client.close()

    app = FastAPI(title="fdx", version=fdx_version(), lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.client = client
    app.state.serving = serving
    app.state.metrics = metrics

    # -- errors ----------------------------------------------------------

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError) -> Response:
        if metrics is not None and exc.code in (429, 503):
            metrics.reject(exc.code)
        return error_response(str(exc), exc.code, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        e = validation_error(exc.errors())
        return error_response(str(e), 400, e.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        return error_response(str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> Response:
        log.exception("internal error")
        return error_response(f"internal server error: {type(exc).__name__}: {exc}", 500)

    # -- routes ----------------------------------------------------------

    def engine_info() -> dict[str, Any]:
        e = client.engine
        return {
            "engine_pid": e.pid if e else None,
            "api_pid": os.getpid(),
            "launcher_pid": os.getppid(),
            "model": config.model_name,
            "weights_version": client.weights_version,
        }

    @app.get("/health")
    async def health() -> Response:
        reason = serving.unavailable_reason()
        if reason is None:
            s = client.stats
            return JSONResponse({"status": "ok", **engine_info(), "is_paused": s.is_paused,
                                 "num_running": s.num_running, "num_waiting": s.num_waiting})
        status = "starting" if client.failed is None else "unavailable"
        body = {"status": status, "reason": reason, **engine_info()}
        return JSONResponse({**error_body(reason, 503), **body}, status_code=503)

    @app.get("/ping")
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": fdx_version(), **engine_info()})

    @app.get("/v1/models")
    async def models() -> Response:
        card = {
            "id": config.model_name,
            "object": "model",
            "created": int(started),
            "owned_by": "fdx",
            "root": config.model,
            "parent": None,
            "max_model_len": client.max_model_len or None,
            "version": client.weights_version,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/metrics")
    async def prom() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serving.completions(request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await serving.chat(request)

    add_control_routes(app, client)  # /v1/pause, /v1/sleep, ... (fdx/server/control.py)

    if plugins is not None:
        try:
            plugins.hook.fdx_add_routes(app=app, client=client)
        except Exception as exc:
            raise RuntimeError(f"a plugin failed in fdx_add_routes: {type(exc).__name__}: {exc}") from exc

    if config.api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=config.api_key)
    return app


def fdx_version() -> str:
    return getattr(fdx, "__version__", None) or _dist_version()


def _dist_version() -> str:
    try:
        import importlib.metadata as md

        return md.version("fdx")
    except Exception:  # noqa: BLE001
        return "0+unknown"


__all__ = ["create_app", "error_response"]
