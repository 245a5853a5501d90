"""Helpers for the control-plane end-to-end tests (tests/test_control_*.py).

    from controlutil import control, metric, engine_pid, rss_bytes, greedy, StreamClient
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import attrs
import httpx

HTTP_TIMEOUT = 600.0


def control(base: str, route: str, body: dict[str, Any] | None = None, *, method: str = "POST",
            params: dict[str, Any] | None = None, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """Call ``/v1/<route>``; returns (HTTP status, JSON body).  A POST always
    sends a JSON body (``{}`` by default), as the control guard requires."""
    if method == "POST" and body is None:
        body = {}
    r = httpx.request(method, f"{base}/v1/{route}", json=body, params=params, headers=headers,
                      timeout=HTTP_TIMEOUT)
    return r.status_code, r.json()


def ok(base: str, route: str, body: dict[str, Any] | None = None, **kw: Any) -> Any:
    """Call a control route that must succeed; returns its ``result``."""
    code, js = control(base, route, body, **kw)
    assert code == 200 and js["status"] == "success", (route, code, js)
    return js["result"]


def metric(base: str, name: str) -> float:
    """The value of one unlabelled-or-labelled sample of ``name`` in /metrics."""
    text = httpx.get(base + "/metrics", timeout=30).text
    m = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    assert m is not None, f"{name} not in /metrics"
    return float(m.group(1))


def wait_metric(base: str, name: str, want: float, timeout: float = 5.0) -> float:
    """Poll /metrics until ``name`` equals ``want`` (a heartbeat sent just
    before a control reply may briefly carry the previous snapshot); returns
    the last value read."""
    deadline = time.monotonic() + timeout
    while True:
        got = metric(base, name)
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def engine_pid(base: str) -> int:
    pid = httpx.get(base + "/version", timeout=30).json()["engine_pid"]
    assert isinstance(pid, int) and pid > 0
    return pid


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def greedy(base: str, prompt: str, max_tokens: int = 24, **extra: Any) -> tuple[int, dict[str, Any]]:
    r = httpx.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                    **extra}, timeout=HTTP_TIMEOUT)
    return r.status_code, r.json()


def greedy_text(base: str, prompt: str, max_tokens: int = 24) -> str:
    code, js = greedy(base, prompt, max_tokens)
    assert code == 200, js
    return js["choices"][0]["text"]


@attrs.define
class StreamResult:
    """What one streaming client saw."""

    status: int = 0
    id: str | None = None
    text: dict[int, str] = attrs.field(factory=dict)  # choice index -> text
    finish: dict[int, str | None] = attrs.field(factory=dict)
    chunks: int = 0
    error: dict[str, Any] | None = None  # error event in the stream, or the HTTP error body
    done: bool = False  # saw data: [DONE]
    usage: dict[str, Any] | None = None


class StreamClient:
    """One streaming /v1/completions call run as an asyncio task; ``started``
    is set at the first text chunk (or at the end, whatever comes first)."""

    def __init__(self, http: httpx.AsyncClient, base: str, body: dict[str, Any], chat: bool = False) -> None:
        self.http, self.base, self.body = http, base, {**body, "stream": True}
        self.path = "/v1/chat/completions" if chat else "/v1/completions"
        self.result = StreamResult()
        self.started = asyncio.Event()
        self.task: asyncio.Task[StreamResult] = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> StreamResult:
        res = self.result
        try:
            async with self.http.stream("POST", self.base + self.path, json=self.body) as r:
                res.status = r.status_code
                if r.status_code != 200:
                    res.error = json.loads(await r.aread()).get("error")
                    return res
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        res.done = True
                        break
                    ev = json.loads(data)
                    if "error" in ev:
                        res.error = ev["error"]
                        continue
                    res.id = ev.get("id", res.id)
                    if ev.get("usage"):
                        res.usage = ev["usage"]
                    for ch in ev.get("choices", []):
                        i = ch["index"]
                        piece = ch.get("text") or (ch.get("delta") or {}).get("content") or ""
                        res.text[i] = res.text.get(i, "") + piece
                        res.finish[i] = ch.get("finish_reason")
                        res.chunks += 1
                        if piece:
                            self.started.set()
            return res
        finally:
            self.started.set()
