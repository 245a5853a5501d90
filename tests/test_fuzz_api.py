"""Schemathesis fuzzing of a real ``fdx serve`` from its own ``/openapi.json``
(issue 14): every route, positive and negative cases, a bounded number of
examples each.  No response may be a 5xx; every 4xx carries the OpenAI
error envelope with ``code`` equal to the status; every response has a
status, content type and (for JSON) a body the schema declares.

The server generates little: ``--max-model-len 64``, and the cases'
``n`` / ``max_tokens`` / prompt counts are clamped (``map_body`` below) so
one case never asks for more than a few tokens.  The first pass sends no
control key, so every control route answers 401 and the engine's state
never changes; the second pass fuzzes the control routes' arguments with
the key, leaving out the methods that stop the engine serving (pause,
sleep, wakeup), and checks afterwards that a normal request is served.
"""

from __future__ import annotations

import collections
import secrets
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402

from serverutil import start_server  # noqa: E402

pytestmark = pytest.mark.slow

CONTROL_KEY = secrets.token_hex(16)
EXAMPLES = 25
#: control methods the second pass must not call: they stop the engine serving
STATEFUL = {"pause", "sleep", "wakeup"}
FUZZ_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                         suppress_health_check=list(HealthCheck), print_blob=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    allowed = tmp_path_factory.mktemp("fuzz-weights")
    with start_server("--max-model-len", "64", "--num-kv-blocks", "64", "--max-num-seqs", "8",
                      "--max-request-bytes", "64K", "--control-api-key", CONTROL_KEY,
                      "--allowed-weights-dir", str(allowed), default_args=()) as (base, _proc):
        yield base


def _clamp(body: Any) -> Any:
    """Keep generation cheap: at most 2 choices, 4 tokens, 4 prompts."""
    if not isinstance(body, dict):
        return body
    for key, cap in (("n", 2), ("max_tokens", 4), ("max_completion_tokens", 4), ("min_tokens", 4)):
        v = body.get(key)
        if type(v) is int and v > cap:
            body[key] = cap
    if type(body.get("min_tokens")) is int and type(body.get("max_tokens")) is int:
        body["min_tokens"] = min(body["min_tokens"], body["max_tokens"])
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 4:
        body["prompt"] = prompt[:4]
    convs = body.get("messages")
    if isinstance(convs, list) and convs and all(isinstance(c, list) for c in convs):
        body["messages"] = convs[:4]  # /v1/chat/completions/batch: a few conversations
    if isinstance(body.get("messages"), list) and "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 4
    return body


#: every route of the server, fuzzed one by one (test_every_route_is_fuzzed
#: fails when a route is added to the server and not here)
ROUTES = [
    ("GET", "/health"), ("GET", "/ping"), ("GET", "/version"), ("GET", "/v1/models"), ("GET", "/metrics"),
    ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
    ("POST", "/v1/chat/completions/batch"), ("POST", "/invocations"),
    ("POST", "/v1/pause"), ("POST", "/v1/resume"), ("GET", "/v1/is_paused"), ("POST", "/v1/abort_requests"),
    ("POST", "/v1/sleep"), ("POST", "/v1/wakeup"), ("POST", "/v1/update_weights"),
    ("POST", "/v1/control/{method}"),
    # vLLM's dev-mode aliases
    ("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused"), ("POST", "/sleep"), ("POST", "/wake_up"),
    ("GET", "/is_sleeping"), ("POST", "/reset_prefix_cache"),
]
CONTROL_ROUTES = [r for r in ROUTES if r[1] in ("/v1/resume", "/v1/is_paused", "/v1/abort_requests",
                                                 "/v1/update_weights", "/v1/control/{method}")]


@pytest.fixture(scope="module")
def api_schema(server: str) -> Any:
    schema = schemathesis.openapi.from_url(server + "/openapi.json")
    schema.config.update(base_url=server)
    return schema


def check_response(case: Any, response: Any) -> None:
    code = response.status_code
    assert code < 500, f"{case.method} {case.formatted_path}: {code} {response.text[:300]}"
    if code >= 400:
        js = response.json()
        err = js.get("error")
        assert isinstance(err, dict), js
        assert set(err) >= {"message", "type", "param", "code"} and err["code"] == code, js
        assert isinstance(err["message"], str) and err["message"] and "Traceback" not in err["message"], js
    from schemathesis.checks import content_type_conformance, response_schema_conformance, status_code_conformance

    case.validate_response(response, checks=[status_code_conformance, content_type_conformance,
                                             response_schema_conformance])


def fuzz(api_schema: Any, method: str, path: str, headers: dict[str, str] | None = None) -> int:
    """Run EXAMPLES positive and negative cases of one route; returns how
    many were sent."""
    from hypothesis import assume, given
    from hypothesis import strategies as st
    from schemathesis.generation.modes import GenerationMode

    op = api_schema[path][method]
    strategy = st.one_of(op.as_strategy(GenerationMode.POSITIVE), op.as_strategy(GenerationMode.NEGATIVE))
    sent = []

    @given(case=strategy)
    @FUZZ_SETTINGS
    def run(case: Any) -> None:
        assume((case.path_parameters or {}).get("method") not in STATEFUL)
        case.body = _clamp(case.body)
        extra = dict(headers or {})
        if extra:
            extra = {**(case.headers or {}), **extra}
        response = case.call(headers=extra or None, timeout=120)
        sent.append(response.status_code)
        check_response(case, response)
        if headers is None and "control" in (case.operation.tags or []):
            # no key: the guard answers before anything reaches the engine
            assert response.status_code in (401, 403, 413, 415), (case.formatted_path, response.text[:300])

    run()
    print(f"\n{method} {path}: statuses {dict(sorted(collections.Counter(sent).items()))}")
    return len(sent)


def declared_routes(api_schema: Any) -> set[tuple[str, str]]:
    return {(m.upper(), p) for p, item in api_schema.raw_schema["paths"].items() for m in item}


def test_every_route_is_fuzzed(api_schema: Any) -> None:
    assert set(ROUTES) <= declared_routes(api_schema)  # plugin routes are fuzzed below


def test_fuzz_plugin_routes(api_schema: Any) -> None:
    """Routes plugins added through ``fdx_add_routes`` (the example plugin's, when installed)."""
    for method, path in sorted(declared_routes(api_schema) - set(ROUTES)):
        assert fuzz(api_schema, method, path) > 0


@pytest.mark.parametrize("method,path", ROUTES, ids=[f"{m} {p}" for m, p in ROUTES])
def test_fuzz_without_control_key(api_schema: Any, method: str, path: str) -> None:
    assert fuzz(api_schema, method, path) > 0


@pytest.mark.parametrize("method,path", CONTROL_ROUTES, ids=[f"{m} {p}" for m, p in CONTROL_ROUTES])
def test_fuzz_control_with_key(api_schema: Any, method: str, path: str) -> None:
    assert fuzz(api_schema, method, path, {"authorization": f"Bearer {CONTROL_KEY}"}) > 0


def test_serves_after_fuzzing(server: str) -> None:
    h = httpx.get(server + "/health", timeout=30)
    assert h.status_code == 200 and h.json()["is_paused"] is False, h.text
    r = httpx.post(server + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
