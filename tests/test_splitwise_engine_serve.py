"""Splitwise with real processes and the real model: a prefill and a
decode ``fdx serve`` (``--num-threads 1`` each), requests posted to D with
``kv_transfer_params`` (the router path is W2's tests/test_router*.py), for
both KV connectors (mooncake against a real ``mooncake_master`` started and
stopped by PID).

Greedy outputs (token ids, text, usage) equal a single mixed instance's on
prompts of 16-1,500 tokens; D recomputes no prompt token; the KV blocks of
both go back to 0; abort (client gone, during the handoff or the decode)
frees both; killing P's engine mid-request ends D's pending requests with
a 503 (envelope or error event), and D serves again once P is back."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import signal
import threading
import time
from typing import Any, Iterator

import httpx
import pytest

from kvservices import MooncakeMaster, have_mooncake
from serverutil import children_of, free_port, metric_value, record_stream, start_server, wait_health

pytestmark = pytest.mark.slow

COMMON = ("--num-threads", "1", "--max-num-seqs", "16")
LENGTHS = (16, 23, 48, 64, 100, 150, 256, 333, 512, 700, 900, 1024, 1200, 1500)
MAX_TOKENS = 10


def _prompts() -> list[list[int]]:
    rng = random.Random(12)
    out = [[rng.randrange(200, 40000) for _ in range(n)] for n in LENGTHS]
    # two that share a 640-token prefix with a longer one: D's prefix cache sends only their tails
    out += [out[-3][:640] + [rng.randrange(200, 40000) for _ in range(k)] for k in (30, 77)]
    return out


PROMPTS = _prompts()


def _complete(base: str, prompt: list[int], kv: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True,
                            **extra}
    if kv is not None:
        body["kv_transfer_params"] = kv
    r = httpx.post(base + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _all(base: str, kv: dict[str, str] | None = None) -> list[dict[str, Any]]:
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda p: _complete(base, p, kv), PROMPTS))


def _summary(res: dict[str, Any]) -> tuple[Any, ...]:
    ch = res["choices"][0]
    return ch["token_ids"], ch["text"], ch["finish_reason"], res["usage"]["prompt_tokens"], \
        res["usage"]["completion_tokens"]


def _wait_blocks_free(*bases: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    for base in bases:
        while metric_value(base, "fdx:kv_blocks_used") != 0:
            assert time.monotonic() < deadline, f"{base}: {metric_value(base, 'fdx:kv_blocks_used')} KV blocks used"
            time.sleep(0.2)


def _settled(base: str, name: str) -> float:
    """A counter once the engine's latest stats reached the API process
    (P's jobs send no outputs there: its stats travel with heartbeats)."""
    last = metric_value(base, name)
    while True:
        time.sleep(1.2)  # more than two heartbeats
        now = metric_value(base, name)
        if now == last:
            return now
        last = now


@pytest.fixture(scope="module")
def reference() -> list[tuple[Any, ...]]:
    """A single mixed instance's answers."""
    with start_server(*COMMON) as (base, _proc):
        return [_summary(r) for r in _all(base)]


@pytest.fixture(scope="module", params=["zmq", "mooncake"])
def pd(request: Any) -> Iterator[dict[str, Any]]:
    """P and D ``fdx serve`` with the given connector (mooncake: + a real master)."""
    name = request.param
    with _services(name) as extra:
        p_kv = free_port()  # fixed, so a restarted P engine listens where D dials
        with start_server(*COMMON, "--scheduler", "splitwise", "--splitwise-role", "prefill", "--kv-connector", name,
                          "--kv-connector-port", str(p_kv), *extra) as (p_base, p_proc), \
             start_server(*COMMON, "--scheduler", "splitwise", "--splitwise-role", "decode", "--kv-connector", name,
                          *extra) as (d_base, d_proc):
            info = httpx.get(p_base + "/v1/splitwise/info", timeout=10).json()
            assert info["role"] == "prefill" and info["kv_connector"] == name
            assert info["kv_addr"] == f"tcp://127.0.0.1:{p_kv}"
            assert httpx.get(d_base + "/v1/splitwise/info", timeout=10).json()["role"] == "decode"
            yield {"name": name, "p": p_base, "d": d_base, "p_proc": p_proc, "d_proc": d_proc,
                   "kv": {"prefill_addr": info["kv_addr"], "prefill_url": p_base}}


class _services:
    """Nothing for zmq; a mooncake_master (by PID) for mooncake."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.master: MooncakeMaster | None = None

    def __enter__(self) -> tuple[str, ...]:
        if self.name != "mooncake":
            return ()
        if not have_mooncake():
            pytest.skip("mooncake_master / mooncake.store not installed (pip install 'fdx[mooncake]')")
        self.master = MooncakeMaster()
        cfg = {"master": self.master.address, "global_segment_size": "256M"}
        return ("--kv-connector-config", json.dumps(cfg))

    def __exit__(self, *exc: object) -> None:
        if self.master is not None:
            self.master.stop()


def test_outputs_equal_a_mixed_instance_and_d_recomputes_nothing(pd: dict[str, Any], reference: Any) -> None:
    before = metric_value(pd["d"], "fdx:splitwise_handoffs_total")
    got = [_summary(r) for r in _all(pd["d"], pd["kv"])]
    for i, (g, want) in enumerate(zip(got, reference)):
        assert g == want, f"prompt {i} ({len(PROMPTS[i])} tokens) differs"
    d, p = pd["d"], pd["p"]
    assert metric_value(d, "fdx:splitwise_handoffs_total") - before == len(PROMPTS)
    assert metric_value(d, "fdx:splitwise_recomputed_prompt_tokens_total") == 0
    assert metric_value(d, "fdx:splitwise_handoff_failures_total") == 0
    assert _settled(d, "fdx:splitwise_kv_bytes_total") == _settled(p, "fdx:splitwise_kv_bytes_total") > 0
    assert metric_value(d, "fdx:splitwise_handoff_seconds_count") >= len(PROMPTS)
    _wait_blocks_free(d, p)


def test_kv_transfer_params_only_on_decode(pd: dict[str, Any]) -> None:
    r = httpx.post(pd["p"] + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2,
                                                      "kv_transfer_params": pd["kv"]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
    r = httpx.post(pd["d"] + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2,
                                                      "kv_transfer_params": {"prefill_addr": "x", "y": 1}}, timeout=30)
    assert r.status_code == 400
    # a request stopping on its first token ends on D without a decode step
    res = _complete(pd["d"], PROMPTS[0], pd["kv"], max_tokens=1)
    assert res["usage"]["completion_tokens"] == 1 and res["choices"][0]["finish_reason"] == "length"


def test_abort_frees_both_during_the_handoff_and_the_decode(pd: dict[str, Any]) -> None:
    d, p = pd["d"], pd["p"]
    long_prompt = PROMPTS[LENGTHS.index(1500)][::-1]  # not in P's prefix cache: P really prefills
    body = {"prompt": long_prompt, "max_tokens": 300, "temperature": 0, "kv_transfer_params": pd["kv"]}
    handoffs = _settled(p, "fdx:splitwise_handoffs_total")
    # P busy with two plain 1,500-token prompts first, so the job is still queued there when D aborts it
    busy = [threading.Thread(target=_complete, args=(p, PROMPTS[LENGTHS.index(n)][::-2] * 2), kwargs={"max_tokens": 1})
            for n in (1200, 1500)]
    for t in busy:
        t.start()
    deadline = time.monotonic() + 60
    while metric_value(p, "fdx:kv_blocks_used") == 0:
        assert time.monotonic() < deadline, "P never started the plain requests"
        time.sleep(0.05)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up while P is busy: D aborts, tells P
        httpx.post(d + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    for t in busy:
        t.join(300)
    _wait_blocks_free(d, p)
    assert _settled(p, "fdx:splitwise_handoffs_total") == handoffs  # P dropped the job: no KV sent
    body["stream"] = True
    # during the decode: read a few tokens, then hang up
    with httpx.stream("POST", d + "/v1/completions", json={**body, "prompt": PROMPTS[2]}, timeout=60) as r:
        n = 0
        for line in r.iter_lines():
            n += line.startswith("data: ")
            if n >= 3:
                break
    _wait_blocks_free(d, p)
    assert _summary(_complete(d, PROMPTS[1], pd["kv"]))[2] == "length"  # both serve on


def test_killing_p_mid_request_ends_ds_requests_with_an_error(pd: dict[str, Any]) -> None:
    d, p = pd["d"], pd["p"]
    engine = [k for k in children_of(pd["p_proc"].pid) if b"engine_proc" in open(f"/proc/{k}/cmdline", "rb").read()]
    assert len(engine) == 1
    outs = [{} for _ in range(4)]
    started = [threading.Event() for _ in outs]
    threads = [threading.Thread(target=record_stream, args=(
        d, {"prompt": PROMPTS[LENGTHS.index(1200 + 300 * (i % 2))][i:] + [7] * i, "max_tokens": 50, "temperature": 0,
            "kv_transfer_params": pd["kv"]}, outs[i], started[i], 60)) for i in range(len(outs))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while metric_value(p, "fdx:kv_blocks_used") == 0:  # P is prefilling them
        assert time.monotonic() < deadline, "P never started the jobs"
        time.sleep(0.05)
    t0 = time.monotonic()
    os.kill(engine[0], signal.SIGKILL)
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a request hangs"
    for o in outs:
        failed = o.get("status") == 503 or (o.get("error") or {}).get("code") == 503
        assert failed or o.get("finish") == "length", o  # one P already handed over may finish
        assert o["ended"] - t0 < 15
    assert any(o.get("status") == 503 or o.get("error") for o in outs)
    _wait_blocks_free(d)
    # P's engine is restarted by its launcher, at the same kv port: D serves through it again
    wait_health(p, 120, what="P")
    assert _summary(_complete(d, PROMPTS[3], pd["kv"]))[2] == "length"
    _wait_blocks_free(d, p)
