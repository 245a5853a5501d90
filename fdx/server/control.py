"""HTTP routes of the control plane, and their guard.

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

Arguments come as a JSON body, in the query string, or both (a name given
in both is a 400); an argument a route does not take is a 400 naming it.
vLLM's dev-mode routes are served as aliases with vLLM's argument names and
replies (:data:`VLLM_PATHS`): ``POST /pause?mode=abort`` ->
``{"status": "paused"}``, ``POST /resume`` -> ``{"status": "resumed"}``,
``GET /is_paused`` -> ``{"is_paused": bool}``, ``POST /sleep?level=1|2``
and ``POST /wake_up?tags=weights`` (an empty 200), ``GET /is_sleeping`` ->
``{"is_sleeping": bool}``, ``POST /reset_prefix_cache`` (an empty 200).
Their errors are fdx's (the envelope below).

Every route sends one ``ControlRequest`` over the same IPC as requests
(:meth:`EngineClient.call`); the engine dispatches it to
``Engine._control_<method>`` by name.  Replies are
``{"status": "success", "result": ...}`` or, on failure,
``{"status": "error", "result": null, "message": ..., "error": {...}}``
(``error`` is the OpenAI envelope) with the HTTP status: 400 for an unknown
method, bad arguments or a refused call, 500 when the method failed (the
message says why), 503 when the engine is unavailable, 504 when no reply
came in time ("timed out after N s").  Every call waits at most its
method's timeout (:data:`TIMEOUTS`, or ``?timeout=SECONDS``).

The guard (:func:`check_guard`, run before any argument is read):

* a browser request from another origin is refused with 403: an
  ``Origin`` header that does not match ``Host``, or
  ``Sec-Fetch-Site: cross-site`` / ``same-site``;
* without a control key, a request whose ``Host`` is a DNS name rather
  than an IP address or ``localhost`` is refused with 403 (a DNS-rebinding
  page is same-origin with itself, but sends its own name as ``Host``);
* ``--control-api-key`` (default: ``--api-key``) must come as
  ``Authorization: Bearer <key>`` (401);
* a POST body, when there is one, must be JSON with ``Content-Type:
  application/json`` (415), and a form or ``text/plain`` content type is
  refused even empty (:func:`check_body`): those are what a browser can send
  across origins without a CORS preflight, which this server never grants.
  A POST with no body (``curl -X POST``) is fine;
* ``update_weights`` (directly or through ``/v1/control/update_weights``)
  only loads from inside an ``--allowed-weights-dir``
  (:func:`resolve_weights_path`; none by default: 403).

Request ids: users abort by the id the API returned (``cmpl-...`` /
``chatcmpl-...``); :mod:`fdx.deploy.request_ids` maps it to the engine
requests ``<id>-<choice index>`` of an ``n > 1`` (or several prompts)
request, and the reply groups them back under that id.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import math
import os
import re
from typing import Any, Awaitable, Callable, Sequence, Union
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr
from starlette.responses import JSONResponse, Response

from fdx.core.errors import RequestError
from fdx.deploy.request_ids import api_ids, engine_ids_for, group_aborted
from fdx.server.protocol import ErrorDetail, error_body, error_responses, loads_object, openapi_body

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
    "reset_prefix_cache": 30.0,
}
DEFAULT_TIMEOUT = 60.0
MIN_TIMEOUT = 1.0
MAX_TIMEOUT = 3600.0

#: the control routes (the ``--api-key`` middleware leaves them to :func:`check_guard`)
#: vLLM's dev-mode control routes (``VLLM_SERVER_DEV_MODE=1``), served as aliases
VLLM_PATHS = frozenset({"/pause", "/resume", "/is_paused", "/sleep", "/wake_up", "/is_sleeping",
                        "/reset_prefix_cache"})
CONTROL_PATHS = frozenset({"/v1/pause", "/v1/resume", "/v1/is_paused", "/v1/abort_requests", "/v1/sleep",
                           "/v1/wakeup", "/v1/update_weights"}) | VLLM_PATHS
CONTROL_PREFIX = "/v1/control/"
_METHOD_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")
_BYTES_REPR = re.compile(r"""\(?bad magic b(['"]).*?(?<!\\)\1\)?|\bb(['"]).*?(?<!\\)\2""")
_EXC_TYPE = re.compile(r"\b[A-Z][A-Za-z0-9_]*(?:Error|Exception|Warning|Interrupt|Exit): ")


def is_control_path(path: str) -> bool:
    return path in CONTROL_PATHS or path.startswith(CONTROL_PREFIX)


class _BadCall(RequestError):
    def __init__(self, message: str, code: int = 400, param: str | None = None) -> None:
        super().__init__(message, code, param=param)


def success(result: Any) -> JSONResponse:
    return JSONResponse({"status": "success", "result": result})


def failure(message: str, code: int, param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        {"status": "error", "result": None, "message": message, **error_body(message, code, param)},
        status_code=code, headers=headers,
    )


# --------------------------------------------------------------------------
# schemas (for /openapi.json; the routes parse their bodies strictly)
# --------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class EmptyControlBody(_Body):
    """No arguments (an empty body or ``{}``)."""


class TagsBody(_Body):
    tags: Union[StrictStr, list[StrictStr], None] = Field(
        None, description="'weight', 'kv_cache' or both (comma-separated or a list); default: both / all asleep")


class AbortRequestsBody(_Body):
    req_ids: Union[StrictStr, list[StrictStr], None] = Field(None, description="ids the API returned")
    abort_all: StrictBool = False


class UpdateWeightsBody(_Body):
    path: StrictStr = Field(description="a .gguf file or a Hugging Face folder inside an --allowed-weights-dir "
                            "(a relative path is taken inside the first one)")
    version: Union[StrictStr, int, None] = Field(None, description="recorded version (default: the path)")


class ControlArgs(BaseModel):
    """Keyword arguments of the engine control method."""

    model_config = ConfigDict(extra="allow")


class ControlSuccess(BaseModel):
    status: str = Field(description="'success'")
    result: Any = None


class ControlFailure(BaseModel):
    status: str = Field(description="'error'")
    result: None = None
    message: str
    error: ErrorDetail


def _responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    out: dict[int | str, dict[str, Any]] = {200: {"model": ControlSuccess, "description": "the method's result"}}
    for code, entry in error_responses(*codes).items():
        out[code] = {**entry, "model": ControlFailure}
    return out


# --------------------------------------------------------------------------
# the guard
# --------------------------------------------------------------------------


def _origin_matches(origin: str, host: str) -> bool:
    """Whether a browser's ``Origin`` names the host the request was sent to."""
    try:
        o = urlsplit(origin)
        h = urlsplit("//" + host)
        o_port = o.port or {"http": 80, "https": 443}.get(o.scheme)
        h_port = h.port or o_port
    except ValueError:
        return False
    if o.scheme not in ("http", "https") or not o.hostname or not h.hostname:
        return False
    return o.hostname.lower() == h.hostname.lower() and o_port == h_port


def _host_is_literal(host: str) -> bool:
    """Whether a ``Host`` header names an IP address or ``localhost``
    (what a DNS-rebinding page cannot send: it uses its own name)."""
    try:
        name = urlsplit("//" + host).hostname or ""
    except ValueError:
        return False
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def check_guard(request: Request, control_key: str | None) -> None:
    """Refuse a cross-origin browser request (403), without a control key
    a request addressed by a DNS name (403: DNS rebinding) and a missing or
    wrong control key (401).  The body's type is :func:`check_body`'s."""
    headers = request.headers
    origin = headers.get("origin")
    site = headers.get("sec-fetch-site", "").lower()
    if (origin is not None and not _origin_matches(origin, headers.get("host", ""))) or site in (
            "cross-site", "same-site"):
        raise _BadCall("cross-origin requests to the control plane are refused (Origin does not match Host)", 403)
    if not control_key and not _host_is_literal(headers.get("host", "")):
        raise _BadCall("without --control-api-key the control plane only answers requests addressed to an IP "
                       "address or localhost (Host header); set --control-api-key to reach it by name", 403)
    if control_key:
        auth = headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), control_key.encode()):
            msg = ("missing control API key (send 'Authorization: Bearer <key>' with the --control-api-key, "
                   "default --api-key)" if not auth else "invalid control API key")
            raise _BadCall(msg, 401)


#: content types a browser sends across origins without a CORS preflight
#: (forms, text/plain): refused even with an empty body
_SIMPLE_TYPES = frozenset({"application/x-www-form-urlencoded", "multipart/form-data", "text/plain"})


def check_body(request: Request, raw: bytes) -> None:
    """Refuse (415) a form or ``text/plain`` POST, empty or not, and a
    body with content that is not ``Content-Type: application/json``.  No
    body at all (``curl -X POST``, vLLM's query-string clients) is fine."""
    ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if ctype in _SIMPLE_TYPES:
        raise _BadCall(f"control requests take no {ctype} body: send JSON with 'Content-Type: application/json', "
                       "or no body (arguments may go in the query string)", 415)
    if raw.strip() and ctype != "application/json":
        raise _BadCall("a control request body must be JSON sent with 'Content-Type: application/json' "
                       "(or send no body; arguments may go in the query string)", 415)


def resolve_weights_path(path: str, allowed: Sequence[str]) -> str:
    """The real path of ``path`` if it lies inside one of the ``allowed``
    directories (symlinks resolved, no ``..`` escape; for a folder, every
    entry too), else a 403 that says nothing about the path itself.  A
    relative path is taken inside the first allowed directory."""
    if not allowed:
        raise _BadCall("update_weights is disabled: start fdx serve with --allowed-weights-dir DIR (repeatable) "
                       "to allow loading checkpoints from DIR", 403, param="path")
    outside = _BadCall("'path' is not inside any --allowed-weights-dir", 403, param="path")
    if "\x00" in path:
        raise outside
    roots = [os.path.realpath(d) for d in allowed]

    def inside(p: str) -> bool:
        return any(p == r or p.startswith(r.rstrip(os.sep) + os.sep) for r in roots)

    real = os.path.realpath(path if os.path.isabs(path) else os.path.join(roots[0], path))
    if not inside(real):
        raise outside
    if os.path.isdir(real):
        try:
            entries = os.listdir(real)
        except OSError:
            entries = []
        if any(not inside(os.path.realpath(os.path.join(real, e))) for e in entries):
            raise outside
    return real


def clean_message(message: str, replace: dict[str, str] | None = None) -> str:
    """An engine error fit for a client: no Python exception type names,
    no file bytes (``b'...'`` reprs), ``replace`` applied (real path ->
    the path the client sent)."""
    for old, new in (replace or {}).items():
        if old and old != new:
            message = message.replace(old, new)
    message = _BYTES_REPR.sub("", message)
    message = _EXC_TYPE.sub("", message)
    return re.sub(r"\s+([,;:)])", r"\1", re.sub(r"  +", " ", message)).strip()


# --------------------------------------------------------------------------
# argument parsing
# --------------------------------------------------------------------------


async def _arguments(request: Request, reads_body: bool) -> dict[str, Any]:
    """The call's arguments: the JSON body (if any) and the query string
    (``timeout`` aside; a repeated name is a list), merged.  A name given in
    both is a 400."""
    body: dict[str, Any] = {}
    if reads_body:
        raw = await request.body()
        check_body(request, raw)
        if raw.strip():
            body = loads_object(raw)
    query: dict[str, Any] = {}
    for key in dict.fromkeys(request.query_params.keys()):
        if key == "timeout":
            continue
        values = request.query_params.getlist(key)
        query[key] = values[0] if len(values) == 1 else values
    both = sorted(set(body) & set(query))
    if both:
        raise _BadCall(f"{request.url.path}: {', '.join(b[:64] for b in both)} given both in the query string and "
                       "in the body", param=both[0][:64])
    return {**body, **query}


def _flag(args: dict[str, Any], name: str, default: bool, route: str) -> bool:
    """A boolean argument: JSON ``true``/``false`` or, in a query string,
    ``true``/``false``/``1``/``0``."""
    v = args.get(name, default)
    if isinstance(v, str) and v.strip().lower() in ("true", "1", "false", "0"):
        v = v.strip().lower() in ("true", "1")
    if not isinstance(v, bool):
        raise _BadCall(f"{route}: '{name}' must be true or false", param=name)
    return v


def _timeout(request: Request, method: str) -> float:
    raw = request.query_params.get("timeout")
    if raw is None:
        return TIMEOUTS.get(method, DEFAULT_TIMEOUT)
    try:
        t = float(raw)
    except ValueError:
        raise _BadCall("'timeout' must be a number of seconds", param="timeout") from None
    if math.isnan(t) or not (MIN_TIMEOUT <= t <= MAX_TIMEOUT):
        raise _BadCall(f"'timeout' must be in [{MIN_TIMEOUT:g}, {MAX_TIMEOUT:g}] seconds", param="timeout")
    return t


def _only(args: dict[str, Any], allowed: tuple[str, ...], route: str) -> None:
    extra = sorted(set(args) - set(allowed))
    if extra:
        shown = ", ".join(repr(e)[1:-1][:64] for e in extra[:5])
        raise _BadCall(f"{route}: unknown argument(s) {shown}; allowed: {', '.join(allowed) or 'none'}",
                       param=extra[0][:64])


def _tags(args: dict[str, Any], route: str) -> dict[str, Any]:
    """``tags`` from the query (``?tags=weight,kv_cache``, or repeated) or a
    JSON body (a string or a list); vLLM's ``weights`` is fdx's ``weight``."""
    _only(args, ("tags",), route)
    tags = args.get("tags")
    if tags is None:
        return {}
    if isinstance(tags, str):
        tags = tags.split(",")
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise _BadCall(f"{route}: 'tags' must be a string like 'weight,kv_cache' or a list of strings", param="tags")
    return {"tags": ["weight" if t.strip() == "weights" else t.strip() for t in tags]}


def _choice(args: dict[str, Any], name: str, default: str, allowed: tuple[str, ...], route: str, why: str) -> str:
    """A string argument that fdx implements only some values of."""
    v = args.get(name, default)
    v = str(v) if isinstance(v, int) and not isinstance(v, bool) else v
    if v not in allowed:
        raise _BadCall(f"{route}: {name}={str(v)[:64]!r} is not supported ({why})", param=name)
    return v


# --------------------------------------------------------------------------
# schemas of vLLM's dev-mode replies
# --------------------------------------------------------------------------


class VllmStatus(BaseModel):
    status: str = Field(description="'paused' or 'resumed'")


class VllmIsPaused(BaseModel):
    is_paused: bool


class VllmIsSleeping(BaseModel):
    is_sleeping: bool


# --------------------------------------------------------------------------
# routes
# --------------------------------------------------------------------------


def add_control_routes(app: FastAPI, client: Any, config: Any = None) -> None:
    """Mount the control routes on ``app`` (called by ``create_app``).
    ``config`` gives the guard: ``control_api_key`` (default ``api_key``)
    and ``allowed_weights_dirs``."""
    control_key = (getattr(config, "control_api_key", None) or getattr(config, "api_key", None)) or None
    allowed: tuple[str, ...] = tuple(getattr(config, "allowed_weights_dirs", ()) or ())

    async def call(request: Request, method: str, args: dict[str, Any]) -> Any:
        return await client.call(method, args, timeout=_timeout(request, method))

    async def result(request: Request, method: str, args: dict[str, Any] | None = None) -> Any:
        """The method's result; a failure raises (the guard wrapper answers it)."""
        try:
            return await call(request, method, args or {})
        except RequestError as exc:
            log.warning("control %s failed (%d): %s", method, exc.code, exc)
            raise _BadCall(clean_message(str(exc)), exc.code, exc.param) from None

    async def run(request: Request, method: str, args: dict[str, Any] | None = None,
                  replace: dict[str, str] | None = None) -> Response:
        try:
            return success(await call(request, method, args or {}))
        except RequestError as exc:
            log.warning("control %s failed (%d): %s", method, exc.code, exc)
            return failure(clean_message(str(exc), replace), exc.code, exc.param)

    Handler = Callable[[Request, dict[str, Any]], Awaitable[Response]]

    def guarded(fn: Handler, *, reads_body: bool = True) -> Callable[[Request], Awaitable[Response]]:
        async def wrapper(request: Request) -> Response:
            try:
                check_guard(request, control_key)
                return await fn(request, await _arguments(request, reads_body))
            except RequestError as exc:
                headers = {"www-authenticate": "Bearer"} if exc.code == 401 else None
                return failure(str(exc), exc.code, exc.param, headers)
            except Exception:  # noqa: BLE001
                ref = os.urandom(4).hex()
                log.exception("control route %s failed (ref %s)", request.url.path, ref)
                return failure(f"internal server error (ref {ref}; the server log has the details)", 500)

        wrapper.__name__ = fn.__name__
        return wrapper

    async def pause(request: Request, args: dict[str, Any]) -> Response:
        _only(args, (), "/v1/pause")
        return await run(request, "pause")

    async def resume(request: Request, args: dict[str, Any]) -> Response:
        _only(args, (), "/v1/resume")
        return await run(request, "resume")

    async def is_paused(request: Request, args: dict[str, Any]) -> Response:
        _only(args, (), "/v1/is_paused")
        return await run(request, "is_paused")

    async def sleep(request: Request, args: dict[str, Any]) -> Response:
        return await run(request, "sleep", _tags(args, "/v1/sleep"))

    async def wakeup(request: Request, args: dict[str, Any]) -> Response:
        return await run(request, "wakeup", _tags(args, "/v1/wakeup"))

    async def reset_prefix_cache(request: Request, args: dict[str, Any]) -> Response:
        _only(args, (), "/v1/control/reset_prefix_cache")
        return await run(request, "reset_prefix_cache")

    async def update_weights(request: Request, args: dict[str, Any]) -> Response:
        _only(args, ("path", "version"), "/v1/update_weights")
        path = args.get("path")
        if not isinstance(path, str) or not path:
            raise _BadCall("/v1/update_weights needs 'path' (a .gguf file or a Hugging Face model folder)",
                           param="path")
        version = args.get("version")
        if version is not None and (isinstance(version, bool) or not isinstance(version, (str, int))):
            raise _BadCall("/v1/update_weights: 'version' must be a string", param="version")
        real = resolve_weights_path(path, allowed)
        call_args: dict[str, Any] = {"path": real, "version": path if version is None else str(version)}
        response = await run(request, "update_weights", call_args, replace={real: path})
        if response.status_code == 200:
            return success({"version": call_args["version"], "path": path})
        return response

    async def abort_requests(request: Request, args: dict[str, Any]) -> Response:
        _only(args, ("req_ids", "abort_all"), "/v1/abort_requests")
        abort_all = _flag(args, "abort_all", False, "/v1/abort_requests")
        req_ids = args.get("req_ids")
        if isinstance(req_ids, str):
            req_ids = [req_ids]
        if req_ids is not None and (not isinstance(req_ids, list) or not all(isinstance(i, str) for i in req_ids)):
            raise _BadCall("/v1/abort_requests: 'req_ids' must be a list of request ids", param="req_ids")
        if not abort_all and not req_ids:
            raise _BadCall("/v1/abort_requests needs 'req_ids' (a non-empty list) or 'abort_all': true",
                           param="req_ids")
        if abort_all:
            owner = api_ids(client)
            res = await call(request, "abort_requests", {"abort_all": True})
            return success({"aborted": group_aborted(res.get("aborted", []), owner), "not_found": []})
        asked = list(dict.fromkeys(req_ids or []))
        owner = {}
        for rid in asked:
            for eid in engine_ids_for(client, rid):
                owner.setdefault(eid, rid)
        res = await call(request, "abort_requests", {"req_ids": list(owner)})
        aborted = group_aborted(res.get("aborted", []), owner)
        done = {a["request_id"] for a in aborted}
        return success({"aborted": aborted, "not_found": [r for r in asked if r not in done]})

    named: dict[str, Handler] = {"pause": pause, "resume": resume, "is_paused": is_paused, "sleep": sleep,
                                 "wakeup": wakeup, "update_weights": update_weights,
                                 "abort_requests": abort_requests, "reset_prefix_cache": reset_prefix_cache}

    async def generic(request: Request, args: dict[str, Any]) -> Response:
        method = request.path_params["method"]
        if not _METHOD_NAME.fullmatch(method):
            raise _BadCall("unknown control method: a method name is lowercase letters, digits and '_'",
                           param="method")
        if method in named:  # same checks as the named route (update_weights' allowed dirs above all)
            return await named[method](request, args)
        return await run(request, method, args)

    # -- vLLM's dev-mode routes: its argument names and replies ------------

    async def vllm_pause(request: Request, args: dict[str, Any]) -> Response:
        _only(args, ("mode", "wait_for_inflight_requests", "clear_cache"), "/pause")
        _choice(args, "mode", "abort", ("abort",), "/pause", "fdx's pause aborts every in-flight request")
        if _flag(args, "wait_for_inflight_requests", False, "/pause"):
            raise _BadCall("/pause: wait_for_inflight_requests=true is not supported (fdx's pause aborts every "
                           "in-flight request)", param="wait_for_inflight_requests")
        if not _flag(args, "clear_cache", True, "/pause"):
            raise _BadCall("/pause: clear_cache=false is not supported (fdx's pause always resets the prefix cache)",
                           param="clear_cache")
        await result(request, "pause")
        return JSONResponse({"status": "paused"})

    async def vllm_resume(request: Request, args: dict[str, Any]) -> Response:
        _only(args, (), "/resume")
        await result(request, "resume")
        return JSONResponse({"status": "resumed"})

    async def vllm_is_paused(request: Request, args: dict[str, Any]) -> Response:
        _only(args, (), "/is_paused")
        return JSONResponse({"is_paused": bool((await result(request, "is_paused"))["is_paused"])})

    async def vllm_sleep(request: Request, args: dict[str, Any]) -> Response:
        _only(args, ("level", "mode"), "/sleep")
        _choice(args, "level", "1", ("1", "2"), "/sleep", "levels are 1 and 2; both free the weights and the KV "
                "cache, and wake_up reloads the weights from their checkpoint")
        _choice(args, "mode", "abort", ("abort",), "/sleep", "fdx's sleep aborts every in-flight request")
        await result(request, "sleep")
        return Response(status_code=200)

    async def vllm_wake_up(request: Request, args: dict[str, Any]) -> Response:
        await result(request, "wakeup", _tags(args, "/wake_up"))
        return Response(status_code=200)

    async def vllm_is_sleeping(request: Request, args: dict[str, Any]) -> Response:
        _only(args, (), "/is_sleeping")
        return JSONResponse({"is_sleeping": bool((await result(request, "is_paused"))["sleeping"])})

    async def vllm_reset_prefix_cache(request: Request, args: dict[str, Any]) -> Response:
        _only(args, ("reset_running_requests", "reset_external"), "/reset_prefix_cache")
        for name, why in (("reset_running_requests", "running requests keep their blocks"),
                          ("reset_external", "the KV storage tier (--cache-backend) is not reset")):
            if _flag(args, name, False, "/reset_prefix_cache"):
                raise _BadCall(f"/reset_prefix_cache: {name}=true is not supported ({why})", param=name)
        await result(request, "reset_prefix_cache")
        return Response(status_code=200)

    timeout_param = {"name": "timeout", "in": "query", "required": False,
                     "description": f"seconds to wait for the reply (default per method, at most {MAX_TIMEOUT:g})",
                     "schema": {"type": "number", "minimum": MIN_TIMEOUT, "maximum": MAX_TIMEOUT}}
    method_param = {"name": "method", "in": "path", "required": True, "description": "the control method",
                    "schema": {"type": "string", "pattern": "^[a-z][a-z0-9_]{0,63}$"}}

    def query(name: str, description: str, schema: dict[str, Any]) -> dict[str, Any]:
        return {"name": name, "in": "query", "required": False, "description": description, "schema": schema}

    tags_param = query("tags", "'weight', 'kv_cache' or 'weight,kv_cache' (vLLM's 'weights' = 'weight')",
                       {"type": "string"})
    params: dict[str, list[dict[str, Any]]] = {
        "/v1/sleep": [tags_param], "/v1/wakeup": [tags_param],
        "/v1/control/{method}": [method_param],
        "/pause": [query("mode", "'abort' (the only mode fdx implements)", {"type": "string", "enum": ["abort"]}),
                   query("wait_for_inflight_requests", "false only", {"type": "boolean", "enum": [False]}),
                   query("clear_cache", "true only", {"type": "boolean", "enum": [True]})],
        "/sleep": [query("level", "1 or 2 (both free weights and KV cache)", {"type": "integer", "enum": [1, 2]}),
                   query("mode", "'abort' only", {"type": "string", "enum": ["abort"]})],
        "/wake_up": [query("tags", "'weights' and/or 'kv_cache' (repeatable; default: everything asleep)",
                           {"type": "string"})],
        "/reset_prefix_cache": [query("reset_running_requests", "false only", {"type": "boolean", "enum": [False]}),
                                query("reset_external", "false only", {"type": "boolean", "enum": [False]})],
    }

    def route(path: str, fn: Handler, method: str, body: type[BaseModel] | None, codes: tuple[int, ...],
              summary: str, reply: type[BaseModel] | None | str = "control") -> None:
        extra: dict[str, Any] = openapi_body(body, required=False) if body is not None else {}
        extra["parameters"] = [timeout_param] + params.get(path, [])
        responses = _responses(*codes)
        if reply != "control":  # vLLM's replies: a JSON object, or an empty 200
            responses[200] = ({"model": reply, "description": "vLLM's reply"} if reply is not None else
                              {"description": "empty (vLLM's reply)", "content": {}})
        app.add_api_route(path, guarded(fn, reads_body=method == "POST"), methods=[method], summary=summary,
                          responses=responses, openapi_extra=extra, tags=["control"])

    common = (400, 401, 403, 413, 415, 503, 504)
    route("/v1/pause", pause, "POST", EmptyControlBody, common + (500,), "Pause: end every request, admit none")
    route("/v1/resume", resume, "POST", EmptyControlBody, common + (500,), "Resume serving")
    route("/v1/is_paused", is_paused, "GET", None, (400, 401, 403, 500, 503, 504),
          "Whether the engine is paused or asleep")
    route("/v1/abort_requests", abort_requests, "POST", AbortRequestsBody, common + (500,), "Abort requests by id")
    route("/v1/sleep", sleep, "POST", TagsBody, common + (500,), "Free weights and/or the KV cache")
    route("/v1/wakeup", wakeup, "POST", TagsBody, common + (500,), "Reload what sleep freed, then resume")
    route("/v1/update_weights", update_weights, "POST", UpdateWeightsBody, common + (500,),
          "Load a checkpoint from inside an --allowed-weights-dir (paused only)")
    route("/v1/control/{method}", generic, "POST", ControlArgs, common + (500,),
          "Any engine control method; the JSON body (or the query string) is its keyword arguments")
    gets = (400, 401, 403, 500, 503, 504)
    route("/pause", vllm_pause, "POST", None, common + (500,), "vLLM: pause (mode=abort)", VllmStatus)
    route("/resume", vllm_resume, "POST", None, common + (500,), "vLLM: resume", VllmStatus)
    route("/is_paused", vllm_is_paused, "GET", None, gets, "vLLM: whether the engine is paused", VllmIsPaused)
    route("/sleep", vllm_sleep, "POST", None, common + (500,), "vLLM: sleep (free weights and KV cache)", None)
    route("/wake_up", vllm_wake_up, "POST", None, common + (500,), "vLLM: wake up (tags=weights, kv_cache)", None)
    route("/is_sleeping", vllm_is_sleeping, "GET", None, gets, "vLLM: whether anything is asleep", VllmIsSleeping)
    route("/reset_prefix_cache", vllm_reset_prefix_cache, "POST", None, common + (500,),
          "vLLM: forget the prefix cache", None)


__all__ = ["add_control_routes", "check_body", "check_guard", "clean_message", "is_control_path",
           "resolve_weights_path", "TIMEOUTS", "VLLM_PATHS"]
