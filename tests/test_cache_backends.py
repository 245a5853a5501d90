"""The four built-in cache backends against real stores: host memory, a
directory, a real ``redis-server`` and a real Mooncake master (+ a
standalone ``mooncake_client`` pool), all started and stopped by PID in
:mod:`tests.kvservices`."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from fdx.core.errors import ConfigError
from fdx.core.interfaces import CacheBackend
from kvservices import MooncakeMaster, MooncakePool, RedisServer, have_mooncake, have_redis

needs_redis = pytest.mark.skipif(not have_redis(), reason="redis-server not installed (apt-get install redis-server)")
needs_mooncake = pytest.mark.skipif(
    not have_mooncake(), reason="mooncake not installed (pip install mooncake-transfer-engine-non-cuda; libibverbs1)"
)

BLOCK = 737_344  # about one SmolLM2 KV block (30 layers x K/V x 3 heads x 16 slots x 64 x fp32) + header


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


@pytest.fixture(scope="module")
def mooncake_pool() -> Iterator[MooncakeMaster]:
    with MooncakeMaster() as master, MooncakePool(master, "512 MB"):
        yield master


def make(kind: str, tmp_path: Path, request: pytest.FixtureRequest, **extra: Any) -> CacheBackend:
    if kind == "memory":
        from fdx.plugins.cache_backends.memory import create

        return create({"max_bytes": "256M", **extra})
    if kind == "file":
        from fdx.plugins.cache_backends.file import create

        return create({"path": str(tmp_path / "kv"), **extra})
    if kind == "redis":
        srv = request.getfixturevalue("redis_server")
        from fdx.plugins.cache_backends.redis import create

        return create({"url": srv.url, "prefix": f"t{os.getpid()}:{request.node.name}:", **extra})
    if kind == "mooncake":
        master = request.getfixturevalue("mooncake_pool")
        from fdx.plugins.cache_backends.mooncake import create

        return create({"master": master.address, "global_segment_size": 0, "local_buffer_size": "16M", **extra})
    raise AssertionError(kind)


KINDS = [
    "memory",
    "file",
    pytest.param("redis", marks=[needs_redis, pytest.mark.redis]),
    pytest.param("mooncake", marks=[needs_mooncake, pytest.mark.mooncake]),
]


@pytest.fixture(params=KINDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[CacheBackend]:
    b = make(request.param, tmp_path, request)
    assert b.health()
    try:
        yield b
    finally:
        try:
            b.clear()
        finally:
            b.close()


def key(i: int, tag: str = "") -> str:
    return f"fdx_test{tag}_{i:04d}"


def test_round_trip_batches(backend: CacheBackend) -> None:
    items = [(key(i), bytes([i % 251]) * (1000 + i)) for i in range(10)]
    backend.put_batch(items)
    got = backend.get_batch([key(3), key(99), key(0), key(9)])
    assert got == [items[3][1], None, items[0][1], items[9][1]]
    assert backend.exists_batch([key(1), key(98), key(9)]) == [True, False, True]
    st = backend.stats()
    assert st["puts"] >= 10 and st["hits"] >= 3 and st["misses"] >= 1
    assert {"hits", "misses", "puts"} <= set(st)
    backend.clear()
    assert backend.get_batch([key(3)]) == [None]
    assert backend.exists_batch([key(3)]) == [False]


def test_large_batch_of_kv_blocks(backend: CacheBackend) -> None:
    """62 blocks (~45 MB: a 1,000-token prompt) in one call each way; the
    Mooncake backend must split it to fit its 16 MB local buffer."""
    payloads = [os.urandom(64) + bytes([i]) * (BLOCK - 64) for i in range(62)]
    backend.put_batch([(key(i, "big"), p) for i, p in enumerate(payloads)])
    got = backend.get_batch([key(i, "big") for i in range(62)])
    assert all(g == p for g, p in zip(got, payloads)) and len(got) == 62


def test_empty_batches(backend: CacheBackend) -> None:
    backend.put_batch([])
    assert backend.get_batch([]) == []
    assert backend.exists_batch([]) == []


# ---------------------------------------------------------------- memory / file


def test_memory_lru_cap() -> None:
    from fdx.plugins.cache_backends.memory import MemoryBackend

    b = MemoryBackend(max_bytes=3000)
    b.put_batch([(key(i), b"x" * 1000) for i in range(3)])
    b.get_batch([key(0)])  # 0 is now most recent
    b.put_batch([(key(3), b"y" * 1000)])
    assert b.exists_batch([key(0), key(1), key(2), key(3)]) == [True, False, True, True]
    assert b.stats()["bytes"] <= 3000 and b.stats()["evictions"] == 1
    b.put_batch([(key(9), b"z" * 5000)])  # larger than the cap: not stored
    assert b.exists_batch([key(9)]) == [False]


def test_file_survives_restart_and_is_fanned_out(tmp_path: Path) -> None:
    from fdx.plugins.cache_backends.file import FileBackend

    root = tmp_path / "kv"
    a = FileBackend(root)
    a.put_batch([(key(i), bytes([i]) * 500) for i in range(5)])
    a.close()
    files = [p for p in root.rglob("*") if p.is_file()]
    assert len(files) == 5
    for p in files:  # root/ab/cd/abcd...
        rel = p.relative_to(root).parts
        assert len(rel) == 3 and rel[2].startswith(rel[0] + rel[1])
    b = FileBackend(root)
    assert b.get_batch([key(4), key(7)]) == [bytes([4]) * 500, None]
    assert b.stats()["keys"] == 5 and b.stats()["bytes"] == 2500


def test_file_lru_cap_and_stale_temp_files(tmp_path: Path) -> None:
    from fdx.plugins.cache_backends import file as fmod

    root = tmp_path / "kv"
    b = fmod.FileBackend(root, max_bytes=3000)
    b.put_batch([(key(i), b"x" * 1000) for i in range(3)])
    b.get_batch([key(0)])
    b.put_batch([(key(3), b"y" * 1000)])
    assert b.exists_batch([key(0), key(1), key(2), key(3)]) == [True, False, True, True]
    # a crashed writer's temp file is removed at the next start once stale
    d = root / "zz" / "zz"
    d.mkdir(parents=True)
    stale = d / f"zzzz{fmod.TMP_MARK}123.456"
    stale.write_bytes(b"partial")
    os.utime(stale, (1, 1))
    fmod.FileBackend(root, max_bytes=3000)
    assert not stale.exists()
    # a smaller cap at start evicts the least recently used files
    c = fmod.FileBackend(root, max_bytes=2000)
    assert c.stats()["bytes"] <= 2000
    assert not any(fmod.TMP_MARK in p.name for p in root.rglob("*"))


def test_unknown_option_is_a_one_line_error(tmp_path: Path) -> None:
    from fdx.plugins.cache_backends import file, memory, mooncake, redis

    for mod, opts in ((memory, {"max_byte": 1}), (file, {"pth": "x"}), (redis, {"uri": "x"}), (mooncake, {"mastr": "x"})):
        with pytest.raises(ConfigError, match="unknown option") as ei:
            mod.create(opts)
        assert "\n" not in str(ei.value)
    with pytest.raises(ConfigError, match="max_bytes"):
        memory.create({"max_bytes": "lots"})


def test_registered_through_entry_points() -> None:
    from fdx.core.plugins import get_plugins

    names = get_plugins().registry("cache_backend").names()
    assert {"memory", "file", "redis", "mooncake"} <= set(names)


# ---------------------------------------------------------------- redis


@needs_redis
@pytest.mark.redis
def test_redis_down_raises_fast_and_reports_unhealthy(tmp_path: Path) -> None:
    from fdx.plugins.cache_backends.redis import create

    with RedisServer() as srv:
        b = create({"url": srv.url, "timeout": 0.5})
        b.put_batch([(key(1), b"v")])
        assert b.get_batch([key(1)]) == [b"v"]
        srv.kill()
        assert not b.health()
        with pytest.raises(Exception):
            b.get_batch([key(1)])
        with pytest.raises(Exception):
            b.put_batch([(key(2), b"w")])
        assert b.stats()["errors"] >= 2
        srv.start()  # same port: the client reconnects
        assert b.health()
        assert b.get_batch([key(1)]) == [None]  # no persistence
        b.close()


@needs_redis
@pytest.mark.redis
def test_redis_ttl_and_prefix_isolation(redis_server: RedisServer) -> None:
    import redis as redis_py

    from fdx.plugins.cache_backends.redis import create

    a = create({"url": redis_server.url, "prefix": "A:", "ttl": 100})
    b = create({"url": redis_server.url, "prefix": "B:"})
    a.put_batch([(key(1), b"a")])
    assert b.get_batch([key(1)]) == [None]
    r = redis_py.Redis.from_url(redis_server.url)
    assert 0 < r.ttl("A:" + key(1)) <= 100
    b.put_batch([(key(1), b"b")])
    a.clear()
    assert b.get_batch([key(1)]) == [b"b"]
    b.clear()
    a.close(), b.close(), r.close()


def test_redis_backend_unreachable_at_start_is_not_fatal() -> None:
    pytest.importorskip("redis")
    from fdx.plugins.cache_backends.redis import create
    from kvservices import free_port

    b = create({"port": free_port(), "timeout": 0.2})  # nothing listens there
    assert not b.health()
    with pytest.raises(Exception):
        b.exists_batch([key(1)])
    b.close()


# ---------------------------------------------------------------- mooncake


@needs_mooncake
@pytest.mark.mooncake
def test_mooncake_settings_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fdx.plugins.cache_backends.mooncake import resolve_settings

    cfg = tmp_path / "mc.json"
    cfg.write_text('{"master_server_address": "10.0.0.1:1", "local_buffer_size": 1048576, "protocol": "tcp"}')
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(cfg))
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "64M")
    monkeypatch.delenv("MOONCAKE_MASTER", raising=False)
    s = resolve_settings({})
    assert s["master"] == "10.0.0.1:1" and s["local_buffer_size"] == 1 << 20 and s["global_segment_size"] == 64 << 20
    monkeypatch.setenv("MOONCAKE_MASTER", "127.0.0.1:2")
    assert resolve_settings({})["master"] == "127.0.0.1:2"
    assert resolve_settings({"master": "127.0.0.1:3"})["master"] == "127.0.0.1:3"


@needs_mooncake
@pytest.mark.mooncake
def test_mooncake_pool_keeps_objects_after_the_writer_exits(mooncake_pool: MooncakeMaster) -> None:
    """A block put by another engine process (segment 0, objects in the
    standalone pool) is readable after that process exited."""
    code = textwrap.dedent(
        f"""
        from fdx.plugins.cache_backends.mooncake import create
        b = create({{"master": "{mooncake_pool.address}", "global_segment_size": 0, "local_buffer_size": "16M"}})
        b.put_batch([("fdx_other_proc", b"from-another-process" * 1000)])
        b.close()
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env={**os.environ, "MC_LOG_LEVEL": "ERROR"})
    from fdx.plugins.cache_backends.mooncake import create

    b = create({"master": mooncake_pool.address, "global_segment_size": 0, "local_buffer_size": "16M"})
    try:
        assert b.get_batch(["fdx_other_proc"]) == [b"from-another-process" * 1000]
        assert b.exists_batch(["fdx_other_proc", "fdx_nope"]) == [True, False]
        b.clear("fdx_other")
        assert b.exists_batch(["fdx_other_proc"]) == [False]
    finally:
        b.close()


@needs_mooncake
@pytest.mark.mooncake
def test_mooncake_master_down_raises_fast_then_recovers() -> None:
    from fdx.plugins.cache_backends.backend_options import BackendUnavailable
    from fdx.plugins.cache_backends.mooncake import create

    with MooncakeMaster() as master:
        # no pool: this client contributes its own segment
        b = create({"master": master.address, "global_segment_size": "64M", "local_buffer_size": "16M"})
        try:
            b.put_batch([(key(1), b"v" * 100)])
            assert b.get_batch([key(1)]) == [b"v" * 100]
            master.kill()
            assert not b.health()
            for op in (lambda: b.get_batch([key(1)]), lambda: b.put_batch([(key(2), b"w")]),
                       lambda: b.exists_batch([key(1)])):
                with pytest.raises(BackendUnavailable):
                    op()
            assert b.stats()["errors"] >= 3
            master.start()  # same port, empty metadata
            deadline = time.monotonic() + 30  # the client reconnects on its own schedule
            while not b.health():
                assert time.monotonic() < deadline, "mooncake client did not reconnect"
                time.sleep(0.2)
            assert b.get_batch([key(1)]) == [None]
        finally:
            b.close()


@needs_mooncake
@pytest.mark.mooncake
def test_mooncake_master_absent_at_start_is_not_fatal() -> None:
    from fdx.plugins.cache_backends.mooncake import create
    from kvservices import free_port

    b = create({"master": f"127.0.0.1:{free_port()}", "global_segment_size": 0})
    assert not b.health()
    with pytest.raises(ConnectionError):
        b.get_batch([key(1)])
    b.close()


@needs_mooncake
@pytest.mark.mooncake
def test_mooncake_first_get_in_a_fresh_client_fits_its_buffer(mooncake_pool: MooncakeMaster) -> None:
    """A reader that never put anything still splits a 45 MB get to fit a
    16 MB local buffer."""
    from fdx.plugins.cache_backends.mooncake import create

    opts = {"master": mooncake_pool.address, "global_segment_size": 0, "local_buffer_size": "16M"}
    writer = create(opts)
    payloads = [bytes([i]) * BLOCK for i in range(62)]
    writer.put_batch([(key(i, "fresh"), p) for i, p in enumerate(payloads)])
    reader = create(opts)
    try:
        got = reader.get_batch([key(i, "fresh") for i in range(62)])
        assert [g == p for g, p in zip(got, payloads)] == [True] * 62
    finally:
        writer.clear("fdx_testfresh")
        writer.close()
        reader.close()
