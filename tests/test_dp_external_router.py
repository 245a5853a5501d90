"""An existing router (``vllm-router``, a Rust router on PyPI) in front of two
real ``fdx serve`` instances: it spreads distinct requests over both and,
with ``--policy cache_aware``, keeps each shared-prefix group on one
instance so the prefix cache serves its later rounds.

Skips cleanly when the ``vllm-router`` binary is absent (install it in a
venv of its own: ``python -m venv /work/routers-venv &&
/work/routers-venv/bin/pip install vllm-router``; the test finds it on PATH
or through ``FDX_VLLM_ROUTER``; ``make test`` installs it with the ``test``
extra).  The router re-serializes every request and adds sglang-style
fields at their neutral values (``no_stop_trim: false``,
``skip_special_tokens: true``, ``return_hidden_states: false``, the
reasoning switches); fdx accepts exactly those values
(``protocol.DEFAULT_ONLY_FIELDS``) and refuses any other."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from serverutil import metric_value, start_server, stop_process, wait_health

_NEXT_TO_PYTHON = Path(sys.executable).with_name("vllm-router")
ROUTER = (os.environ.get("FDX_VLLM_ROUTER") or shutil.which("vllm-router")
          or (str(_NEXT_TO_PYTHON) if _NEXT_TO_PYTHON.exists() else None))
pytestmark = [pytest.mark.slow, pytest.mark.skipif(ROUTER is None, reason="vllm-router is not installed")]
WORKER = ("--num-threads", "1", "--max-num-seqs", "8")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _router(workers: list[str]) -> Iterator[str]:
    port = _free_port()
    assert ROUTER is not None
    proc = subprocess.Popen([ROUTER, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
                             "--policy", "cache_aware", "--prometheus-host", "127.0.0.1", "--prometheus-port",
                             str(_free_port())], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_health(base, 60, proc, "vllm-router")
        yield base
    finally:
        stop_process(proc)


def _post(base: str, prompt: str, max_tokens: int = 4) -> httpx.Response:
    return httpx.post(base + "/v1/completions", timeout=120,
                      json={"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def _executed(workers: list[str]) -> list[float]:
    return [metric_value(w, "fdx:request_success_total", finished_reason="length")
            + metric_value(w, "fdx:request_success_total", finished_reason="stop") for w in workers]


@pytest.fixture(scope="module")
def routed() -> Iterator[dict[str, Any]]:
    with ExitStack() as stack:
        first, _ = stack.enter_context(start_server(*WORKER))
        probe = stack.enter_context(_router([first]))
        r = _post(probe, "Hello")
        assert r.status_code == 200, r.text
        second, _ = stack.enter_context(start_server(*WORKER))
        workers = [first, second]
        yield {"router": stack.enter_context(_router(workers)), "workers": workers}


def test_the_router_spreads_distinct_requests_over_both_instances(routed: dict[str, Any]) -> None:
    router, workers = routed["router"], routed["workers"]
    rng = random.Random(3)
    words = "river stone cloud paper engine garden violet number silver window planet orange".split()
    prompts = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(16)]
    before = _executed(workers)
    with ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(lambda p: _post(router, p).status_code, prompts))
    assert codes == [200] * 16
    ran = [b - a for a, b in zip(before, _executed(workers))]
    assert sum(ran) == 16 and min(ran) > 0, ran


def test_cache_aware_routing_keeps_a_prefix_group_on_one_instance(routed: dict[str, Any]) -> None:
    router, workers = routed["router"], routed["workers"]
    rng = random.Random(5)
    words = "alpha beta gamma delta river stone cloud paper engine garden violet silver window planet".split()
    groups = [" ".join(rng.choice(words) for _ in range(300)) for _ in range(4)]
    where: dict[int, list[int]] = {}
    hits0 = sum(metric_value(w, "fdx:prefix_cache_hits_total") for w in workers)
    for rnd in range(3):
        for g, prefix in enumerate(groups):
            before = _executed(workers)
            assert _post(router, f"{prefix} question {rnd}?", 2).status_code == 200
            ran = [i for i, (a, b) in enumerate(zip(before, _executed(workers))) if b > a]
            assert len(ran) == 1
            where.setdefault(g, []).append(ran[0])
    assert all(len(set(ws)) == 1 for ws in where.values()), where
    assert sum(metric_value(w, "fdx:prefix_cache_hits_total") for w in workers) > hits0
