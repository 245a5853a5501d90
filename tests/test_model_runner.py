"""PaddleModelRunner beyond the forward: KV block export/import, sleep
(release/restore), fingerprint, bad batches."""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np
import pytest

from fdx.core.errors import FdxError
from fdx.core.interfaces import ScheduledBatch, ScheduledSeq
from fdx.core.messages import SamplingParams
from fdx.core.request import Request

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def runner(request: pytest.FixtureRequest) -> Any:
    """The default runner (int8 compute) with each KV pool dtype."""
    from fdx.config import make_config
    from fdx.model.runner import PaddleModelRunner
    from fdx.plugins.hardware.cpu import CPUDevice

    r = PaddleModelRunner(make_config(num_kv_blocks=64, max_model_len=512, kv_cache_dtype=request.param), CPUDevice())
    assert r.dtype == request.param and str(r.caches[0].dtype) == f"paddle.{request.param}"
    return r


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
    assert runner.bytes_per_block == 30 * 2 * 3 * 16 * 64 * (4 if runner.dtype == "float32" else 2)
    runner.write_kv_blocks([40, 41], payloads)
    assert runner.read_kv_blocks([40, 41]) == payloads
    assert runner._host_pools() is not None  # NumPy over the pool's own memory (bfloat16: its uint16 bits)
    if runner.dtype == "float32":  # the host path and Paddle's gather/scatter agree byte for byte
        runner._host_pools = lambda: None
        try:
            assert runner.read_kv_blocks([3, 9, 40]) == payloads + payloads[:1]
            runner.write_kv_blocks([44], payloads[1:])
        finally:
            del runner._host_pools
    else:  # a block's bytes are the bfloat16 bit patterns of the pool (the fingerprint says which)
        runner.write_kv_blocks([44], payloads[1:])
        k0 = np.frombuffer(payloads[0], np.uint16)[: 16 * 64]  # layer 0, K, kv head 0: block 3's 16 slots
        pool = runner.caches[0][0, 3].reshape([-1]).view("uint16").numpy()  # the C++ op's keys: in pairs of dims
        assert runner.key_blocks == "dim-major"
        np.testing.assert_array_equal(k0, runner._keys_moved(pool, to_wire=True)[: 16 * 64])
        np.testing.assert_array_equal(k0, pool.reshape(3, 32, 16, 2).transpose(0, 2, 1, 3).reshape(-1)[: 16 * 64])
    assert runner.read_kv_blocks([44]) == payloads[1:]
    runner.copy_kv_blocks([(9, 45)])  # copy on write (a forked beam's partial block)
    assert runner.read_kv_blocks([45]) == payloads[1:]
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


@pytest.mark.parametrize("model, dtype, runner_name, why", [
    ("smollm2", "float32", "cpu", "float32 compute keeps a float32 KV cache"),
    ("gemma2", "int8", "cpu", "needs fdx's C++ attention op"),
    ("smollm2", "float32", "gpu", "the gpu runner keeps its KV cache in the compute dtype (float32)"),
])
def test_a_bfloat16_kv_cache_the_runner_cannot_keep_is_refused(model: str, dtype: str, runner_name: str,
                                                               why: str) -> None:
    """``--kv-cache-dtype bfloat16`` is an error, never ignored, where the
    runner would not keep the cache in bfloat16."""
    from pathlib import Path

    from fdx.config import make_config
    from fdx.core.errors import ModelLoadError
    from fdx.model.gpu_runner import GPUModelRunner
    from fdx.model.runner import PaddleModelRunner
    from fdx.plugins.hardware.cpu import CPUDevice

    if model != "smollm2":
        model = str(Path(__file__).parent / "data" / "arch" / model)
    cls = GPUModelRunner if runner_name == "gpu" else PaddleModelRunner
    cfg = make_config(model=model, dtype=dtype, num_kv_blocks=8, max_model_len=256, kv_cache_dtype="bfloat16")
    with pytest.raises(ModelLoadError, match=re.escape("--kv-cache-dtype bfloat16: " + why)):
        cls(cfg, CPUDevice())

