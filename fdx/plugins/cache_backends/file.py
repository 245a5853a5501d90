"""``--cache-backend file``: KV blocks as files in a directory.

Options: ``path`` (default ``$FDX_KV_DIR`` or ``~/.cache/fdx/kv``),
``max_bytes`` (default ``10G``), ``fsync`` (default false).

Layout: a key maps to ``path/ab/cd/<32 hex>`` where the hex is a BLAKE2b
digest of the key (two fan-out levels keep directories small).  Invariants:

* a value file is always complete: it is written under a temporary name in
  the same directory and published with ``os.replace`` (atomic on POSIX), so
  a crash leaves at most a stray ``.tmp`` file, removed at the next start;
* the directory survives restarts; at start the index of existing files is
  rebuilt in modification-time order (a hit refreshes the file's mtime), and
  files beyond ``max_bytes`` are removed least recently used first.

Several processes may share one directory (reads and writes are atomic);
each process enforces the size cap over the files it knows about.
"""

from __future__ import annotations

import collections
import hashlib
import os
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import CacheBackend
from fdx.plugins.cache_backends.backend_options import Counters, check_options, size_option

DEFAULT_MAX_BYTES = 10 << 30
TMP_MARK = ".tmp."
STALE_TMP_SECONDS = 600.0


class FileBackend(CacheBackend):
    name = "file"

    def __init__(self, path: str | os.PathLike[str], max_bytes: int = DEFAULT_MAX_BYTES, fsync: bool = False) -> None:
        self.root = Path(path).expanduser()
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.fsync = fsync
        self._lock = threading.Lock()
        #: file name -> size, least recently used first
        self._index: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._size = 0
        self._counters = Counters()
        self._scan()
        with self._lock:
            self._evict_locked()

    # ------------------------------------------------------------------
    def _name(self, key: str) -> str:
        return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()

    def _path(self, name: str) -> Path:
        return self.root / name[:2] / name[2:4] / name

    def _scan(self) -> None:
        found: list[tuple[float, str, int]] = []
        now = time.time()
        for d1 in os.scandir(self.root):
            if not d1.is_dir() or len(d1.name) != 2:
                continue
            for d2 in os.scandir(d1.path):
                if not d2.is_dir():
                    continue
                for f in os.scandir(d2.path):
                    try:
                        st = f.stat()
                    except FileNotFoundError:
                        continue
                    if TMP_MARK in f.name:
                        if now - st.st_mtime > STALE_TMP_SECONDS:
                            _unlink(f.path)
                        continue
                    found.append((st.st_mtime, f.name, st.st_size))
        found.sort()
        for _, name, size in found:
            self._index[name] = size
            self._size += size

    def _evict_locked(self) -> int:
        n = 0
        while self._size > self.max_bytes and self._index:
            name, size = self._index.popitem(last=False)
            self._size -= size
            _unlink(self._path(name))
            n += 1
        if n:
            self._counters.add(evictions=n)
        return n

    # ------------------------------------------------------------------
    def get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        hits = nbytes = 0
        for key in keys:
            name = self._name(key)
            p = self._path(name)
            try:
                with open(p, "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                with self._lock:
                    size = self._index.pop(name, None)
                    if size is not None:
                        self._size -= size
                out.append(None)
                continue
            try:
                os.utime(p)
            except OSError:
                pass
            with self._lock:
                if name in self._index:
                    self._index.move_to_end(name)
                else:  # written by another process sharing the directory
                    self._index[name] = len(data)
                    self._size += len(data)
            hits += 1
            nbytes += len(data)
            out.append(data)
        self._counters.add(hits=hits, misses=len(keys) - hits, bytes_read=nbytes)
        return out

    def put_batch(self, items: Sequence[tuple[str, bytes]]) -> None:
        written = 0
        for key, value in items:
            if len(value) > self.max_bytes:
                continue
            name = self._name(key)
            p = self._path(name)
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_name(f"{name}{TMP_MARK}{os.getpid()}.{threading.get_ident()}")
            try:
                with open(tmp, "wb") as f:
                    f.write(value)
                    if self.fsync:
                        f.flush()
                        os.fsync(f.fileno())
                os.replace(tmp, p)
            except BaseException:
                _unlink(tmp)
                raise
            written += len(value)
            with self._lock:
                old = self._index.pop(name, None)
                if old is not None:
                    self._size -= old
                self._index[name] = len(value)
                self._size += len(value)
        with self._lock:
            self._evict_locked()
        self._counters.add(puts=len(items), bytes_written=written)

    def exists_batch(self, keys: Sequence[str]) -> list[bool]:
        return [self._path(self._name(k)).exists() for k in keys]

    def stats(self) -> dict[str, float]:
        with self._lock:
            size, n = self._size, len(self._index)
        return self._counters.snapshot(bytes=size, keys=n, max_bytes=self.max_bytes)

    def health(self) -> bool:
        return self.root.is_dir() and os.access(self.root, os.W_OK)

    def clear(self) -> None:
        with self._lock:
            for name in list(self._index):
                _unlink(self._path(name))
            self._index.clear()
            self._size = 0
        for d1 in os.scandir(self.root):  # files written by other processes too
            if d1.is_dir() and len(d1.name) == 2:
                for d2 in os.scandir(d1.path):
                    if d2.is_dir():
                        for f in os.scandir(d2.path):
                            _unlink(f.path)


def _unlink(path: str | os.PathLike[str]) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def create(options: dict[str, Any] | None = None) -> FileBackend:
    opts = check_options("file", options, {"path", "max_bytes", "fsync"})
    path = opts.get("path") or os.environ.get("FDX_KV_DIR") or os.path.join("~", ".cache", "fdx", "kv")
    return FileBackend(
        path,
        max_bytes=size_option("file", "max_bytes", opts.get("max_bytes", DEFAULT_MAX_BYTES)),
        fsync=bool(opts.get("fsync", False)),
    )


@hookimpl
def fdx_register_cache_backends(register: Any) -> None:
    register("file", lambda options=None: create(options), description="files in a directory (survives restarts)")
