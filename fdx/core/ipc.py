"""The transport between the front end and the engine process.

Two one-way channels under a per-run directory, both bound by the front
end, so two servers on one machine never collide:

* ``in``: ZMQ PUSH (front end, bind) -> PULL (engine, connect), an
  ``ipc://`` socket: AddRequest, AbortRequest, ControlRequest, Shutdown.
  The engine polls it with its scheduler's own sockets (one ``zmq.Poller``).
* ``out``: a unix stream socket, the front end listening: OutputBatch,
  ControlReply, Heartbeat, EngineReady, EngineFailed, each one frame (a
  little-endian uint32 length, then the :func:`~fdx.core.messages.encode`
  bytes).  Each engine thread that sends has its own connection
  (:class:`OutputWriter`: the loop's, the heartbeat thread's); the front
  end reads every connection in its event loop
  (:class:`~fdx.deploy.engine_link.FrontendSide`) with no thread of its
  own, and one ``sendall`` of the engine wakes it once (ZMQ's I/O thread
  and its hand-off to the loop cost the API process about 12 us a token).

A dead peer is detected by the heartbeat, never by waiting forever on a
socket.  A connection that failed mid-frame is closed: the reader drops
its partial frame, and the writer connects again for its next message.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import struct
import tempfile
import time
from typing import Any, Iterator

import attrs
import zmq

from fdx.core.messages import Message, decode, encode

log = logging.getLogger("fdx.ipc")


@attrs.frozen
class IpcPaths:
    dir: str

    @property
    def input_addr(self) -> str:
        return f"ipc://{self.dir}/in.sock"

    @property
    def output_path(self) -> str:
        """The output channel's unix socket (a path, not a ZMQ address)."""
        return os.path.join(self.dir, "out.sock")

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def make_run_dir(base: str | None = None) -> IpcPaths:
    """Create a private per-run directory for the sockets."""
    base = base or os.environ.get("FDX_RUN_DIR") or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    return IpcPaths(tempfile.mkdtemp(prefix=f"fdx-{os.getpid()}-", dir=base))


def write_config(fd: int, config_json: str) -> None:
    """Write the config to the child's end of an inherited pipe and close
    it (the config never travels in argv, where ``ps`` shows it).  A child
    that died before reading it is not an error here: its exit is seen."""
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(config_json.encode("utf-8"))
    except BrokenPipeError:
        pass


def read_config(fd: int) -> dict[str, Any]:
    """Read the config JSON a launcher wrote to inherited pipe ``fd``."""
    with os.fdopen(fd, "rb") as f:
        return json.loads(f.read().decode("utf-8"))


def child_args(argv: list[str]) -> tuple[dict[str, Any], str, int | None]:
    """Parse a child process's ``--config-fd FD RUN_DIR [PARENT_PID]``."""
    if len(argv) < 3 or argv[0] != "--config-fd":
        raise SystemExit("usage: --config-fd FD RUN_DIR [PARENT_PID]")
    return read_config(int(argv[1])), argv[2], int(argv[3]) if len(argv) > 3 else None


def zmq_socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    if kind == zmq.PUSH:
        s.setsockopt(zmq.SNDHWM, 0)
    else:
        s.setsockopt(zmq.RCVHWM, 0)
    return s


#: an output frame's header: the length of the message that follows
FRAME = struct.Struct("<I")
#: how long an engine waits for the front end's output socket to exist
CONNECT_TIMEOUT_S = 30.0


class ChannelClosed(ConnectionError):
    """The front end closed the output channel (it is gone or shutting down)."""


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


class OutputWriter:
    """One engine thread's connection to the output channel.

    ``send`` writes one frame with one ``sendall``.  ``timeout`` (seconds,
    ``None``: block) bounds a send; a send that fails or times out closes
    the connection (the front end drops a partial frame with it) and raises
    :class:`ChannelClosed`; the next send connects again."""

    def __init__(self, path: str, timeout: float | None = None) -> None:
        self.path = path
        self.timeout = timeout
        self.sock: socket.socket | None = None

    def connect(self, wait_s: float = CONNECT_TIMEOUT_S) -> None:
        """Connect now, waiting up to ``wait_s`` for the front end to listen."""
        deadline = time.monotonic() + wait_s
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.path)
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                sock.close()
                if time.monotonic() > deadline:
                    raise ChannelClosed(f"no front end listens on {self.path}: {exc}") from None
                time.sleep(0.01)
                continue
            sock.settimeout(self.timeout)
            self.sock = sock
            return

    def send(self, msg: Message) -> None:
        self.send_bytes(encode(msg))

    def send_bytes(self, data: bytes) -> None:
        if self.sock is None:
            self.connect(CONNECT_TIMEOUT_S if self.timeout is None else self.timeout)
        assert self.sock is not None
        try:
            self.sock.sendall(FRAME.pack(len(data)) + data)
        except OSError as exc:
            self.close()
            raise ChannelClosed(f"the output channel closed: {exc}") from None

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


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
        import selectors

        self.sock = listen_output(paths)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.sock, selectors.EVENT_READ, None)
        self.ready: list[bytes] = []

    def recv(self, timeout_s: float) -> Message | None:
        """The next message, or ``None`` after ``timeout_s`` seconds."""
        import selectors

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


class EngineSide:
    """The engine's end: receive inputs (ZMQ), send outputs (the output
    channel, blocking: the engine loop waits while the front end is behind
    by a whole socket buffer)."""

    def __init__(self, paths: IpcPaths) -> None:
        self.ctx = zmq.Context()
        self.inp = zmq_socket(self.ctx, zmq.PULL)
        self.inp.connect(paths.input_addr)
        self.out = OutputWriter(paths.output_path)
        self.out.connect()
        self.poller = zmq.Poller()
        self.poller.register(self.inp, zmq.POLLIN)

    def poll(self, timeout_ms: float) -> bool:
        return bool(self.poller.poll(timeout_ms))

    def recv_nowait(self) -> Message | None:
        """The next input message, or ``None``; one that cannot be decoded
        is logged and skipped (it must not end the engine)."""
        while True:
            try:
                raw = self.inp.recv(zmq.NOBLOCK)
            except zmq.Again:
                return None
            try:
                return decode(raw)
            except Exception as exc:  # noqa: BLE001
                log.error("dropping an input message that cannot be decoded (%d bytes): %s", len(raw), exc)

    def send(self, msg: Message) -> None:
        """Raises :class:`ChannelClosed` when the front end is gone."""
        self.out.send(msg)

    def close(self) -> None:
        self.inp.close(0)
        self.out.close()
        self.ctx.term()


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
