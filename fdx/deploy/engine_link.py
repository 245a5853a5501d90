"""The API process's half of the engine IPC (:mod:`fdx.core.ipc`).

:class:`FrontendSide` binds both channels of one engine.  Inputs go out on
an asyncio PUSH socket.  Outputs are read from a plain PULL socket by a
reader callback on the event loop (:meth:`FrontendSide.start_reader`): each
wake-up drains every message queued, so no future or task is woken per
message (the engine sends one :class:`~fdx.core.messages.OutputBatch` per
step, carrying every request's deltas).  :class:`Liveness` tracks the
engine's heartbeats and pid.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

import attrs
import msgpack
import zmq

from fdx.core.ipc import IpcPaths, pid_alive, zmq_socket
from fdx.core.messages import EngineStats, Message, OutputBatch, RequestOutput, decode, encode

log = logging.getLogger("fdx.ipc")


#: the RequestOutput fields :func:`decode_output` builds itself (scalars, and
#: ``new_token_ids``); an output with any other field set, or a change of the
#: fields, takes :func:`~fdx.core.messages.decode`
_PLAIN_OUTPUT = ("request_id", "new_token_ids", "finish_reason", "num_prompt_tokens", "num_cached_tokens",
                 "num_output_tokens", "error", "error_code", "queue_time")
_NESTED_OUTPUT = ("logprobs", "prompt_logprobs", "beams")
_FAST = ({f.name for f in attrs.fields(RequestOutput)} == {*_PLAIN_OUTPUT, *_NESTED_OUTPUT}
         and [f.name for f in attrs.fields(OutputBatch)] == ["outputs", "stats"])
_stats_converter = None


def decode_output(raw: bytes) -> Message:
    """:func:`~fdx.core.messages.decode`, with a short path for the
    message sent every step: an :class:`OutputBatch` of plain outputs (no
    logprobs, no beams) is built without the generic tagged-union and tuple
    structuring.  The result equals ``decode(raw)``."""
    global _stats_converter
    if not _FAST:
        return decode(raw)
    d = msgpack.unpackb(raw)
    if not isinstance(d, dict) or d.get("_t") != "OutputBatch":
        return decode(raw)
    outs = []
    for o in d["outputs"]:
        if len(o) != 12 or o["logprobs"] is not None or o["prompt_logprobs"] is not None or o["beams"] is not None:
            return decode(raw)
        outs.append(RequestOutput(o["request_id"], tuple(o["new_token_ids"]), o["finish_reason"],
                                  o["num_prompt_tokens"], o["num_cached_tokens"], o["num_output_tokens"], None,
                                  o["error"], o["error_code"], o["queue_time"]))
    stats = d.get("stats")
    if stats is not None:
        if _stats_converter is None:
            from cattrs.preconf.msgpack import make_converter

            _stats_converter = make_converter()
        stats = _stats_converter.structure(stats, EngineStats)
    return OutputBatch(tuple(outs), stats)


class FrontendSide:
    """The front end's end: binds both channels."""

    def __init__(self, paths: IpcPaths) -> None:
        import zmq.asyncio

        self.paths = paths
        self.ctx = zmq.asyncio.Context()
        self.inp = zmq_socket(self.ctx, zmq.PUSH)
        self.inp.bind(paths.input_addr)
        # a plain (not asyncio) socket: read by the loop reader of start_reader
        self.out = zmq.Socket(self.ctx, zmq.PULL)
        self.out.setsockopt(zmq.LINGER, 0)
        self.out.setsockopt(zmq.RCVHWM, 0)
        self.out.bind(paths.output_addr)
        self._loop: asyncio.AbstractEventLoop | None = None

    async def send(self, msg: Message) -> None:
        await self.inp.send(encode(msg))

    def send_nowait(self, msg: Message) -> Any:
        return self.send_bytes_nowait(encode(msg))

    def send_bytes_nowait(self, data: bytes) -> Any:
        """Queue already-encoded bytes; returns pyzmq's send future (which
        holds ``zmq.Again`` when no engine is connected)."""
        return self.inp.send(data, zmq.NOBLOCK)

    def start_reader(self, on_message: Callable[[Message], None]) -> Callable[[], None]:
        """Call ``on_message`` for every output message, from a reader on
        the running loop; returns the drain function (safe to call at any
        time: the watch loop calls it too, so a missed edge of ZMQ's
        edge-triggered descriptor cannot strand a message)."""
        sock = self.out
        getsockopt, recv = sock.getsockopt, sock.recv
        events, pollin, noblock = zmq.EVENTS, zmq.POLLIN, zmq.NOBLOCK

        def drain() -> None:
            while True:
                try:
                    # EVENTS first: no zmq.Again raised at the end of every drain
                    if not getsockopt(events) & pollin:
                        return
                    raw = recv(noblock)
                except zmq.Again:
                    return
                except zmq.ZMQError as exc:
                    if not sock.closed:
                        log.error("engine channel error: %s", exc)
                    return
                try:
                    msg = decode_output(raw)
                except Exception:  # noqa: BLE001 - a garbled message must not stop the reader
                    log.exception("cannot decode an engine message")
                    continue
                try:
                    on_message(msg)
                except Exception:  # noqa: BLE001
                    log.exception("error handling %s", type(msg).__name__)

        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(sock.FD, drain)
        drain()  # what arrived before the reader was set
        return drain

    def stop_reader(self) -> None:
        if self._loop is not None and not self.out.closed:
            self._loop.remove_reader(self.out.FD)
        self._loop = None

    def close(self) -> None:
        self.stop_reader()
        self.inp.close(0)
        self.out.close(0)
        self.ctx.term()


@attrs.define
class Liveness:
    """Tracks whether the engine is alive from its heartbeats and pid.

    Two bounds: no message for ``timeout`` seconds means *unresponsive*
    (requests fail with 503; it may still come back), and no progress for
    ``step_timeout`` seconds -- a step running that long per the heartbeat's
    ``busy_s``, or silence that long -- means *hung*: the front end kills
    it, and the supervisor starts a new one."""

    timeout: float
    step_timeout: float = 120.0
    pid: int | None = None
    last_seen: float = attrs.field(factory=time.monotonic)
    busy_s: float = 0.0  # the engine loop's busy time at ``last_seen``
    steps: int = 0
    dead_reason: str | None = None

    def beat(self, busy_s: float = 0.0, steps: int | None = None) -> None:
        self.last_seen = time.monotonic()
        self.busy_s = busy_s
        if steps is not None:
            self.steps = steps

    def stalled_s(self) -> float:
        """Seconds without progress: the step in progress at the last
        message plus the silence since."""
        return self.busy_s + (time.monotonic() - self.last_seen)

    def hung(self) -> str | None:
        """A reason when the engine made no progress for ``step_timeout``."""
        stalled = self.stalled_s()
        if stalled <= self.step_timeout:
            return None
        silent = time.monotonic() - self.last_seen
        if silent > self.timeout:
            return f"engine sent nothing for {silent:.0f}s (hung; --step-timeout {self.step_timeout:g}s)"
        return f"engine step has run for {stalled:.0f}s (hung; --step-timeout {self.step_timeout:g}s)"

    def check(self) -> str | None:
        """``None`` while alive, else a one-line reason (sticky)."""
        if self.dead_reason is not None:
            return self.dead_reason
        if self.pid is not None and not pid_alive(self.pid):
            self.dead_reason = f"engine process {self.pid} exited"
        elif time.monotonic() - self.last_seen > self.timeout:
            self.dead_reason = f"engine sent no heartbeat for {self.timeout:.1f}s (hung or dead)"
        else:
            self.dead_reason = self.hung()
        return self.dead_reason
