"""The control-plane guard (fdx/server/control.py) on the real FastAPI app,
without an engine: a call the guard lets through reaches the EngineClient,
which answers 503 (no engine here).  So 503 means "passed the guard", and
403/401/415 mean "refused before anything was sent".  The same checks
against a real ``fdx serve`` are in test_server_hostile.py."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import pytest
from starlette.testclient import TestClient

from fdx.config import make_config
from fdx.server.control import clean_message, resolve_weights_path


def _app(tmp_path: Path, **cfg: Any) -> Iterator[TestClient]:
    from fdx.core.ipc import IpcPaths
    from fdx.server.app import create_app
    from fdx.deploy.engine_client import EngineClient

    config = make_config(**cfg)
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    client = EngineClient(config, IpcPaths(str(run)))
    with TestClient(create_app(config, client), base_url="http://127.0.0.1:8000") as http:
        yield http


@pytest.fixture
def open_app(tmp_path: Path) -> Iterator[TestClient]:
    yield from _app(tmp_path)


def envelope(r: Any, code: int) -> dict[str, Any]:
    assert r.status_code == code, (r.status_code, r.text)
    js = r.json()
    assert js["status"] == "error" and js["error"]["code"] == code and js["error"]["message"] == js["message"]
    assert set(js["error"]) == {"message", "type", "param", "code"}
    return js


def test_cross_origin_browser_requests_are_refused(open_app: TestClient) -> None:
    # the classic CSRF: a page elsewhere POSTs text/plain (no preflight)
    r = open_app.post("/v1/pause", content=b"{}", headers={"content-type": "text/plain",
                                                            "origin": "http://evil.example"})
    assert "cross-origin" in envelope(r, 403)["message"]
    r = open_app.post("/v1/pause", json={}, headers={"origin": "http://127.0.0.1:9999"})  # other port
    envelope(r, 403)
    r = open_app.post("/v1/pause", json={}, headers={"origin": "null"})
    envelope(r, 403)
    r = open_app.post("/v1/pause", json={}, headers={"sec-fetch-site": "cross-site"})
    envelope(r, 403)
    r = open_app.get("/v1/is_paused", headers={"origin": "http://evil.example"})
    envelope(r, 403)
    # same origin, or no browser at all: passes the guard (503: no engine)
    envelope(open_app.post("/v1/pause", json={}, headers={"origin": "http://127.0.0.1:8000"}), 503)
    envelope(open_app.post("/v1/pause", json={}, headers={"sec-fetch-site": "same-origin"}), 503)
    envelope(open_app.post("/v1/pause", json={}), 503)


def test_post_needs_json_content_type(open_app: TestClient) -> None:
    for headers in ({}, {"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"},
                    {"content-type": "multipart/form-data; boundary=x"}):
        r = open_app.post("/v1/pause", content=b"{}", headers=headers)
        assert "application/json" in envelope(r, 415)["message"], headers
    envelope(open_app.post("/v1/pause", content=b"", headers={"content-type": "application/json; charset=utf-8"}),
             503)
    # a form or text/plain content type is refused even empty (a browser sends those without a preflight)
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        r = open_app.post("/pause", content=b"", headers={"content-type": ctype})
        assert "application/json" in envelope(r, 415)["message"], ctype
    # no body and no content type (curl -X POST) passes the guard (503: no engine here)
    for path in ("/v1/pause", "/v1/resume", "/pause", "/resume", "/sleep", "/wake_up", "/reset_prefix_cache"):
        envelope(open_app.post(path), 503)
    envelope(open_app.post("/v1/sleep?tags=weights"), 503)
    envelope(open_app.post("/sleep?level=2"), 503)
    # a GET has no body to type
    envelope(open_app.get("/v1/is_paused"), 503)
    envelope(open_app.get("/is_paused"), 503)
    envelope(open_app.get("/is_sleeping"), 503)


def test_unknown_arguments_are_refused_before_the_engine(open_app: TestClient) -> None:
    for method, path, kw, name in (
            ("POST", "/v1/control/is_paused", {"json": {"x": 1}}, "x"),
            ("GET", "/v1/is_paused?x=1", {}, "x"),
            ("POST", "/v1/pause?now=1", {}, "now"),
            ("POST", "/v1/sleep", {"json": {"tags": "weight", "level": 1}}, "level"),
            ("POST", "/pause?bogus=1", {}, "bogus"),
            ("POST", "/pause?mode=wait", {}, "mode"),
            ("POST", "/sleep?level=3", {}, "level"),
            ("POST", "/wake_up?tags=weights&level=1", {}, "level"),
            ("GET", "/is_sleeping?x=1", {}, "x"),
            ("POST", "/reset_prefix_cache?reset_running_requests=true", {}, "reset_running_requests"),
            ("POST", "/v1/abort_requests?abort_all=maybe", {}, "abort_all")):
        js = envelope(open_app.request(method, path, **kw), 400)
        assert name in js["message"] and js["error"]["param"] == name, (path, js)


def test_vllm_paths_take_the_control_key(tmp_path: Path) -> None:
    for http in _app(tmp_path, api_key="data-key", control_api_key="ctl-key"):
        for method, path in (("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused"), ("POST", "/sleep"),
                             ("POST", "/wake_up"), ("GET", "/is_sleeping"), ("POST", "/reset_prefix_cache")):
            envelope(http.request(method, path), 401)
            envelope(http.request(method, path, headers={"Authorization": "Bearer data-key"}), 401)
            envelope(http.request(method, path, headers={"Authorization": "Bearer ctl-key"}), 503)


def test_control_key_defaults_to_api_key_and_can_differ(tmp_path: Path) -> None:
    for http in _app(tmp_path, api_key="data-key", control_api_key="ctl-key"):
        data = {"Authorization": "Bearer data-key"}
        ctl = {"Authorization": "Bearer ctl-key"}
        # the data key does not open the control plane, and the other way round
        r = http.post("/v1/pause", json={}, headers=data)
        assert envelope(r, 401)["message"] == "invalid control API key"
        assert r.headers["www-authenticate"] == "Bearer"
        assert http.get("/v1/models", headers=ctl).status_code == 401
        assert "missing control API key" in envelope(http.post("/v1/pause", json={}), 401)["message"]
        envelope(http.post("/v1/pause", json={}, headers=ctl), 503)
        assert http.get("/v1/models", headers=data).status_code == 200
    for http in _app(tmp_path, control_api_key="ctl-key"):  # data plane open, control plane keyed
        assert http.get("/v1/models").status_code == 200
        envelope(http.post("/v1/abort_requests", json={"abort_all": True}), 401)
        envelope(http.post("/v1/control/is_paused", json={}, headers={"Authorization": "Bearer ctl-key"}), 503)


def test_update_weights_refused_without_allowed_dirs(open_app: TestClient, tmp_path: Path) -> None:
    ckpt = tmp_path / "model.gguf"
    ckpt.write_bytes(b"GGUF" + b"\0" * 64)
    for route in ("/v1/update_weights", "/v1/control/update_weights"):
        js = envelope(open_app.post(route, json={"path": str(ckpt)}), 403)
        assert "--allowed-weights-dir" in js["message"] and js["error"]["param"] == "path"
        assert str(tmp_path) not in js["message"]


def test_update_weights_paths(tmp_path: Path) -> None:
    allowed = tmp_path / "ckpts"
    (allowed / "good").mkdir(parents=True)
    (allowed / "good" / "config.json").write_text("{}")
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "model.gguf").write_bytes(b"SECRET-BYTES")
    (allowed / "link.gguf").symlink_to(secret / "model.gguf")
    (allowed / "linkdir").symlink_to(secret)
    (allowed / "leaky").mkdir()
    (allowed / "leaky" / "model.safetensors").symlink_to(secret / "model.gguf")
    for http in _app(tmp_path, allowed_weights_dirs=[str(allowed)]):
        refused = []
        for path in ("../secret/model.gguf", str(allowed / ".." / "secret" / "model.gguf"), str(secret / "model.gguf"),
                     str(secret / "missing.gguf"), "/etc/passwd", "/no/such/file", str(allowed / "link.gguf"),
                     str(allowed / "linkdir" / "model.gguf"), str(allowed / "leaky"), str(allowed) + "-sibling/x",
                     "good/\x00x"):
            for route in ("/v1/update_weights", "/v1/control/update_weights"):
                js = envelope(http.post(route, json={"path": path}), 403)
                refused.append(js)
        # one answer for all of them: nothing tells whether a file outside exists
        assert all(js == refused[0] for js in refused), refused
        assert "SECRET" not in str(refused) and str(tmp_path) not in str(refused)
        # inside: relative (to the first allowed dir) or absolute, passes to the engine (503 here)
        for path in ("good", str(allowed / "good"), "good/../good", "new.gguf"):
            envelope(http.post("/v1/update_weights", json={"path": path, "version": "v2"}), 503)
        # bad arguments are 400s naming the field
        js = envelope(http.post("/v1/update_weights", json={"path": 3}), 400)
        assert js["error"]["param"] == "path"
        js = envelope(http.post("/v1/update_weights", json={"path": "good", "version": True}), 400)
        assert js["error"]["param"] == "version"
        js = envelope(http.post("/v1/update_weights", json={"path": "good", "extra": 1}), 400)
        assert js["error"]["param"] == "extra"


def test_resolve_weights_path(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "m.gguf").write_bytes(b"x")
    root = str(tmp_path / "a")
    assert resolve_weights_path("m.gguf", [root]) == os.path.realpath(os.path.join(root, "m.gguf"))
    assert resolve_weights_path(os.path.join(root, "sub", "..", "m.gguf"), [root]).endswith("/a/m.gguf")
    with pytest.raises(Exception) as e:
        resolve_weights_path("../a2/m.gguf", [root])
    assert getattr(e.value, "code", None) == 403


def test_clean_message_drops_file_bytes_and_exception_types() -> None:
    msg = clean_message("/real/dir/x.gguf: not a GGUF file (bad magic b'SECR')", {"/real/dir/x.gguf": "x.gguf"})
    assert msg == "x.gguf: not a GGUF file"
    assert clean_message("control method wakeup failed: OSError: gone") == "control method wakeup failed: gone"
    assert "\\x00" not in clean_message("header b'\\x00\\x01ab' is short")


def test_dns_rebinding_needs_a_key(tmp_path: Path) -> None:
    """A page at http://evil.example:8000 whose name was rebound to
    127.0.0.1 is same-origin with itself; its Host header is its own name."""
    rebound = {"host": "evil.example:8000", "origin": "http://evil.example:8000"}
    for http in _app(tmp_path):
        js = envelope(http.post("/v1/pause", json={}, headers=rebound), 403)
        assert "--control-api-key" in js["message"]
        envelope(http.post("/v1/pause", json={}, headers={"host": "my-box.lan:8000"}), 403)
        for host in ("127.0.0.1:8000", "localhost:8000", "[::1]:8000", "10.1.2.3"):
            envelope(http.post("/v1/pause", json={}, headers={"host": host}), 503)
    for http in _app(tmp_path, control_api_key="k"):  # with a key, names are fine
        envelope(http.post("/v1/pause", json={}, headers={"host": "my-box.lan:8000", "authorization": "Bearer k"}),
                 503)
