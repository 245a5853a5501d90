"""EngineClient against a real engine process (no HTTP edge in between):
nothing a caller submits can leave a request handle behind; and its engine
state machine across a crash and a new engine (messages fed directly)."""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from typing import Any

import pytest
import zmq

from fdx.config import make_config
from fdx.core.errors import RequestError
from fdx.deploy.launcher import make_run_dir
from fdx.core.messages import EngineFailed, EngineReady, EngineStats, Heartbeat, OutputBatch, SamplingParams
from fdx.deploy.engine_client import ControlCallError, EngineClient, EngineUnavailable
from fdx.server.metrics import Metrics
from fdx.deploy.launcher import child_config_json, spawn_child


async def _drain(h: Any) -> Any:
    while True:
        _, out = await asyncio.wait_for(h.sink.get(), 120)
        if isinstance(out, BaseException):
            raise out
        if out.finish_reason is not None:
            return out


@pytest.mark.slow
def test_unencodable_submissions_leak_no_handle() -> None:
    base = tempfile.mkdtemp(prefix="fdx-test-client-")
    config = make_config(num_kv_blocks=64, max_model_len=512, max_waiting=4, ipc_dir=base)
    paths = make_run_dir(base)

    async def main() -> None:
        client = EngineClient(config, paths)
        await client.start()
        proc = spawn_child("fdx.core.engine_proc", child_config_json(config, engine=True), paths.dir, os.getpid())
        try:
            deadline = time.monotonic() + 180
            while not client.ready.is_set():
                assert client.failed is None, client.failed
                assert time.monotonic() < deadline, "the engine did not start"
                await asyncio.sleep(0.1)
            bad = [
                ("r-topk", SamplingParams(top_k=2**64), "top_k"),
                ("r-seed", SamplingParams(seed=2**70), "seed"),
                ("r-stop", SamplingParams(stop=("x\udc80",)), "stop"),
                ("r-\ud800", SamplingParams(), "request_id"),
            ]
            # many more than --max-waiting: a leak would turn every later request into a 429
            for i in range(10 * config.max_waiting):
                rid, params, field = bad[i % len(bad)]
                with pytest.raises(RequestError) as ei:
                    client.submit(f"{rid}-{i}", (1, 2, 3), params, time.time())
                err = ei.value
                assert err.code == 400 and err.param == field, (err.code, err.param, str(err))
                assert field in str(err) and "Error" not in str(err), str(err)  # no Python exception names
                assert client.num_live == 0 and client.num_waiting() == 0
            with pytest.raises(ControlCallError) as ce:
                await client.call("abort_requests", {"req_ids": ["a\udc80"]}, timeout=5)
            assert ce.value.code == 400
            # the engine serves normally afterwards
            h = client.submit("good", (1, 2, 3), SamplingParams(max_tokens=3, temperature=0), time.time())
            out = await _drain(h)
            assert out.finish_reason == "length" and out.num_output_tokens == 3
            assert client.num_live == 0
            assert proc.poll() is None
        finally:
            await client.close()
            try:
                proc.wait(20)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(5)

    try:
        asyncio.run(main())
    finally:
        paths.cleanup()
        os.rmdir(base)


def _metric(m: Metrics, name: str, reason: str | None = None) -> float:
    for line in m.render().decode().splitlines():
        if line.startswith(name + "{") and (reason is None or f'reason="{reason}"' in line):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_crash_then_new_engine_state_machine(tmp_path: Any) -> None:
    """EngineFailed of the running engine fails its requests and counts a
    crash; a restarted engine that fails to start counts start_failed; the
    next EngineReady (a new pid) serves again, with fresh stats; beats of
    another pid are ignored."""
    config = make_config(ipc_dir=str(tmp_path), max_engine_restarts=3)
    paths = make_run_dir(str(tmp_path))

    async def main() -> None:
        client = EngineClient(config, paths)
        metrics = Metrics("smollm2", lambda: client.stats)
        client.metrics = metrics
        ctx = zmq.Context()
        engine_in = ctx.socket(zmq.PULL)  # stands in for the engine's input socket
        engine_in.connect(paths.input_addr)
        try:
            t0 = time.monotonic()
            with pytest.raises(EngineUnavailable):  # not ready yet
                client.submit("early", (1,), SamplingParams(), time.time())
            client._dispatch(EngineReady(os.getpid(), 64, 512, "smollm2", "v1"))
            while True:  # the PULL side connects asynchronously
                try:
                    h = client.submit("a", (1, 2), SamplingParams(max_tokens=4), time.time())
                    break
                except EngineUnavailable:
                    assert client.num_live == 0  # a failed send leaves nothing behind
                    assert time.monotonic() - t0 < 10
                    await asyncio.sleep(0.01)
            assert client.alive and client.unavailable_reason() is None and client.num_live == 1
            client._dispatch(OutputBatch((), EngineStats(kv_blocks_used=5, kv_blocks_total=64)))
            client._dispatch(EngineFailed("engine crashed: boom", pid=os.getpid()))
            _, err = h.sink.get_nowait()
            assert isinstance(err, EngineUnavailable) and err.code == 503
            assert "a new engine is starting" in str(err)
            assert client.num_live == 0 and not client.alive
            with pytest.raises(EngineUnavailable):
                client.submit("b", (1,), SamplingParams(), time.time())
            client._dispatch(EngineFailed("cannot load the model", pid=99999991))  # a restart that failed
            assert _metric(metrics, "fdx:engine_crashes_total", "crashed") == 1.0
            assert _metric(metrics, "fdx:engine_crashes_total", "start_failed") == 1.0
            assert client.last_crash == ("start_failed", "cannot load the model")
            client._dispatch(Heartbeat(time.time(), EngineStats(kv_blocks_used=9), pid=99999992, steps=1))
            assert client.stats.kv_blocks_used == 5  # not the stranger's
            client._dispatch(EngineReady(99999992, 64, 512, "smollm2", "v1"))
            assert client.alive and client.unavailable_reason() is None and client.engine_pid == 99999992
            assert client.restarts == 1 and _metric(metrics, "fdx:engine_restarts_total") == 1.0
            assert client.stats.kv_blocks_used == 0  # the dead engine's snapshot is gone
            client._dispatch(Heartbeat(time.time(), EngineStats(kv_blocks_used=2), pid=99999992, steps=3))
            assert client.stats.kv_blocks_used == 2 and client.liveness.steps == 3
        finally:
            client._closed = True
            client.side.close()
            engine_in.close(0)
            ctx.term()

    try:
        asyncio.run(main())
    finally:
        paths.cleanup()


def test_loop_histogram_exports_what_prometheus_histogram_does() -> None:
    """The per-token ITL histogram (LoopHistogram) renders the same text as
    prometheus_client's Histogram fed the same values, bucket edges included."""
    import random

    import prometheus_client
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from fdx.server.metrics import _ITL_BUCKETS, LoopHistogram

    name, doc = "fdx:inter_token_latency_seconds", "Inter-token latency."
    ref_reg, loop_reg = CollectorRegistry(), CollectorRegistry()
    ref = Histogram(name, doc, ["model_name"], buckets=_ITL_BUCKETS, registry=ref_reg).labels("m")
    mine = LoopHistogram(name, doc, _ITL_BUCKETS, "m")
    loop_reg.register(mine)
    rng = random.Random(1)
    values = [0.0, *_ITL_BUCKETS, 1e9, *(rng.expovariate(20) for _ in range(2000))]
    for v in values:
        ref.observe(v)
        mine.observe(v)
    prometheus_client.disable_created_metrics()
    try:
        assert generate_latest(loop_reg) == generate_latest(ref_reg)
    finally:
        prometheus_client.enable_created_metrics()
    assert sum(mine.counts) == len(values)


def test_sink_hands_items_over_in_order_and_survives_a_cancelled_get() -> None:
    import asyncio

    from fdx.deploy.frontend import Sink

    async def main() -> None:
        sink = Sink()
        sink.put_nowait(1)
        assert await sink.get() == 1 and sink.empty()
        waiting = asyncio.ensure_future(sink.get())
        await asyncio.sleep(0)
        assert not waiting.done()
        sink.put_nowait(2)
        sink.put_nowait(3)
        assert await waiting == 2 and sink.qsize() == 1 and sink.get_nowait() == 3
        with pytest.raises(asyncio.QueueEmpty):
            sink.get_nowait()
        cancelled = asyncio.ensure_future(sink.get())
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        sink.put_nowait(4)  # no stale waiter swallows it
        assert await asyncio.wait_for(sink.get(), 1) == 4

    asyncio.run(main())
