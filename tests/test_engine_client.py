"""EngineClient against a real engine process (no HTTP edge in between):
nothing a caller submits can leave a request handle behind."""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from typing import Any

import pytest

from fdx.core.config import make_config
from fdx.core.errors import RequestError
from fdx.core.ipc import make_run_dir
from fdx.core.messages import SamplingParams
from fdx.server.client import ControlCallError, EngineClient
from fdx.server.launcher import child_config_json, spawn_child

pytestmark = pytest.mark.slow


async def _drain(h: Any) -> Any:
    while True:
        _, out = await asyncio.wait_for(h.sink.get(), 120)
        if isinstance(out, BaseException):
            raise out
        if out.finish_reason is not None:
            return out


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
