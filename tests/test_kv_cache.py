"""KVCacheManager: allocation, prefix caching, eviction, storage hooks."""

from __future__ import annotations

from typing import Callable

import pytest

from fdx.core.kv_cache import KVCacheManager
from fdx.core.request import Request
from fdx.testing import check_kv_invariants, make_request

BS = 4


def req(rid: str, prompt: list[int], max_tokens: int = 8) -> Request:
    return make_request(rid, prompt, max_tokens)


def admit(kv: KVCacheManager, r: Request) -> int:
    """Admit ``r`` with its prefix match, compute its whole prompt, commit."""
    computed = kv.get_computed_blocks(r)
    assert kv.allocate(r, r.num_tokens - len(computed) * BS, computed)
    r.num_computed_tokens = r.num_tokens
    kv.commit(r)
    return len(computed)


def test_allocate_free_accounting() -> None:
    kv = KVCacheManager(10, BS, enable_prefix_caching=False)
    r = req("a", list(range(1, 10)))  # 9 tokens -> 3 blocks
    assert kv.allocate(r, 9, [])
    assert len(r.block_ids) == 3 and kv.num_used_blocks == 3 and kv.num_free_blocks == 7
    check_kv_invariants(kv, [r])
    r.num_computed_tokens = 9
    assert kv.allocate(r, 3)  # positions 9..11 fit in block 3
    assert len(r.block_ids) == 3
    assert kv.allocate(r, 4)
    assert len(r.block_ids) == 4
    check_kv_invariants(kv, [r])
    kv.free(r)
    assert r.block_ids == [] and r.num_computed_tokens == 0
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == 10
    check_kv_invariants(kv, [])


def test_allocate_failure_changes_nothing() -> None:
    kv = KVCacheManager(4, BS, enable_prefix_caching=True)
    a = req("a", list(range(1, 13)))
    assert kv.allocate(a, 12, [])
    b = req("b", list(range(20, 30)))
    assert not kv.allocate(b, 10, [])
    assert b.block_ids == [] and kv.num_used_blocks == 3 and kv.prefix_queries == 12
    assert kv.allocate(b, 4, [])
    assert kv.allocate(b, 1) and len(b.block_ids) == 1  # room left in its block: no new block
    c = req("c", [1])
    assert not kv.can_allocate(c, 1, [], watermark=1)
    check_kv_invariants(kv, [a, b])


def test_prefix_match_shares_blocks_and_never_covers_last_token() -> None:
    kv = KVCacheManager(20, BS, enable_prefix_caching=True)
    prompt = list(range(1, 13))  # exactly 3 full blocks
    a = req("a", prompt)
    assert admit(kv, a) == 0
    assert len(kv.cached) == 3
    b = req("b", list(prompt))
    n = admit(kv, b)
    assert n == 2  # the last block holds the last token: recomputed
    assert b.num_cached_tokens == 8
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert kv.ref_cnt[a.block_ids[0]] == 2
    assert kv.prefix_queries == 24 and kv.prefix_hits == 8
    check_kv_invariants(kv, [a, b])
    c = req("c", prompt[:6] + [99, 98, 97])
    assert admit(kv, c) == 1
    check_kv_invariants(kv, [a, b, c])
    for r in (a, b, c):
        kv.free(r)
    check_kv_invariants(kv, [])
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == 20


def test_hash_chain_is_stable_and_stored() -> None:
    kv = KVCacheManager(20, BS, enable_prefix_caching=True)
    a = req("a", list(range(1, 10)))
    admit(kv, a)
    kv2 = KVCacheManager(20, BS, enable_prefix_caching=True)
    b = req("b", list(range(1, 10)))
    kv2.ensure_hashes(b, 2)
    assert a.block_hashes == b.block_hashes and len(a.block_hashes) == 2
    # different earlier block -> different later hash (chain)
    c = req("c", [7] + list(range(2, 10)))
    kv2.ensure_hashes(c, 2)
    assert c.block_hashes[1] != b.block_hashes[1]


def test_output_tokens_are_cached_too() -> None:
    kv = KVCacheManager(20, BS, enable_prefix_caching=True)
    a = req("a", [1, 2, 3])
    assert kv.allocate(a, 3, [])
    a.num_computed_tokens = 3
    for t in (4, 5, 6):  # decode: computed positions 3, 4, 5
        a.append_token(t)
        assert kv.allocate(a, 1)
        a.num_computed_tokens += 1
        kv.commit(a)
    assert len(kv.cached) == 1  # positions 0..3 = [1,2,3,4]
    b = req("b", [1, 2, 3, 4, 5])
    assert kv.get_computed_blocks(b) == a.block_ids[:1]


def test_lru_eviction_tail_first() -> None:
    kv = KVCacheManager(6, BS, enable_prefix_caching=True)
    a = req("a", list(range(1, 14)))  # 13 tokens: 3 full blocks + 1
    admit(kv, a)
    blocks = list(a.block_ids)
    kv.free(a)
    assert kv.num_used_blocks == 0 and len(kv.cached) == 3
    check_kv_invariants(kv, [])
    # 2 plain free blocks + 1 unregistered (the partial tail) are used first
    b = req("b", list(range(50, 62)))  # 3 blocks
    assert kv.allocate(b, 12, [])
    assert len(kv.cached) == 3
    c = req("c", list(range(70, 74)))
    assert kv.allocate(c, 4, [])
    # the evicted one is a's tail full block (freed first)
    assert blocks[2] in c.block_ids and len(kv.cached) == 2 and kv.num_evictions == 1
    d = req("d", list(range(1, 14)))
    assert kv.get_computed_blocks(d) == blocks[:2]
    check_kv_invariants(kv, [b, c])


def test_evictable_prefix_blocks_count_against_free() -> None:
    kv = KVCacheManager(4, BS, enable_prefix_caching=True)
    a = req("a", list(range(1, 10)))  # 2 full + 1
    admit(kv, a)
    kv.free(a)
    b = req("b", list(range(1, 10)) + list(range(100, 108)))  # 17 tokens = 5 blocks, 2 cached
    computed = kv.get_computed_blocks(b)
    assert len(computed) == 2
    assert kv.num_blocks_needed(b, 17 - 8, computed) == 5
    assert not kv.allocate(b, 9, computed)
    check_kv_invariants(kv, [])
    c = req("c", list(range(1, 10)) + [100, 101, 102])  # 12 tokens: 3 blocks, 2 cached
    computed = kv.get_computed_blocks(c)
    assert kv.allocate(c, 4, computed)
    check_kv_invariants(kv, [c])


def test_reset_prefix_cache() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    a = req("a", list(range(1, 10)))
    b = req("b", list(range(20, 30)))
    admit(kv, a)
    admit(kv, b)
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert not kv.cached
    check_kv_invariants(kv, [b])
    kv.free(b)
    check_kv_invariants(kv, [])
    assert kv.num_free_blocks == 8 and len(kv._free) == 8


def test_disabled_prefix_caching() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    a = req("a", list(range(1, 10)))
    admit(kv, a)
    b = req("b", list(range(1, 10)))
    assert admit(kv, b) == 0 and not kv.cached
    check_kv_invariants(kv, [a, b])


class FakeStorage:
    """Stores block hash -> tokens; 'loads' by recording which device block
    got which hash (the KV content itself is the runner's business)."""

    def __init__(self) -> None:
        self.store: dict[int, int] = {}  # hash -> the block it came from
        self.full: list[tuple[int, int]] = []
        self.evicted: list[tuple[int, int]] = []
        self.loaded: list[tuple[int, int]] = []

    def on_block_full(self, block_id: int, block_hash: int) -> None:
        self.full.append((block_id, block_hash))
        self.store[block_hash] = block_id

    def on_block_evicted(self, block_id: int, block_hash: int) -> None:
        self.evicted.append((block_id, block_hash))

    def load_prefix(self, request: Request, n: int, allocate: Callable[[int], list[int]]) -> int:
        k = 0
        for h in request.block_hashes[n:]:
            if h not in self.store:
                break
            k += 1
        if k == 0:
            return 0
        ids = allocate(k)
        for j, b in enumerate(ids):
            self.loaded.append((b, request.block_hashes[n + j]))
        return len(ids)


def test_storage_hooks_extend_the_match() -> None:
    kv = KVCacheManager(6, BS, enable_prefix_caching=True)
    st = FakeStorage()
    kv.storage = st
    prompt = list(range(1, 14))  # 3 full blocks + 1
    a = req("a", prompt)
    admit(kv, a)
    assert [h for _, h in st.full] == a.block_hashes[:3]
    kv.free(a)
    # fill the pool with something else: evicts all of a's cached blocks
    x = req("x", list(range(100, 124)))
    assert kv.allocate(x, 24, [])
    assert len(st.evicted) == 3 and not kv.cached
    kv.free(x)
    b = req("b", list(prompt))
    computed = kv.get_computed_blocks(b)
    assert len(computed) == 3 and len(st.loaded) == 3
    assert [h for _, h in st.loaded] == b.block_hashes[:3]
    check_kv_invariants(kv, [])
    assert kv.allocate(b, 1, computed)
    assert b.num_cached_tokens == 12 and kv.prefix_hits == 12
    check_kv_invariants(kv, [b])


def test_storage_probed_once_per_admission() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    calls = []

    class Counting(FakeStorage):
        def load_prefix(self, request: Request, n: int, allocate: Callable[[int], list[int]]) -> int:
            calls.append(n)
            return 0

    kv.storage = Counting()
    r = req("r", list(range(1, 20)))
    kv.get_computed_blocks(r)
    kv.get_computed_blocks(r)  # blocked at the head of the queue: no second probe
    assert calls == [0]
    assert kv.allocate(r, 19, [])
    kv.free(r)  # preemption re-arms the probe
    kv.get_computed_blocks(r)
    assert len(calls) == 2


def test_storage_load_never_evicts_matched_blocks() -> None:
    kv = KVCacheManager(4, BS, enable_prefix_caching=True)
    st = FakeStorage()
    kv.storage = st
    prompt = list(range(1, 18))  # 4 full blocks + 1
    a = req("a", prompt[:9])
    admit(kv, a)  # registers blocks 0,1 of the prompt
    kv.free(a)
    # pretend storage has blocks 2 and 3 of the chain
    b = req("b", prompt)
    kv.ensure_hashes(b, 4)
    st.store[b.block_hashes[2]] = -1
    st.store[b.block_hashes[3]] = -1
    computed = kv.get_computed_blocks(b)
    # pool of 4: 2 matched (pinned) + at most 2 loaded
    assert len(computed) == 4 and len(set(computed)) == 4
    check_kv_invariants(kv, [])
    assert not kv.allocate(b, 1, computed)  # needs a 5th block
    check_kv_invariants(kv, [])


def test_invariant_checker_catches_bad_tables() -> None:
    kv = KVCacheManager(4, BS, enable_prefix_caching=True)
    a = req("a", [1, 2, 3])
    kv.allocate(a, 3, [])
    b = req("b", [1, 2, 3])
    b.block_ids = list(a.block_ids)
    with pytest.raises(AssertionError):
        check_kv_invariants(kv, [a, b])
    with pytest.raises(AssertionError):
        check_kv_invariants(kv, [])


def test_storage_exception_frees_its_blocks() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)

    class Broken(FakeStorage):
        def load_prefix(self, request: Request, n: int, allocate: Callable[[int], list[int]]) -> int:
            allocate(3)
            raise OSError("backend went away")

    kv.storage = Broken()
    r = req("r", list(range(1, 20)))
    assert kv.get_computed_blocks(r) == []
    check_kv_invariants(kv, [])
    assert kv.num_free_blocks == 8
