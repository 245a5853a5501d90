"""``fdx serve --deployment dp+splitwise --data-parallel-size 2`` with real
processes: two prefill and two decode instances (``--num-threads 1`` each)
and the router, as managed children.

* ``/health`` lists every engine of the four instances (pid, state);
* greedy parity: the parity prompts of tests/test_splitwise_serve.py give
  the same text and usage through the router as through a single instance,
  streamed too, and no D recomputed a prompt token;
* the requests land on both P and both D: each instance's own
  ``fdx:splitwise_handoffs_total`` (P: KV sent, D: KV inserted) grew;
* a pause through the router reaches every instance (each one's own
  ``/v1/is_paused``), the reply lists each, and a resume serves again; a
  sleep (KV cache) and wakeup too; an update_weights every instance
  refuses answers their 403 with each one's reply;
* a prefill instance SIGKILLed while the deployment is paused comes back
  paused (the router gives it the deployment's control state before
  routing to it: fdx/router/state.py), counted in
  ``fdx:router_instance_restarts_total``, and serves after a resume;
* SIGKILL of one D instance under a few streams: every stream ends (done,
  or a 5xx error event / status), the other D's streams finish, the dead
  instance is started again and the deployment serves again.

One single-instance reference and one dp+splitwise deployment for the module.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import httpx
import pytest
from serverutil import metric_value, pid_alive, read_log, start_server
from test_splitwise_serve import COMMON, _complete, _healthy, _kill_instance, _prompts, _stream, _usage, _wait, kill_under_streams

pytestmark = pytest.mark.slow

N_PARITY = 8
N_STREAMS = 8


@pytest.fixture(scope="module")
def reference() -> Iterator[str]:
    with start_server(*COMMON) as (base, _proc):
        yield base


@pytest.fixture(scope="module")
def dps() -> Iterator[dict[str, Any]]:
    with start_server("--deployment", "dp+splitwise", "--data-parallel-size", "2", "--splitwise-handoff-timeout",
                      "600", *COMMON, timeout=600) as (base, proc):
        # the router is healthy with one P and one D up: wait for all four
        _wait(lambda: _all_serving(base), 300, f"not every instance came up: {_health(base)}")
        yield {"router": base, "proc": proc}


def _all_serving(router: str) -> bool:
    h = _health(router)
    return len(h["engines"]) == 4 and all(e["state"] == "serving" for e in h["engines"]) and \
        all(i["up"] for i in h["prefill"] + h["decode"])


def _health(router: str) -> dict[str, Any]:
    return httpx.get(router + "/health", timeout=10).json()


def _urls(router: str, role: str) -> list[str]:
    return [i["url"] for i in _health(router)[role]]


def test_health_lists_every_engine(dps: dict[str, Any]) -> None:
    h = _health(dps["router"])
    assert h["status"] == "ok" and len(h["prefill"]) == 2 and len(h["decode"]) == 2, h
    names = sorted(e["instance"] for e in h["engines"])
    assert names == ["decode0", "decode1", "prefill0", "prefill1"], h["engines"]
    assert all(e["state"] == "serving" and pid_alive(e["pid"]) for e in h["engines"]), h["engines"]
    assert len({e["pid"] for e in h["engines"]}) == 4
    for inst in h["prefill"] + h["decode"]:  # the same pids as the instances' own /health
        own = httpx.get(inst["url"] + "/health", timeout=10).json()
        assert [e["pid"] for e in own["engines"]] == [e["pid"] for e in inst["engines"]]
        assert httpx.get(inst["url"] + "/v1/splitwise/info", timeout=10).json()["role"] == inst["role"]


def _handoffs(url: str) -> float:
    return metric_value(url, "fdx:splitwise_handoffs_total")


def test_greedy_parity_over_both_prefill_and_both_decode(dps: dict[str, Any], reference: str) -> None:
    router = dps["router"]
    insts = _urls(router, "prefill") + _urls(router, "decode")
    before = {u: _handoffs(u) for u in insts}
    prompts = _prompts(N_PARITY, seed=312)
    with ThreadPoolExecutor(8) as pool:
        futs = [(pool.submit(_complete, reference, p, 8), pool.submit(_complete, router, p, 8)) for p in prompts]
        ref, got = [a.result() for a, _ in futs], [b.result() for _, b in futs]
    for k, (a, b) in enumerate(zip(ref, got)):
        assert b["choices"][0]["text"] == a["choices"][0]["text"], f"prompt {k} ({len(prompts[k])} tokens)"
        assert _usage(b["usage"]) == _usage(a["usage"]) == (len(prompts[k]), 8, len(prompts[k]) + 8)
    for p in _prompts(3, seed=313, hi=600):
        assert _stream(router, p, 12) == _stream(reference, p, 12)
    # every P and every D did part of the work (engine-side counts; P's stats come with its heartbeats)
    _wait(lambda: all(_handoffs(u) > before[u] for u in insts), 30,
          f"an instance took no handoff: {[(u, before[u], _handoffs(u)) for u in insts]}")
    decode = _urls(router, "decode")
    assert sum(_handoffs(u) - before[u] for u in decode) == N_PARITY + 3
    assert all(metric_value(u, "fdx:splitwise_recomputed_prompt_tokens_total") == 0 for u in decode)
    h = _health(router)
    assert all(i["given"] > 0 for i in h["prefill"] + h["decode"])
    print("handoffs per instance:", {u: _handoffs(u) - before[u] for u in insts},
          "given:", {i["url"]: i["given"] for i in h["prefill"] + h["decode"]})


def test_sleep_and_a_refused_call_report_every_instance(dps: dict[str, Any]) -> None:
    router = dps["router"]
    insts = sorted(_urls(router, "prefill") + _urls(router, "decode"))
    r = httpx.post(router + "/v1/sleep?tags=kv_cache", timeout=300)
    try:
        assert r.status_code == 200, r.text
        res = r.json()["result"]
        assert res["sleeping"] == ["kv_cache"] and sorted(e["url"] for e in res["instances"]) == insts
        assert all(e["reply"]["result"]["sleeping"] == ["kv_cache"] for e in res["instances"]), res
        assert httpx.get(router + "/is_sleeping", timeout=30).json() == {"is_sleeping": True}
    finally:
        r = httpx.post(router + "/v1/wakeup?tags=kv_cache", timeout=300)
    assert r.status_code == 200 and r.json()["result"]["sleeping"] == [], r.text
    assert all(httpx.get(u + "/v1/is_paused", timeout=30).json()["result"]["sleeping"] == [] for u in insts)
    # every instance refuses (no --allowed-weights-dir): the router answers that status and lists each reply
    r = httpx.post(router + "/v1/update_weights", json={"path": "/tmp"}, timeout=120)
    assert r.status_code == 403, r.text
    body = r.json()
    assert body["error"]["code"] == 403 and "4 of 4 instances failed" in body["error"]["message"]
    assert sorted((e["url"], e["status_code"]) for e in body["result"]["instances"]) == [(u, 403) for u in insts]
    assert _complete(router, _prompts(1, seed=318)[0], 4)["usage"]["completion_tokens"] == 4


def test_pause_reaches_every_instance(dps: dict[str, Any]) -> None:
    router = dps["router"]
    insts = _urls(router, "prefill") + _urls(router, "decode")
    r = httpx.post(router + "/v1/pause", timeout=120)
    try:
        assert r.status_code == 200, r.text
        res = r.json()["result"]
        assert res["is_paused"] is True
        assert sorted(e["url"] for e in res["instances"]) == sorted(insts)
        assert all(e["status_code"] == 200 and e["reply"]["result"]["is_paused"] for e in res["instances"]), res
        for u in insts:  # each instance says so itself
            assert httpx.get(u + "/v1/is_paused", timeout=30).json()["result"]["is_paused"] is True
        assert httpx.get(router + "/is_paused", timeout=30).json() == {"is_paused": True}
    finally:
        r = httpx.post(router + "/v1/resume", timeout=120)
    assert r.status_code == 200 and r.json()["result"]["is_paused"] is False, r.text
    assert all(httpx.get(u + "/v1/is_paused", timeout=30).json()["result"]["is_paused"] is False for u in insts)
    assert _complete(router, _prompts(1, seed=315)[0], 4)["usage"]["completion_tokens"] == 4


def test_a_prefill_instance_restarted_while_paused_is_paused_again(dps: dict[str, Any]) -> None:
    router = dps["router"]
    _wait(lambda: _all_serving(router), 300, f"not every instance is serving: {_health(router)}")
    inst = _health(router)["prefill"][1]
    url, old_pid = inst["url"], inst["engine_pid"]
    r = httpx.post(router + "/v1/pause", timeout=120)
    try:
        assert r.status_code == 200, r.text
        assert _health(router)["control_state"]["is_paused"] is True
        _kill_instance(url)
        t_kill = time.monotonic()
        _wait(lambda: (lambda i: i["up"] and i.get("engine_pid") not in (None, old_pid))(
            _health(router)["prefill"][1]), 300, f"prefill1 did not come back: {_health(router)['prefill']}")
        print(f"prefill1 back in rotation, paused, {time.monotonic() - t_kill:.1f}s after its SIGKILL")
        assert httpx.get(url + "/v1/is_paused", timeout=30).json()["result"]["is_paused"] is True
        assert _health(router)["prefill"][1]["restarts"] >= 1
        assert metric_value(router, "fdx:router_instance_restarts_total", instance=url) >= 1
        assert httpx.post(router + "/v1/completions", json={"model": "smollm2", "prompt": _prompts(1, seed=319)[0],
                                                            "max_tokens": 4}, timeout=120).status_code == 503
    finally:
        r = httpx.post(router + "/v1/resume", timeout=120)
    assert r.status_code == 200 and r.json()["result"]["is_paused"] is False, r.text
    assert httpx.get(url + "/v1/is_paused", timeout=30).json()["result"]["is_paused"] is False
    assert _complete(router, _prompts(1, seed=320)[0], 4)["usage"]["completion_tokens"] == 4


def test_sigkill_of_one_decode_instance_under_streams(dps: dict[str, Any]) -> None:
    router, proc = dps["router"], dps["proc"]
    dead, survivor = _urls(router, "decode")
    prompts = _prompts(N_STREAMS, seed=316, lo=32, hi=160)
    ok, failed, killed, t_kill, outs = kill_under_streams(router, dead, prompts, 48, started=2, budget=120)
    assert ok, "no stream finished on the surviving decode instance"
    print(f"after SIGKILL of {dead}: {len(ok)} streams finished, {len(failed)} ended with a 5xx, "
          f"last one {max(o['ended'] for o in outs) - t_kill:.1f}s after the kill")
    # a SIGKILLed process can take a while to exit (unmapping a Mooncake segment on a busy machine)
    _wait(lambda: not any(pid_alive(pid) for pid in killed), 30, f"a killed process is still alive: {killed}")
    _wait(lambda: metric_value(survivor, "fdx:kv_blocks_used") == 0, 60, "the survivor still holds KV blocks")
    # the deployment starts the dead instance again; every engine serves again, and requests do
    _wait(lambda: _healthy(dead) and _all_serving(router), 300,
          "the killed decode instance did not come back")
    print(f"every engine serving again {time.monotonic() - t_kill:.1f}s after the kill")
    assert "the decode0 child" in read_log(proc, 400_000)
    for p in _prompts(4, seed=317, lo=16, hi=64):
        assert _complete(router, p, 4)["usage"]["completion_tokens"] == 4
