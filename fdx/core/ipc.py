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
  end listens and reads every connection in its event loop
  (:mod:`fdx.deploy.engine_link`) with no thread of its own, and one
  ``sendall`` of the engine wakes it once (ZMQ's I/O thread and its
  hand-off to the loop cost the API process about 12 us a token).

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
from typing import Any

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
#: how long an engine waits for its input channel to connect
CONNECT_WAIT_MS = 10_000


class ChannelClosed(ConnectionError):
    """The front end closed the output channel (it is gone or shutting down)."""


class OutputWriter:
    """One engine thread's connection to the output channel, made at its
    first send.  ``send`` writes one frame with one ``sendall``; ``timeout``
    (seconds, ``None``: block) bounds it.  A send that fails or times out
    closes the connection (the front end drops a partial frame with it) and
    raises :class:`ChannelClosed`; the next send connects again."""

    def __init__(self, path: str, timeout: float | None = None) -> None:
        self.path, self.timeout = path, timeout
        self.sock: socket.socket | None = None

    def send(self, msg: Message) -> None:
        self.send_bytes(encode(msg))

    def send_bytes(self, data: bytes) -> None:
        try:
            if self.sock is None:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.settimeout(self.timeout)
                self.sock.connect(self.path)
            self.sock.sendall(FRAME.pack(len(data)) + data)
        except OSError as exc:
            self.close()
            raise ChannelClosed(f"the output channel {self.path} closed: {exc}") from None

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class EngineSide:
    """The engine's end: receive inputs (ZMQ), send outputs (the output
    channel, blocking: the engine loop waits while the front end is behind
    by a whole socket buffer)."""

    def __init__(self, paths: IpcPaths) -> None:
        self.ctx = zmq.Context()
        self.inp = zmq_socket(self.ctx, zmq.PULL)
        # connected before the first output: a front end that saw EngineReady can send at once (ZMQ
        # connects in the background; the output channel, which is not ZMQ, would not wait for it)
        mon = self.inp.get_monitor_socket(zmq.EVENT_CONNECTED)
        self.inp.connect(paths.input_addr)
        mon.poll(CONNECT_WAIT_MS)
        self.inp.disable_monitor()
        mon.close(0)
        self.out = OutputWriter(paths.output_path)
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

