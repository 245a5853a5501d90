"""One request never stalls or breaks the others in the API process (issue 14),
against a real ``fdx serve``:

* huge prompts are tokenized off the event loop: while they tokenize,
  ``/health`` and a small streaming request answer, and the API process
  gives the memory back afterwards;
* a token-processor plugin that fails for one request (``failing``, from
  ``failing_token_processor.py``, found through its entry point as an
  installed plugin would be) ends that request with an error -- an error
  event in a stream, a 500 envelope otherwise, naming no exception or path
  -- aborts it in the engine (its KV blocks are freed at once, long before
  its ``max_tokens``), and the other requests go on.
"""

from __future__ import annotations

import json
import random
import threading
import time
from typing import Any, Iterator

import httpx
import pytest

import failing_token_processor as failing
from serverutil import start_server

pytestmark = pytest.mark.slow

#: what a probe must answer within while huge prompts tokenize (behaviour, not a benchmark)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = failing.write_entry_point(str(tmp_path_factory.mktemp("plugin")))
    with start_server("--token-processor", "failing", env={"PYTHONPATH": path}) as (base, _proc):
        yield base


def big_prompt(n_bytes: int, seed: int) -> str:
    """Random words (the tokenizer's word cache does not help): seconds to encode."""
    rnd = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rnd.choice(letters) for _ in range(rnd.randint(2, 9))) for _ in range(50000)]
    out: list[str] = []
    size = 0
    while size < n_bytes:
        w = rnd.choice(words)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n_bytes]


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def sse(base: str, body: dict[str, Any], timeout: float = 120) -> list[Any]:
    """Every ``data:`` payload of a streamed completion (``[DONE]`` as a string)."""
    out: list[Any] = []
    with httpx.stream("POST", base + "/v1/completions", json={"model": "smollm2", "stream": True, **body},
                      timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return out


def stream_text(events: list[Any]) -> str:
    return "".join(c["text"] for ev in events if isinstance(ev, dict) for c in ev.get("choices", ()))


def wait_idle(base: str, timeout: float) -> dict[str, Any]:
    """/health once the engine runs nothing and holds no KV block."""
    deadline = time.monotonic() + timeout
    while True:
        h = httpx.get(base + "/health", timeout=10).json()
        usage = _metric(httpx.get(base + "/metrics", timeout=10).text, "fdx:kv_cache_usage_perc")
        if h["num_running"] == 0 and h["num_waiting"] == 0 and usage == 0.0:
            return h
        assert time.monotonic() < deadline, f"engine still busy after {timeout}s: {h}, kv usage {usage}"
        time.sleep(0.2)


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def assert_clean_error(text: str) -> None:
    """No exception type, traceback or path reaches the client."""
    for leak in (failing.SECRET, "KeyError", "RuntimeError", "Traceback", ".py"):
        assert leak not in text, text


# -- huge prompts off the event loop ----------------------------------------


def test_huge_prompts_do_not_stall_health_or_streams(server: str) -> None:
    api_pid = httpx.get(server + "/health", timeout=10).json()["api_pid"]
    prompts = [big_prompt(3 << 20, seed) for seed in (1, 2)]  # under --max-request-bytes (4 MiB)
    rss_before = rss_kib(api_pid)
    done: list[float] = []
    replies: list[httpx.Response] = []

    def send(prompt: str) -> None:
        r = httpx.post(server + "/v1/completions", json={"model": "smollm2", "prompt": prompt, "max_tokens": 4},
                       timeout=300)
        replies.append(r)
        done.append(time.monotonic())

    threads = [threading.Thread(target=send, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    time.sleep(0.5)  # both bodies are in and being tokenized (seconds each)
    t0 = time.monotonic()
    health = httpx.get(server + "/health", timeout=120)
    t_health = time.monotonic()
    events = sse(server, {"prompt": "The sky is", "max_tokens": 6, "temperature": 0, "ignore_eos": True},
                 timeout=120)
    t_stream = time.monotonic()
    for t in threads:
        t.join(300)
    assert health.status_code == 200
    assert events[-1] == "[DONE]" and stream_text(events)
    # on a blocked event loop neither could answer before a huge prompt's
    # reply: an ordering, not a time bound (the machine may be busy)
    assert t_health < t_stream < min(done), (t_health - t0, t_stream - t0, [d - t0 for d in done])
    for r in replies:  # ~1.7M tokens each: refused after tokenizing, with the count
        assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"], r.text
    # the tokenizer's buffers went back to the OS (the issue saw +1.5 GB kept for 16 MB)
    grown_mib = (rss_kib(api_pid) - rss_before) / 1024
    assert grown_mib < 150, f"API process kept {grown_mib:.0f} MiB after two 3 MiB prompts"


# -- a failing token-processor plugin fails its request only -----------------


LONG = {"max_tokens": 1500, "ignore_eos": True, "temperature": 0}  # minutes of decoding if never aborted


def test_failing_stream_ends_with_an_error_event_and_frees_its_blocks(server: str) -> None:
    wait_idle(server, 30)
    others: list[list[Any]] = []
    other = threading.Thread(target=lambda: others.append(
        sse(server, {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True})))
    other.start()
    events = sse(server, {"prompt": f"Tell me a story {failing.FAIL_FEED}", **LONG})
    t_error = time.monotonic()
    # some text came, then the error event, then [DONE]
    assert events[-1] == "[DONE]"
    err = events[-2]
    assert set(err) == {"error"} and err["error"]["code"] == 500
    assert "token processor" in err["error"]["message"]
    assert all("choices" in ev for ev in events[:-2]) and len(events) >= 3
    assert_clean_error(json.dumps(events))
    other.join(120)
    [ok] = others
    assert ok[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in ok)
    finals = [c["finish_reason"] for e in ok if isinstance(e, dict) for c in e["choices"] if c["finish_reason"]]
    assert finals == ["length"]
    # aborted in the engine: idle long before 1500 tokens could be decoded
    wait_idle(server, 20)
    assert time.monotonic() - t_error < 20


def test_failing_request_without_stream_is_a_500_envelope(server: str) -> None:
    r = httpx.post(server + "/v1/completions",
                   json={"model": "smollm2", "prompt": f"Hello {failing.FAIL_FEED}", **LONG}, timeout=120)
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["code"] == 500 and err["type"] == "internal_server_error"
    assert "token processor" in err["message"]
    assert_clean_error(r.text)
    wait_idle(server, 20)


def test_failing_open_is_a_500_and_submits_nothing(server: str) -> None:
    for stream in (False, True):
        r = httpx.post(server + "/v1/chat/completions",
                       json={"model": "smollm2", "stream": stream, "max_tokens": 8,
                             "messages": [{"role": "user", "content": f"hi {failing.FAIL_OPEN}"}]}, timeout=60)
        assert r.status_code == 500, r.text
        assert "token processor" in r.json()["error"]["message"]
        assert_clean_error(r.text)
    wait_idle(server, 10)
    # and the server still serves
    r = httpx.post(server + "/v1/chat/completions",
                   json={"model": "smollm2", "max_tokens": 8, "temperature": 0,
                         "messages": [{"role": "user", "content": "What is the capital of France?"}]}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
