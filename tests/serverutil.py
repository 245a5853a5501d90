"""Start a real ``fdx serve`` subprocess for tests (reusable by every helper).

    from serverutil import start_server  # tests/ is on sys.path under pytest

    with start_server("--max-num-seqs", "8", env={"FDX_...": "..."}) as (base_url, proc):
        httpx.get(base_url + "/health")

The server runs on a free port (or ``port``) with its own IPC directory;
``start_server`` waits for ``/health`` to answer 200 (default 180 s) and fails
fast with the server's log if the process exits first.  On exit it stops
the server by PID (SIGTERM, then SIGKILL) and kills any child left behind.
The log is in ``proc.log_path`` (a temp file; removed after a clean run
unless ``FDX_KEEP_SERVER_LOGS`` is set); ``proc.run_dir`` is the server's
``FDX_IPC_DIR`` (empty again once the server stopped cleanly).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Iterator

import httpx

DEFAULT_ARGS = ("--num-kv-blocks", "512", "--max-model-len", "2048")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def read_log(proc: subprocess.Popen[bytes], tail: int = 8000) -> str:
    path = getattr(proc, "log_path", None)
    if not path:
        return ""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()[-tail:]
    except OSError:
        return ""


def children_of(pid: int) -> list[int]:
    """PIDs whose parent is ``pid`` (from /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            if int(fields[1]) == pid:
                out.append(int(d))
        except (OSError, IndexError, ValueError):
            continue
    return out


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    """SIGTERM, wait, SIGKILL; then kill any child still alive (by PID)."""
    kids = children_of(proc.pid)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    for k in kids:
        if pid_alive(k):
            with contextlib.suppress(ProcessLookupError):
                os.kill(k, signal.SIGKILL)


def wait_health(base: str, timeout: float, proc: subprocess.Popen[bytes] | None = None,
                what: str = "the server") -> None:
    """Poll ``base/health`` until it answers 200; fail the test when ``proc``
    (if given) exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc is None or proc.poll() is None, f"{what} exited with {proc.returncode}"
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{what} was not healthy after {timeout:.0f}s"
        time.sleep(0.25)


def record_stream(base: str, body: dict[str, Any], out: dict[str, Any], started: threading.Event,
                  timeout: float = 60) -> None:
    """POST a streaming ``/v1/completions`` request and record how it ends in
    ``out``: ``status``, ``done`` ([DONE] seen), ``error`` (an error event),
    ``finish`` (the last finish_reason), ``exc`` (a transport error) and
    ``ended`` (monotonic time).  ``started`` is set at the first event, and at
    the end whatever happened, so a waiting test never hangs."""
    try:
        with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True}, timeout=timeout) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                started.set()
                if line == "data: [DONE]":
                    out["done"] = True
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    out["error"] = ev["error"]
                for ch in ev.get("choices") or ():
                    if ch.get("finish_reason"):
                        out["finish"] = ch["finish_reason"]
    except httpx.HTTPError as exc:
        out["exc"] = repr(exc)
    finally:
        out["ended"] = time.monotonic()
        started.set()


def metric_value(base: str, name: str, **labels: str) -> float:
    """The value of the labelled series ``name{...}`` on ``base``'s /metrics
    whose labels include ``labels`` (0.0 when there is none)."""
    text = httpx.get(base + "/metrics", timeout=10).text
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', line[len(name):line.rindex("}") + 1]))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def serve_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "fdx", "serve", *args]


@contextlib.contextmanager
def start_server(
    *extra_args: str,
    env: dict[str, str] | None = None,
    port: int | None = None,
    timeout: float = 180.0,
    default_args: tuple[str, ...] = DEFAULT_ARGS,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Launch ``fdx serve`` on 127.0.0.1 and yield ``(base_url, proc)``."""
    port = port or free_port()
    run_dir = tempfile.mkdtemp(prefix="fdx-test-run-")
    # FDX_NATIVE_BUILD=1: a test server may JIT-build the C++ ops (a checkout without `make install`'s build)
    full_env = {"FDX_NATIVE_BUILD": "1", **os.environ, "FDX_IPC_DIR": run_dir, "PYTHONUNBUFFERED": "1"}
    full_env.update(env or {})
    log = tempfile.NamedTemporaryFile(prefix="fdx-serve-", suffix=".log", delete=False)
    cmd = serve_command("--host", "127.0.0.1", "--port", str(port), *default_args, *extra_args)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    proc.log_path = log.name  # type: ignore[attr-defined]
    proc.run_dir = run_dir  # type: ignore[attr-defined]
    base = f"http://127.0.0.1:{port}"
    ok = False
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"fdx serve exited with code {proc.returncode} before it was healthy:\n"
                                   f"{read_log(proc)}")
            try:
                r = httpx.get(base + "/health", timeout=5)
                # the pid check guards against another test's server that grabbed the same port
                if r.status_code == 200 and r.json().get("launcher_pid") == proc.pid:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"fdx serve was not healthy after {timeout:.0f}s:\n{read_log(proc)}")
            time.sleep(0.25)
        yield base, proc
        ok = True
    finally:
        stop_process(proc)
        log.close()
        if ok and not os.environ.get("FDX_KEEP_SERVER_LOGS"):
            with contextlib.suppress(OSError):
                os.unlink(log.name)
        with contextlib.suppress(OSError):
            os.rmdir(run_dir)  # fails (kept for inspection) if the server left files behind


def write_plugin_entry_point(directory: str, dist: str, name: str, module: str) -> str:
    """Install test module ``module`` as a plugin the way a package would:
    a ``{dist}-0.1.dist-info`` in ``directory`` with the ``fdx.plugins``
    entry point ``name``.  Returns the ``PYTHONPATH`` (``directory``, the
    tests folder, the current one) on which a server subprocess finds it."""
    info = os.path.join(directory, f"{dist.replace('-', '_')}-0.1.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write(f"[fdx.plugins]\n{name} = {module}\n")
    here = os.path.dirname(os.path.abspath(__file__))
    return os.pathsep.join(p for p in (directory, here, os.environ.get("PYTHONPATH", "")) if p)
