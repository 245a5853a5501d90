"""`fdx serve` under concurrency: 64 streaming clients, and 20 clients that
disconnect mid-stream (their KV blocks must be freed)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any, Iterator

import httpx
import pytest
from serverutil import start_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with start_server("--max-num-seqs", "64", "--num-kv-blocks", "1024") as (base, _proc):
        yield base


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


async def _stream(client: httpx.AsyncClient, base: str, i: int) -> dict[str, Any]:
    chat = i % 2 == 1
    if chat:
        path = "/v1/chat/completions"
        body: dict[str, Any] = {"messages": [{"role": "user", "content": f"Tell me fact number {i}."}],
                                "logprobs": True}
    else:
        path = "/v1/completions"
        body = {"prompt": f"Request {i}: a story about the number {i}", "logprobs": 0}
    body.update({"model": "smollm2", "max_tokens": 16, "ignore_eos": True, "stream": True, "temperature": 0.7,
                 "seed": i, "stream_options": {"include_usage": True}})
    n_tokens, usage, finish, done = 0, None, None, False
    async with client.stream("POST", base + path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            ev = json.loads(line[6:])
            assert "error" not in ev, ev
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev["choices"]:
                lp = ch.get("logprobs")
                if lp:
                    n_tokens += len(lp["content"]) if chat else len(lp["tokens"])
                finish = ch.get("finish_reason") or finish
    return {"i": i, "chat": chat, "tokens": n_tokens, "usage": usage, "finish": finish, "done": done,
            "prompt": body.get("prompt") or body["messages"]}


def test_64_concurrent_streams(server: str) -> None:
    from fdx.model.loader import load_tokenizer

    tok = load_tokenizer("smollm2")

    async def run() -> list[dict[str, Any]]:
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            return await asyncio.gather(*(_stream(client, server, i) for i in range(64)))

    results = asyncio.run(run())
    assert len(results) == 64
    for r in results:
        assert r["done"] and r["finish"] == "length", r
        u = r["usage"]
        assert u["completion_tokens"] == 16 == r["tokens"], r
        expect = len(tok.encode_chat(r["prompt"])) if r["chat"] else len(tok.encode(r["prompt"]))
        assert u["prompt_tokens"] == expect and u["total_tokens"] == expect + 16, r
    m = httpx.get(server + "/metrics").text
    assert metric(m, "fdx:num_requests_running") == 0


def test_disconnects_free_kv_blocks(server: str) -> None:
    before = httpx.get(server + "/metrics").text
    aborted0 = metric(before, "fdx:request_aborted_total")

    async def one(i: int, started: asyncio.Event, go: asyncio.Event) -> int:
        body = {"model": "smollm2", "prompt": f"Client {i} writes an endless poem:", "max_tokens": 1500,
                "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(timeout=120) as client:
            async with client.stream("POST", server + "/v1/completions", json=body) as r:
                n = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        n += 1
                        if n == 2:
                            started.set()
                            await go.wait()
                        if n >= 3:
                            break
                return n  # leaving the blocks closes the connection mid-stream

    async def run() -> tuple[list[int], float]:
        events = [asyncio.Event() for _ in range(20)]
        go = asyncio.Event()
        tasks = [asyncio.create_task(one(i, events[i], go)) for i in range(20)]
        await asyncio.gather(*(e.wait() for e in events))
        async with httpx.AsyncClient() as c:
            used = metric((await c.get(server + "/metrics")).text, "fdx:kv_blocks_used")
        go.set()
        return list(await asyncio.gather(*tasks)), used

    counts, used_mid = asyncio.run(run())
    assert all(n >= 3 for n in counts)
    assert used_mid > 0  # the 20 streams held KV blocks
    deadline = time.monotonic() + 30
    while True:
        m = httpx.get(server + "/metrics").text
        if metric(m, "fdx:kv_blocks_used") == 0 and metric(m, "fdx:num_requests_running") == 0:
            break
        assert time.monotonic() < deadline, "KV blocks still in use after all clients disconnected"
        time.sleep(0.2)
    assert metric(m, "fdx:request_aborted_total") - aborted0 == 20
    assert httpx.get(server + "/health").status_code == 200


def test_non_streaming_disconnect_aborts(server: str) -> None:
    body = {"model": "smollm2", "prompt": "A very long essay:", "max_tokens": 1500, "ignore_eos": True, "n": 2}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=3))
    deadline = time.monotonic() + 30
    while True:
        m = httpx.get(server + "/metrics").text
        if metric(m, "fdx:kv_blocks_used") == 0 and metric(m, "fdx:num_requests_running") == 0:
            break
        assert time.monotonic() < deadline, "the abandoned request kept running"
        time.sleep(0.2)
