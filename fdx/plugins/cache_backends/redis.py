"""``--cache-backend redis``: KV blocks in a Redis (or Valkey) server.

Options: ``url`` (default ``$FDX_REDIS_URL`` or ``redis://127.0.0.1:6379/0``)
or ``host``/``port``/``db``/``password``; ``prefix`` (default ``fdx:kv:``),
``ttl`` (seconds, default none: rely on the server's ``maxmemory-policy
allkeys-lru``), ``timeout`` (seconds for connect and each command, default
1.0), ``chunk`` (keys per pipelined round trip, default 64).

Batch operations are pipelined (``MGET``, ``SET`` and ``EXISTS`` in one round
trip per chunk).  A server that is down raises within ``timeout`` (no
client-side retries); the caller degrades to recompute.  Capacity and
eviction belong to the server (run it with ``--maxmemory`` and
``--maxmemory-policy allkeys-lru``).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from fdx.core.errors import ConfigError
from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import CacheBackend
from fdx.plugins.cache_backends.backend_options import Counters, check_options, float_option

DEFAULT_URL = "redis://127.0.0.1:6379/0"


class RedisBackend(CacheBackend):
    name = "redis"

    def __init__(
        self,
        url: str | None = None,
        *,
        host: str | None = None,
        port: int | None = None,
        db: int = 0,
        password: str | None = None,
        prefix: str = "fdx:kv:",
        ttl: int | None = None,
        timeout: float = 1.0,
        chunk: int = 64,
    ) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        common: dict[str, Any] = dict(
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
        if host is not None or port is not None:
            self._r = redis.Redis(host=host or "127.0.0.1", port=int(port or 6379), db=db, password=password, **common)
            self.address = f"redis://{host or '127.0.0.1'}:{port or 6379}/{db}"
        else:
            self.address = url or DEFAULT_URL
            self._r = redis.Redis.from_url(self.address, **common)
        self.prefix = prefix
        self.ttl = ttl
        self.chunk = max(1, chunk)
        self._counters = Counters()

    def _k(self, key: str) -> str:
        return self.prefix + key

    def _chunks(self, seq: Sequence[Any]) -> list[Sequence[Any]]:
        return [seq[i : i + self.chunk] for i in range(0, len(seq), self.chunk)]

    def get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        try:
            for part in self._chunks(keys):
                out.extend(self._r.mget([self._k(k) for k in part]))
        except Exception:
            self._counters.add(errors=1)
            raise
        hits = sum(1 for v in out if v is not None)
        self._counters.add(hits=hits, misses=len(keys) - hits, bytes_read=sum(len(v) for v in out if v is not None))
        return out

    def put_batch(self, items: Sequence[tuple[str, bytes]]) -> None:
        try:
            for part in self._chunks(items):
                pipe = self._r.pipeline(transaction=False)
                for k, v in part:
                    pipe.set(self._k(k), v, ex=self.ttl)
                pipe.execute()
        except Exception:
            self._counters.add(errors=1)
            raise
        self._counters.add(puts=len(items), bytes_written=sum(len(v) for _, v in items))

    def exists_batch(self, keys: Sequence[str]) -> list[bool]:
        out: list[bool] = []
        try:
            for part in self._chunks(keys):
                pipe = self._r.pipeline(transaction=False)
                for k in part:
                    pipe.exists(self._k(k))
                out.extend(bool(x) for x in pipe.execute())
        except Exception:
            self._counters.add(errors=1)
            raise
        return out

    def stats(self) -> dict[str, float]:
        return self._counters.snapshot()

    def health(self) -> bool:
        try:
            return bool(self._r.ping())
        except Exception:  # noqa: BLE001 - unhealthy is the answer
            return False

    def clear(self) -> None:
        batch: list[str] = []
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in self.prefix) + "*"
        for k in self._r.scan_iter(match=pattern, count=1000):
            batch.append(k)
            if len(batch) >= 1000:
                self._r.unlink(*batch)
                batch.clear()
        if batch:
            self._r.unlink(*batch)

    def close(self) -> None:
        try:
            self._r.close()
        except Exception:  # noqa: BLE001
            pass


def create(options: dict[str, Any] | None = None) -> RedisBackend:
    allowed = {"url", "host", "port", "db", "password", "prefix", "ttl", "timeout", "chunk"}
    opts = check_options("redis", options, allowed)
    ttl = opts.get("ttl")
    if ttl is not None and (not isinstance(ttl, int) or ttl <= 0):
        raise ConfigError(f"--cache-backend-config: redis.ttl must be a positive integer (seconds), got {ttl!r}")
    try:
        import redis  # noqa: F401
    except ImportError:
        raise ConfigError("--cache-backend redis needs the redis package: pip install 'fdx[redis]'") from None
    url = opts.get("url")
    if url is None and opts.get("host") is None and opts.get("port") is None:
        url = os.environ.get("FDX_REDIS_URL")
    return RedisBackend(
        url,
        host=opts.get("host"),
        port=opts.get("port"),
        db=int(opts.get("db", 0)),
        password=opts.get("password"),
        prefix=str(opts.get("prefix", "fdx:kv:")),
        ttl=ttl,
        timeout=float_option("redis", "timeout", opts.get("timeout", 1.0)),
        chunk=int(opts.get("chunk", 64)),
    )


@hookimpl
def fdx_register_cache_backends(register: Any) -> None:
    register("redis", lambda options=None: create(options), description="a Redis/Valkey server (pipelined batches)")
