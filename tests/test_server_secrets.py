"""The API key never shows in a process's command line (``ps -eo cmd``):
not the launcher's, not a child's; whether it came from ``--api-key`` or
``FDX_API_KEY``.  Auth still works."""

from __future__ import annotations

import secrets

import httpx
import pytest
from serverutil import children_of, start_server

pytestmark = pytest.mark.slow


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _check(base: str, launcher_pid: int, key: str) -> None:
    info = httpx.get(base + "/health", timeout=10).json()
    kids = children_of(launcher_pid)
    assert {info["api_pid"], info["engine_pid"]} <= set(kids), (info, kids)
    for pid in [launcher_pid, *kids]:
        cmd = _read(f"/proc/{pid}/cmdline")
        assert cmd, f"cannot read the command line of {pid}"
        assert key.encode() not in cmd, f"the key is in the command line of {pid}: {cmd!r}"
    for pid in kids:  # the children get it through the config pipe only
        assert key.encode() not in _read(f"/proc/{pid}/environ"), f"the key is in the environment of {pid}"
    body = {"model": "smollm2", "prompt": "hi", "max_tokens": 1}
    assert httpx.post(base + "/v1/completions", json=body, timeout=60).status_code == 401
    wrong = httpx.post(base + "/v1/completions", json=body, headers={"authorization": "Bearer nope"}, timeout=60)
    assert wrong.status_code == 401
    ok = httpx.post(base + "/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=60)
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("source", ["flag", "env"])
def test_api_key_is_not_in_any_command_line(source: str) -> None:
    key = "sk-" + secrets.token_hex(16)
    if source == "flag":
        ctx = start_server("--api-key", key)
    else:
        ctx = start_server(env={"FDX_API_KEY": key})
    with ctx as (base, proc):
        _check(base, proc.pid, key)
