"""The headline command runs Mooncake for real (issue 15): ``fdx serve
--scheduler v1 --cache-backend mooncake`` with no master configured starts a
``mooncake_master`` of its own (a child of the launcher, on a free loopback
port), the store holds the KV -- a 1,000-token prompt sent again after a
pause and a resume (which empty the device prefix cache) is served >= 90%
from it and the storage-hit counter rises -- and SIGTERM leaves no master
behind, nor does a SIGKILL of the launcher.  An explicit ``master`` starts
none (its end-to-end use is in ``test_kv_storage_e2e.py``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from kvservices import have_mooncake
from serverutil import children_of, start_server
from test_kv_storage_e2e import complete, long_prompt, metric, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.mooncake,
              pytest.mark.skipif(not have_mooncake(), reason="mooncake not installed")]


def _masters(pid: int) -> list[int]:
    out = []
    for c in children_of(pid):
        try:
            with open(f"/proc/{c}/cmdline", "rb") as f:
                if b"mooncake_master" in f.read():
                    out.append(c)
        except OSError:
            continue
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_headline_command_starts_and_stops_its_own_master() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")}
    prompt = long_prompt("headline")
    with start_server("--scheduler", "v1", "--cache-backend", "mooncake", env=env) as (base, proc):
        masters = _masters(proc.pid)
        assert len(masters) == 1, children_of(proc.pid)
        text, n_prompt, cached = complete(base, prompt)
        assert n_prompt >= 900 and cached == 0
        wait_for(lambda: metric(base, "fdx:kv_storage_puts_total") >= n_prompt // 16, 120)
        for route in ("pause", "resume"):  # a pause empties the device prefix cache
            r = httpx.post(f"{base}/v1/{route}", json={}, timeout=600)
            assert r.status_code == 200, r.text
        hits = metric(base, "fdx:kv_storage_hits_total")
        text2, _, cached2 = complete(base, prompt)
        assert text2 == text
        assert cached2 >= 0.9 * n_prompt, (cached2, n_prompt)
        assert metric(base, "fdx:kv_storage_hits_total") >= hits + cached2 // 16
        assert metric(base, "fdx:kv_storage_errors_total") == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    deadline = time.monotonic() + 10
    while _alive(masters[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(masters[0]), "the managed mooncake_master outlived fdx serve"


def test_explicit_master_starts_none() -> None:
    from fdx.config import make_config
    from fdx.plugins.cache_backends import mooncake

    cfg = make_config(model="smollm2", cache_backend="mooncake", cache_backend_config={"master": "127.0.0.1:1"})
    before = len(mooncake.MANAGED)
    assert mooncake.fdx_adjust_config(cfg, None) is None and len(mooncake.MANAGED) == before
    assert mooncake.fdx_adjust_config(make_config(model="smollm2", cache_backend="memory"), None) is None


def test_managed_master_dies_with_a_killed_launcher() -> None:
    """SIGKILL leaves no handler to run: the parent-death signal stops the master."""
    code = ("import sys; from fdx.config import make_config; from fdx.plugins.cache_backends import mooncake; "
            "o = mooncake.fdx_adjust_config(make_config(model='smollm2', cache_backend='mooncake'), None); "
            "print(mooncake.MANAGED[0].pid, o['cache_backend_config']['master'], flush=True); "
            "import time; time.sleep(600)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")}
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env, text=True)
    try:
        pid_s, address = launcher.stdout.readline().split()  # type: ignore[union-attr]
        pid = int(pid_s)
        host, port = address.rsplit(":", 1)
        socket.create_connection((host, int(port)), timeout=2).close()  # it listens
        assert _masters(launcher.pid) == [pid]
    finally:
        launcher.kill()
        launcher.wait(30)
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "the managed mooncake_master outlived a SIGKILLed launcher"
