"""`fdx serve --api-key ... --max-waiting 1 --max-num-seqs 1`: 401 and 429."""

from __future__ import annotations

import threading
import time
from typing import Any, Iterator

import httpx
import openai
import pytest
from serverutil import start_server

pytestmark = pytest.mark.slow

KEY = "sekret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with start_server("--api-key", KEY, "--max-waiting", "1", "--max-num-seqs", "1") as (base, _proc):
        yield base


def test_401(server: str) -> None:
    body = {"model": "smollm2", "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server + "/v1/models").status_code == 401
    # open routes
    assert httpx.get(server + "/health").status_code == 200
    assert httpx.get(server + "/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="bad", max_retries=0).models.list()
    ok = openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)
    assert ok.completions.create(model="smollm2", prompt="hi", max_tokens=2).usage.completion_tokens >= 1


def test_429_when_waiting_queue_is_full(server: str) -> None:
    long_body = {"model": "smollm2", "prompt": "Tell me a long story.", "max_tokens": 400, "stream": True,
                 "ignore_eos": True}
    results: dict[str, Any] = {}
    with httpx.Client(timeout=120) as c, c.stream("POST", server + "/v1/completions", json=long_body,
                                                  headers=AUTH) as running:
        assert running.status_code == 200
        lines = running.iter_lines()
        next(line for line in lines if line.startswith("data:"))  # A is running (max_num_seqs=1)

        def waiting() -> None:
            r = httpx.post(server + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=AUTH,
                           timeout=120)
            results["b"] = r.status_code

        t = threading.Thread(target=waiting)
        t.start()
        deadline = time.monotonic() + 30
        while httpx.get(server + "/health").json().get("num_waiting", 0) < 1:
            assert time.monotonic() < deadline, "request B never queued"
            time.sleep(0.05)
        r = httpx.post(server + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=AUTH)
        assert r.status_code == 429, r.text
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert "max-waiting" in r.json()["error"]["message"]
    # A disconnected (aborted): B runs to completion
    t.join(60)
    assert results.get("b") == 200
