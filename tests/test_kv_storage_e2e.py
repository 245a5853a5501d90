"""The KV storage tier end to end: real ``fdx serve`` processes, the real
model, real stores (a directory, redis-server, mooncake_master + a
mooncake_client pool).

* ``--cache-backend file``: a restarted server serves the same ~1,000-token
  prompt with >= 90% cached tokens and the identical greedy output;
* mooncake / redis: server B serves server A's prompt from the shared store;
  then the store is killed mid-run and every request still succeeds, with a
  warning in the log and backend errors in /metrics;
* a block written under another weights version is never loaded.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest
from kvservices import MooncakeMaster, MooncakePool, RedisServer, have_mooncake, have_redis
from serverutil import read_log, start_server

pytestmark = pytest.mark.slow

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau upsilon".split()


def long_prompt(tag: str, n_words: int = 250) -> str:
    """About 4 tokens per word: ~1,000 tokens."""
    return f"[{tag}] " + " ".join(f"{WORDS[i % 20]}{i}" for i in range(n_words))


def complete(base: str, prompt: str, max_tokens: int = 8) -> tuple[str, int, int]:
    """Greedy completion -> (text, prompt_tokens, cached_tokens)."""
    r = httpx.post(
        base + "/v1/completions",
        json={"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        timeout=600,
    )
    assert r.status_code == 200, r.text
    js = r.json()
    u = js["usage"]
    assert js["choices"][0]["finish_reason"] in ("stop", "length")
    return js["choices"][0]["text"], u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]


def metric(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics", timeout=30).text
    m = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    assert m is not None, f"{name} not in /metrics"
    return float(m.group(1))


def wait_for(cond: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.2)


def backend_args(name: str, config: dict[str, Any]) -> tuple[str, ...]:
    return ("--cache-backend", name, "--cache-backend-config", json.dumps(config))


# ---------------------------------------------------------------- file: restart


def test_file_backend_survives_restart_and_rejects_other_versions(tmp_path: Path) -> None:
    args = backend_args("file", {"path": str(tmp_path / "kv")})
    prompt = long_prompt("file")
    with start_server(*args) as (base, _):
        text, n_prompt, cached = complete(base, prompt)
        assert n_prompt >= 900 and cached == 0
    # the stop drained the writer queue: the blocks are on disk
    assert len([p for p in (tmp_path / "kv").rglob("*") if p.is_file()]) >= n_prompt // 16
    from fdx.model.source import embedded_gguf_path

    # update_weights below loads the embedded model again: allow its directory
    with start_server(*args, "--allowed-weights-dir", os.path.dirname(embedded_gguf_path())) as (base, _):
        text2, _, cached2 = complete(base, prompt)
        assert text2 == text
        assert cached2 >= 0.9 * n_prompt, (cached2, n_prompt)
        assert metric(base, "fdx:kv_storage_hits_total") >= cached2
        # the same weights under another version: other KV fingerprint, so no
        # stored block (nor device block) may be reused
        for route, body in (("pause", None), ("update_weights", {"path": embedded_gguf_path(), "version": "v-other"}),
                            ("resume", None)):
            r = httpx.post(f"{base}/v1/{route}", json=body or {}, timeout=600)
            assert r.status_code == 200, r.text
        hits_before = metric(base, "fdx:kv_storage_hits_total")
        text3, _, cached3 = complete(base, prompt)
        assert cached3 == 0 and text3 == text
        assert metric(base, "fdx:kv_storage_hits_total") == hits_before


# ---------------------------------------------------------------- shared stores


def shared_store_scenario(args: tuple[str, ...], count_keys: Callable[[], int], kill: Callable[[], None],
                          tag: str) -> None:
    """A and B share the store: B serves A's prompt from it.  Then the store
    dies mid-run: every request still succeeds (recompute), B logs a warning
    and counts backend errors in /metrics."""
    prompt = long_prompt(tag)
    with start_server(*args) as (base_a, _), start_server(*args) as (base_b, proc_b):
        text_a, n_prompt, cached_a = complete(base_a, prompt)
        assert cached_a == 0
        # A's writer thread stored the full blocks.  A key counted by the store
        # is not yet readable (Mooncake counts it from the start of its put,
        # while exists() stays false until the put ends), so wait for A's
        # completed writes, then for the store's key count.
        n_blocks = n_prompt // 16
        wait_for(lambda: metric(base_a, "fdx:kv_storage_puts_total") >= n_blocks, 120)
        wait_for(lambda: count_keys() >= n_blocks)
        text_b, _, cached_b = complete(base_b, prompt)
        assert text_b == text_a
        assert cached_b >= 0.9 * n_prompt, (cached_b, n_prompt)
        assert metric(base_b, "fdx:kv_storage_hits_total") >= cached_b
        assert metric(base_b, "fdx:kv_storage_errors_total") == 0

        # kill the store while requests are in flight
        results: list[Any] = []

        def worker(i: int) -> None:
            try:
                results.append(complete(base_b, long_prompt(f"{tag}-kill{i}", 60), max_tokens=16))
            except BaseException as exc:  # noqa: BLE001 - reported below
                results.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        kill()
        for t in threads:
            t.join(600)
        # after the kill: a stored prompt and a new one are both served by recompute
        results.append(complete(base_b, prompt))
        results.append(complete(base_b, long_prompt(f"{tag}-after", 60)))
        bad = [r for r in results if isinstance(r, BaseException)]
        assert not bad, bad
        assert results[-2][0] == text_a  # identical greedy output without the store
        wait_for(lambda: metric(base_b, "fdx:kv_storage_errors_total") >= 1, 30)
        log = read_log(proc_b, 200_000)
        assert "KV storage" in log and "backend failed" in log, log[-3000:]


@pytest.mark.mooncake
@pytest.mark.skipif(not have_mooncake(), reason="mooncake not installed")
def test_mooncake_shared_across_two_servers_and_master_death() -> None:
    with MooncakeMaster() as master, MooncakePool(master, "1 GB"):
        args = backend_args("mooncake", {"master": master.address, "global_segment_size": 0})
        shared_store_scenario(args, master.key_count, master.kill, "mooncake")


@pytest.mark.redis
@pytest.mark.skipif(not have_redis(), reason="redis-server not installed")
def test_redis_shared_across_two_servers_and_server_death() -> None:
    import redis as redis_py

    with RedisServer() as srv:
        client = redis_py.Redis.from_url(srv.url)

        def count_keys() -> int:
            return int(client.dbsize())

        args = backend_args("redis", {"url": srv.url})
        try:
            shared_store_scenario(args, count_keys, srv.kill, "redis")
        finally:
            client.close()
