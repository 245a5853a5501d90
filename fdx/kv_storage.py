"""The KV storage tier: device prefix-cache blocks copied to and from a
:class:`~fdx.core.interfaces.CacheBackend` (memory, files, Redis, Mooncake).

The :class:`~fdx.core.kv_cache.KVCacheManager` calls three hooks (see its
module docstring): :meth:`KVStorage.load_prefix` after a device prefix match
stops short, :meth:`KVStorage.on_block_full` when a block becomes full,
computed and registered, and :meth:`KVStorage.on_block_evicted` just before a
cached block is reused.  The engine calls :meth:`KVStorage.flush` after every
step and :meth:`KVStorage.close` at shutdown.

Invariants:

* **Keys** are ``fdx_<fp>_<hash>``: ``<hash>`` is the block's prefix hash
  chain (``request.block_hashes``, stable across processes) and ``<fp>``
  a digest of ``runner.kv_fingerprint()`` (weights version, dtype, block
  size, layer/head geometry), so a block written by another model, version
  or layout is never looked up.
* **Payloads** carry a header (magic, format version, fingerprint digest,
  block hash, body length, CRC-32 of the body).  A payload whose header does
  not match the expected fingerprint and hash, or whose body is truncated or
  corrupt, is a miss (counted in ``rejected``) -- never loaded.
* **The engine loop never waits on a put**: on the engine thread a step's
  newly full blocks are copied out in one ``runner.read_kv_blocks`` call
  (they are immutable from then on) and handed to a writer thread through a
  queue bounded in bytes; when it is full the blocks are dropped (counted in
  ``put_dropped``), never waited for.  Loads are synchronous but batched: one
  ``exists_batch`` and one ``get_batch`` per admitted request.
* **Failures degrade to recompute**: any backend error is counted in
  ``errors``, logged once as a warning, and marks the backend down; while
  down nothing touches it from the engine thread (loads miss, new blocks are
  not queued) and the writer thread probes ``backend.health()`` every
  ``retry_interval`` seconds until it answers, then logs the recovery (a
  backend that fails again within a minute of recovering is retried with a
  doubling interval, up to ``max_retry_interval``, so a flapping store does
  not flood the log).  No request ever fails because of the storage tier.
* **Shutdown writes what is queued**: :meth:`close` (and, for an engine
  that is never closed, an ``atexit`` hook) drains the queue, bounded in
  time.
"""

from __future__ import annotations

import atexit
import collections
import hashlib
import logging
import os
import queue
import struct
import threading
import time
import weakref
import zlib
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from fdx.core.interfaces import CacheBackend, ModelRunner
    from fdx.core.kv_cache import KVCacheManager
    from fdx.core.request import Request

log = logging.getLogger("fdx.kv_storage")
#: debug switch: read every loaded block back from the device and log mismatches
_VERIFY = bool(os.environ.get("FDX_KV_STORAGE_VERIFY"))

MAGIC = b"FDXK"
FORMAT_VERSION = 1
#: magic, format version, flags, reserved, fingerprint digest, block hash, body length, crc32
HEADER = struct.Struct("<4sBBH16sQQI")
HASH_MASK = (1 << 64) - 1


def fingerprint_digest(fingerprint: str) -> bytes:
    """16-byte digest of a ``runner.kv_fingerprint()`` string."""
    return hashlib.blake2b(fingerprint.encode(), digest_size=16).digest()


def storage_key(fp_digest: bytes, block_hash: int) -> str:
    """The backend key of a block: only ``[0-9a-z_]`` (safe for every backend)."""
    return f"fdx_{fp_digest[:8].hex()}_{block_hash & HASH_MASK:016x}"


def pack(fp_digest: bytes, block_hash: int, body: bytes) -> bytes:
    """Header + body (the stored value)."""
    head = HEADER.pack(MAGIC, FORMAT_VERSION, 0, 0, fp_digest, block_hash & HASH_MASK, len(body), zlib.crc32(body))
    return head + body


def unpack(fp_digest: bytes, block_hash: int, payload: bytes | None) -> memoryview | None:
    """The body of ``payload`` (a zero-copy view) when it is a valid block
    for this fingerprint and hash, else ``None``."""
    if payload is None or len(payload) < HEADER.size:
        return None
    magic, ver, _flags, _res, fpd, h, length, crc = HEADER.unpack_from(payload)
    if magic != MAGIC or ver != FORMAT_VERSION or fpd != fp_digest or h != (block_hash & HASH_MASK):
        return None
    if len(payload) - HEADER.size != length:
        return None
    body = memoryview(payload)[HEADER.size :]
    if zlib.crc32(body) != crc:
        return None
    return body


class KVStorage:
    """Engine-side driver of one :class:`CacheBackend` (see module doc)."""

    def __init__(
        self,
        backend: CacheBackend,
        runner: ModelRunner,
        kv: KVCacheManager,
        *,
        max_queue_bytes: int = 256 << 20,
        put_batch_bytes: int = 32 << 20,
        retry_interval: float = 2.0,
        max_retry_interval: float = 60.0,
        max_unsaved: int = 65536,
    ) -> None:
        self.backend = backend
        self.runner = runner
        self.kv = kv
        self.block_size = kv.block_size
        self.max_queue_bytes = max_queue_bytes
        self.put_batch_bytes = put_batch_bytes
        self.retry_interval = retry_interval
        self.base_retry_interval = retry_interval
        self.max_retry_interval = max_retry_interval
        self._up_since = 0.0
        self._closed = False
        self.name = getattr(backend, "name", "") or type(backend).__name__
        self._fp_cache: tuple[str, str, bytes] | None = None  # (weights_version, fingerprint, digest)
        # engine-thread state
        self._pending: list[tuple[int, int]] = []  # (block_id, block_hash) full, not yet copied out
        self._pending_ids: set[int] = set()
        # shared with the writer thread
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[bytes, list[tuple[int, bytes]]] | None] = queue.Queue()
        self._queued_bytes = 0
        self._unsaved: collections.OrderedDict[int, None] = collections.OrderedDict()  # hashes whose put was lost
        self.max_unsaved = max_unsaved
        self._up = False  # set by the writer thread's first successful probe
        self._ever_up = False
        self._start_warned = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._c: dict[str, float] = collections.defaultdict(float)
        self._clock = threading.Lock()
        self._writer = threading.Thread(target=self._run, name=f"fdx-kv-storage-{self.name}", daemon=True)
        self._writer.start()
        atexit.register(_drain_at_exit, weakref.ref(self))

    def _inc(self, key: str, n: float = 1) -> None:
        with self._clock:
            self._c[key] += n

    # ------------------------------------------------------------------
    # identity
    # ------------------------------------------------------------------

    def _fingerprint(self) -> bytes:
        version = str(getattr(self.runner, "weights_version", ""))
        cached = self._fp_cache
        if cached is None or cached[0] != version:
            fp = self.runner.kv_fingerprint()
            cached = (version, fp, fingerprint_digest(fp))
            self._fp_cache = cached
        return cached[2]

    @property
    def is_up(self) -> bool:
        return self._up

    def wait_ready(self, timeout: float = 10.0) -> bool:
        """Block until the backend answered a probe (tests, benches)."""
        deadline = time.monotonic() + timeout
        while not self._up and time.monotonic() < deadline:
            time.sleep(0.01)
        return self._up

    # ------------------------------------------------------------------
    # hooks called by the KVCacheManager (engine thread)
    # ------------------------------------------------------------------

    def load_prefix(self, request: Request, num_matched_blocks: int, allocate: Callable[[int], list[int]]) -> int:
        """Load the longest run of stored blocks continuing the device match
        into freshly allocated device blocks; returns how many were filled.
        Never raises for backend trouble (returns 0: recompute)."""
        if not self._up:
            return 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        cands = list(request.block_hashes[num_matched_blocks:max_blocks])
        if not cands:
            return 0
        t0 = time.perf_counter()
        self._inc("lookups", 1)
        fpd = self._fingerprint()
        keys = [storage_key(fpd, h) for h in cands]
        try:
            present = self.backend.exists_batch(keys)
            n = 0
            while n < len(present) and present[n]:
                n += 1
            payloads = self.backend.get_batch(keys[:n]) if n else []
        except Exception as exc:  # noqa: BLE001 - degrade to recompute
            self._backend_failed("load", exc)
            return 0
        bodies: list[memoryview] = []
        for h, p in zip(cands, payloads):
            body = unpack(fpd, h, p)
            if body is None:
                if p is not None:
                    self._inc("rejected", 1)
                    log.warning("KV storage %s: rejected a corrupt or foreign block (hash %016x)", self.name, h & HASH_MASK)
                break
            bodies.append(body)
        if not bodies:
            self._inc("misses", 1)
            return 0
        ids = allocate(len(bodies))
        m = len(ids)
        if m == 0:
            return 0
        try:
            self.runner.write_kv_blocks(ids, bodies[:m])
        except Exception as exc:  # noqa: BLE001 - e.g. a payload of the wrong size
            self._inc("errors", 1)
            log.warning("KV storage %s: writing %d loaded blocks to the device failed (%s: %s); recomputing",
                        self.name, m, type(exc).__name__, exc)
            return 0
        if _VERIFY:
            back = self.runner.read_kv_blocks(ids)
            bad = [j for j in range(m) if bytes(back[j]) != bytes(bodies[j])]
            log.warning("KV storage verify: %d/%d blocks differ after write (ids %s..)", len(bad), m, ids[:3])
        self._inc("hit_blocks", m)
        self._inc("hits", m * self.block_size)
        self._inc("load_seconds", time.perf_counter() - t0)
        return m

    def on_block_full(self, block_id: int, block_hash: int) -> None:
        """A block became full, computed and registered: save it (copied out
        at the next :meth:`flush`, written by the writer thread)."""
        if not self._up:
            self._inc("put_skipped", 1)
            self._remember_unsaved(block_hash)
            return
        if block_id in self._pending_ids:  # re-registered before a flush: keep the newest
            self._flush_pending()
        self._pending.append((block_id, block_hash))
        self._pending_ids.add(block_id)
        if len(self._pending) >= 256:  # bound the work of one flush
            self._flush_pending()

    def on_block_evicted(self, block_id: int, block_hash: int) -> None:
        """A cached block is about to be reused: copy it out first if it was
        never saved (pending, or its earlier put was lost)."""
        if block_id in self._pending_ids:
            self._flush_pending()
            return
        if not self._up:
            return
        with self._lock:
            lost = self._unsaved.pop(block_hash, 0) is None
        if lost:
            self._copy_out([(block_id, block_hash)])

    # ------------------------------------------------------------------
    # engine-thread flush
    # ------------------------------------------------------------------

    def flush(self) -> None:
        """Copy out the blocks that became full this step (engine thread,
        called after every step)."""
        if self._pending:
            self._flush_pending()

    def _flush_pending(self) -> None:
        pending, self._pending = self._pending, []
        self._pending_ids.clear()
        # a block unregistered since (prefix-cache reset) may hold other KV now
        live = [(b, h) for b, h in pending if self.kv.block_hash[b] == h]
        if live:
            self._copy_out(live)

    def _copy_out(self, blocks: list[tuple[int, int]]) -> None:
        if not self._up:
            for _, h in blocks:
                self._remember_unsaved(h)
            self._inc("put_skipped", len(blocks))
            return
        try:
            bodies = self.runner.read_kv_blocks([b for b, _ in blocks])
        except Exception as exc:  # noqa: BLE001
            self._inc("errors", 1)
            log.warning("KV storage %s: reading %d blocks from the device failed (%s: %s)",
                        self.name, len(blocks), type(exc).__name__, exc)
            return
        items = [(h, bytes(body)) for (_, h), body in zip(blocks, bodies)]
        nbytes = sum(len(b) for _, b in items)
        with self._lock:
            if self._queued_bytes + nbytes > self.max_queue_bytes:
                drop = True
            else:
                drop = False
                self._queued_bytes += nbytes
                self._idle.clear()
        if drop:
            self._inc("put_dropped", len(items))
            for h, _ in items:
                self._remember_unsaved(h)
            return
        self._queue.put((self._fingerprint(), items))

    def _remember_unsaved(self, block_hash: int) -> None:
        with self._lock:
            self._unsaved[block_hash] = None
            self._unsaved.move_to_end(block_hash)
            while len(self._unsaved) > self.max_unsaved:
                self._unsaved.popitem(last=False)

    # ------------------------------------------------------------------
    # writer thread
    # ------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set() or not self._queue.empty():
            if not self._up:
                if self._probe():
                    continue
                self._drain_dropping()
                if self._stop.is_set():
                    return
                self._wake.wait(self.retry_interval)
                self._wake.clear()
                continue
            try:
                first = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            if first is None:
                continue
            batch = [first]
            size = sum(len(b) for _, b in first[1])
            while size < self.put_batch_bytes:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    continue
                batch.append(nxt)
                size += sum(len(b) for _, b in nxt[1])
            self._write(batch, size)

    def _write(self, batch: list[tuple[bytes, list[tuple[int, bytes]]]], size: int) -> None:
        try:
            if not self._up:
                raise ConnectionError("backend is down")
            kv_items = [(storage_key(fpd, h), pack(fpd, h, body)) for fpd, items in batch for h, body in items]
            self.backend.put_batch(kv_items)
            self._inc("puts", len(kv_items))
            self._inc("put_bytes", size)
        except Exception as exc:  # noqa: BLE001
            n = sum(len(items) for _, items in batch)
            self._inc("put_dropped", n)
            for _, items in batch:
                for h, _ in items:
                    self._remember_unsaved(h)
            if self._up:
                self._backend_failed("put", exc)
        finally:
            with self._lock:
                self._queued_bytes -= size
                if self._queued_bytes == 0:
                    self._idle.set()

    def _drain_dropping(self) -> None:
        """While down, queued blocks are dropped (remembered as unsaved)."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                self._write([item], sum(len(b) for _, b in item[1]))

    def _probe(self) -> bool:
        try:
            ok = bool(self.backend.health())
        except Exception:  # noqa: BLE001
            ok = False
        if ok:
            self._up = True
            self._up_since = time.monotonic()
            if self._ever_up:
                log.warning("KV storage %s: backend is reachable again; storage tier resumed", self.name)
            else:
                log.info("KV storage %s: backend ready", self.name)
            self._ever_up = True
        elif not self._ever_up and not self._start_warned:
            self._start_warned = True
            log.warning("KV storage %s: backend unreachable at start; recomputing until it answers "
                        "(retrying every %gs)", self.name, self.retry_interval)
        return ok

    def _backend_failed(self, op: str, exc: BaseException) -> None:
        self._inc("errors", 1)
        if self._up:
            self._up = False
            if time.monotonic() - self._up_since < 60.0:  # flapping: back off
                self.retry_interval = min(self.max_retry_interval, self.retry_interval * 2)
            else:
                self.retry_interval = self.base_retry_interval
            log.warning("KV storage %s: backend failed during %s (%s: %s); serving by recompute until it "
                        "recovers (retrying every %gs)", self.name, op, type(exc).__name__, exc,
                        self.retry_interval)
            self._wake.set()

    # ------------------------------------------------------------------
    # observability and life cycle
    # ------------------------------------------------------------------

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until every queued block was written (or dropped)."""
        self.flush()
        return self._idle.wait(timeout)

    def stats(self) -> dict[str, float]:
        """``hits`` (tokens loaded from storage), ``hit_blocks``, ``lookups``,
        ``misses``, ``puts`` (blocks written), ``put_dropped``,
        ``put_skipped``, ``rejected``, ``errors`` (storage-tier failures:
        the backend's and ours), ``up``, ``queue_bytes``, ``load_seconds``."""
        with self._clock:
            out = dict(self._c)
        for k in ("hits", "hit_blocks", "lookups", "misses", "puts", "put_dropped", "put_skipped", "rejected",
                  "errors"):
            out.setdefault(k, 0)
        out["up"] = 1.0 if self._up else 0.0
        out["queue_bytes"] = float(self._queued_bytes)
        return out

    def backend_stats(self) -> dict[str, Any]:
        try:
            return dict(self.backend.stats())
        except Exception:  # noqa: BLE001
            return {}

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (up to ``timeout``), stop the writer, close
        the backend.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()
        except Exception:  # noqa: BLE001
            log.exception("KV storage %s: final flush failed", self.name)
        if self._up and not self._idle.wait(timeout):
            log.warning("KV storage %s: %d bytes still queued at close; dropped", self.name, self._queued_bytes)
        self._stop.set()
        self._wake.set()
        self._queue.put(None)
        self._writer.join(timeout=2.0)
        try:
            self.backend.close()
        except Exception:  # noqa: BLE001
            pass


__all__ = ["KVStorage", "fingerprint_digest", "storage_key", "pack", "unpack", "HEADER"]


def _drain_at_exit(ref: weakref.ref[KVStorage]) -> None:
    """Interpreter exit (e.g. an offline ``fdx.LLM`` never closed): write
    what is queued, briefly; the writer is a daemon thread."""
    storage = ref()
    if storage is not None and not storage._closed:
        try:
            storage.close(timeout=5.0)
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
