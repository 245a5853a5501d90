"""KVStorage: the storage tier's logic over the real KVCacheManager, with a
fake model runner (block contents are bytes derived from the block hash, so
a loaded block can be checked exactly) and real backends (memory, file)."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

import pytest

from fdx.core.kv_cache import KVCacheManager
from fdx.kv_storage import HEADER, KVStorage, fingerprint_digest, pack, storage_key, unpack
from fdx.core.request import Request
from fdx.plugins.cache_backends.file import FileBackend
from fdx.plugins.cache_backends.memory import MemoryBackend
from fdx.testing import check_kv_invariants, make_request

BS = 4
BODY = 256


def content(h: int) -> bytes:
    return (h & ((1 << 64) - 1)).to_bytes(8, "little") * (BODY // 8)


class FakeRunner:
    """The three ModelRunner methods the storage tier uses."""

    def __init__(self, fingerprint: str = "model-a", version: str = "v1") -> None:
        self.fp = fingerprint
        self.weights_version = version
        self.blocks: dict[int, bytes] = {}
        self.reads = 0
        self.writes = 0

    def kv_fingerprint(self) -> str:
        return f"{self.fp}|{self.weights_version}"

    def read_kv_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        self.reads += 1
        return [self.blocks[b] for b in block_ids]

    def write_kv_blocks(self, block_ids: Sequence[int], payloads: Sequence[Any]) -> None:
        self.writes += 1
        for b, p in zip(block_ids, payloads):
            if len(p) != BODY:
                raise ValueError(f"payload of {len(p)} bytes")
            self.blocks[b] = bytes(p)


class Engine:
    """Just enough of an engine: a pool, a runner and the storage tier."""

    def __init__(self, backend: Any, runner: FakeRunner | None = None, num_blocks: int = 64, **kw: Any) -> None:
        self.runner = runner or FakeRunner()
        self.kv = KVCacheManager(num_blocks, BS)
        self.storage = KVStorage(backend, self.runner, self.kv, retry_interval=0.05, **kw)  # type: ignore[arg-type]
        self.kv.storage = self.storage
        assert self.storage.wait_ready(5)

    def serve(self, r: Request) -> int:
        """Admit, 'compute' the prompt (write each block's expected content),
        commit, flush; return the number of prefix-hit blocks."""
        computed = self.kv.get_computed_blocks(r)
        assert self.kv.allocate(r, r.num_tokens - len(computed) * BS, computed)
        self.kv.ensure_hashes(r, r.num_tokens // BS)
        for i in range(len(computed), len(r.block_ids)):
            full = (i + 1) * BS <= r.num_tokens
            self.runner.blocks[r.block_ids[i]] = content(r.block_hashes[i]) if full else b"partial"
        for i in range(len(computed)):  # what the prefix cache gave must be exactly right
            assert self.runner.blocks[r.block_ids[i]] == content(r.block_hashes[i]), f"block {i} wrong"
        r.num_computed_tokens = r.num_tokens
        self.kv.commit(r)
        self.storage.flush()
        return len(computed)

    def finish(self, r: Request) -> None:
        self.kv.free(r)

    def close(self) -> None:
        self.storage.close()


def prompt(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


def req(rid: str, tokens: list[int]) -> Request:
    return make_request(rid, tokens, 4)


# ---------------------------------------------------------------- payload format


def test_payload_header_checks() -> None:
    fpd = fingerprint_digest("a")
    body = os.urandom(100)
    p = pack(fpd, -5, body)
    assert len(p) == HEADER.size + 100
    assert bytes(unpack(fpd, -5, p)) == body  # type: ignore[arg-type]
    assert unpack(fingerprint_digest("b"), -5, p) is None  # foreign model
    assert unpack(fpd, 7, p) is None  # stored under the wrong key
    assert unpack(fpd, -5, p[:-1]) is None  # truncated
    flipped = bytearray(p)
    flipped[-1] ^= 1
    assert unpack(fpd, -5, bytes(flipped)) is None  # corrupt body
    assert unpack(fpd, -5, b"junk") is None and unpack(fpd, -5, None) is None
    k = storage_key(fpd, -5)
    assert k.startswith("fdx_") and set(k) <= set("0123456789abcdef_fdx")
    assert storage_key(fingerprint_digest("b"), -5) != k


# ---------------------------------------------------------------- restart / sharing


def test_restart_serves_prompt_from_files(tmp_path: Path) -> None:
    a = Engine(FileBackend(tmp_path / "kv"))
    r = req("r1", prompt(41))  # 10 full blocks + 1 token
    assert a.serve(r) == 0
    a.finish(r)
    a.close()  # drains the writer queue
    assert a.storage.stats()["puts"] == 10

    b = Engine(FileBackend(tmp_path / "kv"))  # a fresh process: empty device pool
    r2 = req("r2", prompt(41))
    assert b.serve(r2) == 10
    assert r2.num_cached_tokens == 40
    st = b.storage.stats()
    assert st["hits"] == 40 and st["hit_blocks"] == 10 and st["errors"] == 0
    # the loaded blocks are now device-cached: a third request hits the device
    r3 = req("r3", prompt(41))
    assert b.serve(r3) == 10
    assert b.storage.stats()["lookups"] == 1  # no second storage lookup
    b.close()


def test_partial_prefix_and_device_then_storage(tmp_path: Path) -> None:
    backend = MemoryBackend()
    a = Engine(backend)
    a.serve(req("a", prompt(33)))  # blocks 0..7 stored
    a.storage.drain()
    b = Engine(backend)
    # block 0 comes from storage and stays on the device ...
    x = req("x", prompt(5))
    assert b.serve(x) == 1
    assert b.storage.stats()["hit_blocks"] == 1
    # ... so the next prompt matches it there and storage continues with blocks 1..4
    r = req("y", prompt(22) + [999] * 11)  # shares 5 full blocks (20 tokens) with a's prompt
    assert b.serve(r) == 5
    assert b.storage.stats()["hit_blocks"] == 5  # 1 + 4 from storage, 1 from the device
    assert r.num_cached_tokens == 20
    check_kv_invariants(b.kv, [x, r])


def test_pool_too_small_loads_what_fits() -> None:
    backend = MemoryBackend()
    a = Engine(backend)
    a.serve(req("a", prompt(41)))
    a.storage.drain()
    b = Engine(backend, num_blocks=64)
    used = [req(f"f{i}", prompt(4, 1000 + 4 * i)) for i in range(58)]
    for u in used:
        b.serve(u)  # 58 blocks held by live requests
    r = req("r", prompt(41))
    computed = b.kv.get_computed_blocks(r)
    assert len(computed) == 6  # only 6 free blocks to load into
    check_kv_invariants(b.kv, used)


# ---------------------------------------------------------------- never load a wrong block


def test_foreign_fingerprint_is_never_loaded(tmp_path: Path) -> None:
    backend = FileBackend(tmp_path / "kv")
    a = Engine(backend, FakeRunner("model-a"))
    a.serve(req("a", prompt(41)))
    a.storage.drain()
    other_model = Engine(backend, FakeRunner("model-b"))
    assert other_model.serve(req("b", prompt(41))) == 0
    other_version = Engine(backend, FakeRunner("model-a", version="v2"))
    assert other_version.serve(req("c", prompt(41))) == 0
    # even a foreign payload copied under our key is rejected by its header;
    # drain first so model-b's own (legitimate) write of block 0 cannot land
    # after the copy and overwrite it
    other_model.storage.drain()
    other_version.storage.drain()
    r = req("d", prompt(41))
    rb = other_model.kv.ensure_hashes(r, 10)
    fa = fingerprint_digest(a.runner.kv_fingerprint())
    fb = fingerprint_digest(other_model.runner.kv_fingerprint())
    backend.put_batch([(storage_key(fb, rb[0]), backend.get_batch([storage_key(fa, rb[0])])[0])])  # type: ignore[list-item]
    fresh = Engine(backend, FakeRunner("model-b"))
    assert fresh.serve(req("e", prompt(41))) == 0
    assert fresh.storage.stats()["rejected"] == 1


def test_corrupt_payload_is_a_miss(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "kv"
    a = Engine(FileBackend(root))
    r = req("a", prompt(41))
    a.serve(r)
    a.close()
    fpd = fingerprint_digest(a.runner.kv_fingerprint())
    fb = FileBackend(root)
    victim = fb._path(fb._name(storage_key(fpd, r.block_hashes[3])))
    data = bytearray(victim.read_bytes())
    data[HEADER.size + 10] ^= 0xFF
    victim.write_bytes(bytes(data))
    b = Engine(FileBackend(root))
    with caplog.at_level(logging.WARNING, logger="fdx.kv_storage"):
        assert b.serve(req("b", prompt(41))) == 3  # blocks 0..2 only; block 3 and later recomputed
    assert b.storage.stats()["rejected"] == 1
    assert "corrupt or foreign" in caplog.text


# ---------------------------------------------------------------- failures degrade


class Flaky(MemoryBackend):
    """A real memory backend that can be switched off (raises like a dead server)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise ConnectionError("connection refused")

    def get_batch(self, keys):  # type: ignore[no-untyped-def]
        self._check()
        return super().get_batch(keys)

    def exists_batch(self, keys):  # type: ignore[no-untyped-def]
        self._check()
        return super().exists_batch(keys)

    def put_batch(self, items):  # type: ignore[no-untyped-def]
        self._check()
        super().put_batch(items)

    def health(self) -> bool:
        return not self.down


def test_backend_down_degrades_to_recompute_and_recovers(caplog: pytest.LogCaptureFixture) -> None:
    backend = Flaky()
    a = Engine(backend)
    a.serve(req("a", prompt(41)))
    a.storage.drain()
    b = Engine(backend)
    backend.down = True
    with caplog.at_level(logging.WARNING, logger="fdx.kv_storage"):
        assert b.serve(req("b", prompt(41))) == 0  # recomputed, no exception
        assert b.serve(req("c", prompt(41, start=500))) == 0  # down: storage not touched
    st = b.storage.stats()
    assert st["errors"] == 1 and st["up"] == 0 and st["put_skipped"] == 20
    assert "backend failed during load" in caplog.text
    backend.down = False
    assert b.storage.wait_ready(5)
    assert "reachable again" in caplog.text
    b2 = Engine(backend)
    assert b2.serve(req("d", prompt(41))) == 10


def test_blocks_lost_while_down_are_written_on_eviction() -> None:
    backend = Flaky()
    e = Engine(backend, num_blocks=11)
    backend.down = True
    e.storage._backend_failed("test", ConnectionError("x"))
    r = req("a", prompt(41))
    e.serve(r)  # 10 full blocks, none saved (down)
    e.finish(r)
    backend.down = False
    assert e.storage.wait_ready(5)
    r2 = req("b", prompt(41, start=700))
    e.serve(r2)  # needs all 11 blocks: evicts the 10 cached ones -> saved on eviction
    e.storage.drain()
    fresh = Engine(backend)
    assert fresh.serve(req("c", prompt(41))) == 10


def test_full_queue_drops_instead_of_blocking() -> None:
    gate = threading.Event()

    class Slow(MemoryBackend):
        def put_batch(self, items):  # type: ignore[no-untyped-def]
            gate.wait(10)
            super().put_batch(items)

    e = Engine(Slow(), max_queue_bytes=3 * BODY)
    e.serve(req("a", prompt(41)))  # 10 blocks > 3-block queue
    st = e.storage.stats()
    assert st["put_dropped"] == 10  # one step's blocks are one queue item
    assert e.storage.stats()["queue_bytes"] == 0
    gate.set()
    e.serve(req("b", prompt(9, start=300)))  # 2 blocks fit
    assert e.storage.drain(5)
    assert e.storage.stats()["puts"] == 2


def test_reset_before_flush_saves_nothing() -> None:
    backend = MemoryBackend()
    e = Engine(backend)
    r = req("a", prompt(41))
    computed = e.kv.get_computed_blocks(r)
    e.kv.allocate(r, 41, computed)
    e.kv.ensure_hashes(r, 10)
    for i in range(10):
        e.runner.blocks[r.block_ids[i]] = content(r.block_hashes[i])
    e.runner.blocks[r.block_ids[10]] = b"partial"
    r.num_computed_tokens = 41
    e.kv.commit(r)  # 10 blocks pending
    e.kv.free(r)
    e.kv.reset_prefix_cache()  # e.g. update_weights: the blocks hold stale KV now
    e.storage.flush()
    e.storage.drain()
    assert e.storage.stats()["puts"] == 0 and e.runner.reads == 0


def test_evicting_a_pending_block_copies_it_first() -> None:
    e = Engine(MemoryBackend())
    e.runner.blocks[3] = content(77)
    e.kv.block_hash[3] = 77
    e.storage.on_block_full(3, 77)
    assert e.runner.reads == 0
    e.storage.on_block_evicted(3, 77)  # before reuse
    assert e.runner.reads == 1
    e.storage.drain()
    assert e.storage.stats()["puts"] == 1


def test_write_failure_on_device_is_counted_not_raised(tmp_path: Path) -> None:
    backend = MemoryBackend()
    a = Engine(backend)
    a.serve(req("a", prompt(41)))
    a.storage.drain()

    class Broken(FakeRunner):
        def write_kv_blocks(self, block_ids, payloads):  # type: ignore[no-untyped-def]
            raise RuntimeError("device error")

    b = Engine(backend, Broken())
    r = req("b", prompt(41))
    assert b.serve(r) == 0  # recomputed
    assert b.storage.stats()["errors"] == 1
    check_kv_invariants(b.kv, [r])  # the blocks allocated for the load went back


# ---------------------------------------------------------------- real servers


from kvservices import MooncakeMaster, MooncakePool, RedisServer, have_mooncake, have_redis  # noqa: E402


def _real_backend(kind: str, stack: Any) -> tuple[Any, Callable[[str, bytes], None]]:
    """A backend on a real server plus ``overwrite(key, value)`` that
    bypasses the storage tier (to plant corrupt data)."""
    if kind == "redis":
        import redis as redis_py

        from fdx.plugins.cache_backends.redis import create as create_redis

        srv = stack.enter_context(RedisServer())
        raw = redis_py.Redis.from_url(srv.url)
        stack.callback(raw.close)
        return create_redis({"url": srv.url}), lambda k, v: raw.set("fdx:kv:" + k, v)
    from fdx.plugins.cache_backends.mooncake import create as create_mc

    master = stack.enter_context(MooncakeMaster())
    stack.enter_context(MooncakePool(master, "256 MB"))
    b = create_mc({"master": master.address, "global_segment_size": 0, "local_buffer_size": "16M"})

    def overwrite(k: str, v: bytes) -> None:
        store = b._get_store()
        store.remove(k, True)
        assert store.put(k, v) == 0

    return b, overwrite


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("redis", marks=[pytest.mark.redis, pytest.mark.skipif(not have_redis(), reason="no redis")]),
        pytest.param("mooncake",
                     marks=[pytest.mark.mooncake, pytest.mark.skipif(not have_mooncake(), reason="no mooncake")]),
    ],
)
def test_shared_real_server_round_trip_corrupt_and_foreign(kind: str) -> None:
    import contextlib

    with contextlib.ExitStack() as stack:
        backend, overwrite = _real_backend(kind, stack)
        a = Engine(backend)
        r = req("a", prompt(41))
        a.serve(r)
        assert a.storage.drain(10) and a.storage.stats()["puts"] == 10
        assert Engine(backend).serve(req("b", prompt(41))) == 10  # another engine: all from the server
        assert Engine(backend, FakeRunner("model-b")).serve(req("c", prompt(41))) == 0  # foreign model
        fpd = fingerprint_digest(a.runner.kv_fingerprint())
        key = storage_key(fpd, r.block_hashes[3])
        good = backend.get_batch([key])[0]
        bad = bytearray(good)
        bad[-5] ^= 0x40
        overwrite(key, bytes(bad))
        e = Engine(backend)
        assert e.serve(req("d", prompt(41))) == 3  # stops at the corrupt block
        assert e.storage.stats()["rejected"] == 1
        a.close()
        e.close()
