"""Control plane end to end (issue 6): pause / resume / is_paused and
abort_requests against a real ``fdx serve`` (one server for the module).

Every test leaves the server resumed and idle (the autouse fixture checks).
"""

from __future__ import annotations

import asyncio
from typing import Any, Iterator

import httpx
import pytest

from controlutil import StreamClient, control, greedy, greedy_text, metric, ok, wait_metric
from serverutil import start_server

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with start_server() as (base, _proc):
        yield base


@pytest.fixture(scope="module")
def baseline(server: str) -> str:
    first = greedy_text(server, PROMPT)
    assert greedy_text(server, PROMPT) == first, "the engine is not deterministic"
    return first


@pytest.fixture(autouse=True)
def _resumed(server: str) -> Iterator[None]:
    yield
    ok(server, "resume")
    ok(server, "abort_requests", {"abort_all": True})
    assert ok(server, "is_paused", method="GET")["is_paused"] is False


def run(coro: Any, timeout: float = 300.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def story(i: int, max_tokens: int = 400) -> dict[str, Any]:
    return {"prompt": f"Story {i}: once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0}


# --------------------------------------------------------------------------
# pause / resume
# --------------------------------------------------------------------------


def test_pause_under_load_ends_every_stream_then_resume(server: str, baseline: str) -> None:
    async def scenario() -> tuple[list[Any], dict[str, Any], httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(300)) as http:
            clients = [StreamClient(http, server, story(i)) for i in range(16)]
            await asyncio.gather(*(c.started.wait() for c in clients))
            r = await http.post(server + "/v1/pause", json={})
            results = await asyncio.wait_for(asyncio.gather(*(c.task for c in clients)), 120)
            new_plain = await http.post(server + "/v1/completions", json={"prompt": "hi", "max_tokens": 4})
            new_stream = await http.post(server + "/v1/completions",
                                         json={"prompt": "hi", "max_tokens": 4, "stream": True})
            return results, r.json(), new_plain, new_stream

    results, reply, new_plain, new_stream = run(scenario())
    assert reply["status"] == "success", reply
    assert reply["result"]["is_paused"] is True
    assert 1 <= reply["result"]["num_aborted"] <= 16
    for res in results:
        # every client ends with an error (none hangs, none looks finished)
        assert res.status == 200 and res.chunks >= 1, res
        assert res.error is not None and res.error["code"] == 503, res
        assert "paused" in res.error["message"]
        assert res.done, res
    # requests arriving while paused: 503 (plain and streaming)
    assert new_plain.status_code == 503, new_plain.text
    assert "paused" in new_plain.json()["error"]["message"]
    assert new_stream.status_code == 503, new_stream.text
    assert ok(server, "is_paused", method="GET") == {"is_paused": True, "sleeping": []}
    assert wait_metric(server, "fdx:engine_paused", 1.0) == 1.0
    assert wait_metric(server, "fdx:kv_blocks_used", 0.0) == 0.0
    # pausing twice is a no-op
    assert ok(server, "pause") == {"is_paused": True, "num_aborted": 0}
    # resume restores service, with the same greedy output as before
    assert ok(server, "resume") == {"is_paused": False}
    assert ok(server, "is_paused", method="GET")["is_paused"] is False
    assert greedy_text(server, PROMPT) == baseline
    assert wait_metric(server, "fdx:engine_paused", 0.0) == 0.0


def test_pause_ends_non_streaming_requests_with_an_error(server: str) -> None:
    async def scenario() -> tuple[list[httpx.Response], dict[str, Any]]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(300)) as http:
            starter = StreamClient(http, server, story(99))  # lets us pause once work is running
            plain = [asyncio.ensure_future(http.post(server + "/v1/completions", json=story(i, 300)))
                     for i in range(3)]
            await starter.started.wait()
            reply = (await http.post(server + "/v1/pause", json={})).json()
            got = await asyncio.wait_for(asyncio.gather(*plain), 120)
            await starter.task
            return got, reply

    got, reply = run(scenario())
    assert reply["status"] == "success"
    for r in got:
        assert r.status_code == 503, r.text
        assert "paused" in r.json()["error"]["message"]


def cached_tokens(server: str, prompt: str) -> int:
    """Prompt tokens of a 2-token greedy completion that came from the prefix cache."""
    code, js = greedy(server, prompt, 2)
    assert code == 200, js
    return int(js["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_pause_resets_the_prefix_cache(server: str) -> None:
    long_prompt = "Here is a long preamble that spans several KV blocks. " * 8
    cached_tokens(server, long_prompt)
    assert cached_tokens(server, long_prompt) > 0  # the prompt's full blocks are in the prefix cache
    ok(server, "pause")
    ok(server, "resume")
    assert cached_tokens(server, long_prompt) == 0


# --------------------------------------------------------------------------
# abort_requests
# --------------------------------------------------------------------------


def test_abort_streaming_request_by_id(server: str) -> None:
    async def scenario() -> tuple[Any, dict[str, Any], float]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(300)) as http:
            c = StreamClient(http, server, {**story(1, 600), "stream_options": {"include_usage": True}})
            await c.started.wait()
            await asyncio.sleep(0.5)  # a few more tokens
            assert metric(server, "fdx:kv_blocks_used") > 0
            reply = (await http.post(server + "/v1/abort_requests", json={"req_ids": [c.result.id]})).json()
            res = await asyncio.wait_for(c.task, 60)
            return res, reply, wait_metric(server, "fdx:kv_blocks_used", 0.0)

    res, reply, used = run(scenario())
    assert reply["status"] == "success", reply
    aborted = reply["result"]["aborted"]
    assert reply["result"]["not_found"] == []
    assert len(aborted) == 1 and aborted[0]["request_id"] == res.id and res.id.startswith("cmpl-")
    n = aborted[0]["output_token_count"]
    assert 1 <= n < 600
    # the client got its partial output and a final chunk with finish_reason "abort"
    assert res.error is None and res.done
    assert res.finish[0] == "abort"
    assert res.text[0]
    assert res.usage is not None and res.usage["completion_tokens"] == n
    assert used == 0.0


def test_abort_chat_stream_by_chatcmpl_id(server: str) -> None:
    async def scenario() -> tuple[Any, dict[str, Any]]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(300)) as http:
            body = {"messages": [{"role": "user", "content": "Write a very long poem about the sea."}],
                    "max_tokens": 500, "ignore_eos": True, "temperature": 0}
            c = StreamClient(http, server, body, chat=True)
            await c.started.wait()
            reply = (await http.post(server + "/v1/abort_requests", json={"req_ids": [c.result.id]})).json()
            return await asyncio.wait_for(c.task, 60), reply

    res, reply = run(scenario())
    assert res.id.startswith("chatcmpl-")
    assert [a["request_id"] for a in reply["result"]["aborted"]] == [res.id]
    assert res.finish[0] == "abort" and res.text[0] and res.error is None
    assert wait_metric(server, "fdx:kv_blocks_used", 0.0) == 0.0


def test_abort_n2_request_by_user_id_aborts_every_choice(server: str) -> None:
    async def scenario() -> tuple[httpx.Response, dict[str, Any], dict[str, Any]]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(300)) as http:
            starter = StreamClient(http, server, story(7, 600))
            body = {**story(2, 500), "n": 2, "request_id": "my-batch-job-1", "temperature": 0.8, "seed": 1}
            plain = asyncio.ensure_future(http.post(server + "/v1/completions", json=body))
            await starter.started.wait()
            await asyncio.sleep(1.0)
            reply = (await http.post(server + "/v1/abort_requests",
                                     json={"req_ids": ["my-batch-job-1", "cmpl-does-not-exist"]})).json()
            r = await asyncio.wait_for(plain, 60)
            all_reply = (await http.post(server + "/v1/abort_requests", json={"abort_all": True})).json()
            await starter.task
            return r, reply, all_reply

    r, reply, all_reply = run(scenario())
    res = reply["result"]
    assert res["not_found"] == ["cmpl-does-not-exist"]
    assert len(res["aborted"]) == 1
    entry = res["aborted"][0]
    assert entry["request_id"] == "my-batch-job-1"
    assert sorted(c["request_id"] for c in entry["choices"]) == ["my-batch-job-1-0", "my-batch-job-1-1"]
    assert entry["output_token_count"] == sum(c["output_token_count"] for c in entry["choices"])
    # the non-streaming client gets a normal response with its partial output
    assert r.status_code == 200, r.text
    js = r.json()
    assert js["id"] == "my-batch-job-1"
    assert [c["finish_reason"] for c in js["choices"]] == ["abort", "abort"]
    assert js["usage"]["completion_tokens"] == entry["output_token_count"]
    # abort_all got the other (streaming) request
    assert all_reply["status"] == "success"
    assert [a["request_id"].startswith("cmpl-") for a in all_reply["result"]["aborted"]] == [True]
    assert wait_metric(server, "fdx:kv_blocks_used", 0.0) == 0.0


def test_abort_all_streams(server: str) -> None:
    async def scenario() -> tuple[list[Any], dict[str, Any]]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(300)) as http:
            clients = [StreamClient(http, server, story(i, 500)) for i in range(3)]
            await asyncio.gather(*(c.started.wait() for c in clients))
            reply = (await http.post(server + "/v1/abort_requests", json={"abort_all": True})).json()
            return await asyncio.wait_for(asyncio.gather(*(c.task for c in clients)), 60), reply

    results, reply = run(scenario())
    assert sorted(a["request_id"] for a in reply["result"]["aborted"]) == sorted(r.id for r in results)
    assert all(r.finish[0] == "abort" and r.error is None and r.done for r in results)
    assert wait_metric(server, "fdx:kv_blocks_used", 0.0) == 0.0


def test_abort_unknown_ids_and_bad_bodies(server: str) -> None:
    assert ok(server, "abort_requests", {"req_ids": ["cmpl-nope"]}) == {"aborted": [], "not_found": ["cmpl-nope"]}
    for body in ({}, {"req_ids": []}, {"req_ids": "x", "abort_all": "yes"}, {"req_ids": [1, 2]},
                 {"req_ids": ["a"], "junk": 1}):
        code, js = control(server, "abort_requests", body)
        assert code == 400 and js["status"] == "error" and js["message"], (body, js)
    r = httpx.post(server + "/v1/abort_requests", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["message"]


# --------------------------------------------------------------------------
# dispatch, errors, timeouts
# --------------------------------------------------------------------------


def test_unknown_method_bad_args_and_timeout(server: str) -> None:
    code, js = control(server, "control/no_such_method")
    assert code == 400 and js["message"] == "unknown control method: no_such_method"
    # /v1/control/<named method> takes the named route's checks
    code, js = control(server, "control/pause", {"bogus": 1})
    assert code == 400 and "unknown argument(s) bogus" in js["message"] and js["error"]["param"] == "bogus", js
    code, js = control(server, "sleep", params={"tags": "weight,gpu"})
    assert code == 400 and "gpu" in js["message"]
    # a timeout below a second is refused (it could only end in a 504)
    code, js = control(server, "is_paused", method="GET", params={"timeout": "0.000001"})
    assert code == 400 and js["error"]["param"] == "timeout", js
    assert ok(server, "is_paused", method="GET", params={"timeout": "1"})["is_paused"] is False
    code, js = control(server, "is_paused", method="GET", params={"timeout": "-1"})
    assert code == 400
    # the engine is fine afterwards
    assert greedy(server, PROMPT, 4)[0] == 200


# --------------------------------------------------------------------------
# calls without a body, arguments in the query string, vLLM's dev-mode paths
# --------------------------------------------------------------------------


def raw_call(server: str, method: str, path: str, **kw: Any) -> httpx.Response:
    """A control call exactly as a client sends it (no JSON body unless given)."""
    return httpx.request(method, server + path, timeout=120, **kw)


def test_bodyless_and_query_string_calls(server: str) -> None:
    # what `curl -X POST` sends: no body, no content type
    r = raw_call(server, "POST", "/v1/pause")
    assert r.status_code == 200 and r.json()["result"]["is_paused"] is True, r.text
    assert raw_call(server, "GET", "/v1/is_paused").json()["result"]["is_paused"] is True
    r = raw_call(server, "POST", "/v1/resume")
    assert r.status_code == 200 and r.json()["result"] == {"is_paused": False}, r.text
    # arguments in the query string
    r = raw_call(server, "POST", "/v1/abort_requests", params={"req_ids": "cmpl-nope"})
    assert r.status_code == 200 and r.json()["result"] == {"aborted": [], "not_found": ["cmpl-nope"]}, r.text
    r = raw_call(server, "POST", "/v1/abort_requests", params={"abort_all": "true"})
    assert r.status_code == 200 and r.json()["result"]["aborted"] == [], r.text
    r = raw_call(server, "POST", "/v1/control/abort_requests", params=[("req_ids", "a"), ("req_ids", "b")])
    assert r.status_code == 200 and r.json()["result"]["not_found"] == ["a", "b"], r.text
    # an empty JSON body is no arguments too
    r = raw_call(server, "POST", "/v1/pause", content=b"", headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert raw_call(server, "POST", "/v1/resume").status_code == 200


def test_vllm_dev_mode_pause_resume_and_prefix_cache(server: str) -> None:
    r = raw_call(server, "POST", "/pause")
    assert r.status_code == 200 and r.json() == {"status": "paused"}, r.text
    assert raw_call(server, "GET", "/is_paused").json() == {"is_paused": True}
    assert greedy(server, PROMPT, 2)[0] == 503  # really paused
    r = raw_call(server, "POST", "/resume")
    assert r.status_code == 200 and r.json() == {"status": "resumed"}, r.text
    assert raw_call(server, "GET", "/is_paused").json() == {"is_paused": False}
    r = raw_call(server, "POST", "/pause", params={"mode": "abort", "clear_cache": "true",
                                                  "wait_for_inflight_requests": "false"})
    assert r.status_code == 200 and r.json() == {"status": "paused"}, r.text
    assert raw_call(server, "POST", "/resume").json() == {"status": "resumed"}
    assert raw_call(server, "GET", "/is_sleeping").json() == {"is_sleeping": False}

    long_prompt = "A preamble long enough to fill several KV blocks of the prefix cache. " * 8
    cached_tokens(server, long_prompt)
    assert cached_tokens(server, long_prompt) > 0
    r = raw_call(server, "POST", "/reset_prefix_cache")  # while serving, as vLLM
    assert r.status_code == 200 and r.content == b"", r.text
    assert cached_tokens(server, long_prompt) == 0


def test_unknown_control_arguments_are_refused(server: str) -> None:
    cases = [
        ("POST", "/v1/control/is_paused", {"json": {"x": 1}}, "x"),
        ("GET", "/v1/is_paused", {"params": {"verbose": "1"}}, "verbose"),
        ("POST", "/v1/pause", {"params": {"now": "1"}}, "now"),
        ("POST", "/v1/resume", {"json": {"force": True}}, "force"),
        ("POST", "/v1/sleep", {"params": {"tags": "weight", "level": "1"}}, "level"),
        ("POST", "/v1/abort_requests", {"params": {"req_ids": "a", "everything": "1"}}, "everything"),
        ("POST", "/pause", {"params": {"bogus": "1"}}, "bogus"),
        ("GET", "/is_sleeping", {"params": {"level": "1"}}, "level"),
        ("POST", "/reset_prefix_cache", {"params": {"all": "true"}}, "all"),
    ]
    for method, path, kw, name in cases:
        r = raw_call(server, method, path, **kw)
        js = r.json()
        assert r.status_code == 400 and name in js["message"] and js["error"]["param"] == name, (path, r.text)
    # values fdx does not implement: named, 400, nothing done
    for path, params, name in (("/pause", {"mode": "wait"}, "mode"), ("/pause", {"mode": "keep"}, "mode"),
                               ("/pause", {"wait_for_inflight_requests": "true"}, "wait_for_inflight_requests"),
                               ("/pause", {"clear_cache": "false"}, "clear_cache"),
                               ("/sleep", {"level": "3"}, "level"),
                               ("/reset_prefix_cache", {"reset_external": "true"}, "reset_external")):
        r = raw_call(server, "POST", path, params=params)
        assert r.status_code == 400 and r.json()["error"]["param"] == name, (path, params, r.text)
    # the same name in the query and the body
    r = raw_call(server, "POST", "/v1/abort_requests", params={"req_ids": "a"}, json={"req_ids": ["b"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "req_ids", r.text
    assert ok(server, "is_paused", method="GET") == {"is_paused": False, "sleeping": []}


def test_guard_still_refuses_browsers_forms_and_text_plain(server: str) -> None:
    for path in ("/v1/pause", "/pause", "/sleep"):
        # a page elsewhere: Origin, or Sec-Fetch-Site without one
        r = raw_call(server, "POST", path, headers={"origin": "http://evil.example"})
        assert r.status_code == 403 and "cross-origin" in r.json()["message"], (path, r.text)
        r = raw_call(server, "POST", path, headers={"sec-fetch-site": "cross-site"})
        assert r.status_code == 403, (path, r.text)
        # what an HTML form or a no-cors fetch can send without a preflight, empty or not
        r = raw_call(server, "POST", path, data={"tags": "weight"})
        assert r.status_code == 415, (path, r.text)
        for content in (b"{}", b""):
            r = raw_call(server, "POST", path, content=content, headers={"content-type": "text/plain"})
            assert r.status_code == 415, (path, content, r.text)
        r = raw_call(server, "POST", path, content=b"", headers={"content-type": "multipart/form-data; boundary=x"})
        assert r.status_code == 415, (path, r.text)
        # a body with content but no JSON content type
        r = raw_call(server, "POST", path, content=b"{}")
        assert r.status_code == 415, (path, r.text)
    # nothing reached the engine
    assert ok(server, "is_paused", method="GET") == {"is_paused": False, "sleeping": []}
