"""The FastAPI application of the API process.

:func:`create_app` wires the deployment's :class:`~fdx.deploy.frontend.EngineFrontend`, the metrics and the
OpenAI handlers, then calls the ``fdx_add_routes`` hook once.  Every error
leaves as the OpenAI envelope (FastAPI's 422 becomes a 400; a 500 names
no exception type and no path, only a reference to the server log).  When
``config.api_key`` is set, every ``/v1/*`` route (plugin routes included)
and ``/invocations`` need ``Authorization: Bearer <key>``; the control routes have their own
guard (``--control-api-key``, fdx/server/control.py); ``/health``,
``/version`` and ``/metrics`` stay open.  A body larger than
``--max-request-bytes`` gets 413 before it is parsed (Content-Length, or
the bytes counted as they arrive).  ``/openapi.json`` declares every
route's request body, responses and error envelope.
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
from fdx.config import EngineConfig
from fdx.core.errors import RequestError
from fdx.deploy.frontend import EngineFrontend
from fdx.server.control import add_control_routes, is_control_path
from fdx.server.metrics import CONTENT_TYPE, Metrics
from fdx.server.protocol import (
    SSE_RESPONSE,
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    HealthResponse,
    ModelList,
    VersionResponse,
    add_component_schemas,
    error_body,
    error_responses,
    openapi_body,
    validation_error,
)
from fdx.server.serving import OpenAIServing, routes
from fdx.server.serving.tokenize import add_tokenize_routes
from fdx.structured_outputs import warm_grammar

log = logging.getLogger("fdx.server")


def error_response(message: str, code: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, code, param), status_code=code)


class _ApiKeyMiddleware:
    """Pure ASGI (never buffers a stream): checks the bearer key on /v1/*."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and (scope["path"].startswith("/v1") or scope["path"] == "/invocations")
                and scope.get("method") != "OPTIONS"
                and not is_control_path(scope["path"])):
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


class _BodyTooLarge(RequestError):
    def __init__(self, limit: int) -> None:
        super().__init__(f"request body exceeds --max-request-bytes ({limit} bytes)", 413)


class _BodyLimitMiddleware:
    """Pure ASGI: a body larger than ``limit`` gets 413 without being read
    (by its Content-Length) or as soon as the counted bytes pass the limit
    (chunked bodies: ``receive`` raises, the handler's error path answers)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                try:
                    too_big = int(v) > limit
                except ValueError:
                    too_big = False
                if too_big:
                    exc = _BodyTooLarge(limit)
                    resp = JSONResponse(error_body(str(exc), 413), status_code=413, headers={"connection": "close"})
                    await resp(scope, receive, send)
                    return
        seen = 0

        async def counted() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _BodyTooLarge(limit)
            return message

        await self.app(scope, counted, send)


def create_app(
    config: EngineConfig,
    client: EngineFrontend,
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
    metrics.set_parallel(config.tensor_parallel_size, config.tp_backend)
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
        await asyncio.to_thread(warm_grammar, config, tok.vocab_size)
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
    async def _request_error(request: Request, exc: RequestError) -> Response:
        if metrics is not None and exc.code in (429, 503):
            metrics.reject(exc.code)
        return refused(request, str(exc), exc.code, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        e = validation_error(exc.errors())
        return refused(request, str(e), 400, e.param)

    def refused(request: Request, message: str, code: int, param: str | None) -> Response:
        resp = error_response(message, code, param)
        serving.trace_refused(request, code, error_body(message, code)["error"]["type"], message)
        return resp

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        return error_response(str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        ref = os.urandom(4).hex()
        log.exception("internal error on %s (ref %s)", request.url.path, ref)
        return error_response(f"internal server error (ref {ref}; the server log has the details)", 500)

    # -- routes ----------------------------------------------------------

    def engine_info() -> dict[str, Any]:
        e = client.engine
        return {
            "engine_pid": e.pid if e else None,
            "rank_pids": list(e.rank_pids) if e else [],  # tensor parallelism: ranks 1..N-1
            # every engine process of the deployment: its name, pid, state and ranks
            "engines": [{"name": h.name, "pid": h.pid, "state": h.state, "rank_pids": list(h.rank_pids)}
                        for h in client.engines()],
            "api_pid": os.getpid(),
            "launcher_pid": os.getppid(),
            "model": config.model_name,
            "weights_version": client.weights_version,
        }

    @app.get("/health", responses={200: {"model": HealthResponse, "description": "serving"},
                                   503: {"model": HealthResponse, "description": "starting or unavailable"}})
    async def health() -> Response:
        reason = serving.unavailable_reason()
        if reason is None:
            s = client.stats
            return JSONResponse({"status": "ok", **engine_info(), "is_paused": s.is_paused,
                                 "num_running": s.num_running, "num_waiting": s.num_waiting})
        status = "starting" if client.failed is None else "unavailable"
        body = {"status": status, "reason": reason, **engine_info()}
        return JSONResponse({**error_body(reason, 503), **body}, status_code=503)

    @app.get("/ping", responses={200: {"model": HealthResponse}, 503: {"model": HealthResponse}})
    async def ping() -> Response:
        return await health()

    @app.get("/version", responses={200: {"model": VersionResponse}})
    async def version() -> Response:
        return JSONResponse({"version": fdx_version(), **engine_info()})

    @app.get("/v1/models", responses={200: {"model": ModelList}, **error_responses(401)})
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
            "generation_defaults": serving.defaults.values(),
            "generation_defaults_source": serving.defaults.source,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/metrics", responses={200: {"content": {CONTENT_TYPE.split(";")[0]: {"schema": {"type": "string"}}},
                                          "description": "Prometheus text format"}})
    async def prom() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    gen_errors = error_responses(400, 401, 404, 413, 429, 500, 503, 504)

    @app.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest),
              responses={200: {"model": CompletionResponse, "content": SSE_RESPONSE,
                               "description": "the completion (JSON), or with stream=true an event stream"},
                         **gen_errors})
    async def completions(request: Request) -> Response:
        return await routes.completions(serving, request)

    @app.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest),
              responses={200: {"model": ChatCompletionResponse, "content": SSE_RESPONSE,
                               "description": "the chat completion (JSON), or with stream=true an event stream"},
                         **gen_errors})
    async def chat(request: Request) -> Response:
        return await routes.chat(serving, request)

    @app.post("/v1/chat/completions/batch", openapi_extra=openapi_body(BatchChatCompletionRequest),
              responses={200: {"model": ChatCompletionResponse,
                               "description": "one chat completion, one choice per conversation (vLLM)"},
                         **gen_errors})
    async def chat_batch(request: Request) -> Response:
        return await routes.chat_batch(serving, request)

    @app.post("/invocations",
              openapi_extra={"requestBody": {"required": True, "description": "a chat completion or a completion "
                                             "request (SageMaker's route, dispatched by the body as vLLM does)",
                                             "content": {"application/json": {"schema": {"oneOf": [
                                                 {"$ref": "#/components/schemas/ChatCompletionRequest"},
                                                 {"$ref": "#/components/schemas/CompletionRequest"}]}}}}},
              responses={200: {"content": {"application/json": {"schema": {"oneOf": [
                                   {"$ref": "#/components/schemas/ChatCompletionResponse"},
                                   {"$ref": "#/components/schemas/CompletionResponse"}]}},
                                   **SSE_RESPONSE},
                               "description": "what /v1/chat/completions or /v1/completions answers"},
                         **gen_errors})
    async def invocations(request: Request) -> Response:
        return await routes.invocations(serving, request)

    add_tokenize_routes(app, serving)  # /tokenize, /detokenize (fdx/server/serving/tokenize.py)
    add_control_routes(app, client, config)  # /v1/pause, /v1/sleep, ... (fdx/server/control.py)

    if plugins is not None:
        try:
            plugins.hook.fdx_add_routes(app=app, client=client)
        except Exception as exc:
            raise RuntimeError(f"a plugin failed in fdx_add_routes: {type(exc).__name__}: {exc}") from exc

    if config.api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=config.api_key)
    app.add_middleware(_BodyLimitMiddleware, limit=config.max_request_bytes)  # outermost: before auth and parsing

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            spec = get_openapi(title=app.title, version=app.version, routes=app.routes,
                               description="fdx: an OpenAI-compatible server. Every error carries the OpenAI "
                                           "envelope {error: {message, type, param, code}}.")
            app.openapi_schema = add_component_schemas(spec)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
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
