"""``fdx bench serve`` against a real ``fdx serve``: the benchmark's token
counts must equal the server's own ``/metrics`` counters exactly, and the
prompts must reach the engine at exactly the length the dataset built."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any, Iterator

import pytest

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


@pytest.fixture(scope="module")
def fdx_url(tmp_path_factory: Any) -> Iterator[str]:
    """A running ``fdx serve`` (the server helper's tests/serverutil.py when
    present, else started here and stopped by PID)."""
    try:
        from serverutil import start_server  # tests/ is on sys.path under pytest
    except ImportError:
        start_server = None
    if start_server is not None:
        with start_server("--num-threads", "2") as (base_url, _proc):
            yield base_url
        return
    try:
        import fdx.deploy.launcher  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"fdx serve is not available yet ({exc})")
    port = _free_port()
    log = tmp_path_factory.mktemp("fdx") / "serve.log"
    fdx_bin = os.path.join(os.path.dirname(sys.executable), "fdx")
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [fdx_bin, "serve", "--port", str(port), "--num-threads", "2"],
            stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                pytest.fail(f"fdx serve exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
            try:
                _get(url + "/health", 2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"fdx serve not ready after 300 s:\n{log.read_text()[-3000:]}")
                time.sleep(0.5)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


def _counter(text: str, name: str) -> float:
    """Sum of a Prometheus counter's samples over all label sets."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", text, re.M):
        total += float(m.group(1))
    return total


COUNTERS = ("fdx:prompt_tokens_total", "fdx:generation_tokens_total", "fdx:request_success_total")


def _scrape(url: str) -> dict[str, float]:
    text = _get(url + "/metrics")
    return {c: _counter(text, c) for c in COUNTERS}


@pytest.mark.parametrize(
    ("endpoint", "fmt"),
    [("/v1/completions", "ids"), ("/v1/completions", "text"), ("/v1/chat/completions", "text")],
)
def test_bench_counts_match_server_metrics(fdx_url: str, endpoint: str, fmt: str, tmp_path: Any) -> None:
    from fdx.bench.serve import main

    before = _scrape(fdx_url)
    out = tmp_path / "r.json"
    rc = main([
        "--base-url", fdx_url, "--endpoint", endpoint, "--prompt-format", fmt, "--num-prompts", "4", "--max-concurrency", "2",
        "--random-input-len", "40", "--random-range-ratio", "0.25", "--random-output-len", "12", "--ignore-eos",
        "--warmup", "0", "--no-progress", "--json", str(out),
    ])
    after = _scrape(fdx_url)
    doc = json.loads(out.read_text())
    run = doc["runs"][0]
    assert rc == 0, run.get("errors")
    assert run["completed"] == 4 and run["failed"] == 0
    assert run["usage_reported"] is True
    delta = {k: after[k] - before[k] for k in COUNTERS}
    # the bench's totals are exactly the server's own counters
    assert delta["fdx:request_success_total"] == 4
    assert delta["fdx:generation_tokens_total"] == run["total_output_tokens"]
    assert delta["fdx:prompt_tokens_total"] == run["total_input_tokens"]
    reqs = run["per_request"]
    # ignore_eos: every request generated exactly max_tokens
    assert [r["output_tokens"] for r in reqs] == [r["max_tokens"] for r in reqs]
    assert doc["prompt_format"] == (fmt if endpoint == "/v1/completions" else "text")
    # prompts reach the engine at exactly the length the dataset built (for
    # chat: the words plus the chat template, counted with the same tokenizer)
    assert [r["prompt_len"] for r in reqs] == [r["sent_prompt_len"] for r in reqs]
    if endpoint == "/v1/completions":
        assert all(30 <= r["prompt_len"] <= 50 for r in reqs)
    assert run["mean_ttft_ms"] > 0 and run["mean_itl_ms"] > 0
