"""The FastAPI application of ``fdx router``.

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions``
(:class:`fdx.router.proxy.RelayResponse`), ``GET /v1/models`` (an up
instance's answer), ``GET /health`` (200 while at least one P and one D
are up, else 503 with the OpenAI error envelope; the body lists every
instance: url, role, up, in_flight, kv_connector, restarts, the reason it is
down; ``control_state``: the deployment's paused / sleeping / weights that
an instance coming up is given, :mod:`fdx.router.state`),
``GET /metrics`` (:class:`fdx.router.metrics.RouterMetrics`), the control
routes, each sent to every instance (:mod:`fdx.router.control`).  ``/health``
also lists every engine process of the deployment under ``engines`` (each
instance's own list: name, pid, state).  With an API
key (``--api-key`` / ``FDX_API_KEY``) every ``/v1/*`` route needs
``Authorization: Bearer KEY``; the client's header is passed on to the
instances (which run with the same key).  Errors are OpenAI envelopes.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, AsyncIterator

import aiohttp
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from fdx.router.control import add_control_routes, instance_name
from fdx.router.instances import InstancePool
from fdx.router.metrics import CONTENT_TYPE, RouterMetrics
from fdx.router.proxy import FORWARD_HEADERS, RelayResponse, plan_request
from fdx.router.state import ControlState
from fdx.server.protocol import error_body

if TYPE_CHECKING:
    from fdx.router.config import RouterConfig

log = logging.getLogger("fdx.router")


def _error(message: str, code: int) -> JSONResponse:
    return JSONResponse(error_body(message, code), status_code=code)


def create_router_app(config: RouterConfig) -> FastAPI:
    headers = {"authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    control_key = config.control_api_key or config.api_key
    # the deployment's control state (fdx.router.state), given to every instance that comes (back) up
    state = ControlState({"authorization": f"Bearer {control_key}"} if control_key else {}, config.state_file)
    pool = InstancePool(config.prefill, config.decode, probe_interval=config.probe_interval,
                        probe_timeout=config.probe_timeout, headers=headers, state=state)
    metrics = RouterMetrics(pool)
    tracer = None
    if config.otlp_traces_endpoint:
        from fdx.tracing import tracer as make_tracer

        tracer = make_tracer(config.otlp_traces_endpoint, "router")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        pool.session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout))
        await pool.probe_all()
        task = asyncio.get_running_loop().create_task(pool.probe_loop())
        try:
            yield
        finally:
            task.cancel()
            await pool.session.close()

    app = FastAPI(title="fdx router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.pool = pool
    app.state.metrics = metrics

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        return _error(str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        log.exception("internal error on %s", request.url.path)
        return _error("internal router error (the router log has the details)", 500)

    def check_key(request: Request) -> Response | None:
        if not config.api_key:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            return JSONResponse(error_body("invalid or missing API key", 401, None, "authentication_error"),
                                status_code=401, headers={"www-authenticate": "Bearer"})
        return None

    def forward_headers(request: Request) -> dict[str, str]:
        out = dict(headers)
        for k, v in request.headers.raw:
            if k in FORWARD_HEADERS:
                out[k.decode()] = v.decode("latin-1")
        out.setdefault("content-type", "application/json")
        return out

    @app.get("/health")
    async def health() -> Response:
        body = {"router_pid": os.getpid(), "launcher_pid": os.getppid(),
                # what every instance is given when it comes up (None: no control call yet)
                "control_state": state.describe(),
                "prefill": [i.describe() for i in pool.prefill], "decode": [i.describe() for i in pool.decode],
                # every engine process of the deployment, as each instance's /health lists its own
                "engines": [{**e, "name": f"{instance_name(i)} {e['name']}", "instance": instance_name(i),
                             "role": i.role, "url": i.url} for i in pool.instances for e in i.engine_health()]}
        p, d = pool.up("prefill"), pool.up("decode")
        if p and d:
            return JSONResponse({"status": "ok", **body})
        missing = " and ".join(r for r, live in (("prefill", p), ("decode", d)) if not live)
        return JSONResponse({**error_body(f"no {missing} instance is up", 503), "status": "unavailable", **body},
                            status_code=503)

    @app.get("/metrics")
    async def prom() -> Response:
        return Response(await metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        if (denied := check_key(request)) is not None:
            return denied
        assert pool.session is not None
        for inst in pool.up("decode") + pool.up("prefill"):
            try:
                async with pool.session.get(inst.url + "/v1/models", headers=forward_headers(request),
                                            timeout=aiohttp.ClientTimeout(total=config.probe_timeout)) as r:
                    return Response(await r.read(), status_code=r.status, media_type="application/json")
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                continue
        return _error("no instance is up", 503)

    async def generate(request: Request) -> Response:
        if (denied := check_key(request)) is not None:
            return denied
        raw = await request.body()
        if len(raw) > config.max_request_bytes:
            return _error(f"request body exceeds {config.max_request_bytes} bytes", 413)
        plan = plan_request(request.url.path, raw)
        upstream = forward_headers(request)
        span = None
        if tracer is not None:  # the router's span; the instance's API span is its child
            from fdx.tracing import router_span, traceparent

            span = router_span(tracer, request.headers, request.url.path)
            upstream["traceparent"] = traceparent(span)
        return RelayResponse(pool, plan, upstream, metrics, span)

    app.add_api_route("/v1/completions", generate, methods=["POST"])
    app.add_api_route("/v1/chat/completions", generate, methods=["POST"])
    add_control_routes(app, pool, control_key, state)  # fdx.router.control
    return app


__all__ = ["create_router_app"]
