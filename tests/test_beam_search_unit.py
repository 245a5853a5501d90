"""Beam search without a model: the KV fork, the scheduler's refusals and
bookkeeping, the API's field mapping (the model-level checks against
transformers are in ``tests/test_beam_search.py``)."""

from __future__ import annotations

import attrs
import pytest

from fdx.beam_search import beam_params
from fdx.config import make_config
from fdx.core.errors import RequestError
from fdx.core.interfaces import ModelOutput
from fdx.core.kv_cache import KVCacheManager
from fdx.core.messages import SamplingParams, TokenLogprob
from fdx.core.request import Request, Status
from fdx.plugins.schedulers.beam import beam_conflict
from fdx.plugins.schedulers.v0 import V0Scheduler
from fdx.plugins.schedulers.v1 import V1Scheduler
from fdx.request_params import sampling_params
from fdx.server.protocol import CompletionRequest, parse_body
from fdx.testing import check_kv_invariants

import numpy as np


def beam_request(rid: str, prompt: list[int], width: int, max_tokens: int = 6) -> Request:
    p = SamplingParams(max_tokens=max_tokens, temperature=0.0, beam_width=width)
    return Request(rid, prompt, p, frozenset({0}), 4096)


def test_fork_shares_full_blocks_and_gives_a_fresh_partial_one() -> None:
    kv = KVCacheManager(16, 4, enable_prefix_caching=False)
    src = Request("a", list(range(1, 11)), SamplingParams())
    assert kv.allocate(src, 10, [])
    src.num_computed_tokens = 10  # blocks 0, 1 full, block 2 holds 2 positions
    dst = Request("a", list(src.prompt_token_ids), SamplingParams())
    fresh = kv.fork(src, dst)
    assert dst.block_ids[:2] == src.block_ids[:2] and fresh == dst.block_ids[2] != src.block_ids[2]
    assert [kv.ref_cnt[b] for b in src.block_ids] == [2, 2, 1]
    check_kv_invariants(kv, [src, dst])  # shared full blocks are fine without the prefix cache
    kv.free(src)
    kv.free(dst)
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == 16
    full = Request("b", list(range(1, 9)), SamplingParams())
    assert kv.allocate(full, 8, [])
    full.num_computed_tokens = 8
    assert kv.fork(full, Request("b", [], SamplingParams())) is None  # nothing partial to copy


def test_v0_refuses_beam_search() -> None:
    cfg = make_config(scheduler="v0", num_kv_blocks=64, block_size=4)
    sched = V0Scheduler(cfg, KVCacheManager(64, 4))
    req = beam_request("r", [1, 2, 3], 2)
    sched.add_request(req)
    assert req.finish_reason == "error" and req.error_code == 400 and "v1" in (req.error or "")
    assert not sched.beams


def test_v1_group_runs_as_rows_and_frees_every_block() -> None:
    """A width-2 group beside a plain request: both decode in every step,
    the beams share the prompt blocks, the result is the two best
    sequences and no block is left."""
    cfg = make_config(num_kv_blocks=64, block_size=4, max_logprobs=20)
    kv = KVCacheManager(64, 4)
    sched = V1Scheduler(cfg, kv)
    beam = beam_request("beam", [5, 6, 7, 8, 9], 2, max_tokens=4)
    plain = Request("plain", [3, 4], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), frozenset({0}))
    sched.add_request(beam)
    sched.add_request(plain)
    # token t's logprob from any row: t=1 best, then 2, 3, ...: the best beam repeats 1s
    top = tuple((t, -0.1 * t) for t in range(1, 9))
    steps = 0
    while sched.has_work():
        batch = sched.schedule()
        rids = [s.request.request_id for s in batch.seqs]
        if steps > 0 and "plain" in sched.requests:
            assert "plain" in rids  # the plain request is never held back by the group
        toks = np.array([1] * len(batch.seqs), dtype=np.int64)
        lps = [TokenLogprob(1, -0.1, top) for _ in batch.seqs]
        sched.update(batch, ModelOutput(toks, lps))
        sched.check_invariants()
        steps += 1
        assert steps < 20
    assert beam.status is Status.FINISHED and beam.beams is not None
    assert [b.token_ids for b in beam.beams] == [(1, 1, 1, 1), (1, 1, 1, 2)]
    assert beam.beams[0].score == pytest.approx(-0.4 / 4)
    assert kv.num_used_blocks == 0


def test_engine_level_conflicts_name_the_field() -> None:
    base = SamplingParams(temperature=0.0, beam_width=4)
    assert beam_conflict(base, 20, 1) is None
    for field, value in [("temperature", 0.8), ("top_p", 0.9), ("logprobs", 1), ("stop", ("x",)),
                         ("repetition_penalty", 1.1), ("min_tokens", 2)]:
        msg = beam_conflict(attrs.evolve(base, **{field: value}), 20, 1)
        assert msg is not None and field in msg
    assert "beam width" in (beam_conflict(attrs.evolve(base, beam_width=11), 20, 1) or "")


def params_of(body: bytes) -> SamplingParams:
    req = parse_body(body, CompletionRequest)
    p = sampling_params(req, max_tokens=8, num_logprobs=req.logprobs, max_logprobs=20, vocab_size=100)
    return beam_params(req, p, 20, frozenset({0}))


def test_api_maps_the_fields() -> None:
    p = params_of(b'{"prompt": "x", "use_beam_search": true, "n": 3, "length_penalty": 0.5, '
                  b'"early_stopping": "never"}')
    assert (p.beam_width, p.n, p.length_penalty, p.early_stopping, p.temperature) == (3, 3, 0.5, "never", 0.0)
    assert params_of(b'{"prompt": "x", "use_beam_search": true, "early_stopping": true}').early_stopping == "true"
    assert params_of(b'{"prompt": "x", "temperature": 0.5}').beam_width == 0
    for body, param in [(b'{"prompt": "x", "use_beam_search": true, "temperature": 0.5}', "temperature"),
                        (b'{"prompt": "x", "length_penalty": 2.0}', "length_penalty"),
                        (b'{"prompt": "x", "use_beam_search": true, "n": 11}', "n")]:
        with pytest.raises(RequestError) as ei:
            params_of(body)
        assert ei.value.code == 400 and ei.value.param == param


def test_wider_than_max_num_seqs_is_refused() -> None:
    cfg = make_config(num_kv_blocks=64, block_size=4, max_num_seqs=2)
    sched = V1Scheduler(cfg, KVCacheManager(64, 4))
    req = beam_request("r", [1, 2, 3], 3)
    sched.add_request(req)
    assert req.error_code == 400 and "--max-num-seqs" in (req.error or "") and not sched.beams
