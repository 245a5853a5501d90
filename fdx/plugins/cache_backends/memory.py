"""``--cache-backend memory``: a bounded LRU of KV blocks in the engine
process's host memory.

Options: ``max_bytes`` (default ``1G``).  Invariant: the sum of stored value
sizes never exceeds ``max_bytes`` (a value larger than the cap is not
stored); the least recently used values are evicted first.  Nothing survives
the process.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Sequence

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import CacheBackend
from fdx.plugins.cache_backends.backend_options import Counters, check_options, size_option

DEFAULT_MAX_BYTES = 1 << 30


class MemoryBackend(CacheBackend):
    name = "memory"

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._data: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self._size = 0
        self._lock = threading.Lock()
        self._counters = Counters()

    def get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        hits = nbytes = 0
        with self._lock:
            for k in keys:
                v = self._data.get(k)
                if v is not None:
                    self._data.move_to_end(k)
                    hits += 1
                    nbytes += len(v)
                out.append(v)
        self._counters.add(hits=hits, misses=len(keys) - hits, bytes_read=nbytes)
        return out

    def put_batch(self, items: Sequence[tuple[str, bytes]]) -> None:
        evicted = written = 0
        with self._lock:
            for k, v in items:
                v = bytes(v)
                if len(v) > self.max_bytes:
                    continue
                old = self._data.pop(k, None)
                if old is not None:
                    self._size -= len(old)
                self._data[k] = v
                self._size += len(v)
                written += len(v)
                while self._size > self.max_bytes:
                    _, dropped = self._data.popitem(last=False)
                    self._size -= len(dropped)
                    evicted += 1
        self._counters.add(puts=len(items), bytes_written=written, evictions=evicted)

    def exists_batch(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [k in self._data for k in keys]

    def stats(self) -> dict[str, float]:
        with self._lock:
            size, n = self._size, len(self._data)
        return self._counters.snapshot(bytes=size, keys=n, max_bytes=self.max_bytes)

    def health(self) -> bool:
        return True

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._size = 0

    def close(self) -> None:
        self.clear()


def create(options: dict[str, Any] | None = None) -> MemoryBackend:
    opts = check_options("memory", options, {"max_bytes"})
    return MemoryBackend(size_option("memory", "max_bytes", opts.get("max_bytes", DEFAULT_MAX_BYTES)))


@hookimpl
def fdx_register_cache_backends(register: Any) -> None:
    register("memory", lambda options=None: create(options), description="bounded LRU in host memory (this process)")
