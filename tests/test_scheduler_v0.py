"""v0: the seed's chunk-size rule (partial_chunked_tokens, leftover budget
to the shortest request), admission with an output-block reserve, static
slots, and the out-of-blocks error."""

from __future__ import annotations

import numpy as np
import pytest

from fdx.config import make_config
from fdx.core.kv_cache import KVCacheManager
from fdx.testing import FakeRunner, make_request
from fdx.plugins.schedulers.v0 import OUT_OF_BLOCKS, V0Scheduler, partial_chunked_tokens, plan_chunks


def test_partial_chunked_tokens_table() -> None:
    assert partial_chunked_tokens(512, 16, 3) == [0, 512, 256, 160]
    assert partial_chunked_tokens(100, 16, 2) == [0, 96, 48]


@pytest.mark.parametrize(
    "sizes, expected",
    [
        # one request: block-aligned partial chunk, then the rest
        ([1000], [[512, 488]]),
        ([512], [[512]]),
        # chunk_request_num drops inside a round: the 2nd request gets the 1-request chunk
        ([100, 300], [[100], [300]]),
        ([300, 300], [[256, 44], [256, 44]]),
        # leftover budget (>= one block) goes to the request with fewest tokens left:
        # round 1: 160,160,160 + 32 leftover to the 2nd (40 left) -> 192
        # round 2: 160, 8, 256 + 80 leftover to the 1st (280 left) -> 240
        # round 3: 200, 284
        ([600, 200, 700], [[160, 240, 200], [192, 8], [160, 256, 284]]),
    ],
)
def test_plan_matches_seed_rule(sizes: list[int], expected: list[list[int]]) -> None:
    plan = plan_chunks(sizes, 512, 16)
    assert plan == expected
    assert [sum(p) for p in plan] == sizes
    rounds = max(len(p) for p in plan)
    for k in range(rounds):
        assert sum(p[k] for p in plan if len(p) > k) <= 512


def test_plan_never_exceeds_budget_with_decodes() -> None:
    # the seed would give round 1 = 100 + 256 + 256 = 612 tokens; fdx clamps to the budget
    plan = plan_chunks([100, 300, 700], 512, 16)
    assert plan == [[100], [256, 44], [156, 467, 77]]
    plan = plan_chunks([100, 300, 700], 512, 16, num_decodes=10)
    for k in range(3):
        decodes = 10 + sum(1 for p in plan if len(p) < k + 1)  # finished earlier -> decode now
        assert sum(p[k] for p in plan if len(p) > k) + decodes <= 512
    assert [sum(p) for p in plan] == [100, 300, 700]


def test_plan_rejects_impossible_batches() -> None:
    with pytest.raises(ValueError):
        plan_chunks([10] * 5, 64, 16)
    with pytest.raises(ValueError):
        plan_chunks([10], 64, 16, num_decodes=64)


@pytest.mark.parametrize("seed", range(20))
def test_plan_random_properties(seed: int) -> None:
    rng = np.random.default_rng(seed)
    bs = int(rng.choice([1, 4, 16]))
    budget = int(rng.integers(bs * 3, 600))
    n = int(rng.integers(1, min(3, budget // bs) + 1))
    sizes = [int(x) for x in rng.integers(1, 2000, n)]
    dec = int(rng.integers(0, budget - n + 1))
    plan = plan_chunks(sizes, budget, bs, num_decodes=dec)
    assert [sum(p) for p in plan] == sizes
    for k in range(max(len(p) for p in plan)):
        decodes = dec + sum(1 for p in plan if len(p) < k + 1)
        assert sum(p[k] for p in plan if len(p) > k) + decodes <= budget


def build(num_blocks: int = 400, **kw: object) -> tuple[V0Scheduler, KVCacheManager, FakeRunner]:
    opts = dict(max_num_seqs=8, max_num_batched_tokens=512, block_size=16, enable_prefix_caching=False)
    opts.update(kw)
    cfg = make_config(**opts)
    kv = KVCacheManager(num_blocks, 16, cfg.enable_prefix_caching)
    return V0Scheduler(cfg, kv), kv, FakeRunner(kv, vocab=64, eos=-5)


def step(s: V0Scheduler, runner: FakeRunner) -> list[tuple[str, int]]:
    b = s.schedule()
    if b:
        s.update(b, runner.execute(b))
    s.check_invariants()
    return [(q.request.request_id, q.num_new_tokens) for q in b.seqs]


def test_scheduler_follows_the_plan_and_admits_in_batches() -> None:
    s, kv, runner = build()
    for rid, n in (("a", 600), ("b", 200), ("c", 700), ("d", 50)):
        s.add_request(make_request(rid, list(np.arange(n) % 50 + 1), 20))
    # a, b, c form one prefill batch (max_prefill_batch = 3); d waits
    assert step(s, runner) == [("a", 160), ("b", 192), ("c", 160)]
    # round 2: no decodes yet (b samples at the end of round 2)
    assert step(s, runner) == [("a", 240), ("b", 8), ("c", 256)]
    # round 3: b decodes (1 token), so the round's budget is 511 -- the plan
    # still fits: 200 + 284 + 1 <= 512
    assert step(s, runner) == [("a", 200), ("b", 1), ("c", 284)]
    # prefill batch done: every running request decodes, d is admitted
    assert step(s, runner) == [("a", 1), ("b", 1), ("c", 1), ("d", 50)]
    assert step(s, runner) == [("a", 1), ("b", 1), ("c", 1), ("d", 1)]


def test_admission_requires_output_reserve() -> None:
    # 12 blocks: a's 8 prompt blocks + 2 reserved fit; then b's 3 + 2 > 4 free: b waits
    s, kv, runner = build(num_blocks=12)
    s.add_request(make_request("a", list(range(1, 129)), 4))  # 8 blocks
    s.add_request(make_request("b", list(range(1, 49)), 4))  # 3 blocks
    assert step(s, runner) == [("a", 128)]
    assert s.num_waiting == 1 and kv.num_free_blocks == 4
    while s.get("a") is not None:
        assert s.num_waiting == 1
        step(s, runner)
    assert step(s, runner) == [("b", 48)]


def test_static_slots() -> None:
    s, kv, runner = build(max_num_seqs=2)
    for i in range(4):
        s.add_request(make_request(f"r{i}", [i + 1] * 10, 5))
    assert [r for r, _ in step(s, runner)] == ["r0", "r1"]
    for _ in range(3):
        assert len(step(s, runner)) == 2
    assert s.num_waiting == 2


def test_out_of_blocks_while_decoding_fails_with_507() -> None:
    s, kv, runner = build(num_blocks=6)
    # each needs 2 blocks for the prompt (+2 reserve at admission), 1-2 more to decode
    for rid, lo in (("a", 1), ("b", 40)):
        r = make_request(rid, list(range(lo, lo + 29)), 40)
        r.eos_token_ids = frozenset()  # decode the full 40 tokens
        s.add_request(r)
    failed = []
    for _ in range(60):
        b = s.schedule()
        failed += b.failed
        if b:
            s.update(b, runner.execute(b))
        s.check_invariants()
        if not s.has_work():
            break
    assert len(failed) == 1
    r = failed[0]
    assert r.error_code == OUT_OF_BLOCKS == 507
    assert "KV cache blocks ran out" in r.error and not r.block_ids
    assert s.num_preemptions == 0 and kv.num_used_blocks == 0


def test_abort_during_prefill_batch() -> None:
    s, kv, runner = build()
    for rid, n in (("a", 600), ("b", 200), ("c", 700)):
        s.add_request(make_request(rid, [7] * n, 5))
    step(s, runner)
    assert "c" in s.plans
    s.abort(["c"])
    s.check_invariants()
    assert "c" not in s.plans
    while s.has_work():
        step(s, runner)
    assert kv.num_used_blocks == 0
