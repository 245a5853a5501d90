"""``fdx chat``, ``fdx complete`` and ``fdx run-batch`` as a new user runs
them: against one real ``fdx serve`` (piped, ``-q`` and an interactive
session on a pseudo-terminal; greedy replies equal the server's own), a
server that is down (one line, exit 1), and a 100-request Batch file with
bad lines run offline through ``fdx.LLM`` (results in input order, an error
record per bad line, greedy results equal the server's)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from serverutil import free_port, start_server

FDX = [sys.executable, "-m", "fdx.cli"]
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with start_server("--max-num-batched-tokens", "64", "--num-kv-blocks", "256", "--max-model-len", "512",
                      default_args=()) as (base, _proc):
        yield base


def fdx(*args: str, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*FDX, *args], input=stdin, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def server_chat(base: str, content: str, max_tokens: int) -> str:
    r = httpx.post(base + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0})
    return r.json()["choices"][0]["message"]["content"]


def server_complete(base: str, prompt: str, max_tokens: int) -> str:
    r = httpx.post(base + "/v1/completions", timeout=120,
                   json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    return r.json()["choices"][0]["text"]


def test_chat_piped_and_quick(server: str) -> None:
    want = server_chat(server, QUESTION, 8)
    r = fdx("chat", "--url", server, "--max-tokens", "8", "--temperature", "0", stdin=QUESTION)
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == want
    r = fdx("chat", "--url", server + "/v1", "--model", "smollm2", "--max-tokens", "8", "--temperature", "0",
            "-q", QUESTION)
    assert r.returncode == 0 and r.stdout.rstrip("\n") == want, r.stderr


def test_complete_piped_and_quick(server: str) -> None:
    want = server_complete(server, "Once upon a time", 6)
    r = fdx("complete", "--url", server, "--max-tokens", "6", "--temperature", "0", stdin="Once upon a time")
    assert r.returncode == 0 and r.stdout.rstrip("\n") == want, r.stderr
    r = fdx("complete", "--url", server, "--max-tokens", "6", "--temperature", "0", "-q", "Once upon a time")
    assert r.returncode == 0 and r.stdout.rstrip("\n") == want, r.stderr


def _read_until(fd: int, needle: str, timeout: float = 120) -> str:
    out = ""
    deadline = time.monotonic() + timeout
    while needle not in out:
        left = deadline - time.monotonic()
        assert left > 0, f"{needle!r} not seen in {out!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                out += os.read(fd, 4096).decode(errors="replace")
            except OSError:  # the child closed the terminal
                break
    return out


def test_chat_interactive_session_keeps_the_conversation(server: str) -> None:
    master, slave = os.openpty()
    proc = subprocess.Popen([*FDX, "chat", "--url", server, "--max-tokens", "8", "--temperature", "0"],
                            stdin=slave, stdout=slave, stderr=slave, close_fds=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    os.close(slave)
    try:
        assert "fdx chat with smollm2" in _read_until(master, "> ")
        os.write(master, (QUESTION + "\n").encode())
        answer = server_chat(server, QUESTION, 8)
        assert answer in _read_until(master, "> ").replace("\r\n", "\n")
        os.write(master, b"And of Italy?\n")
        history = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": answer},
                   {"role": "user", "content": "And of Italy?"}]
        r = httpx.post(server + "/v1/chat/completions", timeout=120,
                       json={"messages": history, "max_tokens": 8, "temperature": 0})
        assert r.json()["choices"][0]["message"]["content"] in _read_until(master, "> ").replace("\r\n", "\n")
        os.write(master, b"/exit\n")
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)


@pytest.mark.parametrize("verb", ["chat", "complete"])
def test_server_down_is_one_line_and_exit_1(verb: str) -> None:
    r = fdx(verb, "--url", f"http://127.0.0.1:{free_port()}", "-q", "hi", timeout=60)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fdx: error: cannot reach a server at"), r.stderr


def test_server_error_is_one_line(server: str) -> None:
    r = fdx("chat", "--url", server, "--model", "no-such-model", "-q", "hi")
    assert r.returncode == 1 and "404" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_run_batch_100_requests_in_order_with_bad_lines(server: str, tmp_path: Path) -> None:
    lines: list[str] = []
    for i in range(100):
        if i % 2:
            body: dict[str, Any] = {"model": "smollm2", "messages": [{"role": "user", "content": f"Count to {i}"}],
                                    "max_tokens": 3, "temperature": 0}
            url = "/v1/chat/completions"
        else:
            body = {"model": "smollm2", "prompt": f"Number {i} is", "max_tokens": 3, "temperature": 0}
            url = "/v1/completions"
        lines.append(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body}))
    lines.insert(10, "{not json")
    lines.insert(20, json.dumps({"custom_id": "bad-field", "method": "POST", "url": "/v1/completions",
                                 "body": {"prompt": "x", "max_tokens": 2, "bogus": True}}))
    lines.insert(30, json.dumps({"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {}}))
    lines.insert(40, json.dumps({"custom_id": "echo", "method": "POST", "url": "/v1/chat/completions", "body": {
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! I am"}],
        "continue_final_message": True, "echo": True, "max_tokens": 3, "temperature": 0}}))
    src, dst = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    src.write_text("\n".join(lines) + "\n")
    r = fdx("run-batch", "-i", str(src), "-o", str(dst), "--max-model-len", "512", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "requests" in r.stderr and "104/104" in r.stderr  # the progress bar reached the end
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert len(out) == 104
    ids = [o["custom_id"] for o in out]
    assert ids[10] is None and ids[20] == "bad-field" and ids[30] == "bad-url" and ids[40] == "echo"
    assert [x for k, x in enumerate(ids) if k not in (10, 20, 30, 40)] == [f"req-{i}" for i in range(100)]
    echoed = out[40]["response"]["body"]["choices"][0]["message"]["content"]
    assert echoed.startswith("Hello! I am") and len(echoed) > len("Hello! I am")
    assert out[10]["error"]["code"] == "invalid_json" and out[10]["response"] is None
    assert out[30]["error"]["code"] == "invalid_url"
    bad = out[20]["response"]
    assert bad["status_code"] == 400 and bad["body"]["error"]["param"] == "bogus"
    good = [o for k, o in enumerate(out) if k not in (10, 20, 30, 40)]
    assert all(o["response"]["status_code"] == 200 and o["error"] is None for o in good)
    assert all(o["response"]["body"]["usage"]["completion_tokens"] >= 1 for o in good)
    # greedy: the same text as the server's
    assert good[0]["response"]["body"]["choices"][0]["text"] == server_complete(server, "Number 0 is", 3)
    assert good[1]["response"]["body"]["choices"][0]["message"]["content"] == server_chat(server, "Count to 1", 3)


def test_run_batch_missing_input_is_one_line(tmp_path: Path) -> None:
    r = fdx("run-batch", "-i", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "out.jsonl"), timeout=60)
    assert r.returncode == 1 and r.stderr.strip().startswith("fdx: error: cannot read"), r.stderr
