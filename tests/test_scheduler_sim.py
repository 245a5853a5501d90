"""Both schedulers driven for thousands of steps by a fake model runner that
checks KV placement (random prompts/outputs, shared prefixes, aborts, tiny
pools); block invariants are checked after every step."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from fdx.config import make_config
from fdx.core.interfaces import ModelOutput
from fdx.core.kv_cache import KVCacheManager
from fdx.core.request import Status
from fdx.testing import check_kv_invariants, FakeRunner, make_request, simulate
from fdx.plugins.schedulers.v0 import V0Scheduler
from fdx.plugins.schedulers.v1 import V1Scheduler

SCHEDULERS = {"v0": V0Scheduler, "v1": V1Scheduler}


def build(name: str, num_blocks: int, block_size: int = 8, **cfg_kw: object):  # type: ignore[no-untyped-def]
    kw = dict(max_num_seqs=16, max_num_batched_tokens=64, block_size=block_size)
    kw.update(cfg_kw)
    cfg = make_config(**kw)
    kv = KVCacheManager(num_blocks, block_size, cfg.enable_prefix_caching)
    return SCHEDULERS[name](cfg, kv), kv


def run(name: str, num_blocks: int, seed: int, **kw: object):  # type: ignore[no-untyped-def]
    sim_kw = {k: kw.pop(k) for k in list(kw) if k in ("abort_prob", "num_requests", "arrival_prob", "max_output")}
    sched, kv = build(name, num_blocks, **kw)
    res = simulate(sched, FakeRunner(kv), seed=seed, **sim_kw)  # type: ignore[arg-type]
    # everything ended, nothing leaked
    assert kv.num_used_blocks == 0
    assert kv.num_free_blocks == kv.num_blocks
    check_kv_invariants(kv, [])
    return res, sched, kv


@pytest.fixture(scope="module")
def baseline() -> dict[int, dict[str, list[int]]]:
    """Unconstrained outputs per workload seed (huge pool, v1)."""
    out = {}
    for seed in range(3):
        res, _, _ = run("v1", 5000, seed)
        assert set(res.ends.values()) == {"finished"}
        out[seed] = res.outputs
    return out


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("num_blocks", [40, 26])
def test_v1_preemption_keeps_greedy_outputs(seed: int, num_blocks: int, baseline: dict) -> None:
    res, sched, _ = run("v1", num_blocks, seed)
    assert res.preemptions > 0
    failed = {k for k, v in res.ends.items() if v == "failed"}
    for k in failed:  # only requests that can never fit may fail
        assert "whole pool" in res.errors[k]
    for k, toks in res.outputs.items():
        if k not in failed:
            assert toks == baseline[seed][k], k
    assert res.steps > 500


@pytest.mark.parametrize("seed", range(3))
def test_v1_random_aborts_tiny_pool(seed: int) -> None:
    res, _, _ = run("v1", 24, seed, abort_prob=0.05, num_requests=300)
    c = Counter(res.ends.values())
    assert c["aborted"] > 0 and c["finished"] > 0
    assert res.steps > 1000


@pytest.mark.parametrize(
    "opts",
    [
        dict(enable_chunked_prefill=False, max_num_batched_tokens=400),
        dict(enable_prefix_caching=False),
        dict(max_num_seqs=2),
        dict(block_size=1, max_num_batched_tokens=16),
        dict(block_size=16, max_num_batched_tokens=16),
    ],
)
def test_v1_config_variants(opts: dict, baseline: dict) -> None:
    bs = int(opts.pop("block_size", 8))
    nb = 30 * 8 // bs
    res, _, _ = run("v1", nb, 0, block_size=bs, **opts)
    for k, toks in res.outputs.items():
        if res.ends[k] == "finished":
            assert toks == baseline[0][k]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("num_blocks", [5000, 60, 30])
def test_v0_sim(seed: int, num_blocks: int, baseline: dict) -> None:
    res, sched, _ = run("v0", num_blocks, seed, abort_prob=0.01)
    assert sched.num_preemptions == 0
    for k, end in res.ends.items():
        if end == "failed":
            msg = res.errors[k]
            assert "KV cache blocks ran out" in msg or "whole pool" in msg
        if end == "finished":
            assert res.outputs[k] == baseline[seed][k]
    if num_blocks == 5000:
        assert "failed" not in res.ends.values()


def test_v0_no_chunked_prefill(baseline: dict) -> None:
    res, _, _ = run("v0", 5000, 0, enable_chunked_prefill=False, max_num_batched_tokens=400)
    assert set(res.ends.values()) == {"finished"}
    assert res.outputs == baseline[0]


@pytest.mark.parametrize("name", ["v0", "v1"])
def test_request_that_never_fits_fails_cleanly(name: str) -> None:
    sched, kv = build(name, 10)
    r = make_request("big", list(range(1, 100)), max_tokens=5)  # 103 positions > 80
    sched.add_request(r)
    assert sched.has_work()
    batch = sched.schedule()
    assert batch.failed == [r] and not batch.seqs
    assert r.error_code == 400 and "whole pool" in r.error
    assert r.finish_reason == "error" and r.status is Status.FINISHED
    assert not sched.has_work() and sched.get("big") is None


def test_v1_no_chunked_prefill_rejects_long_prompt() -> None:
    sched, _ = build("v1", 100, enable_chunked_prefill=False, max_num_batched_tokens=64)
    sched.add_request(make_request("long", list(range(1, 80)), 4))
    batch = sched.schedule()
    assert batch.failed and "chunked prefill is disabled" in batch.failed[0].error


@pytest.mark.parametrize("name", ["v0", "v1"])
def test_abort_frees_blocks_at_once(name: str) -> None:
    sched, kv = build(name, 100)
    reqs = [make_request(f"r{i}", list(range(1 + i, 40 + i)), 10) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    batch = sched.schedule()
    assert kv.num_used_blocks > 0
    removed = sched.abort(["r0", "nope"])
    assert [r.request_id for r in removed] == ["r0"] and not reqs[0].block_ids
    sched.update(batch, ModelOutput(np.full(len(batch.seqs), -1)))  # r0's seq is skipped
    sched.check_invariants()
    assert sorted(r.request_id for r in sched.preempt_all()) == ["r1", "r2"]
    assert kv.num_used_blocks == 0 and not sched.has_work()
    sched.check_invariants()


def test_v1_budget_interleaves_decodes_and_chunks() -> None:
    sched, kv = build("v1", 200, max_num_batched_tokens=32)
    runner = FakeRunner(kv, vocab=64, eos=-5)
    a = make_request("a", list(range(1, 6)), 50)
    sched.add_request(a)
    out = runner.execute(b := sched.schedule())
    sched.update(b, out)
    long = make_request("long", list(range(1, 101)), 5)
    sched.add_request(long)
    b = sched.schedule()
    # a's decode first, then a 31-token chunk of the long prompt
    assert [(s.request.request_id, s.num_new_tokens) for s in b.seqs] == [("a", 1), ("long", 31)]
    sched.update(b, runner.execute(b))
    b = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in b.seqs] == [("a", 1), ("long", 31)]
    assert b.num_tokens == 32


def test_v1_preempts_newest_and_resumes_first() -> None:
    sched, kv = build("v1", 6, block_size=4, max_num_batched_tokens=64)
    runner = FakeRunner(kv, vocab=64, eos=-5)
    old = make_request("old", list(range(1, 9)), 12)  # up to 5 blocks each, 6 in the pool
    new = make_request("new", list(range(20, 28)), 12)
    sched.add_request(old)
    sched.add_request(new)
    preempted = []
    for _ in range(200):
        b = sched.schedule()
        preempted += [r.request_id for r in b.preempted]
        if b:
            sched.update(b, runner.execute(b))
        sched.check_invariants()
        if not sched.has_work():
            break
    assert preempted and preempted[0] == "new"
    assert new.num_preemptions >= 1 and old.num_preemptions == 0
    assert old.num_output_tokens == 12 and new.num_output_tokens == 12
    assert old.finish_reason == new.finish_reason == "length"
    assert sched.stats()["num_preemptions"] == len(preempted)


def test_v1_resume_without_chunked_prefill() -> None:
    # r1's prompt (60) fits the 64-token budget whole; preempted after more
    # than 4 outputs it needs > 64 tokens recomputed: it must resume in chunks
    sched, kv = build("v1", 14, enable_chunked_prefill=False, max_num_batched_tokens=64)
    runner = FakeRunner(kv, vocab=64, eos=-5)
    reqs = [make_request("r0", [1] * 20, 40), make_request("r1", [2] * 60, 40)]
    for r in reqs:
        r.eos_token_ids = frozenset()
        sched.add_request(r)
    for _ in range(500):
        b = sched.schedule()
        if b:
            sched.update(b, runner.execute(b))
        sched.check_invariants()
        if not sched.has_work():
            break
    assert not sched.has_work()
    assert sched.num_preemptions > 0
    assert all(r.num_output_tokens == 40 for r in reqs)
