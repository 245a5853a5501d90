"""EngineClient against a scripted fake engine on real ZMQ sockets (no model):
routing, life-cycle hooks, control calls, aborts and liveness."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any, Iterator

import pytest

from fdx.config import make_config
from fdx.core.hookspecs import hookimpl
from fdx.core.ipc import EngineSide, IpcPaths
from fdx.deploy.launcher import make_run_dir
from fdx.core.messages import (
    AbortRequest,
    AddRequest,
    ControlReply,
    ControlRequest,
    EngineReady,
    EngineStats,
    Heartbeat,
    OutputBatch,
    RequestOutput,
    SamplingParams,
    Shutdown,
)
from fdx.deploy.engine_client import ControlCallError, EngineClient, EngineUnavailable


class FakeEngine(threading.Thread):
    """Answers AddRequest with ``max_tokens`` tokens (one per message), echoes
    control calls (except ``slow``), records aborts; ``beating`` toggles heartbeats."""

    def __init__(self, paths: IpcPaths) -> None:
        super().__init__(daemon=True)
        self.paths = paths
        self.beating = True
        self.stop = threading.Event()
        self.aborted: list[str] = []
        self.got_shutdown = False

    def run(self) -> None:
        side = EngineSide(self.paths)
        side.send(EngineReady(os.getpid(), 10, 100, "fake", "v7"))
        last_beat = 0.0
        while not self.stop.is_set():
            if self.beating and time.monotonic() - last_beat > 0.1:
                side.send(Heartbeat(time.time(), EngineStats(kv_blocks_total=10, weights_version="v7")))
                last_beat = time.monotonic()
            if not side.poll(20):
                continue
            while (msg := side.recv_nowait()) is not None:
                if isinstance(msg, AddRequest):
                    n = msg.params.max_tokens
                    for i in range(n):
                        fin = "length" if i == n - 1 else None
                        side.send(OutputBatch((RequestOutput(msg.request_id, (100 + i,), fin,
                                                             len(msg.prompt_token_ids), 0, i + 1),)))
                elif isinstance(msg, AbortRequest):
                    self.aborted.extend(msg.request_ids)
                elif isinstance(msg, ControlRequest) and msg.method != "slow":
                    code = 200 if msg.method == "echo" else 400
                    side.send(ControlReply(msg.call_id, code, dict(msg.args), None if code == 200 else "bad"))
                elif isinstance(msg, Shutdown):
                    self.got_shutdown = True
        side.close()


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    @hookimpl
    def fdx_request_added(self, request_id: str) -> None:
        self.events.append(("added", request_id))

    @hookimpl
    def fdx_request_first_token(self, request_id: str, ttft: float) -> None:
        assert ttft >= 0
        self.events.append(("first", request_id))

    @hookimpl
    def fdx_request_finished(self, request_id: str, finish_reason: str, num_output_tokens: int) -> None:
        self.events.append((f"finished:{finish_reason}:{num_output_tokens}", request_id))

    @hookimpl
    def fdx_request_aborted(self, request_id: str, reason: str) -> None:
        self.events.append(("aborted", request_id))


@pytest.fixture
def env(plugin_manager: Any) -> Iterator[tuple[EngineClient, FakeEngine, Recorder]]:
    rec = Recorder()
    plugin_manager.register(rec)
    paths = make_run_dir()
    client = EngineClient(make_config(heartbeat_timeout=1.0, heartbeat_interval=0.1), paths, hook=plugin_manager.hook)
    eng = FakeEngine(paths)
    eng.start()
    try:
        yield client, eng, rec
    finally:
        eng.stop.set()
        eng.join(5)
        paths.cleanup()


async def _drain(h: Any) -> list[Any]:
    items = []
    while True:
        _, item = await asyncio.wait_for(h.sink.get(), 10)
        items.append(item)
        if isinstance(item, BaseException) or item.finish_reason is not None:
            return items


def test_routing_hooks_and_control(env: tuple[EngineClient, FakeEngine, Recorder]) -> None:
    client, eng, rec = env

    async def main() -> None:
        await client.start()
        await asyncio.wait_for(client.ready.wait(), 10)
        assert client.engine_pid == os.getpid() and client.weights_version == "v7"
        sink: asyncio.Queue[Any] = asyncio.Queue()
        a = client.submit("a", [1, 2], SamplingParams(max_tokens=3), time.time(), sink)
        b = client.submit("b", [1], SamplingParams(max_tokens=2), time.time(), sink)
        with pytest.raises(Exception, match="duplicate"):
            client.submit("a", [1], SamplingParams(), time.time())
        got: dict[str, list[int]] = {"a": [], "b": []}
        done = 0
        while done < 2:
            h, out = await asyncio.wait_for(sink.get(), 10)
            got[h.request_id].extend(out.new_token_ids)
            done += out.finish_reason is not None
        assert got == {"a": [100, 101, 102], "b": [100, 101]}
        assert a.done and b.done and client.num_live == 0
        assert await client.call("echo", {"x": 1}) == {"x": 1}
        with pytest.raises(ControlCallError) as ei:
            await client.call("nope")
        assert ei.value.code == 400
        with pytest.raises(ControlCallError) as ei:
            await client.call("slow", timeout=0.3)
        assert ei.value.code == 504
        c = client.submit("c", [1], SamplingParams(max_tokens=10_000), time.time())
        client.abort([c], "client disconnected")
        client.abort([c], "again")  # idempotent
        d = client.submit("d", [1], SamplingParams(max_tokens=10_000), time.time())
        client.finish(d, "stop")
        # the fake engine streams c's and d's tokens before it reads the aborts
        deadline = time.monotonic() + 30
        while len(eng.aborted) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await client.close()

    asyncio.run(main())
    assert eng.aborted == ["c", "d"] and eng.got_shutdown
    ev = rec.events
    assert ev[:2] == [("added", "a"), ("added", "b")]
    assert ("first", "a") in ev and ("finished:length:3", "a") in ev and ("finished:length:2", "b") in ev
    assert ("aborted", "c") in ev and ("finished:stop:0", "d") in ev
    assert sum(1 for e in ev if e[1] == "c" and e[0] != "added") == 1  # one terminal hook per request


def test_liveness_fails_pending_requests(env: tuple[EngineClient, FakeEngine, Recorder]) -> None:
    client, eng, rec = env

    async def main() -> None:
        await client.start()
        await asyncio.wait_for(client.ready.wait(), 10)
        h = client.submit("x", [1], SamplingParams(max_tokens=1), time.time())
        await _drain(h)
        eng.beating = False  # a hung engine: the pid lives, heartbeats stop
        slow = asyncio.create_task(client.call("slow", timeout=30))
        pending = client.submit("y", [1], SamplingParams(max_tokens=0), time.time())  # fake sends nothing
        t0 = time.monotonic()
        items = await _drain(pending)
        assert isinstance(items[-1], EngineUnavailable) and items[-1].code == 503
        assert time.monotonic() - t0 < 5
        with pytest.raises(EngineUnavailable):
            await slow
        assert client.unavailable_reason() and "heartbeat" in client.unavailable_reason()
        with pytest.raises(EngineUnavailable):
            client.submit("z", [1], SamplingParams(), time.time())
        eng.beating = True  # it was only hung: serve again, abort what failed meanwhile
        deadline = time.monotonic() + 5
        while client.unavailable_reason() is not None:
            assert time.monotonic() < deadline, "client never noticed the engine came back"
            await asyncio.sleep(0.05)
        await _drain(client.submit("z", [1], SamplingParams(max_tokens=2), time.time()))
        await client.close()

    asyncio.run(main())
    assert ("aborted", "y") in rec.events
    assert "y" in eng.aborted


class RoutePlugin:
    @hookimpl
    def fdx_add_routes(self, app: Any, client: Any) -> None:
        @app.get("/v1/echo")
        async def echo(x: int = 0) -> Any:
            return await client.call("echo", {"x": x})


def test_app_plugin_routes_auth_and_envelopes(plugin_manager: Any) -> None:
    from fastapi.testclient import TestClient

    from fdx.core.plugins import collect
    from fdx.server.app import create_app

    plugin_manager.register(RoutePlugin())
    plugins = collect(plugin_manager)
    paths = make_run_dir()
    config = make_config(heartbeat_timeout=2.0, api_key="k")
    client = EngineClient(config, paths, hook=plugins.hook)
    eng = FakeEngine(paths)
    eng.start()
    try:
        app = create_app(config, client, plugins=plugins)
        with TestClient(app) as tc:
            deadline = time.monotonic() + 10
            while client.engine is None:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert tc.get("/v1/echo", params={"x": 3}).status_code == 401  # plugin routes are guarded too
            r = tc.get("/v1/echo", params={"x": 3}, headers={"Authorization": "Bearer k"})
            assert r.status_code == 200 and r.json() == {"x": 3}
            r = tc.get("/v1/echo", params={"x": "nope"}, headers={"Authorization": "Bearer k"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "x"  # FastAPI's 422 -> 400
            # no tokenizer loaded: not ready
            h = tc.get("/health")
            assert h.status_code == 503 and h.json()["status"] == "starting"
            r = tc.post("/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer k"})
            assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
    finally:
        eng.stop.set()
        eng.join(5)
        paths.cleanup()
