"""``--kv-connector zmq``: KV straight from instance to instance over ZMQ
(TCP, or any ZMQ endpoint such as ``ipc://``), no server in between.

A handoff is ONE multipart message on the :class:`~.channel.Channel`: the
wire message, a header, then one frame per KV block, each the block's
bytes as :meth:`~fdx.core.interfaces.ModelRunner.read_kv_blocks` copied
them out of the pool (one batched gather per layer), sent with
``copy=False``: the bytes go from that buffer to the socket without
another copy, and arrive as ``zmq.Frame`` buffers that
:meth:`~fdx.core.interfaces.ModelRunner.write_kv_blocks` scatters into the
receiver's pool (one batched scatter per layer).

``--kv-connector-config`` keys: ``address``, ``advertise_host``,
``connect_timeout``, ``heartbeat_interval``, ``heartbeat_timeout`` (see
:mod:`fdx.plugins.kv_connectors.channel`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import KVConnector
from fdx.core.messages import decode, encode
from fdx.plugins.kv_connectors.channel import Channel, bind_address, channel_options

if TYPE_CHECKING:
    from fdx.config import EngineConfig
    from fdx.core.hookspecs import Register
    from fdx.core.interfaces import ModelRunner


class ZmqConnector(KVConnector):
    name = "zmq"

    def __init__(self, config: EngineConfig, runner: ModelRunner, extra_options: Sequence[str] = ()) -> None:
        opts = channel_options(config, extra_options)
        bind, advertise = bind_address(config)
        self.runner = runner
        self.channel = Channel(bind, advertise_host=advertise, **opts)
        self.address = self.channel.address
        self.bytes_sent = 0
        self.bytes_received = 0

    def send(self, peer: str, msg: Any, block_ids: Sequence[int] = ()) -> int:
        payloads = self.runner.read_kv_blocks(block_ids) if block_ids else []
        n = sum(len(p) for p in payloads)
        self.channel.send(peer, encode(msg), {"n": len(payloads)}, payloads)
        self.bytes_sent += n
        return n

    def recv(self) -> list[tuple[str, Any, Any]]:
        out = []
        for peer, raw, header, frames in self.channel.recv():
            out.append((peer, decode(raw), frames if header.get("n") else None))
        return out

    def load(self, kv: Any, block_ids: Sequence[int]) -> int:
        if not block_ids or kv is None:
            return 0
        bufs = [f.buffer for f in kv]
        if len(block_ids) != len(bufs):
            raise ValueError(f"{len(bufs)} KV blocks received for {len(block_ids)} destination blocks")
        self.runner.write_kv_blocks(list(block_ids), bufs)
        n = sum(len(b) for b in bufs)
        self.bytes_received += n
        return n

    def lost_peers(self) -> list[str]:
        return self.channel.lost()

    def pollables(self) -> list[Any]:
        return [self.channel.router]

    def readable(self) -> bool:
        """Whether a message waits (cheap; the splitwise scheduler's has_work)."""
        return self.channel.readable()

    def stats(self) -> dict[str, float]:
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "messages_sent": self.channel.messages_sent, "messages_received": self.channel.messages_received}

    def close(self) -> None:
        self.channel.close()


@hookimpl
def fdx_register_kv_connectors(register: Register) -> None:
    register("zmq", lambda config, runner: ZmqConnector(config, runner),
             description="direct instance-to-instance KV over ZMQ (TCP or ipc), zero-copy multipart, no server")
