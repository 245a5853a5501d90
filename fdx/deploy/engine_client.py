"""The API process's connection to the engine process.

:class:`EngineClient` owns the bound :class:`~fdx.deploy.engine_link.FrontendSide`.
A reader on the event loop receives every engine message and routes each
:class:`RequestOutput` to the sink queue of its :class:`RequestHandle`;
a task watches :class:`~fdx.deploy.engine_link.Liveness`.  Invariants:

* every submitted handle receives exactly one terminal item on its sink: a
  ``RequestOutput`` with ``finish_reason`` set, or an exception
  (:class:`EngineUnavailable` when the engine dies or hangs); unless the
  caller ended it itself with :meth:`EngineClient.finish` /
  :meth:`EngineClient.abort`;
* each handle fires exactly one of the ``fdx_request_finished`` /
  ``fdx_request_aborted`` hooks (and ``fdx_request_first_token`` at most
  once), and is counted once in the metrics;
* while the engine is unavailable, new requests and control calls fail at
  once with 503.  Silence (no heartbeat for ``heartbeat_timeout``, pid alive)
  ends if the engine speaks again: the requests failed meanwhile are then
  aborted in the engine, so none keeps KV blocks.  Death (EngineFailed, pid
  gone) and a hang (no progress for ``step_timeout``: the engine is then
  killed here) end that engine for good; the launcher starts a new one,
  whose ``EngineReady`` (a new pid) makes this client serve again;
* every submission is either registered and sent, or raises with nothing
  left behind (an unencodable value is a 400 naming the field).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
import uuid
from typing import Any, Callable, Iterable

import attrs
import msgpack
import zmq

from fdx.config import EngineConfig
from fdx.core.errors import RequestError
from fdx.deploy.engine_link import FrontendSide, Liveness
from fdx.deploy.frontend import ControlCallError, EngineHealth, EngineUnavailable, RequestHandle, Sink
from fdx.core.ipc import IpcPaths, pid_alive
from fdx.core.messages import (
    AbortRequest,
    AddRequest,
    ControlReply,
    ControlRequest,
    EngineFailed,
    EngineReady,
    EngineStats,
    Heartbeat,
    KVTransferParams,
    Message,
    OutputBatch,
    RequestOutput,
    SamplingParams,
    Shutdown,
    encode,
)

log = logging.getLogger("fdx.server")



class EngineClient:
    """Submit requests and control calls to the engine; track its health.

    Construct in the API process (binds the sockets at once), then
    ``await start()`` inside the event loop.
    """

    def __init__(
        self,
        config: EngineConfig,
        paths: IpcPaths,
        hook: Any = None,
        metrics: Any = None,
        side: FrontendSide | None = None,
    ) -> None:
        self.config = config
        self.paths = paths
        self.side = side or FrontendSide(paths)
        self.hook = hook  # pluggy hook relay (plugins.hook) or None
        self.metrics = metrics
        self.liveness = Liveness(config.heartbeat_timeout, config.step_timeout)
        self.engine: EngineReady | None = None
        self.failed: str | None = None  # EngineFailed message / death reason
        self.stats = EngineStats()
        self.ready = asyncio.Event()
        self._live: dict[str, RequestHandle] = {}
        self._calls: dict[str, asyncio.Future[ControlReply]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self._hung_ids: list[str] | None = None  # set while a live engine is declared unresponsive
        self._crash_pid: int | None = None  # the engine whose crash was last counted
        #: new engines that became ready after a crash
        self.restarts = 0
        #: ``(reason, message)`` of the last crash: reason is ``crashed``
        #: (EngineFailed), ``exited`` (pid gone), ``hung`` (killed for
        #: --step-timeout) or ``start_failed`` (a restarted engine failed)
        self.last_crash: tuple[str, str] | None = None
        #: called once with the reason when the engine fails or dies
        self.on_failure: list[Callable[[str, bool], None]] = []
        self.on_ready: list[Callable[[EngineReady], None]] = []
        #: when set (dp replicas), called for each request that got no token
        #: yet when this engine dies or hangs: True if it was sent elsewhere
        #: (it is then no longer this client's), False to fail it here
        self.reroute: Callable[[RequestHandle], bool] | None = None

    # ------------------------------------------------------------------
    # life cycle
    # ------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        await self.side.start_reader(self._dispatch)
        self._tasks = [loop.create_task(self._watch_loop())]

    async def close(self, shutdown_engine: bool = True, reason: str = "server shutting down") -> None:
        """Fail what is pending, tell the engine to exit, close the sockets."""
        if self._closed:
            return
        self._closed = True
        self.side.stop_reader()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        self._fail_all(f"request aborted: {reason}")
        if shutdown_engine and self.failed is None:
            try:
                await asyncio.wait_for(self.side.send(Shutdown(reason)), 1.0)
            except Exception:  # noqa: BLE001 - engine gone; the launcher kills it
                pass
        # let the Shutdown message leave before closing (LINGER is 0 by default)
        self.side.close(linger_ms=500)

    @property
    def alive(self) -> bool:
        return self.engine is not None and self.failed is None

    def unavailable_reason(self) -> str | None:
        """``None`` when requests can be served, else why not."""
        if self.failed is not None:
            return f"engine unavailable: {self.failed}"
        if self.engine is None:
            return "engine is starting"
        return None

    @property
    def engine_pid(self) -> int | None:
        return self.engine.pid if self.engine else None

    def engines(self, name: str = "engine") -> list[EngineHealth]:
        e = self.engine
        state = "serving" if self.unavailable_reason() is None else ("unavailable" if self.failed else "starting")
        return [EngineHealth(name, e.pid if e else None, state, e.rank_pids if e else ())]

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len if self.engine else (self.config.max_model_len or 0)

    @property
    def weights_version(self) -> str:
        return self.stats.weights_version or (self.engine.weights_version if self.engine else "")

    @property
    def num_live(self) -> int:
        return len(self._live)

    def live_requests(self) -> dict[str, RequestHandle]:
        """A snapshot: engine request id -> handle of every unfinished
        request (``handle.tag`` is the caller's data, e.g. the choice)."""
        return dict(self._live)

    def num_waiting(self) -> int:
        """Requests waiting for their first output: the engine's queue plus
        what was sent since its last stats snapshot."""
        local = sum(1 for h in self._live.values() if h.first_token_time is None)
        return max(self.stats.num_waiting, local)

    # ------------------------------------------------------------------
    # requests
    # ------------------------------------------------------------------

    def check_available(self) -> None:
        reason = self.unavailable_reason()
        if reason is not None:
            raise EngineUnavailable(reason)

    def submit(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        params: SamplingParams,
        arrival: float,
        sink: Sink | None = None,
        tag: Any = None,
        kv_transfer_params: KVTransferParams | None = None,
        trace_context: str = "",
    ) -> RequestHandle:
        """Send one AddRequest; outputs arrive on ``handle.sink``."""
        self.check_available()
        if self._closed:
            raise EngineUnavailable("server shutting down")
        if request_id in self._live:
            raise RequestError(f"duplicate request id {request_id!r}", 400, param="request_id")
        ids = tuple(prompt_token_ids)
        msg = AddRequest(request_id, ids, params, arrival, kv_transfer_params, trace_context)
        try:
            data = encode(msg)
        except Exception:  # noqa: BLE001 - a value msgpack cannot carry (int >= 2**64, lone surrogate)
            raise wire_error(msg) from None
        h = RequestHandle(request_id, len(ids), params, arrival, sink if sink is not None else Sink(), tag,
                          prompt=ids, trace_context=trace_context)
        # registered only once the message is on its way: no failure path leaves a handle behind
        self._live[request_id] = h
        try:
            self._send_encoded(data, "AddRequest")
        except BaseException:
            self._live.pop(request_id, None)
            h.done = True
            raise
        self._call_hook("fdx_request_added", request_id=request_id, num_prompt_tokens=len(ids), params=params,
                        time=arrival)
        return h

    def adopt(self, h: RequestHandle) -> None:
        """Send ``h`` (a request another replica held, none of whose tokens
        reached the client) to this engine; it keeps its handle, sink and
        hooks (``fdx_request_added`` is not fired again).  Raises
        :class:`EngineUnavailable` when this engine cannot take it."""
        self.check_available()
        if self._closed or h.request_id in self._live:
            raise EngineUnavailable("cannot take the request here")
        data = encode(AddRequest(h.request_id, h.prompt, h.params, h.arrival, trace_context=h.trace_context))
        self._live[h.request_id] = h
        h.done = False
        try:
            self._send_encoded(data, "AddRequest")
        except BaseException:
            self._live.pop(h.request_id, None)
            h.done = True
            raise

    def finish(self, handle: RequestHandle, reason: str = "stop") -> None:
        """End a request from the front end as finished normally (a stop
        string matched): the engine is told to abort it and free its KV."""
        if handle.done:
            return
        self._end(handle)
        self._send(AbortRequest((handle.request_id,), "stop string"))
        self._record_finished(handle, reason)

    def abort(self, handles: Iterable[RequestHandle], reason: str = "client disconnected") -> None:
        """Abort unfinished requests (client gone, sibling failed)."""
        ids = []
        for h in handles:
            if h.done:
                continue
            self._end(h)
            ids.append(h.request_id)
            self._record_aborted(h, reason)
        if ids:
            self._send(AbortRequest(tuple(ids), reason))

    # ------------------------------------------------------------------
    # control plane
    # ------------------------------------------------------------------

    async def call(self, method: str, args: dict[str, Any] | None = None, timeout: float = 30.0) -> Any:
        """Run engine control method ``method``; returns its result.

        Raises :class:`EngineUnavailable` (503) when the engine is down or
        dies meanwhile, :class:`ControlCallError` with the engine's code
        (400/500) or 504 when no reply came within ``timeout`` seconds."""
        self.check_available()
        call_id = uuid.uuid4().hex
        try:
            data = encode(ControlRequest(call_id, method, dict(args or {})))
        except Exception:  # noqa: BLE001 - an int >= 2**64, a lone surrogate, an unknown type
            raise ControlCallError(f"the arguments of {method!r} cannot be sent to the engine: integers must fit "
                                   "in 64 bits and text must be valid UTF-8", 400) from None
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[ControlReply] = loop.create_future()
        deadline = loop.time() + timeout
        self._calls[call_id] = fut
        try:
            self._send_encoded(data, "ControlRequest")
            try:
                reply = await asyncio.wait_for(fut, timeout)
                # a busy event loop may run the reply's callback before the
                # expired timer: a reply seen after the deadline is still late
                if loop.time() > deadline:
                    raise asyncio.TimeoutError
            except asyncio.TimeoutError:
                raise ControlCallError(f"control call {method!r} timed out after {timeout:g}s", 504) from None
        finally:
            self._calls.pop(call_id, None)
        if reply.code != 200:
            raise ControlCallError(reply.error or f"control call {method!r} failed", reply.code)
        return reply.result

    # ------------------------------------------------------------------
    # internals
    # ------------------------------------------------------------------

    def _send(self, msg: Message) -> None:
        """Best effort (aborts, control calls): a message that cannot go is
        logged; the liveness watch deals with a dead engine."""
        if self.failed is not None or self._closed:
            return
        try:
            self._send_encoded(encode(msg), type(msg).__name__)
        except (EngineUnavailable, ValueError, OverflowError) as exc:
            log.error("cannot send %s to the engine: %s", type(msg).__name__, exc)

    def _send_encoded(self, data: bytes, what: str) -> None:
        """Queue ``data`` on the input socket; :class:`EngineUnavailable`
        if it cannot be queued now."""
        try:
            fut = self.side.send_bytes_nowait(data)
        except zmq.ZMQError as exc:
            raise EngineUnavailable(f"cannot reach the engine ({exc})") from None
        if isinstance(fut, asyncio.Future):
            if fut.done() and not fut.cancelled() and fut.exception() is not None:
                raise EngineUnavailable(f"cannot reach the engine ({fut.exception()})")
            fut.add_done_callback(_log_send_error)

    def _end(self, h: RequestHandle) -> None:
        h.done = True
        self._live.pop(h.request_id, None)

    def _dispatch(self, msg: Message) -> None:
        if isinstance(msg, Heartbeat) and msg.pid and (self.engine is None or msg.pid != self.engine.pid):
            return  # a dead engine's last beat, or a new one's before its EngineReady
        if self._hung_ids is not None and isinstance(msg, (OutputBatch, Heartbeat)):
            self._revive()
        if isinstance(msg, OutputBatch):
            self.liveness.beat(0.0)
            if msg.stats is not None:
                self.stats = msg.stats
            now = time.time()
            for out in msg.outputs:
                h = self._live.get(out.request_id)
                if h is not None:
                    self._route(h, out, now)
        elif isinstance(msg, Heartbeat):
            self.liveness.beat(msg.busy_s, msg.steps)
            self.stats = msg.stats
        elif isinstance(msg, ControlReply):
            fut = self._calls.get(msg.call_id)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, EngineReady):
            old = self.engine
            if old is not None and msg.pid != old.pid:
                self._new_engine(old, msg)
            self.engine = msg
            self.liveness.pid = msg.pid
            self.liveness.beat()
            if not self.stats.weights_version:
                self.stats = attrs.evolve(self.stats, weights_version=msg.weights_version,
                                          kv_blocks_total=msg.num_kv_blocks)
            log.info("engine ready (pid %d, %d KV blocks, max_model_len %d)", msg.pid, msg.num_kv_blocks,
                     msg.max_model_len)
            self.ready.set()
            for cb in self.on_ready:
                cb(msg)
        elif isinstance(msg, EngineFailed):
            log.error("engine failed: %s", msg.message)
            if msg.details:
                log.debug("%s", msg.details)
            if self.engine is not None:
                running = not msg.pid or msg.pid == self.engine.pid
                self._record_crash("crashed" if running else "start_failed", msg.message,
                                   self.engine.pid if running else None)
            self._hung_ids = None  # a crash is final
            message = self._restart_note(msg.message) if self.engine is not None else msg.message
            if self.failed is not None:
                self.failed = message
            self._mark_dead(message)

    def _route(self, h: RequestHandle, out: RequestOutput, now: float) -> None:
        if out.queue_time is not None:
            h.queue_time = out.queue_time
            if self.metrics is not None:
                self.metrics.queue.observe(out.queue_time)
        if out.new_token_ids:
            k = len(out.new_token_ids)
            if h.first_token_time is None:
                h.first_token_time = now
                ttft = now - h.arrival
                if self.metrics is not None:
                    self.metrics.ttft.observe(ttft)
                    if k > 1:
                        self.metrics.itl.observe(0.0)
                self._call_hook("fdx_request_first_token", request_id=h.request_id, ttft=ttft)
            elif self.metrics is not None and h.last_token_time is not None:
                self.metrics.itl.observe((now - h.last_token_time) / k)
            h.last_token_time = now
        h.num_output_tokens = max(h.num_output_tokens, out.num_output_tokens)
        h.num_cached_tokens = max(h.num_cached_tokens, out.num_cached_tokens)
        if out.finish_reason is not None:
            self._end(h)
            if out.finish_reason in ("stop", "length"):
                self._record_finished(h, out.finish_reason)
            else:
                self._record_aborted(h, out.error or out.finish_reason)
        h.sink.put_nowait((h, out))

    def _record_finished(self, h: RequestHandle, reason: str) -> None:
        e2e = time.time() - h.arrival
        if self.metrics is not None:
            self.metrics.finished(reason, h.num_prompt_tokens, h.num_output_tokens, e2e)
        self._call_hook("fdx_request_finished", request_id=h.request_id, finish_reason=reason,
                        num_prompt_tokens=h.num_prompt_tokens, num_output_tokens=h.num_output_tokens, e2e=e2e)

    def _record_aborted(self, h: RequestHandle, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.aborted(h.num_prompt_tokens, h.num_output_tokens)
        self._call_hook("fdx_request_aborted", request_id=h.request_id, reason=reason,
                        num_output_tokens=h.num_output_tokens)

    def _call_hook(self, name: str, **kwargs: Any) -> None:
        if self.hook is None:
            return
        try:
            getattr(self.hook, name)(**kwargs)
        except Exception:  # noqa: BLE001 - a plugin bug must not break serving
            log.exception("plugin hook %s failed", name)

    async def _watch_loop(self) -> None:
        period = min(0.25, self.config.heartbeat_interval)
        while True:
            await asyncio.sleep(period)
            try:
                self._watch_once()
            except Exception:  # noqa: BLE001 - the watch must go on
                log.exception("engine liveness check failed")

    def _watch_once(self) -> None:
        """Unresponsive -> fail what is pending (it may come back); pid gone
        -> a crash; no progress for --step-timeout -> kill it (a crash: the
        supervisor starts a new engine)."""
        if self.engine is None or self._closed:
            return
        pid = self.engine.pid
        if self.failed is None:
            reason = self.liveness.check()
            if reason is None:
                return
            alive = pid_alive(pid)
            log.error("engine is unavailable: %s", reason)
            if not alive:
                self._record_crash("exited", reason, pid)
                reason = self._restart_note(reason)
            self._mark_dead(reason, hung=alive)
        if self._hung_ids is None:
            return
        if not pid_alive(pid):  # died while unresponsive
            reason = f"engine process {pid} exited"
            self._hung_ids = None
            self.failed = self._restart_note(reason)
            self._record_crash("exited", reason, pid)
            return
        hung = self.liveness.hung()
        if hung is not None:
            log.error("engine %d is hung (%s): killing it", pid, hung)
            self._hung_ids = None
            self.failed = self._restart_note(hung)
            self._record_crash("hung", hung, pid)
            kill_engine(pid)

    def _restart_note(self, reason: str) -> str:
        if self.config.max_engine_restarts > 0:
            return f"{reason}; a new engine is starting"
        return reason

    def _record_crash(self, reason: str, message: str, pid: int | None) -> None:
        """Count one crash (once per engine pid) for /metrics."""
        if pid is not None and pid == self._crash_pid:
            return
        self._crash_pid = pid
        self.last_crash = (reason, message)
        fn = getattr(self.metrics, "engine_crashed", None)
        if fn is not None:
            fn(reason, message)

    def _new_engine(self, old: EngineReady, new: EngineReady) -> None:
        """A new engine process said EngineReady: forget the old one."""
        if self.failed is None:  # it died before the watch noticed
            reason = f"engine process {old.pid} exited"
            self._record_crash("exited", reason, old.pid)
            self._mark_dead(self._restart_note(reason))
        log.warning("a new engine (pid %d) is ready after: %s", new.pid, self.failed)
        self._hung_ids = None
        self.failed = None
        self.liveness = Liveness(self.config.heartbeat_timeout, self.config.step_timeout)
        self.stats = EngineStats()
        self.restarts += 1
        fn = getattr(self.metrics, "engine_restarted", None)
        if fn is not None:
            fn()

    def _mark_dead(self, reason: str, hung: bool = False) -> None:
        if self.failed is not None:
            return
        was_ready = self.engine is not None
        self.failed = reason
        if hung:  # it may come back: remember what to abort then
            self._hung_ids = list(self._live)
        if self.reroute is not None:
            for h in [h for h in self._live.values() if h.num_output_tokens == 0 and h.first_token_time is None]:
                self._live.pop(h.request_id, None)
                try:
                    moved = self.reroute(h)
                except Exception:  # noqa: BLE001
                    log.exception("re-routing request %s failed", h.request_id)
                    moved = False
                if not moved:
                    self._live[h.request_id] = h
        self._fail_all(f"engine unavailable: {reason}")
        for cb in self.on_failure:
            try:
                cb(reason, was_ready)
            except Exception:  # noqa: BLE001
                log.exception("failure callback failed")

    def fail_pending(self, message: str) -> None:
        """End every live request and control call with a 503 (server
        shutting down); the engine is told to abort them."""
        ids = tuple(self._live)
        self._fail_all(message)
        if ids:
            self._send(AbortRequest(ids, "server shutting down"))

    def _revive(self) -> None:
        """A hung (not dead) engine spoke again: serve again, and abort the
        requests that were failed while it hung so their KV is freed."""
        pid = self.liveness.pid
        if pid is None or not pid_alive(pid):
            return
        ids, self._hung_ids = tuple(self._hung_ids or ()), None
        log.warning("engine %d is responsive again after: %s", pid, self.failed)
        self.liveness.dead_reason = None
        self.liveness.beat()
        self.failed = None
        if ids:
            self._send(AbortRequest(ids, "engine was unresponsive"))

    def _fail_all(self, message: str) -> None:
        for h in list(self._live.values()):
            self._end(h)
            self._record_aborted(h, message)
            h.sink.put_nowait((h, EngineUnavailable(message)))
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineUnavailable(message))


def wire_error(msg: AddRequest) -> RequestError:
    """The 400 for an AddRequest that cannot be encoded, naming the field."""
    values: dict[str, Any] = {"request_id": msg.request_id, "prompt": msg.prompt_token_ids}
    values.update({f: getattr(msg.params, f) for f in attrs.fields_dict(SamplingParams)})
    for name, value in values.items():
        try:
            msgpack.packb(value)
        except OverflowError:
            return RequestError(f"'{name}' is out of range: integers must lie between -2**63 and 2**64-1", 400,
                                param=name)
        except (UnicodeError, ValueError, TypeError):
            return RequestError(f"'{name}' is not valid text: it contains a lone surrogate (not UTF-8)", 400,
                                param=name)
    return RequestError("the request holds a value that cannot be sent to the engine", 400)


def kill_engine(pid: int) -> bool:
    """SIGKILL ``pid`` if it still is an fdx engine process (not a reused
    pid); True if the signal was sent."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"fdx.core.engine_proc" not in f.read():
                return False
        os.kill(pid, signal.SIGKILL)
        return True
    except OSError:
        return False


def _log_send_error(fut: asyncio.Future[Any]) -> None:
    if fut.cancelled():
        return
    exc = fut.exception()
    if exc is not None:
        log.error("send to engine failed: %s", exc)
