"""The control plane through ``fdx router``: one call, every instance.

The router serves the instances' control routes (:mod:`fdx.server.control`:
``/v1/pause``, ``/v1/resume``, ``/v1/is_paused``, ``/v1/sleep``,
``/v1/wakeup``, ``/v1/update_weights``, ``/v1/abort_requests``,
``/v1/control/{method}`` and vLLM's aliases) and sends each call, method,
query string and body unchanged, to every prefill and decode instance that
is up, at once; each instance runs it on its own engine.

* The guard runs here first (:func:`fdx.server.control.check_guard`:
  cross-origin and DNS-rebinding refusals, the control key -- the
  instances' ``--control-api-key``, default ``--api-key``), and again on
  every instance, which gets the client's ``Authorization`` header.
* The reply lists every instance: ``result.instances`` is one entry per
  instance (``name`` such as ``prefill0``/``decode1``, ``url``, ``role``,
  ``status_code`` and its own ``reply``, or ``reason`` when it was down or
  did not answer).  Besides that, fdx's routes merge what the engines said
  (``is_paused``: all of them; ``sleeping``: any of them; ``aborted``: all).
* A partial failure is reported, never hidden: an instance answering an
  error makes the call answer that status (the first failing one, in
  instance order) with the OpenAI error envelope naming the instance, and
  the per-instance list beside it.  An instance that is down is not
  called and is listed under ``result.unavailable``; none up -> 503.
* A call that changes the control state (pause, resume, sleep, wakeup,
  update_weights) and succeeded on every instance that was up is the
  deployment's state from then on: an instance that comes (back) up is
  given it before it is routed to (:mod:`fdx.router.state`).
* vLLM's aliases answer as vLLM does when every instance succeeded
  (``{"status": "paused"}``, ``{"is_paused": bool}`` over all instances,
  ``{"is_sleeping": bool}`` over any, an empty 200).
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

import aiohttp
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from fdx.core.errors import RequestError
from fdx.server.control import CONTROL_PATHS, MAX_TIMEOUT, TIMEOUTS, VLLM_PATHS, check_body, check_guard
from fdx.server.protocol import error_body

if TYPE_CHECKING:
    from fdx.router.instances import Instance, InstancePool
    from fdx.router.state import ControlState

#: the GET routes among :data:`fdx.server.control.CONTROL_PATHS`
GET_PATHS = frozenset({"/v1/is_paused", "/is_paused", "/is_sleeping"})
#: request headers a control call passes on
_HEADERS = ("authorization", "content-type")


def instance_name(inst: Instance) -> str:
    """``prefill0``, ``decode1``: the instance's role and rank."""
    return f"{inst.role}{inst.rank}"


def _timeout(request: Request, method: str) -> float:
    """What the instances may take (their ``?timeout``, else the method's
    default), plus a margin for their reply to arrive."""
    try:
        t = float(request.query_params.get("timeout", ""))
    except ValueError:
        t = TIMEOUTS.get(method, 30.0)
    return min(max(t, 1.0), MAX_TIMEOUT) + 10.0


def _method(path: str) -> str:
    name = path.rsplit("/", 1)[-1]
    return {"wake_up": "wakeup", "is_sleeping": "is_paused"}.get(name, name)


async def _one(pool: InstancePool, inst: Instance, request: Request, body: bytes, timeout: float) -> dict[str, Any]:
    assert pool.session is not None
    entry: dict[str, Any] = {"name": instance_name(inst), "url": inst.url, "role": inst.role}
    headers = {k: v for k, v in request.headers.items() if k in _HEADERS}
    url = inst.url + request.url.path + (f"?{request.url.query}" if request.url.query else "")
    try:
        async with pool.session.request(request.method, url, data=body or None, headers=headers,
                                        timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            raw = await r.read()
            entry["status_code"] = r.status
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        pool.suspect(inst)
        entry["status_code"] = 504 if isinstance(exc, asyncio.TimeoutError) else 503
        entry["reason"] = " ".join(str(exc).split()) or type(exc).__name__
        return entry
    try:
        entry["reply"] = json.loads(raw) if raw.strip() else None
    except ValueError:
        entry["reply"] = raw.decode("utf-8", "replace")
    return entry


def _message(entry: dict[str, Any]) -> str:
    reply = entry.get("reply")
    err = reply.get("error") if isinstance(reply, dict) else None
    msg = err.get("message") if isinstance(err, dict) else entry.get("reason") or str(reply)
    return f"{entry['name']} ({entry['url']}): {msg}"


def merge(method: str, results: list[Any]) -> dict[str, Any]:
    """What fdx's routes report for the whole deployment, from every
    instance's ``result`` (the per-instance list goes beside it)."""
    out: dict[str, Any] = {}
    dicts = [r for r in results if isinstance(r, dict)]
    if any("is_paused" in r for r in dicts):
        out["is_paused"] = all(bool(r.get("is_paused")) for r in dicts)
    if any("sleeping" in r for r in dicts):
        out["sleeping"] = sorted({t for r in dicts for t in r.get("sleeping") or ()})
    if method == "pause":
        out["num_aborted"] = sum(int(r.get("num_aborted") or 0) for r in dicts)
    if method == "abort_requests":
        aborted = [a for r in dicts for a in r.get("aborted") or ()]
        done = {a.get("request_id") for a in aborted if isinstance(a, dict)}
        out["aborted"] = aborted
        out["not_found"] = sorted({i for r in dicts for i in r.get("not_found") or ()} - done)
    if method == "update_weights" and dicts:
        out.update({k: v for k, v in dicts[0].items() if all(d.get(k) == v for d in dicts)})
    return out


def _vllm_reply(path: str, entries: list[dict[str, Any]]) -> Response:
    replies = [e.get("reply") for e in entries]
    if path == "/is_paused":
        return JSONResponse({"is_paused": all(isinstance(r, dict) and r.get("is_paused") for r in replies)})
    if path == "/is_sleeping":
        return JSONResponse({"is_sleeping": any(isinstance(r, dict) and r.get("is_sleeping") for r in replies)})
    if replies and isinstance(replies[0], dict):
        return JSONResponse(replies[0])
    return Response(status_code=200)


def _arguments(request: Request, body: bytes) -> dict[str, Any]:
    """A call's arguments as the instances read them: the query string
    (``timeout`` aside) and the JSON body."""
    args: dict[str, Any] = {}
    for key in dict.fromkeys(request.query_params.keys()):
        if key != "timeout":
            values = request.query_params.getlist(key)
            args[key] = values[0] if len(values) == 1 else values
    try:
        data = json.loads(body) if body.strip() else {}
    except ValueError:
        data = {}
    return {**args, **(data if isinstance(data, dict) else {})}


def add_control_routes(app: FastAPI, pool: InstancePool, control_key: str | None,
                       state: ControlState | None = None) -> None:
    """The control routes of ``fdx router`` (see the module docstring);
    ``state`` records the stateful calls that succeeded everywhere
    (:mod:`fdx.router.state`)."""

    async def fan_out(request: Request) -> Response:
        path = request.url.path
        try:
            check_guard(request, control_key)
            body = await request.body()
            if request.method == "POST":
                check_body(request, body)
        except RequestError as exc:
            return JSONResponse({"status": "error", "result": None, "message": str(exc),
                                 **error_body(str(exc), exc.code, exc.param)}, status_code=exc.code)
        method = _method(path)
        if state is not None and state.stateful(method):
            async with state.lock:  # an instance coming up meanwhile gets the state recorded here
                return await call_all(request, path, method, body)
        return await call_all(request, path, method, body)

    async def call_all(request: Request, path: str, method: str, body: bytes) -> Response:
        up = [i for i in pool.instances if i.up]
        down = [{"name": instance_name(i), "url": i.url, "role": i.role, "reason": i.misconfigured or i.reason}
                for i in pool.instances if not i.up]
        if not up:
            msg = "no instance is up: " + "; ".join(f"{d['name']} {d['reason']}" for d in down)
            return JSONResponse({"status": "error", "result": {"instances": [], "unavailable": down},
                                 "message": msg, **error_body(msg, 503)}, status_code=503)
        timeout = _timeout(request, method)
        entries = list(await asyncio.gather(*(_one(pool, i, request, body, timeout) for i in up)))
        result: dict[str, Any] = {}
        failed = [e for e in entries if not 200 <= e["status_code"] < 300]
        if not failed and state is not None:  # every instance that was up did it: the deployment's state
            state.record(method, _arguments(request, body), merge(method, [
                e["reply"].get("result") for e in entries if isinstance(e.get("reply"), dict)]))
        if not failed and path in VLLM_PATHS:
            return _vllm_reply(path, entries)
        if not failed:
            result = merge(method, [e["reply"].get("result") for e in entries if isinstance(e.get("reply"), dict)])
        result["instances"] = entries
        if down:
            result["unavailable"] = down
        if not failed:
            return JSONResponse({"status": "success", "result": result})
        code = failed[0]["status_code"]
        msg = (f"{len(failed)} of {len(entries)} instances failed: " if len(entries) > 1 else "") + \
            "; ".join(_message(e) for e in failed)
        return JSONResponse({"status": "error", "result": result, "message": msg, **error_body(msg, code)},
                            status_code=code)

    for path in sorted(CONTROL_PATHS):
        app.add_api_route(path, fan_out, methods=["GET" if path in GET_PATHS else "POST"])
    app.add_api_route("/v1/control/{method}", fan_out, methods=["POST"])


__all__ = ["add_control_routes", "instance_name", "merge"]
