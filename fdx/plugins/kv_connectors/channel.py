"""The ZMQ message channel both KV connectors share: one ROUTER socket an
instance listens on, one DEALER per peer it talks to, and peer liveness.

* **Addresses name peers.**  An instance binds its ROUTER at its address
  (``tcp://HOST:PORT``, or any ZMQ endpoint such as ``ipc:///path``) and
  every DEALER it opens carries that address as its routing id, so a
  received message says who sent it, and the reply goes to that address.
* **Frames.**  A message is one multipart message: ``MAGIC``, the encoded
  wire message, a small msgpack header (the connector's own: block count,
  store keys), then the KV frames.  Sends are non-blocking and zero-copy
  (``copy=False``: ZMQ's I/O thread sends from the caller's buffers);
  receives are zero-copy too (``zmq.Frame`` buffers).
* **Liveness.**  Each DEALER has a ZMQ monitor.  A peer whose connection
  drops (its process died: the kernel resets the TCP connection at once;
  or it stopped answering ZMTP heartbeats for ``heartbeat_timeout``), or
  that cannot be reached within ``connect_timeout`` of the first message
  to it, is *lost*: its DEALER is closed (whatever was queued to it is
  discarded) and :meth:`Channel.lost` reports it once.  Receiving a
  message from a peer opens a DEALER to it, so a peer that sends work is
  watched even before anything is sent back.

Threading: one thread (the engine's) uses the channel; ZMQ's I/O thread
moves the bytes.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("fdx.kv_connector")

MAGIC = b"FDXKV1"
_EVENTS = (zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
           | zmq.EVENT_CLOSED | zmq.EVENT_MONITOR_STOPPED)


class _Link:
    """The DEALER to one peer and what its monitor said."""

    def __init__(self, ctx: zmq.Context, me: str, peer: str, heartbeat_ms: int, timeout_ms: int) -> None:
        self.peer = peer
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, me.encode())
        self.sock.setsockopt(zmq.SNDHWM, 0)  # a handoff is never dropped by ZMQ; loss is detected instead
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_ms)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
        self.sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self.monitor = self.sock.get_monitor_socket(_EVENTS)
        self.sock.connect(peer)
        self.created = time.monotonic()
        self.connected = False
        self.broken = False

    def drain_events(self) -> None:
        while True:
            try:
                ev = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            e = ev["event"]
            if e in (zmq.EVENT_CONNECTED, zmq.EVENT_HANDSHAKE_SUCCEEDED):
                self.connected = True
            elif e in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED, zmq.EVENT_MONITOR_STOPPED) and self.connected:
                self.broken = True

    def close(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(0)
        self.sock.close(0)


class Channel:
    """See the module docstring."""

    def __init__(self, bind: str, *, advertise_host: str | None = None, connect_timeout: float = 5.0,
                 heartbeat_interval: float = 1.0, heartbeat_timeout: float = 5.0) -> None:
        self.ctx = zmq.Context.instance()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.RCVHWM, 0)
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted peer at the same address takes over
        self.router.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_interval * 1000))
        self.router.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_timeout * 1000))
        if bind.startswith("tcp://") and bind.endswith(":0"):
            host = bind[len("tcp://"):-2]
            port = self.router.bind_to_random_port(f"tcp://{host}")
            bound = f"tcp://{host}:{port}"
        else:
            self.router.bind(bind)
            bound = bind
        if advertise_host and bound.startswith("tcp://"):
            bound = f"tcp://{advertise_host}:{bound.rsplit(':', 1)[1]}"
        self.address = bound
        self.connect_timeout = connect_timeout
        self._hb = (int(heartbeat_interval * 1000), int(heartbeat_timeout * 1000))
        self._links: dict[str, _Link] = {}
        self._lost: list[str] = []
        self.messages_sent = 0
        self.messages_received = 0

    # ------------------------------------------------------------------
    def _link(self, peer: str) -> _Link:
        link = self._links.get(peer)
        if link is None:
            if not peer.startswith(("tcp://", "ipc://", "inproc://")):
                raise ConnectionError(f"not a KV connector address: {peer!r}")
            link = self._links[peer] = _Link(self.ctx, self.address, peer, *self._hb)
        return link

    def send(self, peer: str, msg: bytes, header: dict[str, Any], frames: Sequence[Any] = ()) -> None:
        """Queue one message to ``peer`` (never blocks).  Raises
        ``ConnectionError`` for a peer already known lost."""
        link = self._link(peer)
        link.drain_events()
        if link.broken:
            raise ConnectionError(f"KV connector peer {peer} is gone")
        parts = [MAGIC, msg, msgpack.packb(header), *frames]
        try:
            link.sock.send_multipart(parts, flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            raise ConnectionError(f"KV connector peer {peer}: {exc}") from None
        self.messages_sent += 1

    def recv(self) -> list[tuple[str, bytes, dict[str, Any], list[zmq.Frame]]]:
        """Every message waiting: ``(peer, msg, header, kv frames)``."""
        out = []
        while True:
            try:
                parts = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            if len(parts) < 4 or parts[1].bytes != MAGIC:
                log.warning("KV connector: dropping a malformed message (%d frames)", len(parts))
                continue
            peer = parts[0].bytes.decode(errors="replace")
            self.messages_received += 1
            try:
                self._link(peer)  # watch the sender from now on
            except ConnectionError:
                log.warning("KV connector: message from %r, which is not an address; dropped", peer)
                continue
            out.append((peer, parts[2].bytes, msgpack.unpackb(parts[3].bytes), parts[4:]))
        return out

    def readable(self) -> bool:
        return bool(self.router.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def lost(self) -> list[str]:
        """Peers lost since the last call (their links are closed)."""
        now = time.monotonic()
        for peer, link in list(self._links.items()):
            link.drain_events()
            if link.broken or (not link.connected and now - link.created > self.connect_timeout):
                why = "connection lost" if link.broken else f"unreachable for {self.connect_timeout:g} s"
                log.warning("KV connector peer %s: %s", peer, why)
                link.close()
                del self._links[peer]
                self._lost.append(peer)
        lost, self._lost = self._lost, []
        return lost

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()
        self.router.close(0)


def bind_address(config: Any) -> tuple[str, str | None]:
    """Where a connector listens: ``kv_connector_config["address"]`` (any
    ZMQ endpoint) or ``tcp://<--host>:<--kv-connector-port>``; and the host
    to announce instead of a wildcard bind (``advertise_host``)."""
    opts = config.kv_connector_config or {}
    addr = opts.get("address")
    host = config.host
    advertise = opts.get("advertise_host")
    if addr is None:
        addr = f"tcp://{host}:{int(config.kv_connector_port or 0)}"
        if advertise is None and host in ("0.0.0.0", "::", ""):
            import socket

            advertise = socket.gethostbyname(socket.gethostname())
    return str(addr), advertise


def channel_options(config: Any, extra: Sequence[str] = ()) -> dict[str, float]:
    """The channel's timing options from ``--kv-connector-config``; unknown
    keys are a one-line error naming the known ones."""
    from fdx.core.errors import ConfigError

    opts = dict(config.kv_connector_config or {})
    known = {"address", "advertise_host", "connect_timeout", "heartbeat_interval", "heartbeat_timeout", *extra}
    unknown = set(opts) - known
    if unknown:
        raise ConfigError(f"--kv-connector-config: unknown key(s) {', '.join(sorted(unknown))}; "
                          f"known: {', '.join(sorted(known))}")
    out: dict[str, float] = {}
    for k in ("connect_timeout", "heartbeat_interval", "heartbeat_timeout"):
        if k in opts:
            try:
                out[k] = float(opts[k])
            except (TypeError, ValueError):
                raise ConfigError(f"--kv-connector-config: {k} must be a number of seconds") from None
            if out[k] <= 0:
                raise ConfigError(f"--kv-connector-config: {k} must be > 0")
    return out
