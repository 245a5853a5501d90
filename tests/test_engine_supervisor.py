"""The engine supervisor of ``fdx serve``, with real processes: a killed
engine under 16 streams, a frozen (SIGSTOP'd) engine, a step that hangs
while the heartbeat goes on, and giving up after ``--max-engine-restarts``;
plus the pure restart/hang policies and the heartbeat's step progress."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from typing import Any, Iterator

import httpx
import pytest
import stall_runner_plugin
from serverutil import metric_value, pid_alive, read_log, record_stream, start_server

from fdx.core.engine_proc import HeartbeatThread, Progress
from fdx.core.ipc import IpcPaths
from fdx.deploy.engine_link import OutputListener
from fdx.deploy.engine_link import Liveness
from fdx.core.messages import EngineStats, Heartbeat
from fdx.deploy.launcher import RestartPolicy

MAX_RESTARTS = 3
STEP_TIMEOUT = 10.0
NORMAL_PROMPTS = ("An endless list:", "hi")
STALL_TEXT = "Tell me about ZQXSTALL now"


# --------------------------------------------------------------------------
# pure policies
# --------------------------------------------------------------------------


def test_restart_policy_backs_off_and_gives_up() -> None:
    p = RestartPolicy(max_restarts=3, window=60.0, base_delay=0.5, max_delay=1.5)
    assert [p.on_crash(t) for t in (0.0, 1.0, 2.0)] == [0.5, 1.0, 1.5]
    assert p.on_crash(3.0) is None  # a 4th crash within 60 s
    q = RestartPolicy(max_restarts=1, window=10.0)
    assert q.on_crash(0.0) == 0.5
    assert q.on_crash(11.0) == 0.5  # the first crash left the window
    assert q.on_crash(12.0) is None
    assert RestartPolicy(max_restarts=0, window=10.0).on_crash(0.0) is None


def test_liveness_tells_busy_from_hung() -> None:
    lv = Liveness(timeout=3.0, step_timeout=10.0)
    lv.beat(busy_s=9.0, steps=4)  # a long step, still under the bound
    assert lv.hung() is None and lv.check() is None
    lv.beat(busy_s=10.5, steps=4)  # heartbeats keep coming, the step does not end
    reason = lv.hung()
    assert reason is not None and "step has run for" in reason
    assert lv.check() == reason
    silent = Liveness(timeout=3.0, step_timeout=10.0)
    silent.last_seen -= 11.0  # nothing at all for 11 s
    assert "sent nothing" in (silent.hung() or "")


def test_heartbeat_carries_the_step_in_progress(tmp_path: Any) -> None:
    """The engine's heartbeat thread, over a real socket: a step that has run
    for 12 s shows as ``busy_s`` while beats keep coming, and Liveness calls
    it hung (the real-server tests below freeze the whole process instead)."""
    paths = IpcPaths(str(tmp_path))
    out = OutputListener(paths)
    progress = Progress()
    progress.steps = 7
    progress.busy_since = time.monotonic() - 12.0
    beat = HeartbeatThread(paths, 0.05, lambda: EngineStats(steps=7), progress)
    beat.start()
    try:
        hb = out.recv(5.0)
        assert hb is not None, "no heartbeat"
        progress.busy_since = None  # the step ended: the next beats say idle
        deadline = time.monotonic() + 5
        while (idle := out.recv(5.0)).busy_s != 0.0:  # type: ignore[union-attr]
            assert time.monotonic() < deadline
    finally:
        beat.stop.set()
        beat.join(5)
        out.close()
    assert isinstance(hb, Heartbeat) and hb.pid == os.getpid() and hb.steps == 7 and hb.busy_s >= 12.0
    assert isinstance(idle, Heartbeat) and idle.busy_s == 0.0
    lv = Liveness(timeout=3.0, step_timeout=10.0)
    lv.beat(hb.busy_s, hb.steps)
    assert "step has run for" in (lv.hung() or "")
    lv.beat(idle.busy_s, idle.steps)
    assert lv.hung() is None


# --------------------------------------------------------------------------
# real server
# --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stall_token() -> int:
    """A token of STALL_TEXT that no other prompt of this module has."""
    from fdx.model.loader import load_tokenizer

    tok = load_tokenizer("smollm2")
    normal = {t for p in NORMAL_PROMPTS for t in tok.encode(p, add_special_tokens=True)}
    marked = [t for t in tok.encode(STALL_TEXT, add_special_tokens=True) if t not in normal]
    assert marked
    return marked[0]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, stall_token: int) -> Iterator[tuple[str, Any]]:
    """The real cpu runner, except that a step with the stall token hangs
    (tests/stall_runner_plugin.py)."""
    env = {"PYTHONPATH": stall_runner_plugin.write_entry_point(str(tmp_path_factory.mktemp("runner"))),
           stall_runner_plugin.STALL_ENV: str(stall_token)}
    with start_server("--max-engine-restarts", str(MAX_RESTARTS), "--restart-window", "600",
                      "--step-timeout", str(STEP_TIMEOUT), "--max-num-seqs", "16", "--model-runner", "stall-cpu",
                      env=env) as (base, proc):
        yield base, proc


def _stream(base: str, out: dict[str, Any], started: threading.Event) -> None:
    record_stream(base, {"model": "smollm2", "prompt": "An endless list:", "max_tokens": 1800,
                         "ignore_eos": True}, out, started)


def _engine_pid(base: str) -> int:
    r = httpx.get(base + "/health", timeout=10)
    assert r.status_code == 200, r.text
    return int(r.json()["engine_pid"])


def _wait_serving(base: str, proc: Any, old_pid: int, limit: float) -> tuple[int, float]:
    """Wait for /health 200 with a new engine pid; (pid, seconds)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        assert proc.poll() is None, f"fdx serve exited ({proc.returncode}):\n{read_log(proc)}"
        try:
            r = httpx.get(base + "/health", timeout=5)
            if r.status_code == 200 and r.json()["engine_pid"] != old_pid:
                return int(r.json()["engine_pid"]), time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"not serving again {limit:.0f}s after the engine died:\n{read_log(proc)}")


def _complete(base: str) -> None:
    r = httpx.post(base + "/v1/completions", json={"model": "smollm2", "prompt": "hi", "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.slow
def test_killed_engine_under_16_streams_is_replaced(server: tuple[str, Any]) -> None:
    base, proc = server
    pid = _engine_pid(base)
    outs: list[dict[str, Any]] = [{} for _ in range(16)]
    started = [threading.Event() for _ in outs]
    threads = [threading.Thread(target=_stream, args=(base, o, s), daemon=True) for o, s in zip(outs, started)]
    for t in threads:
        t.start()
    for s in started:
        assert s.wait(120), "a stream never started"
    assert all(o.get("status") == 200 and "ended" not in o for o in outs), outs
    os.kill(pid, signal.SIGKILL)
    t_kill = time.monotonic()
    while (h := httpx.get(base + "/health", timeout=10)).status_code != 503:  # until the new engine is ready
        assert time.monotonic() - t_kill < 10, "/health did not report the dead engine"
        time.sleep(0.05)
    assert "a new engine is starting" in h.json()["reason"], h.json()
    for t in threads:
        t.join(max(1.0, 30 - (time.monotonic() - t_kill)))
    assert not any(t.is_alive() for t in threads), "a stream hung after the engine died"
    for o in outs:  # each ended with an error event (not a cut connection, not a normal finish)
        assert o.get("error", {}).get("code") == 503, o
        assert "engine" in o["error"]["message"], o
    new_pid, _took = _wait_serving(base, proc, pid, 30 - (time.monotonic() - t_kill))
    assert new_pid != pid and not pid_alive(pid)
    _complete(base)
    assert metric_value(base, "fdx:engine_restarts_total") == 1.0
    assert metric_value(base, "fdx:engine_crashes_total", reason="exited") == 1.0
    assert metric_value(base, "fdx:engine_last_crash_info", reason="exited") == 1.0
    assert metric_value(base, "fdx:kv_blocks_used") == 0.0  # the new engine starts clean


@pytest.mark.slow
def test_frozen_engine_is_killed_and_replaced(server: tuple[str, Any]) -> None:
    base, proc = server
    pid = _engine_pid(base)
    out: dict[str, Any] = {}
    started = threading.Event()
    t = threading.Thread(target=_stream, args=(base, out, started), daemon=True)
    t.start()
    assert started.wait(120)
    os.kill(pid, signal.SIGSTOP)  # every thread stops: no step progress, no heartbeat
    try:
        t.join(30)
        assert not t.is_alive(), "the stream hung on a frozen engine"
        assert out.get("error", {}).get("code") == 503, out
        new_pid, _took = _wait_serving(base, proc, pid, STEP_TIMEOUT + 30)
        assert not pid_alive(pid), "the hung engine was not killed"
    finally:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
    assert new_pid != pid
    _complete(base)
    assert metric_value(base, "fdx:engine_crashes_total", reason="hung") == 1.0
    assert metric_value(base, "fdx:engine_last_crash_info", reason="hung") == 1.0
    assert metric_value(base, "fdx:engine_restarts_total") == 2.0


@pytest.mark.slow
def test_hung_step_is_killed_although_the_heartbeat_goes_on(server: tuple[str, Any]) -> None:
    """A step that never ends while the engine's heartbeat thread keeps
    beating: detected from the step progress the beats carry, killed after
    --step-timeout, replaced."""
    base, proc = server
    pid = _engine_pid(base)
    crashes_before = metric_value(base, "fdx:engine_crashes_total", reason="hung")
    r = httpx.post(base + "/v1/completions", json={"model": "smollm2", "prompt": STALL_TEXT, "max_tokens": 4},
                   timeout=STEP_TIMEOUT + 60)
    assert r.status_code == 503, r.text
    assert "step has run for" in r.json()["error"]["message"], r.json()  # not "sent nothing": it kept beating
    new_pid, _took = _wait_serving(base, proc, pid, 40)
    assert new_pid != pid and not pid_alive(pid)
    _complete(base)
    assert metric_value(base, "fdx:engine_crashes_total", reason="hung") == crashes_before + 1
    text = httpx.get(base + "/metrics", timeout=10).text
    assert re.search(r'fdx:engine_last_crash_info\{[^}]*message="engine step has run for', text), text[-2000:]


@pytest.mark.slow
def test_too_many_crashes_exit_nonzero(server: tuple[str, Any]) -> None:
    base, proc = server
    crashes = int(sum(metric_value(base, "fdx:engine_crashes_total", reason=r)
                      for r in ("crashed", "exited", "hung", "start_failed")))
    assert crashes <= MAX_RESTARTS
    for _ in range(MAX_RESTARTS + 1 - crashes):
        pid = _engine_pid(base) if proc.poll() is None else None
        if pid is None:
            break
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while proc.poll() is None:
            try:
                r = httpx.get(base + "/health", timeout=5)
                if r.status_code == 200 and r.json()["engine_pid"] != pid:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, read_log(proc)
            time.sleep(0.1)
    code = proc.wait(60)
    assert code != 0, read_log(proc)
    assert "giving up" in read_log(proc)
