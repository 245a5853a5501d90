"""``--kv-connector mooncake``: the KV travels through a Mooncake store
(``mooncake.store.MooncakeDistributedStore`` over TCP against a real
``mooncake_master``, as FastDeploy and SGLang move KV between nodes); the
small messages travel on the same ZMQ :class:`~.channel.Channel` as the
``zmq`` connector.

A handoff: the sender copies the blocks' KV (one batched gather per layer,
:meth:`~fdx.core.interfaces.ModelRunner.read_kv_blocks`) into a staging
buffer registered with the store and writes them with ONE
``batch_put_from`` (zero-copy from that buffer), under keys unique to the
handoff, then sends the message naming the keys.  The objects go to the
sender's own segment first (``ReplicateConfig.preferred_segment``): the
master places an object in any segment it counts as mounted, and it
counts a segment whose process died as mounted until that client's
``--client_ttl`` (10 s) has passed, so a put placed there fails
(``-800``, the transfer to the dead process) -- which a prefill instance
restarted within those seconds would otherwise hit on about every other
block.  Blocks whose put still failed (the own segment was full, or the
instance contributes none, and the master chose a dead one) are put again
under fresh keys, up to ``PUT_ATTEMPTS`` times.  The receiver reads them
with ONE ``batch_get_into`` its own registered staging buffer (the blocks
whose lease expired during the get -- ``LEASE_EXPIRED``, a transfer slower
than the master's ``--default_kv_lease_ttl`` -- read again, up to
``GET_ATTEMPTS`` tries) and scatters
them into its pool from views of that buffer (no per-block copies), then
removes the keys (``batch_remove``, forced: the objects' lease is still
running).  A message whose KV is not loaded (the request was aborted
meanwhile) has its keys removed too.

``--kv-connector-config`` keys (defaults): ``master`` (``127.0.0.1:50051``,
or ``MOONCAKE_MASTER``), ``global_segment_size`` (``256M``: the memory
this instance contributes to the store; a handoff's objects live in some
instance's segment until the receiver removes them), ``local_buffer_size``
(``16M``), ``local_hostname`` (``127.0.0.1``), ``protocol`` (``tcp``),
``metadata_server`` (``P2PHANDSHAKE``), plus the channel's keys
(``address``, ``advertise_host``, ``connect_timeout``,
``heartbeat_interval``, ``heartbeat_timeout``).
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from fdx.core.errors import ConfigError
from fdx.core.hookspecs import hookimpl
from fdx.plugins.kv_connectors.zmq_direct import ZmqConnector

log = logging.getLogger("fdx.kv_connector")

if TYPE_CHECKING:
    from fdx.config import EngineConfig
    from fdx.core.hookspecs import Register
    from fdx.core.interfaces import ModelRunner

#: store option -> default
STORE_OPTIONS: dict[str, Any] = {
    "master": "127.0.0.1:50051",
    "global_segment_size": "256M",
    "local_buffer_size": "16M",
    "local_hostname": "127.0.0.1",
    "protocol": "tcp",
    "metadata_server": "P2PHANDSHAKE",
}
#: tries of a block's put (the first + retries of the blocks whose put failed, under fresh keys)
PUT_ATTEMPTS = 3
#: mooncake's ``LEASE_EXPIRED``: a get whose transfer ended after the object's lease
#: (the master's ``--default_kv_lease_ttl``, granted when the get looked the key up)
#: fails with it, since an object out of its lease may be evicted mid-read.  A
#: handoff's objects are removed only by their receiver, so reading them again
#: (a fresh lease) is safe; a loaded machine met it with a 0.5 s lease.
LEASE_EXPIRED = -707
#: tries of a block's get (the first + retries of the blocks whose lease expired)
GET_ATTEMPTS = 3


class _Staging:
    """A host buffer registered with the store, grown on demand."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.buf = np.empty(0, dtype=np.uint8)

    def reserve(self, nbytes: int) -> np.ndarray:
        if self.buf.size < nbytes:
            if self.buf.size:
                self.store.unregister_buffer(self.buf.ctypes.data)
            self.buf = np.empty(max(nbytes, 2 * self.buf.size), dtype=np.uint8)
            rc = self.store.register_buffer(self.buf.ctypes.data, self.buf.size)
            if rc != 0:
                self.buf = np.empty(0, dtype=np.uint8)
                raise RuntimeError(f"mooncake register_buffer of {nbytes} bytes failed (rc={rc})")
        return self.buf

    def close(self) -> None:
        if self.buf.size:
            try:
                self.store.unregister_buffer(self.buf.ctypes.data)
            except Exception:  # noqa: BLE001 - shutdown
                pass
            self.buf = np.empty(0, dtype=np.uint8)


class MooncakeConnector(ZmqConnector):
    name = "mooncake"

    def __init__(self, config: EngineConfig, runner: ModelRunner) -> None:
        from fdx.plugins.cache_backends.backend_options import size_option

        super().__init__(config, runner, extra_options=tuple(STORE_OPTIONS))
        opts = {k: (config.kv_connector_config or {}).get(k, v) for k, v in STORE_OPTIONS.items()}
        if "master" not in (config.kv_connector_config or {}) and os.environ.get("MOONCAKE_MASTER"):
            opts["master"] = os.environ["MOONCAKE_MASTER"]
        seg = size_option("mooncake", "global_segment_size", opts["global_segment_size"])
        buf = size_option("mooncake", "local_buffer_size", opts["local_buffer_size"])
        try:
            os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
            from mooncake.store import MooncakeDistributedStore
        except Exception as exc:  # noqa: BLE001 - ImportError or a missing shared library
            self.channel.close()
            raise ConfigError(f"--kv-connector mooncake needs mooncake-transfer-engine-non-cuda "
                              f"(pip install 'fdx[mooncake]') and libibverbs1: {exc}") from None
        host, _, port = str(opts["master"]).rpartition(":")
        try:  # the library retries an absent master for a minute and more: fail at once instead
            socket.create_connection((host, int(port)), timeout=2.0).close()
        except (OSError, ValueError) as exc:
            self.channel.close()
            raise ConfigError(f"--kv-connector mooncake: mooncake_master {opts['master']} is unreachable "
                              f"(setup failed): {exc}") from None
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(str(opts["local_hostname"]), str(opts["metadata_server"]), seg, buf,
                              str(opts["protocol"]), "", str(opts["master"]))
        if rc != 0:
            self.channel.close()
            raise ConfigError(f"--kv-connector mooncake: setup against mooncake_master {opts['master']} "
                              f"failed (rc={rc}); is it running?")
        self.master = str(opts["master"])
        from mooncake.store import ReplicateConfig

        # objects in this instance's own segment first, never in a stale one the master still counts (see the
        # module doc); the master falls back to the other segments when this one is full or absent
        self._put_config = ReplicateConfig()
        self._put_config.replica_num = 1
        if seg > 0:
            self._put_config.preferred_segment = self.store.get_hostname()
        self._out = _Staging(self.store)
        self._in = _Staging(self.store)
        self.store_calls = 0
        self.lease_retries = 0  # blocks read again after their lease expired mid-get

    def send(self, peer: str, msg: Any, block_ids: Sequence[int] = ()) -> int:
        from fdx.core.messages import encode

        if not block_ids:
            self.channel.send(peer, encode(msg), {"n": 0})
            return 0
        payloads = self.runner.read_kv_blocks(block_ids)
        size = len(payloads[0])
        buf = self._out.reserve(size * len(payloads))
        for i, p in enumerate(payloads):
            buf[i * size:(i + 1) * size] = np.frombuffer(p, dtype=np.uint8)
        keys = self._put(buf.ctypes.data, size, len(payloads))
        self.channel.send(peer, encode(msg), {"n": len(keys), "keys": keys, "size": size})
        n = size * len(keys)
        self.bytes_sent += n
        return n

    def recv(self) -> list[tuple[str, Any, Any]]:
        from fdx.core.messages import decode

        out = []
        for peer, raw, header, _frames in self.channel.recv():
            kv = (list(header["keys"]), int(header["size"])) if header.get("n") else None
            out.append((peer, decode(raw), kv))
        return out

    def load(self, kv: Any, block_ids: Sequence[int]) -> int:
        if kv is None:
            return 0
        keys, size = kv
        try:
            if not block_ids:
                return 0
            if len(block_ids) != len(keys):
                raise ValueError(f"{len(keys)} KV blocks received for {len(block_ids)} destination blocks")
            buf = self._in.reserve(size * len(keys))
            base = buf.ctypes.data
            self._get(keys, base, size)
            mv = memoryview(buf)
            self.runner.write_kv_blocks(list(block_ids), [mv[i * size:(i + 1) * size] for i in range(len(keys))])
            n = size * len(keys)
            self.bytes_received += n
            return n
        finally:
            self._remove(keys)

    def _get(self, keys: list[str], base: int, size: int) -> None:
        """Read the blocks under ``keys`` into ``base + i * size`` (one
        ``batch_get_into``; the blocks whose lease expired meanwhile read
        again, up to ``GET_ATTEMPTS`` in all); any other failure raises."""
        todo = list(range(len(keys)))
        for attempt in range(1, GET_ATTEMPTS + 1):
            rcs = self.store.batch_get_into([keys[i] for i in todo], [base + i * size for i in todo],
                                            [size] * len(todo))
            self.store_calls += 1
            failed = [(i, r) for i, r in zip(todo, rcs) if r != size]
            if not failed:
                return
            errors = sorted(set(r for _, r in failed))
            if errors != [LEASE_EXPIRED] or attempt == GET_ATTEMPTS:
                raise RuntimeError(f"mooncake batch_get_into of {len(keys)} KV blocks failed: {errors}"
                                   f" ({len(failed)} blocks, try {attempt})")
            todo = [i for i, _ in failed]
            self.lease_retries += len(todo)
            log.warning("mooncake: the lease of %d of %d KV blocks expired during their get; reading them again",
                        len(todo), len(keys))

    def _put(self, base: int, size: int, n: int) -> list[str]:
        """Put the ``n`` blocks of ``size`` bytes at ``base`` (one
        ``batch_put_from``; the blocks whose put failed again, under fresh
        keys, up to ``PUT_ATTEMPTS`` in all); their keys, in block order."""
        tag = uuid.uuid4().hex
        keys = [f"fdx_pd_{tag}_{i}" for i in range(n)]
        todo = list(range(n))
        errors: list[int] = []
        for attempt in range(1, PUT_ATTEMPTS + 1):
            if attempt > 1:
                for i in todo:
                    keys[i] = f"fdx_pd_{tag}_{i}_{attempt}"
            rcs = self.store.batch_put_from([keys[i] for i in todo], [base + i * size for i in todo],
                                            [size] * len(todo), self._put_config)
            self.store_calls += 1
            failed = [(i, r) for i, r in zip(todo, rcs) if r < 0]
            if not failed:
                return keys
            errors = sorted(set(r for _, r in failed))
            self._remove([keys[i] for i, _ in failed])  # a failed put leaves nothing, normally: be sure
            todo = [i for i, _ in failed]
            if attempt < PUT_ATTEMPTS:
                log.warning("mooncake: the put of %d of %d KV blocks failed (%s); putting them again",
                            len(todo), n, errors)
        failed_ids = set(todo)
        self._remove([keys[i] for i in range(n) if i not in failed_ids])  # the ones that were put
        raise RuntimeError(f"mooncake batch_put_from of {n} KV blocks failed ({len(todo)} still after "
                           f"{PUT_ATTEMPTS} attempts): {errors}")

    def _remove(self, keys: list[str]) -> None:
        try:
            self.store.batch_remove(keys, True)
            self.store_calls += 1
        except Exception:  # noqa: BLE001 - the objects expire with the master's eviction anyway
            pass

    def stats(self) -> dict[str, float]:
        return {**super().stats(), "store_calls": self.store_calls, "lease_retries": self.lease_retries}

    def close(self) -> None:
        super().close()
        self._out.close()
        self._in.close()
        try:
            self.store.close()
        except Exception:  # noqa: BLE001 - shutdown
            pass


@hookimpl
def fdx_register_kv_connectors(register: Register) -> None:
    register("mooncake", lambda config, runner: MooncakeConnector(config, runner),
             description="KV through a Mooncake store (mooncake_master, TCP), batched zero-copy put/get")
