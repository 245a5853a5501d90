"""`fdx serve` process life cycle: a frozen engine that comes back, clean
SIGTERM, a killed launcher's children, engine start-up failure.  Crashes and
restarts: tests/test_engine_supervisor.py."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
import time
from typing import Any

import httpx
import pytest
from serverutil import free_port, pid_alive, read_log, record_stream, serve_command, start_server

pytestmark = pytest.mark.slow


def _stream_until_error(base: str, out: dict[str, Any], started: threading.Event) -> None:
    record_stream(base, {"model": "smollm2", "prompt": "An endless list:", "max_tokens": 1800,
                         "ignore_eos": True}, out, started)


def _wait_503(base: str, limit: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit + 5:
        if httpx.get(base + "/health", timeout=5).status_code == 503:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError("/health never turned 503")


@pytest.mark.parametrize("how", ["hang"])  # a killed engine: tests/test_engine_supervisor.py
def test_engine_death_turns_health_503(how: str) -> None:
    # the default --step-timeout (120 s) is far off: a short freeze is survived without a restart
    with start_server() as (base, proc):
        pid = httpx.get(base + "/health").json()["engine_pid"]
        out: dict[str, Any] = {}
        started = threading.Event()
        t = threading.Thread(target=_stream_until_error, args=(base, out, started))
        t.start()
        assert started.wait(60)
        os.kill(pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        try:
            took = _wait_503(base, 5.0)
            assert took < 5.0, f"/health took {took:.1f}s to report the dead engine"
            t.join(30)
            assert not t.is_alive(), "the in-flight request hung"
            assert out.get("error", {}).get("code") == 503, out
            body = httpx.get(base + "/health").json()
            assert body["status"] == "unavailable" and body["reason"]
            r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == 503
            assert proc.poll() is None  # the API stays up
            if how == "hang":
                os.kill(pid, signal.SIGCONT)  # it recovers: served again, the failed request's KV freed
                deadline = time.monotonic() + 30
                while httpx.get(base + "/health").status_code != 200:
                    assert time.monotonic() < deadline, "server never recovered from the engine hang"
                    time.sleep(0.1)
                r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
                assert r.status_code == 200, r.text
                while "fdx:kv_blocks_used{model_name=\"smollm2\"} 0.0" not in httpx.get(base + "/metrics").text:
                    assert time.monotonic() < deadline, "KV blocks of the failed request were not freed"
                    time.sleep(0.1)
        finally:
            if how == "hang":
                os.kill(pid, signal.SIGKILL)


def test_sigterm_stops_everything() -> None:
    with start_server() as (base, proc):
        info = httpx.get(base + "/health").json()
        kids = [info["engine_pid"], info["api_pid"]]
        run_dir = proc.run_dir  # type: ignore[attr-defined]
        assert os.listdir(run_dir)  # the per-run socket directory exists
        out: dict[str, Any] = {}
        started = threading.Event()
        t = threading.Thread(target=_stream_until_error, args=(base, out, started))
        t.start()
        assert started.wait(60)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, read_log(proc)
        t.join(10)
        assert not t.is_alive() and ("error" in out or "exc" in out), out  # the open stream ended
        for k in kids:
            assert not pid_alive(k), f"child {k} survived"
        assert os.listdir(run_dir) == [], "run directory (socket files) left behind"


def test_a_killed_launcher_leaves_no_orphans() -> None:
    """SIGKILL of `fdx serve` itself (no handler runs, nobody stops the
    children): the API process (a watcher thread) and the engine (its
    channel to the API closing, or its loop's parent check, whichever comes
    first) notice and exit on their own, so no orphan keeps the model's
    memory, the KV pool or the port; the API process, the last one out of
    the launcher's family, removes the run directory (socket files) the
    launcher would have."""
    with start_server() as (base, proc):
        info = httpx.get(base + "/health").json()
        kids = {"engine": info["engine_pid"], "api": info["api_pid"]}
        run_dir = proc.run_dir  # type: ignore[attr-defined]
        assert os.listdir(run_dir)  # the launcher's run directory, under FDX_IPC_DIR
        out: dict[str, Any] = {}
        started = threading.Event()
        t = threading.Thread(target=_stream_until_error, args=(base, out, started))
        t.start()
        assert started.wait(60)
        proc.kill()
        proc.wait(10)
        try:
            deadline = time.monotonic() + 20
            while any(pid_alive(k) for k in kids.values()):
                assert time.monotonic() < deadline, \
                    f"orphans still alive 20 s after the launcher died: {[n for n, k in kids.items() if pid_alive(k)]}"
                time.sleep(0.1)
            t.join(10)
            assert not t.is_alive(), "the open stream hung after the launcher died"
            assert os.listdir(run_dir) == [], f"the dead launcher's run directory was left behind: {os.listdir(run_dir)}"
        finally:
            for k in kids.values():
                if pid_alive(k):
                    os.kill(k, signal.SIGKILL)


def test_engine_start_failure_exits_nonzero() -> None:
    # an accelerator index no machine has: unavailable here and on a GPU machine alike
    run_dir = tempfile.mkdtemp(prefix="fdx-test-run-")
    env = {**os.environ, "FDX_IPC_DIR": run_dir}
    p = subprocess.run(serve_command("--port", str(free_port()), "--device", "cuda:4096"), env=env,
                       capture_output=True, text=True, timeout=180)
    assert p.returncode != 0
    assert "fdx serve: error: device 'cuda:4096' is not available" in p.stderr
    assert os.listdir(run_dir) == []
    os.rmdir(run_dir)
