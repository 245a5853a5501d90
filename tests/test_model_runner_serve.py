"""A model runner from a third-party plugin serves real ``fdx serve``
requests end to end (``--model-runner``), and a runner that fails for one
request fails that request alone: the others get their tokens, the KV pool
empties and the server goes on serving."""

from __future__ import annotations

import concurrent.futures
import os
import re
import subprocess
import sys
import time
from typing import Any, Iterator

import httpx
import pytest

import echo_runner_plugin
from serverutil import start_server

pytestmark = pytest.mark.slow

GOOD = ["The capital of France is", "Once upon a time there was", "Plugins are chosen by name"]
POISON_TEXT = "The capital of ZQXPOISON is"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from fdx.model.loader import load_tokenizer

    return load_tokenizer("smollm2")


@pytest.fixture(scope="module")
def poison_token(tokenizer: Any) -> int:
    good = {t for p in GOOD for t in tokenizer.encode(p, add_special_tokens=True)}
    marked = [t for t in tokenizer.encode(POISON_TEXT, add_special_tokens=True) if t not in good]
    assert marked
    return marked[0]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, poison_token: int) -> Iterator[str]:
    path = echo_runner_plugin.write_entry_point(str(tmp_path_factory.mktemp("runner")))
    env = {"PYTHONPATH": path, echo_runner_plugin.POISON_ENV: str(poison_token)}
    with start_server("--model-runner", "poison-echo", env=env) as (base, _proc):
        yield base


def complete(base: str, prompt: str, max_tokens: int) -> httpx.Response:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(base + "/v1/completions", json=body, timeout=60)


def metric(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics", timeout=30).text
    m = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    assert m is not None, name
    return float(m.group(1))


def test_fdx_plugins_lists_the_runner(tmp_path: Any) -> None:
    env = {"PYTHONPATH": echo_runner_plugin.write_entry_point(str(tmp_path))}
    r = subprocess.run([sys.executable, "-m", "fdx", "plugins"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, **env})
    rows = {tuple(ln.split()[:4]) for ln in r.stdout.splitlines()}
    assert ("model_runner", "poison-echo", "echo_runner", "fdx-echo-runner") in rows, r.stdout + r.stderr


def test_the_plugin_runner_serves_completions(server: str, tokenizer: Any) -> None:
    for prompt in GOOD:
        ids = tokenizer.encode(prompt, add_special_tokens=True)
        r = complete(server, prompt, len(ids))
        assert r.status_code == 200, r.text
        js = r.json()
        assert js["usage"]["prompt_tokens"] == len(ids) and js["usage"]["completion_tokens"] == len(ids)
        assert js["choices"][0]["text"] == tokenizer.decode(ids)  # the echo runner repeats the prompt


def test_a_request_that_breaks_the_runner_fails_alone(server: str, tokenizer: Any) -> None:
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futs = {p: pool.submit(complete, server, p, 48) for p in [*GOOD, POISON_TEXT, *GOOD]}
        replies = {p: f.result() for p, f in futs.items()}
    bad = replies.pop(POISON_TEXT)
    assert bad.status_code == 500, bad.text
    assert bad.json()["error"]["message"]
    for prompt, r in replies.items():
        assert r.status_code == 200, r.text
        ids = tokenizer.encode(prompt, add_special_tokens=True)
        assert r.json()["choices"][0]["text"] == tokenizer.decode([ids[k % len(ids)] for k in range(48)])
    assert httpx.get(server + "/health", timeout=10).status_code == 200
    deadline = time.monotonic() + 30  # the stats of the engine's last step reach /metrics with its outputs or a heartbeat
    while metric(server, "fdx:kv_blocks_used") != 0:
        assert time.monotonic() < deadline, "KV blocks leaked"
        time.sleep(0.2)
    assert complete(server, GOOD[0], 4).status_code == 200
