"""The API edge of fdx/server/app.py on the real FastAPI app without an
engine: the body-size limit (413 before parsing), the envelope of 404/405
and of an unexpected exception (no exception type, no path), and what
/openapi.json declares.  The same behaviour against a real ``fdx serve``
is in test_server_hostile.py and test_fuzz_api.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from fdx.config import make_config

LIMIT = 4096


class _RoutesPlugin:
    """A stand-in plugin manager whose ``fdx_add_routes`` adds one failing route."""

    class hook:  # noqa: N801 - mimics pluggy's ``pm.hook``
        @staticmethod
        def fdx_add_routes(app: FastAPI, client: Any) -> None:
            @app.get("/v1/boom")
            async def boom() -> None:
                raise RuntimeError("/srv/secret/path/model.gguf exploded")


@pytest.fixture
def http(tmp_path: Path) -> Iterator[TestClient]:
    from fdx.core.ipc import IpcPaths
    from fdx.server.app import create_app
    from fdx.deploy.engine_client import EngineClient

    config = make_config(max_request_bytes=LIMIT)
    client = EngineClient(config, IpcPaths(str(tmp_path)))
    app = create_app(config, client, plugins=_RoutesPlugin())
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def err(r: Any, code: int) -> dict[str, Any]:
    assert r.status_code == code, (r.status_code, r.text)
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["code"] == code
    return e


def test_body_limit_by_content_length_and_by_counting(http: TestClient) -> None:
    big = b'{"prompt": "' + b"x" * LIMIT + b'"}'
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/pause", "/v1/update_weights", "/health"):
        e = err(http.post(path, content=big, headers={"content-type": "application/json"}), 413)
        assert "--max-request-bytes" in e["message"] and str(LIMIT) in e["message"]

    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(8):
            yield b"y" * 1024
        yield b'"}'

    e = err(http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}), 413)
    assert "--max-request-bytes" in e["message"]
    # at the limit: parsed (then 503, there is no engine here)
    body = b'{"prompt": "' + b"z" * (LIMIT - 14) + b'"}'
    assert len(body) == LIMIT
    assert http.post("/v1/completions", content=body, headers={"content-type": "application/json"}).status_code \
        == 503


def test_unexpected_errors_name_no_exception_and_no_path(http: TestClient) -> None:
    e = err(http.get("/v1/boom"), 500)
    assert "RuntimeError" not in e["message"] and "/srv" not in e["message"] and "exploded" not in e["message"]
    assert "ref " in e["message"]
    err(http.get("/v1/no-such-route"), 404)
    err(http.get("/v1/completions"), 405)
    err(http.get("/v1/pause"), 405)


def test_openapi_declares_bodies_responses_and_errors(http: TestClient) -> None:
    spec = http.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest"),
                        ("/v1/update_weights", "UpdateWeightsBody"), ("/v1/abort_requests", "AbortRequestsBody"),
                        ("/v1/sleep", "TagsBody"), ("/v1/pause", "EmptyControlBody")):
        op = spec["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"] == f"#/components/schemas/{model}"
        assert model in schemas
        assert "400" in op["responses"] and "413" in op["responses"]
    comp = spec["paths"]["/v1/completions"]["post"]["responses"]
    assert set(comp["200"]["content"]) == {"application/json", "text/event-stream"}
    assert comp["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/CompletionResponse")
    for code in ("400", "401", "404", "413", "429", "500", "503"):
        assert comp[code]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert schemas["UpdateWeightsBody"]["additionalProperties"] is False
    assert schemas["CompletionRequest"]["required"] == ["prompt"]
    method = spec["paths"]["/v1/control/{method}"]["post"]["parameters"]
    assert {p["name"] for p in method} == {"method", "timeout"}
