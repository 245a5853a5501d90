"""One request through ``fdx router``: pick the instances, relay the bytes, end cleanly.

* :func:`plan_request` reads the client's JSON body once (``stream``,
  ``max_tokens``/``max_completion_tokens``, the prompt for affinity).  A
  request with ``max_tokens == 1`` goes to a P as an ordinary request;
  every other one goes to a D with ONE field added to the client's bytes,
  ``"kv_transfer_params": {"prefill_addr": P's kv_addr, "prefill_url": P's
  URL}`` (docs/SPLITWISE.md), spliced in before the closing brace, so the
  rest of the body reaches D byte for byte.  A body that is not a JSON
  object goes to a D unchanged (D answers the 400).
* :class:`RelayResponse` is a pure ASGI response: it opens the upstream
  request, then sends D's status, content type and body as they come.  A
  stream is relayed chunk by chunk as bytes, cut at event boundaries
  (``\\n\\n``) so a broken upstream never leaves half an event; no chunk is
  parsed, ``usage`` and every event reach the client unchanged.
* The client going away cancels the relay and closes the upstream
  connection (not returned to the pool), so D sees the disconnect and
  aborts the request (D tells P).
* Failures never hang: an instance that refuses the connection is marked
  down and the request goes to another one (nothing was sent yet); a
  connection lost before any answer sends it to the same instance once
  more (a pooled connection closed under us) while the probe looks; no
  instance up -> 503 envelope.  An instance marked down by the health probe
  cuts its flights: before D's headers a cut handoff is retried on another
  P, else it answers 503; a stream cut, or one whose upstream ended without
  ``data: [DONE]``, ends with one 503 error event and ``data: [DONE]``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import aiohttp
import anyio
import attrs
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from fdx.router.instances import Flight, Instance, InstancePool
from fdx.server.protocol import error_body

log = logging.getLogger("fdx.router")

DONE = b"data: [DONE]\n\n"
#: request headers passed on to the instances
FORWARD_HEADERS = (b"authorization", b"content-type", b"x-request-id", b"accept", b"traceparent", b"tracestate")
#: response headers passed back to the client
RETURN_HEADERS = ("content-type", "cache-control", "x-accel-buffering", "x-request-id", "retry-after")


@attrs.frozen
class RequestPlan:
    """What the router needs to know of one request (read once)."""

    path: str
    body: bytes
    is_object: bool
    stream: bool
    prefill_only: bool
    #: the prompt's bytes (or token ids) for P's prefix affinity
    key: Any
    #: the prompt's size in the affinity units (bytes, or token ids): P's load
    weight: int
    client_params: bool = False


def plan_request(path: str, raw: bytes) -> RequestPlan:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        body = None
    if not isinstance(body, dict):
        return RequestPlan(path, raw, False, False, False, b"", len(raw))
    if path.endswith("/chat/completions"):
        mt = body.get("max_completion_tokens", body.get("max_tokens"))
        key: Any = json.dumps(body.get("messages"), separators=(",", ":"), ensure_ascii=False,
                              default=str).encode("utf-8", "surrogatepass")
    else:
        mt = body.get("max_tokens")
        p = body.get("prompt")
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            key = p.encode("utf-8", "surrogatepass")
        elif isinstance(p, list) and all(isinstance(t, int) for t in p):
            key = p  # token ids: one per token already
        else:
            key = b""
    weight = len(key)  # in affinity units: bytes, or token ids
    return RequestPlan(path, raw, True, body.get("stream") is True, mt == 1 and not isinstance(mt, bool),
                       key, max(1, weight), "kv_transfer_params" in body)


def with_transfer_params(raw: bytes, prefill: Instance) -> bytes:
    """The client's body with ``kv_transfer_params`` added before its
    closing brace (everything else byte for byte)."""
    params = json.dumps({"kv_transfer_params": {"prefill_addr": prefill.kv_addr,
                                                "prefill_url": prefill.url}}).encode()[1:-1]
    end = raw.rstrip()
    assert end.endswith(b"}")
    head = end[:-1].rstrip()
    sep = b"" if head.endswith(b"{") else b","
    return head + sep + params + b"}"


class RouterError(Exception):
    def __init__(self, message: str, code: int = 503) -> None:
        super().__init__(message)
        self.code = code


class RelayResponse(Response):
    """An ASGI response relaying one request to the instance(s) picked for it."""

    def __init__(self, pool: InstancePool, plan: RequestPlan, headers: dict[str, str], metrics: Any,
                 span: Any = None) -> None:
        self.background = None
        #: the router's span of this request (``--otlp-traces-endpoint``), ended with the relay
        self.span = span
        self.error: str | None = None
        self.pool = pool
        self.plan = plan
        self.upstream_headers = headers
        self.metrics = metrics
        self.started = False  # response start sent to the client
        self.finished = False  # the last body message sent

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gone = False
        async with anyio.create_task_group() as tg:

            async def listen() -> None:
                nonlocal gone
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        break
                gone = not self.finished  # uvicorn says "disconnect" once a response is complete, too
                tg.cancel_scope.cancel()

            tg.start_soon(listen)
            try:
                await self._relay(send)
            except OSError:
                gone = True  # the client went away mid-send
            finally:
                tg.cancel_scope.cancel()
                if self.span is not None:
                    from fdx.tracing import end_span

                    end_span(self.span, "client disconnected" if gone else self.error)
        if gone and self.metrics is not None:
            self.metrics.disconnected.inc()

    # -- the relay -------------------------------------------------------------

    def _route(self, tried: set[Instance]) -> tuple[Flight, bytes]:
        plan, pool = self.plan, self.pool
        if plan.client_params:
            raise RouterError("kv_transfer_params is set by the router, not by the client", 400)
        if plan.prefill_only:
            got = pool.pick_prefill(plan.key, splitwise=False, exclude=tried)
            if got is None:
                raise RouterError(_none_up("prefill", pool, tried))
            self.metrics.routed(got[0], got[1].reason)
            if self.span is not None:
                self.span.set_attribute("fdx.router.prefill_url", got[0].url)
            return Flight(got[0], None, plan.weight), plan.body
        d = pool.pick_decode(exclude=tried)
        if d is None:
            raise RouterError(_none_up("decode", pool, tried))
        if not d.splitwise or not plan.is_object:
            self.metrics.routed(d, "whole")
            if self.span is not None:
                self.span.set_attribute("fdx.router.decode_url", d.url)
            return Flight(d, None, plan.weight), plan.body
        got = pool.pick_prefill(plan.key, splitwise=True, exclude=tried)
        if got is None:
            raise RouterError(_none_up("prefill", pool, tried, splitwise=True))
        p, choice = got
        self.metrics.routed(p, choice.reason)
        self.metrics.routed(d, "load")
        if self.span is not None:
            self.span.set_attributes({"fdx.router.prefill_url": p.url, "fdx.router.decode_url": d.url,
                                      "fdx.router.prefill_reason": choice.reason})
        if log.isEnabledFor(logging.DEBUG):
                log.debug("%s (prompt weight %d) -> P %s (%s, %d of it cached there) then D %s (%d in flight)",
                      plan.path, plan.weight, p.url, choice.reason, choice.matched_tokens, d.url, d.in_flight)
        return Flight(d, p, plan.weight), with_transfer_params(plan.body, p)

    async def _relay(self, send: Send) -> None:
        pool = self.pool
        tried: set[Instance] = set()
        lost_once: set[Instance] = set()
        last_failure: str | None = None
        for _attempt in range(2 * len(pool.instances) + 1):
            try:
                flight, body = self._route(tried)
            except RouterError as exc:
                msg = str(exc) if last_failure is None else f"{last_failure}; {exc}"
                await self._fail(send, msg, exc.code)
                return
            pool.begin(flight)
            try:
                resp = await self._open(flight, body)
                if resp is None:  # refused, lost or cut before any answer: try other instances
                    failed = flight.failed or flight.target
                    if flight.lost and failed not in lost_once:
                        lost_once.add(failed)  # a lost connection: that instance once more
                    else:
                        tried.add(failed)
                    last_failure = flight.failure
                    self.metrics.retries.inc()
                    continue
                try:
                    pool.handed_off(flight)
                    await self._pass(send, flight, resp)
                finally:
                    if self.finished:
                        resp.release()
                    else:
                        resp.close()  # unfinished: the instance sees the disconnect and aborts
                return
            finally:
                pool.end(flight)
        await self._fail(send, last_failure or "no instance could take the request", 503)

    async def _open(self, flight: Flight, body: bytes) -> aiohttp.ClientResponse | None:
        """The upstream response (its headers read), or ``None`` to try
        again elsewhere (``flight.failed`` names the instance that failed
        before anything reached the client); a failure that another
        instance would not fix raises :class:`RouterError`."""
        assert self.pool.session is not None
        inst = flight.target
        resp: aiohttp.ClientResponse | None = None
        with anyio.CancelScope() as cs:
            flight.scope = cs
            if flight.failure is not None:  # cut between begin and here
                cs.cancel()
            try:
                resp = await self.pool.session.post(inst.url + self.plan.path, data=body, headers=self.upstream_headers)
            except (aiohttp.ClientConnectorError, ConnectionRefusedError) as exc:
                self.pool.mark_down(inst, f"unreachable: {exc}")
                flight.failure, flight.failed = str(exc), inst
            except (aiohttp.ClientError, OSError) as exc:
                # connected, then lost before the headers (nothing reached the client): the instance
                # died with the request, or an idle pooled connection was closed under us; the
                # probe looks now, and the request may go to the same instance once more
                self.pool.suspect(inst)
                flight.lost = True
                flight.failure, flight.failed = (f"the {inst.role} instance {inst.url} failed before answering "
                                                 f"({type(exc).__name__})"), inst
            finally:
                flight.scope = None
        if cs.cancelled_caught:
            if resp is not None:
                resp.close()
                resp = None
            if flight.failure is None:
                raise anyio.get_cancelled_exc_class()()  # not ours (the client left)
        if resp is None:
            self.metrics.failure(flight.failed or inst, "before_answer")
        return resp

    async def _pass(self, send: Send, flight: Flight, resp: aiohttp.ClientResponse) -> None:
        headers = [(k.lower().encode(), v.encode()) for k, v in resp.headers.items() if k.lower() in RETURN_HEADERS]
        streaming = resp.status == 200 and resp.headers.get("content-type", "").startswith("text/event-stream")
        inst = flight.target
        if not streaming:
            with anyio.CancelScope() as cs:
                flight.scope = cs
                try:
                    data = await resp.read()
                except (aiohttp.ClientError, OSError) as exc:
                    self.pool.mark_down(inst, f"connection lost: {type(exc).__name__}")
                    data = None
                finally:
                    flight.scope = None
            if data is None or cs.cancelled_caught:
                if cs.cancelled_caught and flight.failure is None:
                    raise anyio.get_cancelled_exc_class()()
                self.metrics.failure(inst, "lost")
                await self._fail(send, flight.failure or f"the {inst.role} instance {inst.url} failed mid-answer", 503)
                return
            self.metrics.answered(inst, resp.status)
            self.started = True
            await send({"type": "http.response.start", "status": resp.status,
                        "headers": [*headers, (b"content-length", str(len(data)).encode())]})
            self.finished = True
            await send({"type": "http.response.body", "body": data, "more_body": False})
            return
        self.started = True
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        tail = b""
        done = False
        broken: str | None = None
        with anyio.CancelScope() as cs:
            flight.scope = cs
            try:
                async for chunk in resp.content.iter_any():
                    if tail:
                        chunk, tail = tail + chunk, b""
                    cut = chunk.rfind(b"\n\n") + 2
                    if cut == 1:
                        tail = chunk
                        continue
                    if cut < len(chunk):
                        chunk, tail = chunk[:cut], chunk[cut:]
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    done = chunk.endswith(DONE)
            except (aiohttp.ClientError, OSError) as exc:
                broken = f"{type(exc).__name__}"
            finally:
                flight.scope = None
        if cs.cancelled_caught and flight.failure is None:
            raise anyio.get_cancelled_exc_class()()
        if not done or tail.strip():
            why = flight.failure or f"the {inst.role} instance {inst.url} ended the stream early" + (
                f" ({broken})" if broken else "")
            if flight.failure is None:
                # our side is fine, the instance's is not: look at it now
                self.pool.suspect(inst)
            self.metrics.failure(inst, "stream")
            event = b"data: " + json.dumps(error_body(why, 503)).encode() + b"\n\n"
            await send({"type": "http.response.body", "body": event + DONE, "more_body": True})
        else:
            self.metrics.answered(inst, 200)
        self.finished = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _fail(self, send: Send, message: str, code: int) -> None:
        self.metrics.rejected(code)
        self.error = message
        if self.started:  # cannot happen today: failures after the start go through the stream
            return
        self.started = True
        body = json.dumps(error_body(message, code)).encode()
        await send({"type": "http.response.start", "status": code,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        self.finished = True
        await send({"type": "http.response.body", "body": body, "more_body": False})


def _none_up(role: str, pool: InstancePool, tried: set[Instance], splitwise: bool = False) -> str:
    insts = pool.prefill if role == "prefill" else pool.decode
    why = "; ".join(f"{i.url}: {'tried' if i in tried and i.up else (i.misconfigured or i.reason or 'down')}"
                    for i in insts)
    kind = "splitwise prefill" if splitwise else role
    return f"no {kind} instance is up ({why})"
