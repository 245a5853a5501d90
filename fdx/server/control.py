"""HTTP routes of the control plane.

=============================  ============================================
``POST /v1/pause``             stop admitting work; end running/waiting
                               requests with an error; reset prefix cache
``POST /v1/resume``            serve again
``GET  /v1/is_paused``         ``{"is_paused": bool, "sleeping": [...]}``
``POST /v1/abort_requests``    ``{"req_ids": [...]}`` or ``{"abort_all": true}``
``POST /v1/sleep?tags=...``    pause, then free ``weight`` / ``kv_cache``
``POST /v1/wakeup?tags=...``   reload what sleep freed, then resume
``POST /v1/update_weights``    ``{"path": ..., "version": ...}`` (paused only)
``POST /v1/control/{method}``  any engine control method, JSON body = args
=============================  ============================================

Every route sends one ``ControlRequest`` over the same IPC as requests
(:meth:`EngineClient.call`); the engine dispatches it to
``Engine._control_<method>`` by name.  Replies are
``{"status": "success", "result": ...}`` or, on failure,
``{"status": "error", "result": null, "message": ..., "error": {...}}``
(``error`` is the OpenAI envelope) with the HTTP status: 400 for an unknown
method, bad arguments or a refused call, 500 when the method failed (the
message says why), 503 when the engine is unavailable, 504 when no reply
came in time ("timed out after N s").  Every call waits at most its
method's timeout (:data:`TIMEOUTS`, or ``?timeout=SECONDS``).  The routes
live under ``/v1`` so ``--api-key`` guards them.

Request ids: users abort by the id the API returned (``cmpl-...`` /
``chatcmpl-...``).  A request with ``n > 1`` (or several prompts) runs as
engine requests ``<id>-<choice index>``; :func:`engine_ids_for` maps the
user's id to all of them and the reply groups them back under that id.
"""

from __future__ import annotations

import collections
import json
import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from fdx.core.errors import RequestError
from fdx.server.protocol import error_body

log = logging.getLogger("fdx.server")

#: default seconds to wait for each method's reply
TIMEOUTS: dict[str, float] = {
    "pause": 60.0,
    "resume": 30.0,
    "is_paused": 30.0,
    "abort_requests": 60.0,
    "sleep": 300.0,
    "wakeup": 600.0,
    "update_weights": 600.0,
}
DEFAULT_TIMEOUT = 60.0
MAX_TIMEOUT = 3600.0


class _BadCall(RequestError):
    def __init__(self, message: str) -> None:
        super().__init__(message, 400)


def success(result: Any) -> JSONResponse:
    return JSONResponse({"status": "success", "result": result})


def failure(message: str, code: int) -> JSONResponse:
    return JSONResponse(
        {"status": "error", "result": None, "message": message, **error_body(message, code)}, status_code=code
    )


# --------------------------------------------------------------------------
# request-id mapping (OpenAI-level id <-> engine request ids)
# --------------------------------------------------------------------------


def _live(client: Any) -> dict[str, Any]:
    return dict(getattr(client, "_live", {}) or {})


def engine_ids_for(client: Any, rid: str) -> list[str]:
    """Engine ids of the live request the API returned as ``rid``: ``rid``
    itself, or ``rid-<k>`` for its choice ``k`` (n > 1 / several prompts).
    Falls back to ``[rid]`` so an id only the engine knows is still tried."""
    out = []
    for eid, h in _live(client).items():
        if eid == rid:
            out.append(eid)
            continue
        idx = getattr(getattr(h, "tag", None), "index", None)
        if isinstance(idx, int) and eid == f"{rid}-{idx}":
            out.append(eid)
    return out or [rid]


def api_ids(client: Any) -> dict[str, str]:
    """engine id -> id the API returned, for every live request.  A choice
    ``rid-<k>`` maps to ``rid`` when its siblings are still live or k > 0
    (an n > 1 request whose other choices all ended keeps ``rid-0``).
    Siblings are the handles sharing one sink queue (one HTTP request)."""
    live = _live(client)
    per_sink = collections.Counter(id(getattr(h, "sink", h)) for h in live.values())
    out = {}
    for eid, h in live.items():
        idx = getattr(getattr(h, "tag", None), "index", None)
        suffix = f"-{idx}"
        grouped = isinstance(idx, int) and (idx > 0 or per_sink[id(getattr(h, "sink", h))] > 1)
        out[eid] = eid[: -len(suffix)] if grouped and eid.endswith(suffix) else eid
    return out


def _group(aborted: list[dict[str, Any]], owner: dict[str, str]) -> list[dict[str, Any]]:
    """Merge engine-level abort entries into one entry per API id."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for a in aborted:
        eid = str(a.get("request_id"))
        groups.setdefault(owner.get(eid, eid), []).append(a)
    out = []
    for rid, items in groups.items():
        entry: dict[str, Any] = {
            "request_id": rid,
            "output_token_count": sum(int(i.get("output_token_count", 0)) for i in items),
        }
        if len(items) > 1 or items[0].get("request_id") != rid:
            entry["choices"] = items
        out.append(entry)
    return out


# --------------------------------------------------------------------------
# argument parsing
# --------------------------------------------------------------------------


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _BadCall(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise _BadCall("request body must be a JSON object")
    return body


def _timeout(request: Request, method: str) -> float:
    raw = request.query_params.get("timeout")
    if raw is None:
        return TIMEOUTS.get(method, DEFAULT_TIMEOUT)
    try:
        t = float(raw)
    except ValueError:
        raise _BadCall(f"'timeout' must be a number of seconds, got {raw!r}") from None
    if not (0 < t <= MAX_TIMEOUT) or math.isnan(t):
        raise _BadCall(f"'timeout' must be in (0, {MAX_TIMEOUT:g}] seconds, got {raw}")
    return t


def _only(body: dict[str, Any], allowed: tuple[str, ...], route: str) -> None:
    extra = sorted(set(body) - set(allowed))
    if extra:
        raise _BadCall(f"{route}: unknown field(s) {', '.join(extra)}; allowed: {', '.join(allowed) or 'none'}")


async def _tags(request: Request, route: str) -> dict[str, Any]:
    """``tags`` from the query (``?tags=weight,kv_cache``) or a JSON body."""
    body = await _json_body(request)
    _only(body, ("tags",), route)
    tags = request.query_params.get("tags")
    if tags is None:
        tags = body.get("tags")
    if tags is None:
        return {}
    if not isinstance(tags, (str, list)):
        raise _BadCall(f"{route}: 'tags' must be a string like 'weight,kv_cache' or a list")
    return {"tags": tags}


# --------------------------------------------------------------------------
# routes
# --------------------------------------------------------------------------


def add_control_routes(app: FastAPI, client: Any) -> None:
    """Mount the control routes on ``app`` (called by ``create_app``)."""

    async def call(request: Request, method: str, args: dict[str, Any]) -> Any:
        return await client.call(method, args, timeout=_timeout(request, method))

    async def run(request: Request, method: str, args: dict[str, Any] | None = None) -> Response:
        try:
            return success(await call(request, method, args or {}))
        except RequestError as exc:
            log.warning("control %s failed (%d): %s", method, exc.code, exc)
            return failure(str(exc), exc.code)

    def guarded(fn):  # type: ignore[no-untyped-def]
        async def wrapper(request: Request) -> Response:
            try:
                return await fn(request)
            except RequestError as exc:
                return failure(str(exc), exc.code)
            except Exception as exc:  # noqa: BLE001
                log.exception("control route failed")
                return failure(f"internal server error: {type(exc).__name__}: {exc}", 500)

        wrapper.__name__ = fn.__name__
        return wrapper

    @guarded
    async def pause(request: Request) -> Response:
        _only(await _json_body(request), (), "/v1/pause")
        return await run(request, "pause")

    @guarded
    async def resume(request: Request) -> Response:
        _only(await _json_body(request), (), "/v1/resume")
        return await run(request, "resume")

    @guarded
    async def is_paused(request: Request) -> Response:
        return await run(request, "is_paused")

    @guarded
    async def sleep(request: Request) -> Response:
        return await run(request, "sleep", await _tags(request, "/v1/sleep"))

    @guarded
    async def wakeup(request: Request) -> Response:
        return await run(request, "wakeup", await _tags(request, "/v1/wakeup"))

    @guarded
    async def update_weights(request: Request) -> Response:
        body = await _json_body(request)
        _only(body, ("path", "version"), "/v1/update_weights")
        path = body.get("path")
        if not isinstance(path, str) or not path:
            raise _BadCall("/v1/update_weights needs 'path' (a .gguf file or a Hugging Face model folder)")
        version = body.get("version")
        if version is not None and not isinstance(version, (str, int)):
            raise _BadCall("/v1/update_weights: 'version' must be a string")
        args: dict[str, Any] = {"path": path}
        if version is not None:
            args["version"] = str(version)
        return await run(request, "update_weights", args)

    @guarded
    async def abort_requests(request: Request) -> Response:
        body = await _json_body(request)
        _only(body, ("req_ids", "abort_all"), "/v1/abort_requests")
        abort_all = body.get("abort_all", False)
        req_ids = body.get("req_ids")
        if not isinstance(abort_all, bool):
            raise _BadCall("/v1/abort_requests: 'abort_all' must be true or false")
        if isinstance(req_ids, str):
            req_ids = [req_ids]
        if req_ids is not None and (not isinstance(req_ids, list) or not all(isinstance(i, str) for i in req_ids)):
            raise _BadCall("/v1/abort_requests: 'req_ids' must be a list of request ids")
        if not abort_all and not req_ids:
            raise _BadCall("/v1/abort_requests needs 'req_ids' (a non-empty list) or 'abort_all': true")
        if abort_all:
            owner = api_ids(client)
            result = await call(request, "abort_requests", {"abort_all": True})
            return success({"aborted": _group(result.get("aborted", []), owner), "not_found": []})
        asked = list(dict.fromkeys(req_ids or []))
        owner = {}
        for rid in asked:
            for eid in engine_ids_for(client, rid):
                owner.setdefault(eid, rid)
        result = await call(request, "abort_requests", {"req_ids": list(owner)})
        aborted = _group(result.get("aborted", []), owner)
        done = {a["request_id"] for a in aborted}
        return success({"aborted": aborted, "not_found": [r for r in asked if r not in done]})

    @guarded
    async def generic(request: Request) -> Response:
        method = request.path_params["method"]
        return await run(request, method, await _json_body(request))

    app.add_api_route("/v1/pause", pause, methods=["POST"])
    app.add_api_route("/v1/resume", resume, methods=["POST"])
    app.add_api_route("/v1/is_paused", is_paused, methods=["GET"])
    app.add_api_route("/v1/abort_requests", abort_requests, methods=["POST"])
    app.add_api_route("/v1/sleep", sleep, methods=["POST"])
    app.add_api_route("/v1/wakeup", wakeup, methods=["POST"])
    app.add_api_route("/v1/update_weights", update_weights, methods=["POST"])
    app.add_api_route("/v1/control/{method}", generic, methods=["POST"])


__all__ = ["add_control_routes", "api_ids", "engine_ids_for", "TIMEOUTS"]
