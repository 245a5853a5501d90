"""``fdx router`` over two ordinary (mixed) ``fdx serve`` instances, real processes.

An instance without ``/v1/splitwise/info`` serves requests whole, so this
module checks the router's own behaviour without the handoff (that is
tests/test_splitwise_serve.py):

* unit: request planning (``max_tokens == 1`` -> P, the affinity key),
  ``kv_transfer_params`` spliced into the client's bytes, metrics
  re-labelling, picks by load and prefix affinity, config errors;
* the relay: the same text and ``usage`` as D answered directly, streamed
  and not; SSE relayed byte for byte but ids/timestamps; ``max_tokens == 1``
  served by P; errors (a client-set ``kv_transfer_params``, invalid JSON)
  as OpenAI envelopes; ``/health`` and ``/metrics`` cover both instances;
* a client that disconnects mid-stream: D aborts it and frees its blocks;
* D killed: ``/health`` 503 naming it, a request -> 503 envelope, an open
  stream -> one error event and ``[DONE]``, nothing hangs; D restarted on
  its port -> the router serves again.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Iterator

import httpx
import pytest
from serverutil import children_of, free_port, metric_value, read_log, record_stream, start_server, stop_process

from fdx.core.errors import ConfigError
from fdx.router.instances import Flight, InstancePool
from fdx.router.main import RouterConfig
from fdx.router.metrics import relabel
from fdx.router.proxy import plan_request, with_transfer_params

COMMON = ("--num-threads", "1", "--max-num-seqs", "8")


# ----------------------------------------------------------------------------- unit


def test_plan_request() -> None:
    p = plan_request("/v1/completions", b'{"prompt": "hello world", "max_tokens": 1, "stream": true}')
    assert p.prefill_only and p.stream and p.key == b"hello world" and not p.client_params
    p = plan_request("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                                         "max_completion_tokens": 1}).encode())
    assert p.prefill_only and p.key.startswith(b'[{"role":"user"')
    p = plan_request("/v1/completions", b'{"prompt": [1, 2, 3], "max_tokens": 5}')
    assert not p.prefill_only and p.key == [1, 2, 3] and p.weight == 3
    assert not plan_request("/v1/completions", b'{"prompt": "x", "max_tokens": true}').prefill_only
    p = plan_request("/v1/completions", b"[not json")
    assert not p.is_object and not p.prefill_only
    assert plan_request("/v1/completions", b'{"kv_transfer_params": {}}').client_params


def test_transfer_params_spliced_into_the_clients_bytes() -> None:
    pool = InstancePool(["http://127.0.0.1:1"], ["http://127.0.0.1:2"])
    p = pool.prefill[0]
    p.info = {"kv_addr": "tcp://127.0.0.1:9"}
    raw = b'{"prompt":  "a}b",\n "max_tokens": 4 }\n'
    out = with_transfer_params(raw, p)
    assert out.startswith(b'{"prompt":  "a}b",\n "max_tokens": 4,')
    assert json.loads(out) == {"prompt": "a}b", "max_tokens": 4,
                               "kv_transfer_params": {"prefill_addr": "tcp://127.0.0.1:9",
                                                      "prefill_url": "http://127.0.0.1:1"}}
    assert json.loads(with_transfer_params(b"{ }", p))["kv_transfer_params"]["prefill_addr"] == "tcp://127.0.0.1:9"


def test_picks_by_load_and_prefix_affinity() -> None:
    pool = InstancePool(["http://p0:1", "http://p1:1"], ["http://d0:1", "http://d1:1"])
    for i in pool.instances:
        i.up, i.splitwise, i.info = True, True, {"kv_addr": f"tcp://{i.url}"}
    group_a = b"A" * 2000
    p, choice = pool.pick_prefill(group_a + b"q1", splitwise=True)  # type: ignore[misc]
    pool.begin(Flight(pool.decode[0], p, 500))
    # another prompt goes to the idle P; the same prefix sticks to its P
    q, _ = pool.pick_prefill(b"B" * 2000, splitwise=True)  # type: ignore[misc]
    assert q is not p
    again, c2 = pool.pick_prefill(group_a + b"q2", splitwise=True)  # type: ignore[misc]
    assert again is p and c2.reason == "affinity" and c2.matched_tokens > 0
    # D by requests in flight; a down instance is never picked, its flights are cut
    assert pool.pick_decode() is pool.decode[1]
    f = Flight(pool.decode[1], p, 10)
    pool.begin(f)
    pool.mark_down(p, "test")
    assert f.failure and f.failed is p
    assert pool.pick_prefill(group_a, splitwise=True)[0] is not p  # type: ignore[index]
    pool.handed_off(f)
    pool.end(f)
    assert f not in pool.decode[1].flights and f not in p.flights


def test_relabel_merges_families_and_adds_labels() -> None:
    pool = InstancePool(["http://p:1"], ["http://d:1"])
    text = ('# HELP fdx:kv_blocks_used KV blocks in use.\n# TYPE fdx:kv_blocks_used gauge\n'
            'fdx:kv_blocks_used{model_name="m"} 3.0\n# TYPE fdx:x_total counter\nfdx:x_total 2.0\n')
    fams = {f.name: f for f in relabel([(pool.prefill[0], text), (pool.decode[0], text)])}
    samples = fams["fdx:kv_blocks_used"].samples
    assert [(s.labels["instance"], s.labels["role"], s.labels["model_name"], s.value) for s in samples] == [
        ("http://p:1", "prefill", "m", 3.0), ("http://d:1", "decode", "m", 3.0)]
    assert [s.name for s in fams["fdx:x"].samples] == ["fdx:x_total", "fdx:x_total"]


def test_config_errors_are_one_line() -> None:
    with pytest.raises(ConfigError, match="--prefill"):
        RouterConfig(prefill=["nope"], decode=["http://127.0.0.1:1"])
    with pytest.raises(ConfigError, match="twice"):
        RouterConfig(prefill=["http://127.0.0.1:1"], decode=["http://127.0.0.1:1/"])
    r = subprocess.run([sys.executable, "-m", "fdx", "router", "--prefill", "http://127.0.0.1:1", "--decode",
                        "ftp://x"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "--decode" in r.stderr


def test_managed_topology_config() -> None:
    from fdx.config import make_config
    from fdx.router.topology import is_managed, topology_children

    with pytest.raises(ConfigError, match="--scheduler splitwise"):
        make_config(num_prefill=1, num_decode=1)
    with pytest.raises(ConfigError, match="both"):
        make_config(scheduler="splitwise", num_prefill=1)
    cfg = make_config(scheduler="splitwise", num_prefill=2, num_decode=1, port=18000, api_key="k",
                      kv_connector="mooncake", num_threads=1)
    assert is_managed(cfg) and not is_managed(make_config(scheduler="splitwise", splitwise_role="decode"))
    kids = topology_children(cfg)
    assert [k.name for k in kids] == ["prefill0", "prefill1", "decode0", "router"]
    roles = [json.loads(k.config_json) for k in kids[:3]]
    assert [r["splitwise_role"] for r in roles] == ["prefill", "prefill", "decode"]
    assert all(r["num_prefill"] == r["num_decode"] == 0 and r["kv_connector"] == "mooncake"
               and r["num_threads"] == 1 and r["api_key"] == "k" for r in roles)
    assert len({r["port"] for r in roles} | {18000}) == 4
    router = json.loads(kids[3].config_json)
    assert router["port"] == 18000 and router["api_key"] == "k"
    assert router["prefill"] == [k.url for k in kids[:2]] and router["decode"] == [kids[2].url]


def test_control_replies_merge_over_the_instances() -> None:
    from fdx.router.control import merge

    assert merge("pause", [{"is_paused": True, "num_aborted": 2}, {"is_paused": True, "num_aborted": 1}]) == {
        "is_paused": True, "num_aborted": 3}
    assert merge("is_paused", [{"is_paused": True, "sleeping": []}, {"is_paused": False, "sleeping": ["weight"]}]) \
        == {"is_paused": False, "sleeping": ["weight"]}
    got = merge("abort_requests", [{"aborted": [{"request_id": "a"}], "not_found": ["b"]},
                                   {"aborted": [], "not_found": ["a", "b"]}])
    assert got == {"aborted": [{"request_id": "a"}], "not_found": ["b"]}
    assert merge("update_weights", [{"version": "v2", "took": 1.0}, {"version": "v2", "took": 2.0}]) == {
        "version": "v2"}


# ----------------------------------------------------------------------------- real processes


@contextlib.contextmanager
def start_router(prefill: list[str], decode: list[str], *extra: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="fdx-router-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "fdx", "router", "--prefill", *prefill, "--decode", *decode,
           "--port", str(port), "--probe-interval", "0.5", *extra]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    proc.log_path = log.name  # type: ignore[attr-defined]
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, read_log(proc)
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, read_log(proc)
            time.sleep(0.2)
        yield base, proc
    finally:
        stop_process(proc)
        log.close()
        with contextlib.suppress(OSError):
            os.unlink(log.name)


@pytest.fixture(scope="module")
def topo() -> Iterator[dict[str, Any]]:
    with start_server(*COMMON) as (p, pp), contextlib.ExitStack() as stack:
        d_port = free_port()
        d, dp = stack.enter_context(start_server(*COMMON, port=d_port))
        with start_router([p], [d]) as (r, rp):
            yield {"p": p, "d": d, "d_port": d_port, "d_proc": dp, "router": r, "router_proc": rp, "stack": stack}


BODY = {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0,
        "ignore_eos": True}

_VOLATILE = re.compile(rb'"(id|created)": ?("[^"]*"|\d+)')


def _events(base: str, body: dict[str, Any]) -> bytes:
    with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True,
                                                              "stream_options": {"include_usage": True}},
                      timeout=60) as r:
        assert r.status_code == 200
        return _VOLATILE.sub(b"", r.read())


@pytest.mark.slow
def test_relay_is_the_instances_answer(topo: dict[str, Any]) -> None:
    r, d = topo["router"], topo["d"]
    via = httpx.post(r + "/v1/completions", json=BODY, timeout=60).json()
    direct = httpx.post(d + "/v1/completions", json=BODY, timeout=60).json()
    assert via["choices"] == direct["choices"] and via["usage"]["completion_tokens"] == 12
    assert via["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]
    assert _events(r, BODY) == _events(d, BODY)  # the stream byte for byte, ids and timestamps aside
    chat = {"model": "smollm2", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 6,
            "temperature": 0}
    a = httpx.post(r + "/v1/chat/completions", json=chat, timeout=60).json()
    b = httpx.post(d + "/v1/chat/completions", json=chat, timeout=60).json()
    assert a["choices"] == b["choices"]
    assert httpx.get(r + "/v1/models", timeout=10).json()["data"][0]["id"] == "smollm2"


@pytest.mark.slow
def test_max_tokens_one_is_served_by_prefill(topo: dict[str, Any]) -> None:
    r, p = topo["router"], topo["p"]
    before = metric_value(p, "fdx:request_success_total", finished_reason="length")
    out = httpx.post(r + "/v1/completions", json={**BODY, "max_tokens": 1}, timeout=60).json()
    assert out["usage"]["completion_tokens"] == 1
    assert metric_value(p, "fdx:request_success_total", finished_reason="length") == before + 1


@pytest.mark.slow
def test_errors_are_envelopes(topo: dict[str, Any]) -> None:
    r = topo["router"]
    bad = httpx.post(r + "/v1/completions", json={**BODY, "kv_transfer_params": {"prefill_addr": "x"}}, timeout=30)
    assert bad.status_code == 400 and "kv_transfer_params" in bad.json()["error"]["message"]
    broken = httpx.post(r + "/v1/completions", content=b"{not json", timeout=30,
                        headers={"content-type": "application/json"})
    assert broken.status_code == 400 and broken.json()["error"]["code"] == 400
    assert httpx.post(r + "/v1/completions", json={**BODY, "max_tokens": -3}, timeout=30).status_code == 400


@pytest.mark.slow
def test_health_and_metrics_cover_the_instances(topo: dict[str, Any]) -> None:
    r, p, d = topo["router"], topo["p"], topo["d"]
    h = httpx.get(r + "/health", timeout=10).json()
    assert h["status"] == "ok"
    assert [(i["url"], i["role"], i["up"]) for i in h["prefill"] + h["decode"]] == [
        (p, "prefill", True), (d, "decode", True)]
    text = httpx.get(r + "/metrics", timeout=10).text
    for inst, role in ((p, "prefill"), (d, "decode")):
        assert f'fdx:kv_blocks_total{{instance="{inst}",model_name="smollm2",role="{role}"}}' in text
        assert f'fdx:router_instance_up{{instance="{inst}",role="{role}"}} 1.0' in text
    assert text.count("# TYPE fdx:kv_blocks_total gauge") == 1


@pytest.mark.slow
def test_client_disconnect_aborts_on_the_instance(topo: dict[str, Any]) -> None:
    r, d = topo["router"], topo["d"]
    aborted = metric_value(d, "fdx:request_aborted_total")
    with httpx.stream("POST", r + "/v1/completions", json={**BODY, "max_tokens": 400, "stream": True},
                      timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                break  # one token, then hang up
    deadline = time.monotonic() + 20
    while metric_value(d, "fdx:request_aborted_total") < aborted + 1 or metric_value(d, "fdx:kv_blocks_used") > 0:
        assert time.monotonic() < deadline, "D did not abort the disconnected request"
        time.sleep(0.2)
    assert metric_value(d, "fdx:num_requests_running") == 0


def _kill_tree(launcher_pid: int) -> None:
    pids = [launcher_pid, *children_of(launcher_pid)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_dead_decode_fails_fast_and_recovers(topo: dict[str, Any]) -> None:
    r = topo["router"]
    out: dict[str, Any] = {}
    started = threading.Event()
    t = threading.Thread(target=record_stream, args=(r, {**BODY, "max_tokens": 1500}, out, started))
    t.start()
    assert started.wait(60)
    t0 = time.monotonic()
    _kill_tree(topo["d_proc"].pid)  # the launcher, its API and engine processes: the machine is gone
    t.join(30)
    assert not t.is_alive(), "the stream hung after D died"
    assert out.get("error", {}).get("code") == 503 and out.get("done"), out
    assert out["ended"] - t0 < 15
    t1 = time.monotonic()
    resp = httpx.post(r + "/v1/completions", json=BODY, timeout=30)
    assert resp.status_code == 503 and resp.json()["error"]["code"] == 503
    assert time.monotonic() - t1 < 10
    h = httpx.get(r + "/health", timeout=10)
    assert h.status_code == 503 and h.json()["decode"][0]["up"] is False and h.json()["decode"][0]["reason"]
    # the same instance back on its port: served again
    topo["stack"].enter_context(start_server(*COMMON, port=topo["d_port"]))
    deadline = time.monotonic() + 30
    while httpx.get(r + "/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    again = httpx.post(r + "/v1/completions", json=BODY, timeout=60)
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 12
