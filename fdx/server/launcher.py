"""``fdx serve`` in the foreground: start, watch and stop the two children.

Order: make the per-run IPC directory -> start the API process (it binds the
ZMQ sockets at once) -> when the socket files exist, start the engine
process.  The API process reports through files in the run directory
(:class:`fdx.server.api_proc.StatusBoard`).

Invariants:

* SIGINT/SIGTERM -> the API process is asked to stop (it sends ``Shutdown``
  to the engine), then every child still alive is terminated and finally
  killed, by PID, within bounded time; the run directory (socket files) is
  removed; exit code 0.
* The engine failing to start -> its one-line message on stderr, exit 1.
* The engine dying after start-up -> the API stays up (``/health`` is 503);
  the API process dying -> everything stops, exit 1.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import attrs

from fdx.core.config import EngineConfig
from fdx.core.ipc import IpcPaths, make_run_dir
from fdx.core.logs import setup_logging
from fdx.server.api_proc import FAILED_FILE, READY_FILE

log = logging.getLogger("fdx.serve")

SOCKET_WAIT_S = 60.0
API_STOP_S = 6.0
ENGINE_STOP_S = 5.0
TERM_WAIT_S = 3.0


class _Stop:
    def __init__(self) -> None:
        self.signal: int | None = None

    def __call__(self, signum: int, _frame: Any) -> None:
        if self.signal is None:
            self.signal = signum


def _config_json(config: EngineConfig) -> str:
    return json.dumps(attrs.asdict(config, recurse=True))


def _spawn(module: str, cfg_json: str, paths: IpcPaths) -> subprocess.Popen[bytes]:
    # own session: a terminal's Ctrl-C reaches only the launcher, which
    # then stops the children in order
    return subprocess.Popen(
        [sys.executable, "-m", module, cfg_json, paths.dir, str(os.getpid())],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
    )


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return None


def _error(message: str) -> None:
    print(f"fdx serve: error: {message}", file=sys.stderr, flush=True)


def serve(config: EngineConfig) -> int:
    """Run the server until a signal; returns the process exit code."""
    setup_logging(config.log_level, process="serve")
    stop = _Stop()
    old: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            old[sig] = signal.signal(sig, stop)
    paths = make_run_dir(config.ipc_dir)
    cfg_json = _config_json(config)
    api: subprocess.Popen[bytes] | None = None
    engine: subprocess.Popen[bytes] | None = None
    ready = False
    try:
        api = _spawn("fdx.server.api_proc", cfg_json, paths)
        sockets = [os.path.join(paths.dir, n) for n in ("in.sock", "out.sock")]
        deadline = time.monotonic() + SOCKET_WAIT_S
        while not all(os.path.exists(s) for s in sockets):
            if stop.signal is not None:
                return 0
            if api.poll() is not None:
                _error(_read(os.path.join(paths.dir, FAILED_FILE)) or f"API server exited with code {api.returncode}")
                return 1
            if time.monotonic() > deadline:
                _error("API server did not bind its sockets in time")
                return 1
            time.sleep(0.02)
        engine = _spawn("fdx.core.engine_proc", cfg_json, paths)
        log.info("started API server (pid %d) and engine (pid %d); run dir %s", api.pid, engine.pid, paths.dir)
        engine_gone_logged = False
        failed_path = os.path.join(paths.dir, FAILED_FILE)
        ready_path = os.path.join(paths.dir, READY_FILE)
        while stop.signal is None:
            if not ready:
                msg = _read(failed_path)
                if msg:
                    _error(msg)
                    return 1
                if os.path.exists(ready_path):
                    ready = True
                    log.info("fdx serve is ready on http://%s:%d (model %s)", config.host, config.port,
                             config.model_name)
            if api.poll() is not None:
                msg = None if ready else _read(failed_path)
                _error(msg or f"API server exited with code {api.returncode}")
                return 1
            if engine.poll() is not None and not engine_gone_logged:
                if not ready:
                    # the API process may still be writing the engine's message
                    t_end = time.monotonic() + 2.0
                    msg = None
                    while time.monotonic() < t_end and not (msg := _read(failed_path)):
                        time.sleep(0.05)
                    _error(msg or f"engine process exited with code {engine.returncode} before it was ready")
                    return 1
                log.error("engine process %d exited with code %s; the API stays up and /health reports 503",
                          engine.pid, engine.returncode)
                engine_gone_logged = True
            time.sleep(0.1)
        log.info("received %s, shutting down", signal.Signals(stop.signal).name)
        return 0
    finally:
        _stop_children(api, engine, ready)
        paths.cleanup()
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _stop_children(api: subprocess.Popen[bytes] | None, engine: subprocess.Popen[bytes] | None,
                   ready: bool) -> None:
    """API first (its shutdown sends Shutdown to the engine), then the
    engine; SIGTERM, then SIGKILL, each bounded in time."""
    if engine is not None and not ready and engine.poll() is None:
        # failed engines exit by themselves; one still loading reads no Shutdown
        if not _wait(engine, 1.0):
            _signal(engine, signal.SIGTERM)
    if api is not None and api.poll() is None:
        _signal(api, signal.SIGTERM)
        _wait(api, API_STOP_S)
    if engine is not None and engine.poll() is None:
        _wait(engine, ENGINE_STOP_S)
    for p in (api, engine):
        if p is not None and p.poll() is None:
            _signal(p, signal.SIGTERM)
            if not _wait(p, TERM_WAIT_S):
                _signal(p, signal.SIGKILL)
                _wait(p, TERM_WAIT_S)


def _signal(p: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.kill(p.pid, sig)
    except ProcessLookupError:
        pass


def _wait(p: subprocess.Popen[bytes], timeout: float) -> bool:
    try:
        p.wait(timeout)
        return True
    except subprocess.TimeoutExpired:
        return False
