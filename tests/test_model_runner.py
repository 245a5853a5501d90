"""PaddleModelRunner beyond the forward: KV block export/import, sleep
(release/restore), fingerprint, bad batches."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from fdx.core.errors import FdxError
from fdx.core.interfaces import ScheduledBatch, ScheduledSeq
from fdx.core.messages import SamplingParams
from fdx.core.request import Request

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runner() -> Any:
    from fdx.config import make_config
    from fdx.model.runner import PaddleModelRunner
    from fdx.plugins.hardware.cpu import CPUDevice

    return PaddleModelRunner(make_config(num_kv_blocks=64, max_model_len=512), CPUDevice())


def _req(runner: Any, ids: list[int], blocks: list[int], n: int = 8) -> Request:
    r = Request("r", list(ids), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                eos_token_ids=runner.eos_token_ids, max_model_len=runner.max_model_len)
    r.block_ids = list(blocks)
    return r


def _advance(runner: Any, r: Request, n: int) -> int:
    seq = ScheduledSeq(r, n)
    smp = seq.samples
    out = runner.execute(ScheduledBatch([seq]))
    r.num_computed_tokens += n
    if smp:
        r.append_token(int(out.token_ids[0]))
    return int(out.token_ids[0])


def _decode(runner: Any, r: Request, steps: int) -> list[int]:
    return [_advance(runner, r, 1) for _ in range(steps)]


PROMPT = list(range(1000, 1040))  # 40 tokens = 2.5 blocks of 16


def test_kv_blocks_roundtrip_through_bytes(runner: Any) -> None:
    a = _req(runner, PROMPT, [3, 9, 4, 20])
    _advance(runner, a, 32)  # two full blocks computed
    payloads = runner.read_kv_blocks([3, 9])
    assert len(payloads) == 2 and all(len(p) == runner.bytes_per_block for p in payloads)
    assert runner.bytes_per_block == 30 * 2 * 3 * 16 * 64 * 4
    runner.write_kv_blocks([40, 41], payloads)
    assert runner.read_kv_blocks([40, 41]) == payloads
    # the host path (NumPy over the pool's own memory) and Paddle's gather/scatter agree byte for byte
    assert runner._host_pools() is not None
    runner._host_pools = lambda: None
    try:
        assert runner.read_kv_blocks([3, 9, 40]) == payloads + payloads[:1]
        runner.write_kv_blocks([44], payloads[1:])
    finally:
        del runner._host_pools
    assert runner.read_kv_blocks([44]) == payloads[1:]
    # a request whose first 32 tokens come from the imported blocks continues identically
    b = _req(runner, PROMPT, [40, 41, 42, 43])
    b.num_computed_tokens = 32
    _advance(runner, a, 8)
    _advance(runner, b, 8)
    assert a.output_token_ids == b.output_token_ids
    assert _decode(runner, a, 6) == _decode(runner, b, 6)
    with pytest.raises(FdxError):
        runner.write_kv_blocks([1], [b"short"])
    with pytest.raises(FdxError):
        runner.read_kv_blocks([runner.num_kv_blocks])


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_sleep_releases_memory_and_wakeup_restores(runner: Any) -> None:
    r = _req(runner, PROMPT, [0, 1, 2, 5])
    _advance(runner, r, len(PROMPT))
    want = _decode(runner, r, 5)
    before = _rss()
    runner.release(["weight", "kv_cache"])
    after = _rss()
    # float32 compute holds ~513 MiB of weights; int8 ~215 MiB (packed blocks + the float32 embedding)
    need = (300 if runner.compute == "float32" else 200) << 20
    assert before - after > need, f"RSS only dropped {(before - after) >> 20} MiB"
    with pytest.raises(FdxError, match="sleeping"):
        runner.execute(ScheduledBatch([ScheduledSeq(_req(runner, PROMPT, [0, 1, 2]), 40)]))
    runner.restore(["weight", "kv_cache"])
    payload = runner.read_kv_blocks([0])[0]
    assert not any(np.frombuffer(payload, dtype=np.float32))  # cache comes back zeroed
    r2 = _req(runner, PROMPT, [6, 7, 8, 10])
    _advance(runner, r2, len(PROMPT))
    assert _decode(runner, r2, 5) == want


def test_fingerprint_and_geometry(runner: Any) -> None:
    fp = runner.kv_fingerprint()
    assert fp == runner.kv_fingerprint() and len(fp) >= 16
    assert runner.block_size == 16 and runner.num_kv_blocks == 64 and runner.max_model_len == 512
    assert runner.vocab_size == 49152 and runner.eos_token_ids == frozenset({2})


def test_bad_batches_are_rejected(runner: Any) -> None:
    r = _req(runner, PROMPT, [0])  # one block cannot hold 40 tokens
    with pytest.raises(FdxError, match="blocks"):
        runner.execute(ScheduledBatch([ScheduledSeq(r, 40)]))
    r = _req(runner, PROMPT, [0, 1, 9999])
    with pytest.raises(FdxError, match="out of range"):
        runner.execute(ScheduledBatch([ScheduledSeq(r, 40)]))
    assert runner.execute(ScheduledBatch([])).token_ids.size == 0
