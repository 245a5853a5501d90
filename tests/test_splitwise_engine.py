"""The splitwise handoff inside real engines (in process, real connectors,
the KV-checking echo runner): P prefills and sends the first token with the
KV, D inserts the request as prefilled and decodes computing no prompt
token; D's prefix cache; stop on the first token; abort, lost peer and
timeout free the blocks on both sides.  The real-model, real-process tests
are in test_splitwise_engine_serve.py."""

from __future__ import annotations

import random
import time

import pytest

from fdx.core.errors import ConfigError
from fdx.core.messages import AbortRequest, RequestOutput
from kvservices import MooncakeMaster, have_mooncake
from splitwiseutil import drive, echo_engine, finished, pd_pair, request, tokens
from splitwiseutil import request as make_request


@pytest.fixture(scope="module")
def master():  # type: ignore[no-untyped-def]
    with MooncakeMaster() as m:
        yield m


@pytest.fixture
def pd():  # type: ignore[no-untyped-def]
    p, d = pd_pair("zmq")
    try:
        yield p, d
    finally:
        p.close()
        d.close()


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 5000) for _ in range(rng.choice((1, 5, 15, 16, 17, 31, 32, 33, 100)))]
            for _ in range(n)]


def _check_empty(*engines) -> None:  # type: ignore[no-untyped-def]
    for e in engines:
        assert e.kv.num_used_blocks == 0
        assert not e.scheduler.request_ids()
        e.scheduler.check_invariants()


@pytest.mark.parametrize("connector", ["zmq", "mooncake"])
def test_handoff_gives_the_mixed_instance_tokens_and_d_computes_no_prompt(connector: str, request) -> None:  # type: ignore[no-untyped-def]
    if connector == "mooncake":
        if not have_mooncake():
            pytest.skip("mooncake not installed (pip install 'fdx[mooncake]')")
        master = request.getfixturevalue("master")
        p, d = pd_pair("mooncake", connector_config={"master": master.address, "global_segment_size": "32M"})
    else:
        p, d = pd_pair("zmq")
    request.addfinalizer(p.close)
    request.addfinalizer(d.close)
    mixed = echo_engine()
    prompts = _prompts(12)
    for i, ids in enumerate(prompts):
        mixed.add_request(make_request(f"r{i}", ids, max_tokens=7))
        d.add_request(make_request(f"r{i}", ids, p, max_tokens=7))
    ids = [f"r{i}" for i in range(len(prompts))]
    want = drive([mixed], finished(*ids))
    got = drive([p, d], finished(*ids))
    for rid in ids:
        assert tokens(got[rid]) == tokens(want[rid]), rid
        assert got[rid][-1].finish_reason == "length"
        assert got[rid][-1].num_prompt_tokens == want[rid][-1].num_prompt_tokens
    sd, sp = d.stats().splitwise, p.stats().splitwise
    assert sd.role == "decode" and sp.role == "prefill"
    assert sd.handoffs == sp.handoffs == len(prompts)
    assert sd.recomputed_prompt_tokens == 0 and sd.failed == 0
    assert sd.kv_bytes == sp.kv_bytes > 0
    # D ran only decode steps: one token per request per step, never a prompt chunk
    assert d.scheduler.local.num_scheduled_tokens == sum(6 for _ in prompts)
    _check_empty(p, d)
    assert not p.scheduler.jobs and not d.scheduler.handoffs


def test_d_prefix_cache_skips_blocks_it_holds(pd) -> None:  # type: ignore[no-untyped-def]
    p, d = pd
    shared = list(range(100, 148))  # three full blocks
    d.add_request(request("a", shared + [7, 8, 9], p, max_tokens=3))
    drive([p, d], finished("a"))
    first = d.stats().splitwise.kv_bytes
    d.add_request(request("b", shared + [4, 5, 6, 1, 2], p, max_tokens=3))
    out = drive([p, d], finished("b"))
    second = d.stats().splitwise.kv_bytes - first
    block_bytes = p.kv.block_size * 8  # the echo runner's KV: one int64 token id per position
    assert first == 4 * block_bytes  # three full blocks and the partial one
    assert out["b"][-1].num_cached_tokens == 48  # D's own prefix cache
    assert second == block_bytes  # only the last (partial) block travelled
    assert tokens(out["b"]) == (shared + [4, 5, 6, 1, 2])[:3]
    _check_empty(p, d)


def test_request_stopping_on_its_first_token_ends_without_decoding(pd) -> None:  # type: ignore[no-untyped-def]
    p, d = pd
    d.add_request(request("one", [5, 6, 7], p, max_tokens=1))
    d.add_request(request("stop", [9, 6, 7], p, max_tokens=10, stop_token_ids=(9,)))
    before = d.scheduler.local.num_scheduled_tokens
    out = drive([p, d], finished("one", "stop"))
    assert tokens(out["one"]) == [5] and out["one"][-1].finish_reason == "length"
    assert tokens(out["stop"]) == [9] and out["stop"][-1].finish_reason == "stop"
    assert d.scheduler.local.num_scheduled_tokens == before  # D never ran a step for them
    _check_empty(p, d)


def test_abort_on_d_frees_both_sides(pd) -> None:  # type: ignore[no-untyped-def]
    p, d = pd
    d.add_request(request("x", list(range(1, 200)), p, max_tokens=50))
    # D preallocates and sends the job; P takes it and starts prefilling (chunked: 512-token budget, 200 tokens)
    d.step()
    assert d.kv.num_used_blocks > 0 and "x" in d.scheduler.handoffs
    for _ in range(20):
        p.step()
        if p.scheduler.jobs or p.kv.num_used_blocks:
            break
    d.abort(["x"])
    assert d.kv.num_used_blocks == 0
    out = drive([p, d], lambda o: not p.scheduler.jobs and p.kv.num_used_blocks == 0 and "x" in o)
    assert out["x"][-1].finish_reason == "abort"
    for _ in range(5):  # a late answer from P is dropped, its KV never written anywhere
        p.step()
        d.step()
    _check_empty(p, d)


def test_abort_of_a_running_handed_off_request(pd) -> None:  # type: ignore[no-untyped-def]
    p, d = pd
    d.add_request(request("y", [3, 4, 5, 6], p, max_tokens=400))
    drive([p, d], lambda o: "y" in o and len(tokens(o["y"])) >= 3)
    d.abort(["y"])
    drive([p, d], finished("y"))
    _check_empty(p, d)


def test_lost_prefill_instance_fails_the_handoff_with_503_and_frees_d() -> None:
    p, d = pd_pair("zmq", connector_config={"connect_timeout": 1.0, "heartbeat_interval": 0.2,
                                             "heartbeat_timeout": 1.0})
    try:
        d.add_request(request("z", list(range(1, 40)), p, max_tokens=5))
        d.step()  # preallocated, job sent; P never steps: it "hangs", then goes away
        assert d.kv.num_used_blocks > 0
        p.close()
        out = drive([d], finished("z"), timeout=15)
        last = out["z"][-1]
        assert last.finish_reason == "error" and last.error_code == 503
        assert "lost" in (last.error or "") or "unreachable" in (last.error or "")
        assert d.stats().splitwise.failed == 1
        _check_empty(d)
    finally:
        d.close()


def test_unreachable_prefill_address_fails_fast() -> None:
    d = echo_engine(scheduler="splitwise", splitwise_role="decode", kv_connector="zmq",
                    kv_connector_config={"connect_timeout": 0.5})
    try:
        from fdx.core.messages import AddRequest, KVTransferParams, SamplingParams

        from splitwiseutil import free_tcp_address

        d.add_request(AddRequest("u", (1, 2, 3), SamplingParams(max_tokens=2), 0.0,
                                 KVTransferParams(free_tcp_address())))
        out = drive([d], finished("u"), timeout=10)
        assert out["u"][-1].error_code == 503
        d.add_request(AddRequest("v", (1, 2, 3), SamplingParams(max_tokens=2), 0.0, KVTransferParams("nonsense")))
        out = drive([d], finished("v"), timeout=10)
        assert out["v"][-1].error_code == 503 and "not a KV connector address" in out["v"][-1].error
        _check_empty(d)
    finally:
        d.close()


def test_handoff_timeout() -> None:
    p, d = pd_pair("zmq", splitwise_handoff_timeout=0.5)
    try:
        d.add_request(request("t", [1, 2, 3], p, max_tokens=3))
        out = drive([d], finished("t"), timeout=10)  # P is alive but never steps
        assert out["t"][-1].error_code == 503 and "timed out" in out["t"][-1].error
        _check_empty(d)
        drive([p], lambda o: p.scheduler.jobs == {} and p.kv.num_used_blocks == 0 and not p.scheduler.local.waiting)
        _check_empty(p)
    finally:
        p.close()
        d.close()


def test_kv_transfer_params_refused_off_decode(pd) -> None:  # type: ignore[no-untyped-def]
    p, _d = pd
    p.add_request(request("w", [1, 2], p, max_tokens=2))
    out = drive([p], finished("w"))
    assert out["w"][-1].error_code == 400 and "decode" in out["w"][-1].error


def test_both_roles_serve_plain_requests(pd) -> None:  # type: ignore[no-untyped-def]
    p, d = pd
    p.add_request(request("a", [1, 2, 3], max_tokens=4))
    d.add_request(request("b", [4, 5, 6], max_tokens=4))
    out = drive([p, d], finished("a", "b"))
    assert tokens(out["a"]) == [1, 2, 3, 1] and tokens(out["b"]) == [4, 5, 6, 4]
    _check_empty(p, d)


def test_prefill_job_with_mismatched_blocks_is_answered_with_an_error(pd) -> None:  # type: ignore[no-untyped-def]
    from fdx.core.messages import AddRequest, KVTransferParams, SamplingParams

    p, d = pd
    job = AddRequest("bad", (1, 2, 3), SamplingParams(max_tokens=2), 0.0,
                     KVTransferParams(decode_addr=d.connector.address, block_ids=(1, 2, 3)))
    d.connector.send(p.connector.address, job)
    drive([p], lambda o: p.stats().splitwise.failed == 1)
    msgs = []
    for _ in range(200):
        msgs += d.connector.recv()
        if msgs:
            break
        time.sleep(0.01)
    (peer, msg, kv), = msgs
    assert peer == p.connector.address
    assert isinstance(msg, RequestOutput) and msg.error_code == 400 and kv is None
    d.connector.send(p.connector.address, AbortRequest(("unknown",)))  # unknown ids are ignored
    drive([p], lambda o: True)
    _check_empty(p)


def test_splitwise_needs_a_role() -> None:
    with pytest.raises(ConfigError, match="splitwise-role"):
        echo_engine(scheduler="splitwise")
    with pytest.raises(ConfigError, match="need --scheduler splitwise"):
        echo_engine(splitwise_role="decode")


def test_prompt_logprobs_and_grammars_are_computed_on_d(pd) -> None:  # type: ignore[no-untyped-def]
    p, d = pd
    d.add_request(request("pl", [1, 2, 3, 4], p, max_tokens=2, prompt_logprobs=1))
    out = drive([p, d], finished("pl"))
    assert tokens(out["pl"]) == [1, 2]
    assert d.stats().splitwise.handoffs == 0 and p.stats().splitwise.handoffs == 0  # never handed off
    _check_empty(p, d)


def test_v0_as_the_local_policy() -> None:
    p, d = pd_pair("zmq", splitwise_local_scheduler="v0")
    try:
        prompts = {f"r{i}": list(range(1, n + 1)) for i, n in enumerate((3, 17, 40, 100))}
        for rid, ids in prompts.items():
            d.add_request(request(rid, ids, p, max_tokens=5))
        out = drive([p, d], finished(*prompts))
        for rid, ids in prompts.items():
            assert tokens(out[rid]) == (ids * 5)[:5] and out[rid][-1].finish_reason == "length"
        assert d.stats().splitwise.recomputed_prompt_tokens == 0
        _check_empty(p, d)
    finally:
        p.close()
        d.close()


def test_lost_decode_instance_drops_its_prefill_jobs() -> None:
    p, d = pd_pair("zmq", connector_config={"connect_timeout": 1.0, "heartbeat_interval": 0.2,
                                             "heartbeat_timeout": 1.0}, max_model_len=2048, num_kv_blocks=256)
    try:
        d.add_request(request("j", list(range(1, 1500)), p, max_tokens=5))
        d.step()  # the job is on its way
        deadline = time.monotonic() + 10
        while not p.scheduler.jobs:  # P takes it and computes its first 512-token chunk
            assert time.monotonic() < deadline, "P never took the job"
            p.step()
        assert p.kv.num_used_blocks > 0
        d.close()  # D goes away before P is done
        time.sleep(1.5)  # past the connector's heartbeat timeout
        p.step()
        assert not p.scheduler.jobs and p.kv.num_used_blocks == 0
        assert p.stats().splitwise.handoffs == 0  # the job was dropped, not finished
        _check_empty(p)
    finally:
        p.close()
