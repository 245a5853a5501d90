"""The one protocol between the HTTP server and the engines of a deployment.

``fdx/server`` (the OpenAI API: protocol, serving, SSE, metrics) talks to
whatever a deployment built -- one :class:`~fdx.deploy.engine_client.EngineClient`,
dp's replica set, the Redis global queue, a third party's pool -- only
through :class:`EngineFrontend`: submit, finish and abort requests, control
calls, health and stats.  It never imports a deployment.

Invariants every front end keeps (the single engine's client states them in
full, :mod:`fdx.deploy.engine_client`):

* every submitted :class:`RequestHandle` receives exactly one terminal item
  on its sink -- a ``RequestOutput`` with ``finish_reason`` set, or an
  exception (:class:`EngineUnavailable` when its engine dies or hangs) --
  unless the caller ended it with :meth:`EngineFrontend.finish` or
  :meth:`EngineFrontend.abort`;
* while no engine can take work, new requests and control calls fail at
  once with :class:`EngineUnavailable` (503);
* a control call acts on every engine of the deployment and reports each.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any, Callable, Iterable, Protocol

import attrs

from fdx.config import EngineConfig
from fdx.core.errors import RequestError
from fdx.core.messages import EngineReady, EngineStats, SamplingParams


class EngineUnavailable(RequestError):
    """The engine is starting, dead or hung (HTTP 503)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 503)


class ControlCallError(RequestError):
    """A control call failed: the engine's code (400/500), or 504 on timeout."""


class Sink:
    """Where a request's outputs go: ``(RequestHandle, RequestOutput |
    BaseException)`` items, put by the front end's reader, taken by the one
    task serving the HTTP request.  The part of :class:`asyncio.Queue` fdx
    uses (an ``asyncio.Queue`` works as one too), at less cost per item: a
    deque, and one future made only while the taker waits."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: collections.deque[Any] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    async def get(self) -> Any:
        while not self._items:
            w = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await w
            finally:
                if self._waiter is w:  # cancelled: no stale waiter left behind
                    self._waiter = None
        return self._items.popleft()

    def get_nowait(self) -> Any:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)


@attrs.define(eq=False)
class RequestHandle:
    """One engine request (one choice) as seen by the front end."""

    request_id: str
    num_prompt_tokens: int
    params: SamplingParams
    arrival: float  # time.time() at HTTP arrival
    sink: Sink
    tag: Any = None  # caller's data (e.g. the choice index)
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    done: bool = False
    prompt: tuple[int, ...] = ()  # the prompt's token ids (to send it again elsewhere: dp re-routing)
    queue_time: float | None = None  # the engine's arrival -> first scheduling (RequestOutput.queue_time)
    trace_context: str = ""  # AddRequest.trace_context (fdx.tracing)
    dp_rank: int | None = None  # the dp replica that holds it (set by ReplicaSet)


@attrs.frozen
class EngineHealth:
    """One engine process of the deployment, as ``/health`` lists it."""

    #: ``engine``, ``dp replica 1``, ...
    name: str
    pid: int | None
    #: ``serving``, ``starting`` or ``unavailable``
    state: str
    #: the pids of its tensor-parallel worker ranks
    rank_pids: tuple[int, ...] = ()


class EngineFrontend(Protocol):
    """What the API process holds: the deployment's engines behind one object."""

    #: ``fdx serve``'s config
    config: EngineConfig
    #: ``fdx.server.metrics.Metrics`` (set by the app before :meth:`start`)
    metrics: Any
    #: called with each engine's ``EngineReady``; and ``(reason, was_ready)`` on a failure
    on_ready: list[Callable[[EngineReady], None]]
    on_failure: list[Callable[[str, bool], None]]

    async def start(self) -> None:
        """Start receiving (in the API's event loop)."""

    async def close(self, shutdown_engine: bool = True, reason: str = "server shutting down") -> None:
        """Stop; ``shutdown_engine`` asks the engines to exit."""

    @property
    def alive(self) -> bool:
        """Whether some engine is serving."""

    @property
    def failed(self) -> str | None:
        """Why the deployment cannot serve for good (``None``: it can, or will)."""

    def unavailable_reason(self) -> str | None:
        """``None`` when requests are taken now, else why not (the 503's message)."""

    @property
    def engine(self) -> EngineReady | None:
        """The first serving engine's ready message (its pid, pool, max_model_len)."""

    @property
    def engine_pid(self) -> int | None: ...

    def engines(self) -> list[EngineHealth]:
        """Every engine process of the deployment (``/health``)."""

    @property
    def max_model_len(self) -> int: ...

    @property
    def weights_version(self) -> str: ...

    @property
    def stats(self) -> EngineStats:
        """The engines' latest stats, summed."""

    def num_waiting(self) -> int:
        """Requests submitted and not yet scheduled (the 429 check)."""

    def submit(self, request_id: str, prompt_token_ids: Iterable[int], params: SamplingParams, arrival: float,
               sink: Sink, tag: Any = None, **kw: Any) -> RequestHandle:
        """Send one engine request; its outputs arrive on ``sink``."""

    def finish(self, handle: RequestHandle, reason: str = "stop") -> None:
        """The caller is done with ``handle`` (e.g. a stop string matched)."""

    def abort(self, handles: Iterable[RequestHandle], reason: str = "client disconnected") -> None: ...

    def fail_pending(self, message: str) -> None:
        """End every open handle with :class:`EngineUnavailable` (shutdown)."""

    async def call(self, method: str, args: dict[str, Any] | None = None, timeout: float = 30.0) -> Any:
        """A control method on every engine (:mod:`fdx.engine_control`)."""
