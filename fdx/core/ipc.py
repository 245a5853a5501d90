"""ZMQ transport between the front end and the engine process.

Two one-way PUSH/PULL channels, bound by the front end under a per-run
directory (``ipc://`` sockets), so two servers on one machine never collide:

* ``in``:  front end PUSH (bind) -> engine PULL (connect): AddRequest,
  AbortRequest, ControlRequest, Shutdown.
* ``out``: engine PUSH (connect) -> front end PULL (bind): OutputBatch,
  ControlReply, Heartbeat, EngineReady, EngineFailed.

The front end's half (its sockets and the engine's liveness) is
:mod:`fdx.deploy.engine_link`.  A dead peer is detected by the heartbeat,
never by waiting forever on a socket.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
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
    def output_addr(self) -> str:
        return f"ipc://{self.dir}/out.sock"

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


class EngineSide:
    """The engine's end: receive inputs, send outputs (blocking sockets)."""

    def __init__(self, paths: IpcPaths) -> None:
        self.ctx = zmq.Context()
        self.inp = zmq_socket(self.ctx, zmq.PULL)
        self.inp.connect(paths.input_addr)
        self.out = zmq_socket(self.ctx, zmq.PUSH)
        self.out.connect(paths.output_addr)
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
        self.out.send(encode(msg))

    def close(self) -> None:
        self.inp.close(0)
        self.out.close(0)
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
