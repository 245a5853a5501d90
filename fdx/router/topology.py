"""``fdx serve --scheduler splitwise --num-prefill N --num-decode M``: a splitwise topology on one machine
(also ``--deployment dp+splitwise --data-parallel-size N``: N of each, every rank an instance).

``fdx serve`` (:mod:`fdx.cli`) hands such a config to :func:`run_topology`
(any other to :func:`fdx.deploy.launcher.serve`), which stays in the
foreground and owns N + M + 1 managed children:

* each instance is a full ``fdx serve`` (its own launcher, API and engine
  processes, its engine supervised and restarted as usual) with
  ``--splitwise-role prefill|decode``, on a free port of ``--host``; it is
  started as ``python -m fdx.router.topology --config-fd FD NAME PARENT_PID``
  (the config, API key included, on an inherited pipe, never in argv) and
  stops itself when this process disappears;
* the router (``python -m fdx.router --config-fd FD NAME PARENT_PID``)
  listens on the public ``--host``/``--port`` with every instance's URL,
  and keeps the deployment's control state (:mod:`fdx.router.state`) in a
  ``--state-file`` of a temporary directory this process owns, so a
  restarted router still gives a restarted instance its pause, sleep and
  weights.

Start-up: the instances and the router start at once (the router probes
the instances until they are up); ready when the router's ``/health`` is
200.  A child failing before that -> its last log line on stderr, exit 1.
A child dying later (crashed, killed, or an instance whose own engine gave
up) is reported (an error line naming it, its pid and how it ended) and
started again on the same port after a backoff
(:class:`fdx.deploy.launcher.RestartPolicy`, ``--max-engine-restarts`` per
``--restart-window`` for each child; beyond that everything stops, exit 1).
SIGINT/SIGTERM stops the router first, then the instances (each stops its
own children), SIGTERM then SIGKILL by PID, bounded in time; exit 0.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import attrs

from fdx.config import DP_SPLITWISE, EngineConfig
from fdx.logs import setup_logging
from fdx.deploy.launcher import RestartPolicy, child_config_json, describe_exit, signal_child, spawn_child, wait_child

log = logging.getLogger("fdx.serve")

START_TIMEOUT_S = 600.0
STOP_WAIT_S = 15.0
POLL_S = 0.2


def is_managed(config: EngineConfig) -> bool:
    """Whether ``config`` asks for this managed topology (the ``splitwise``
    or ``dp+splitwise`` deployment)."""
    from fdx.deploy.deployment import deployment_name

    return deployment_name(config) in ("splitwise", DP_SPLITWISE)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@attrs.define(eq=False)
class Child:
    """One managed child: an instance (``role`` prefill/decode) or the router."""

    name: str
    module: str
    config_json: str
    policy: RestartPolicy
    url: str | None = None
    proc: subprocess.Popen[bytes] | None = None
    restart_at: float | None = None

    def start(self) -> None:
        self.proc = spawn_child(self.module, self.config_json, self.name, os.getpid())


def topology_children(config: EngineConfig, state_file: str | None = None) -> list[Child]:
    """The instances (free ports on ``--host``) and the router (``--port``;
    ``state_file``: where it keeps the deployment's control state)."""
    from fdx.router.main import RouterConfig, config_json

    kids: list[Child] = []
    urls: dict[str, list[str]] = {"prefill": [], "decode": []}
    for role, n in (("prefill", config.num_prefill), ("decode", config.num_decode)):
        for k in range(n):
            port = _free_port(config.host)
            # each instance is a ``single`` deployment (a dp+splitwise rank k of its role: dp_rank k)
            cfg = config.replace(splitwise_role=role, port=port, num_prefill=0, num_decode=0, deployment=None,
                                 data_parallel_size=1, dp_rank=k if config.deployment == DP_SPLITWISE else 0)
            url = f"http://{config.host}:{port}"
            urls[role].append(url)
            kids.append(Child(f"{role}{k}", "fdx.router.topology", child_config_json(cfg, engine=False),
                              RestartPolicy(config.max_engine_restarts, config.restart_window), url))
    rc = RouterConfig(prefill=urls["prefill"], decode=urls["decode"], host=config.host, port=config.port,
                      api_key=config.api_key, control_api_key=config.control_api_key, max_request_bytes=config.max_request_bytes,
                      log_level=config.log_level, otlp_traces_endpoint=config.otlp_traces_endpoint,
                      state_file=state_file)
    kids.append(Child("router", "fdx.router", config_json(rc),
                      RestartPolicy(config.max_engine_restarts, config.restart_window),
                      f"http://{config.host}:{config.port}"))
    return kids


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def run_topology(config: EngineConfig) -> int:
    """Run the managed topology until a signal (0) or a failure (1)."""
    setup_logging(config.log_level, process="serve")
    stop = threading.Event()
    got: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        got.append(signum)
        stop.set()

    old = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            old[sig] = signal.signal(sig, on_signal)
    # the router's control state (fdx.router.state) outlives a router restart; removed at the end
    state_dir = tempfile.mkdtemp(prefix="fdx-router-")
    kids = topology_children(config, os.path.join(state_dir, "control_state.json"))
    router = kids[-1]
    ready = False
    t_start = time.monotonic()
    try:
        for kid in kids:
            kid.start()
        log.info("splitwise topology: %s", ", ".join(f"{k.name} {k.url} (pid {k.proc.pid if k.proc else '-'})"
                                                    for k in kids))
        while not stop.is_set():
            if not ready:
                if _healthy(router.url or ""):
                    ready = True
                    log.info("fdx serve (%s, %d prefill + %d decode) is ready on %s (model %s)",
                             config.deployment or "splitwise", config.num_prefill, config.num_decode, router.url,
                             config.model_name)
                elif time.monotonic() - t_start > START_TIMEOUT_S:
                    _error(f"the splitwise topology was not ready after {START_TIMEOUT_S:.0f}s")
                    return 1
            for kid in kids:
                code = _supervise(kid, ready, config)
                if code is not None:
                    return code
            stop.wait(POLL_S)
        log.info("received %s, shutting down", signal.Signals(got[0]).name if got else "a signal")
        return 0
    finally:
        _stop_all([router.proc, *(k.proc for k in kids[:-1])])
        shutil.rmtree(state_dir, ignore_errors=True)
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _supervise(kid: Child, ready: bool, config: EngineConfig) -> int | None:
    p = kid.proc
    if p is not None and p.poll() is not None:
        how = describe_exit(p.returncode)
        kid.proc = None
        if not ready:
            _error(f"the {kid.name} child ({kid.url}) {how} before the topology was ready")
            return 1
        delay = kid.policy.on_crash(time.monotonic())
        if delay is None:
            _error(f"the {kid.name} child ({kid.url}, pid {p.pid}) {how}: more than "
                   f"{config.max_engine_restarts} restarts within {config.restart_window:g}s; giving up")
            return 1
        log.error("the %s child (%s, pid %d) %s; starting it again in %.1fs", kid.name, kid.url, p.pid, how, delay)
        kid.restart_at = time.monotonic() + delay
    if kid.proc is None and kid.restart_at is not None and time.monotonic() >= kid.restart_at:
        kid.restart_at = None
        kid.start()
        log.info("started the %s child again (pid %d)", kid.name, kid.proc.pid if kid.proc else -1)
    return None


def _stop_all(procs: list[subprocess.Popen[bytes] | None]) -> None:
    """SIGTERM each (the router first), wait, SIGKILL what is left, by PID."""
    live = [p for p in procs if p is not None and p.poll() is None]
    for p in live:
        signal_child(p, signal.SIGTERM)
        if p is live[0] and len(live) > 1:
            wait_child(p, 5.0)  # the router ends its streams before the instances go
    t_end = time.monotonic() + STOP_WAIT_S
    for p in live:
        wait_child(p, max(0.0, t_end - time.monotonic()))
    for p in live:
        if p.poll() is None:
            signal_child(p, signal.SIGKILL)
            wait_child(p, 3.0)


def _error(message: str) -> None:
    print(f"fdx serve: error: {message}", file=sys.stderr, flush=True)


def _instance_main() -> int:
    """``python -m fdx.router.topology --config-fd FD NAME PARENT_PID``:
    one managed instance (``fdx serve`` with its role); stops (SIGTERM to
    itself) when the topology process is gone."""
    from fdx.config import make_config
    from fdx.core.ipc import child_args, pid_alive
    from fdx.deploy.launcher import serve

    values, _name, parent_pid = child_args(sys.argv[1:])
    config = make_config(**values)

    def watch() -> None:
        while parent_pid is not None:
            if not pid_alive(parent_pid):
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(1.0)

    threading.Thread(target=watch, daemon=True).start()
    return serve(config)


if __name__ == "__main__":
    sys.exit(_instance_main())


__all__ = ["is_managed", "run_topology", "topology_children"]
