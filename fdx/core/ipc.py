"""ZMQ transport between the front end and the engine process.

Two one-way PUSH/PULL channels, bound by the front end under a per-run
directory (``ipc://`` sockets), so two servers on one machine never collide:

* ``in``:  front end PUSH (bind) -> engine PULL (connect): AddRequest,
  AbortRequest, ControlRequest, Shutdown.
* ``out``: engine PUSH (connect) -> front end PULL (bind): OutputBatch,
  ControlReply, Heartbeat, EngineReady, EngineFailed.

A dead peer is detected by the heartbeat (see :class:`Liveness`), never by
waiting forever on a socket.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any

import attrs
import zmq

from fdx.core.messages import Message, decode, encode


@attrs.frozen
class IpcPaths:
    dir: str

    @property
    def input_addr(self) -> str:
        return f"ipc://{self.dir}/in.sock"

    @property
    def output_addr(self) -> str:
        return f"ipc://{self.dir}/out.sock"

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def make_run_dir(base: str | None = None) -> IpcPaths:
    """Create a private per-run directory for the sockets."""
    base = base or os.environ.get("FDX_RUN_DIR") or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    return IpcPaths(tempfile.mkdtemp(prefix=f"fdx-{os.getpid()}-", dir=base))


def _socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    if kind == zmq.PUSH:
        s.setsockopt(zmq.SNDHWM, 0)
    else:
        s.setsockopt(zmq.RCVHWM, 0)
    return s


class EngineSide:
    """The engine's end: receive inputs, send outputs (blocking sockets)."""

    def __init__(self, paths: IpcPaths) -> None:
        self.ctx = zmq.Context()
        self.inp = _socket(self.ctx, zmq.PULL)
        self.inp.connect(paths.input_addr)
        self.out = _socket(self.ctx, zmq.PUSH)
        self.out.connect(paths.output_addr)
        self.poller = zmq.Poller()
        self.poller.register(self.inp, zmq.POLLIN)

    def poll(self, timeout_ms: float) -> bool:
        return bool(self.poller.poll(timeout_ms))

    def recv_nowait(self) -> Message | None:
        try:
            return decode(self.inp.recv(zmq.NOBLOCK))
        except zmq.Again:
            return None

    def send(self, msg: Message) -> None:
        self.out.send(encode(msg))

    def close(self) -> None:
        self.inp.close(0)
        self.out.close(0)
        self.ctx.term()


class FrontendSide:
    """The front end's end (asyncio sockets): binds both channels."""

    def __init__(self, paths: IpcPaths) -> None:
        import zmq.asyncio

        self.paths = paths
        self.ctx = zmq.asyncio.Context()
        self.inp = _socket(self.ctx, zmq.PUSH)
        self.inp.bind(paths.input_addr)
        self.out = _socket(self.ctx, zmq.PULL)
        self.out.bind(paths.output_addr)

    async def send(self, msg: Message) -> None:
        await self.inp.send(encode(msg))

    def send_nowait(self, msg: Message) -> None:
        self.inp.send(encode(msg), zmq.NOBLOCK)

    async def recv(self) -> Message:
        return decode(await self.out.recv())

    def close(self) -> None:
        self.inp.close(0)
        self.out.close(0)
        self.ctx.term()


@attrs.define
class Liveness:
    """Tracks whether the engine is alive from its heartbeats and pid."""

    timeout: float
    pid: int | None = None
    last_seen: float = attrs.field(factory=time.monotonic)
    dead_reason: str | None = None

    def beat(self) -> None:
        self.last_seen = time.monotonic()

    def check(self) -> str | None:
        """``None`` while alive, else a one-line reason (sticky)."""
        if self.dead_reason is not None:
            return self.dead_reason
        if self.pid is not None and not pid_alive(self.pid):
            self.dead_reason = f"engine process {self.pid} exited"
        elif time.monotonic() - self.last_seen > self.timeout:
            self.dead_reason = f"engine sent no heartbeat for {self.timeout:.1f}s (hung or dead)"
        return self.dead_reason


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


def describe(msg: Any) -> str:
    return type(msg).__name__
