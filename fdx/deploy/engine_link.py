"""The API process's half of the engine IPC (:mod:`fdx.core.ipc`).

:class:`FrontendSide` binds both channels of one engine.  Inputs go out on
an asyncio ZMQ PUSH socket.  Outputs arrive on the output channel's unix
socket, read by the event loop itself (:meth:`FrontendSide.start_reader`):
each engine connection is an :class:`asyncio.Protocol` whose reads are cut
into frames and decoded in the callback, so no thread, future or task is
woken per message (the engine sends one
:class:`~fdx.core.messages.OutputBatch` per step, carrying every request's
deltas).  :class:`Liveness` tracks the engine's heartbeats and pid.
"""

from __future__ import annotations

import asyncio
import logging
import os
import selectors
import socket
import time
from typing import Any, Callable, Iterator

import attrs
import zmq

from fdx.core.ipc import FRAME, IpcPaths, pid_alive, zmq_socket
from fdx.core.messages import Message, decode, encode

log = logging.getLogger("fdx.ipc")


def listen_output(paths: IpcPaths) -> socket.socket:
    """The front end's listening socket of the output channel (non-blocking).
    A socket file left by an earlier listener of this run directory (closed,
    or its process gone) is replaced, as ZMQ's ``ipc://`` bind does."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.unlink(paths.output_path)
    except FileNotFoundError:
        pass
    sock.bind(paths.output_path)
    sock.listen(64)
    sock.setblocking(False)
    return sock


class FrameReader:
    """Cuts one connection's byte stream into frames (the reader's half)."""

    __slots__ = ("buf",)

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> Iterator[bytes]:
        """The frames completed by ``data``, in order."""
        buf = self.buf
        if not buf:  # the usual read: whole frames, nothing held back
            n, end = len(data), 0
            while n - end >= 4:
                size = FRAME.unpack_from(data, end)[0]
                if n - end - 4 < size:
                    break
                yield data[end + 4:end + 4 + size]
                end += 4 + size
            if end < n:
                buf += data[end:]
            return
        buf += data
        while len(buf) >= 4:
            size = FRAME.unpack_from(buf, 0)[0]
            if len(buf) - 4 < size:
                return
            frame = bytes(buf[4:4 + size])
            del buf[:4 + size]
            yield frame


class OutputListener:
    """A blocking reader of the output channel, for tools and tests: it
    listens on ``paths.output_path`` and returns the next message of any
    connection."""

    def __init__(self, paths: IpcPaths) -> None:
        self.sock = listen_output(paths)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.sock, selectors.EVENT_READ, None)
        self.ready: list[bytes] = []

    def recv(self, timeout_s: float) -> Message | None:
        """The next message, or ``None`` after ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        while not self.ready:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            for key, _ in self.sel.select(left):
                if key.data is None:  # a new connection
                    conn, _ = self.sock.accept()
                    conn.setblocking(False)
                    self.sel.register(conn, selectors.EVENT_READ, FrameReader())
                    continue
                data = key.fileobj.recv(1 << 16)  # type: ignore[union-attr]
                if not data:
                    self.sel.unregister(key.fileobj)
                    key.fileobj.close()  # type: ignore[union-attr]
                    continue
                self.ready.extend(key.data.feed(data))
        return decode(self.ready.pop(0))

    def close(self) -> None:
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self.sel.close()


class _OutputConnection(asyncio.Protocol):
    """One engine connection of the output channel: its frames, decoded,
    go to the side's ``on_message`` in order."""

    def __init__(self, side: FrontendSide) -> None:
        self.side = side
        self.frames = FrameReader()
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.side._conns.add(transport)

    def data_received(self, data: bytes) -> None:
        deliver = self.side._deliver
        for frame in self.frames.feed(data):
            deliver(frame)

    def connection_lost(self, exc: Exception | None) -> None:
        # a partial frame left in the reader is dropped with it (the engine's
        # writer connects again, or the engine is gone)
        self.side._conns.discard(self.transport)  # type: ignore[arg-type]


class FrontendSide:
    """The front end's end: binds both channels."""

    def __init__(self, paths: IpcPaths) -> None:
        import zmq.asyncio

        self.paths = paths
        # bound at once: an engine may connect (and send) before the reader starts
        self.listener: socket.socket | None = listen_output(paths)
        self.ctx = zmq.asyncio.Context()
        try:
            self.inp = zmq_socket(self.ctx, zmq.PUSH)
            self.inp.bind(paths.input_addr)
        except BaseException:  # nothing left open: a leaked context's __del__ can block in term()
            self.ctx.destroy(linger=0)
            self.listener.close()
            raise
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.BaseTransport] = set()
        self._on_message: Callable[[Message], None] | None = None

    async def send(self, msg: Message) -> None:
        await self.inp.send(encode(msg))

    def send_nowait(self, msg: Message) -> Any:
        return self.send_bytes_nowait(encode(msg))

    def send_bytes_nowait(self, data: bytes) -> Any:
        """Queue already-encoded bytes; returns pyzmq's send future (which
        holds ``zmq.Again`` when no engine is connected)."""
        return self.inp.send(data, zmq.NOBLOCK)

    async def start_reader(self, on_message: Callable[[Message], None]) -> None:
        """Call ``on_message`` for every output message, from the running
        loop's reads of each engine connection (those made before this call
        included: they waited in the listen backlog)."""
        assert self.listener is not None, "the side is closed"
        self._on_message = on_message
        self._server = await asyncio.get_running_loop().create_unix_server(
            lambda: _OutputConnection(self), sock=self.listener)

    def _deliver(self, frame: bytes) -> None:
        on_message = self._on_message
        if on_message is None:  # the reader stopped
            return
        try:
            msg = decode(frame)
        except Exception:  # noqa: BLE001 - a garbled message must not stop the reader
            log.exception("cannot decode an engine message")
            return
        try:
            on_message(msg)
        except Exception:  # noqa: BLE001
            log.exception("error handling %s", type(msg).__name__)

    def stop_reader(self) -> None:
        """Deliver nothing more (the connections stay open until :meth:`close`)."""
        self._on_message = None

    def close(self, linger_ms: int = 0) -> None:
        """Close both channels; ``linger_ms``: how long a queued input may
        still take to leave."""
        self.stop_reader()
        if self._server is not None:
            self._server.close()  # closes the listening socket
            self._server = None
        elif self.listener is not None:
            self.listener.close()
        self.listener = None
        for t in list(self._conns):
            t.close()
        self._conns.clear()
        self.inp.close(linger_ms)
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
