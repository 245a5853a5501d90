"""Streaming OpenAI-compatible client for the benchmark (aiohttp).

One fresh TCP connection per request (llama.cpp's server drops some reused
keep-alive connections under load).  Token counts come from the server's
``usage`` (requested with ``stream_options.include_usage``); without it the
text-carrying chunks are counted.

Invariant: :func:`send_request` never raises for a server-side problem; it
returns a :class:`RequestResult` with ``success=False`` and a one-line
``error``.
"""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp
import attrs

from fdx.bench.datasets import SampleRequest
from fdx.bench.metrics import RequestResult

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@attrs.frozen
class RequestOptions:
    base_url: str
    endpoint: str
    model: str
    use_token_ids: bool = False
    ignore_eos: bool = False
    temperature: float = 0.0
    api_key: str | None = None
    timeout: float = 600.0
    extra_body: dict[str, Any] = attrs.field(factory=dict)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h


def build_payload(sample: SampleRequest, opts: RequestOptions) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": opts.model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": opts.temperature,
    }
    if sample.output_len is not None:
        body["max_tokens"] = sample.output_len
    if opts.ignore_eos:
        body["ignore_eos"] = True
    if opts.endpoint == CHAT:
        body["messages"] = sample.chat_messages()
    elif opts.use_token_ids and sample.token_ids is not None:
        body["prompt"] = list(sample.token_ids)
    else:
        body["prompt"] = sample.text
    body.update(opts.extra_body)
    return body


def _chunk_text(data: dict[str, Any], chat: bool) -> str | None:
    """Generated text of one SSE chunk; None when it carries no choices."""
    choices = data.get("choices")
    if not choices:
        return None
    c0 = choices[0]
    if chat:
        delta = c0.get("delta") or {}
        return delta.get("content") or delta.get("reasoning_content") or ""
    return c0.get("text") or ""


def _error_line(data: Any) -> str:
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            return str(err.get("message") or err)[:300]
        return str(err)[:300]
    return str(data)[:300]


def connector() -> aiohttp.TCPConnector:
    return aiohttp.TCPConnector(limit=0, force_close=True)


async def send_request(session: aiohttp.ClientSession, sample: SampleRequest, opts: RequestOptions) -> RequestResult:
    """Send one streaming request and time it."""
    chat = opts.endpoint == CHAT
    res = RequestResult(prompt_len=sample.prompt_len)
    payload = build_payload(sample, opts)
    text_parts: list[str] = []
    t0 = time.perf_counter()
    res.start = t0
    last = t0
    usage: dict[str, Any] | None = None
    try:
        async with session.post(
            opts.url, json=payload, headers=opts.headers(), timeout=aiohttp.ClientTimeout(total=opts.timeout)
        ) as resp:
            if resp.status != 200:
                body = await resp.text()
                try:
                    msg = _error_line(json.loads(body))
                except json.JSONDecodeError:
                    msg = body.strip().splitlines()[0][:300] if body.strip() else resp.reason or ""
                res.error = f"HTTP {resp.status}: {msg}"
                return res
            buf = b""
            done = False
            async for raw in resp.content.iter_any():
                buf += raw
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    line = line.strip()
                    if not line or line.startswith(b":"):
                        continue
                    if not line.startswith(b"data:"):
                        continue
                    data_s = line[5:].strip()
                    if data_s == b"[DONE]":
                        done = True
                        break
                    now = time.perf_counter()
                    try:
                        data = json.loads(data_s)
                    except json.JSONDecodeError:
                        res.error = f"bad SSE chunk: {data_s[:120]!r}"
                        return res
                    if "error" in data and not data.get("choices"):
                        res.error = "stream error: " + _error_line(data)
                        return res
                    if data.get("usage"):
                        usage = data["usage"]
                    text = _chunk_text(data, chat)
                    if text:
                        if res.chunks == 0:
                            res.ttft = now - t0
                        else:
                            res.itl.append(now - last)
                        last = now
                        res.chunks += 1
                        text_parts.append(text)
                if done:
                    break
            end = time.perf_counter()
    except Exception as exc:  # noqa: BLE001 - any client/network failure is a failed request
        res.error = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300] if str(exc) else type(exc).__name__
        return res
    res.e2el = end - t0
    res.generated_text = "".join(text_parts)
    if usage and usage.get("completion_tokens") is not None:
        res.output_tokens = int(usage["completion_tokens"])
        if usage.get("prompt_tokens") is not None:
            res.prompt_len = int(usage["prompt_tokens"])
        res.usage_reported = True
    else:
        res.output_tokens = res.chunks
    if res.chunks == 0 and res.output_tokens > 0:
        # text held back entirely (e.g. only special tokens): time it at the end
        res.ttft = res.e2el
    res.success = True
    return res


async def get_models(base_url: str, api_key: str | None = None, timeout: float = 10.0) -> list[str]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(connector=connector()) as s:
        async with s.get(
            base_url.rstrip("/") + "/v1/models", headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            if resp.status != 200:
                raise RuntimeError(f"GET /v1/models: HTTP {resp.status}")
            data = await resp.json(content_type=None)
    return [m.get("id") for m in data.get("data", []) if isinstance(m, dict) and m.get("id")]


async def accepts_token_ids(opts: RequestOptions, ids: list[int]) -> bool:
    """Whether ``/v1/completions`` takes a token-id prompt and counts it as
    ``len(ids)`` tokens (one 1-token non-streaming request)."""
    body = {"model": opts.model, "prompt": list(ids), "max_tokens": 1, "temperature": 0.0, "stream": False}
    try:
        async with aiohttp.ClientSession(connector=connector()) as s:
            async with s.post(
                opts.base_url.rstrip("/") + COMPLETIONS,
                json=body,
                headers=opts.headers(),
                timeout=aiohttp.ClientTimeout(total=min(opts.timeout, 120.0)),
            ) as resp:
                if resp.status != 200:
                    return False
                data = await resp.json(content_type=None)
    except Exception:  # noqa: BLE001 - a failed probe means "send text"
        return False
    usage = data.get("usage") or {}
    n = usage.get("prompt_tokens")
    return n is None or int(n) == len(ids)
