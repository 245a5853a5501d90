"""``fdx serve`` in the foreground: start, supervise and stop the children (API + engine(s)).

Order: make the per-run IPC directory -> start the API process (it binds the
ZMQ sockets at once) -> when the socket files exist, start the engine
process.  The API process reports through files in the run directory
(:class:`fdx.deploy.status_board.StatusBoard`).  Each child gets the config on
an inherited pipe (``--config-fd``), never in argv; the engine's copy has
no API keys, and the launcher blanks a key given on its own command line
(:func:`hide_secrets_in_argv`), so ``ps`` shows no key.

Invariants:

* SIGINT/SIGTERM -> the API process is asked to stop (it sends ``Shutdown``
  to the engine), then every child still alive is terminated and finally
  killed, by PID, within bounded time; the run directory (socket files) is
  removed; exit code 0.  That is the only way to exit 0.
* The engine failing to start the first time -> its one-line message on
  stderr, exit 1.
* The engine dying after start-up (a crash, a kill, or killed by the API
  process because a step hung past ``--step-timeout``) -> the API process
  ends its in-flight requests with a 503 and ``/health`` is 503, while the
  launcher starts a new engine after a backoff (:class:`RestartPolicy`);
  the API serves again when the new engine says ``EngineReady``.  More than
  ``--max-engine-restarts`` crashes within ``--restart-window`` seconds ->
  everything stops, exit 1, so an outside supervisor (systemd, Kubernetes)
  sees it.
* The API process dying -> everything stops, exit 1.
* The deployment (``--deployment``, :mod:`fdx.deploy.deployment`) says
  which engine processes to run: one :class:`EngineSlot` each (its channel
  pair, its config, its own :class:`RestartPolicy`), each supervised and
  restarted as the single engine is; one giving up stops everything, exit
  1.  A deployment may instead run the whole foreground itself (the managed
  splitwise topology: N + M ``fdx serve`` instances and the router).  The
  launcher knows no deployment by name.
"""

from __future__ import annotations

import collections
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import attrs

from fdx.config import EngineConfig
from fdx.core.ipc import IpcPaths
from fdx.deploy.deployment import EngineProcess
from fdx.deploy.status_board import FAILED_FILE, READY_FILE
from fdx.logs import setup_logging

log = logging.getLogger("fdx.serve")


def make_run_dir(base: str | None = None) -> IpcPaths:
    """Create a private per-run directory for the sockets."""
    base = base or os.environ.get("FDX_RUN_DIR") or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    return IpcPaths(tempfile.mkdtemp(prefix=f"fdx-{os.getpid()}-", dir=base))


def write_config(fd: int, config_json: str) -> None:
    """Write the config to the child's end of an inherited pipe and close
    it (the config never travels in argv, where ``ps`` shows it).  A child
    that died before reading it is not an error here: its exit is seen."""
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(config_json.encode("utf-8"))
    except BrokenPipeError:
        pass


SOCKET_WAIT_S = 60.0
API_STOP_S = 6.0
ENGINE_STOP_S = 5.0
TERM_WAIT_S = 3.0
POLL_S = 0.1


class _Stop:
    def __init__(self) -> None:
        self.signal: int | None = None
        self.event = threading.Event()

    def __call__(self, signum: int, _frame: Any) -> None:
        if self.signal is None:
            self.signal = signum
        self.event.set()


@attrs.define
class RestartPolicy:
    """When to restart a crashed engine, and when to give up.

    At most ``max_restarts`` restarts within any ``window`` seconds; the
    delay before restart ``k`` of the window is ``base_delay * 2**(k-1)``,
    capped at ``max_delay``."""

    max_restarts: int
    window: float
    base_delay: float = 0.5
    max_delay: float = 30.0
    crashes: collections.deque[float] = attrs.field(factory=collections.deque)

    def on_crash(self, now: float) -> float | None:
        """Record a crash at ``now``; the delay before the restart, or
        ``None`` to give up."""
        self.crashes.append(now)
        while self.crashes and self.crashes[0] < now - self.window:
            self.crashes.popleft()
        k = len(self.crashes)
        if k > self.max_restarts:
            return None
        return min(self.max_delay, self.base_delay * 2 ** (k - 1))


def is_secret(field: str) -> bool:
    """Config fields that hold credentials (``api_key``, ``control_api_key``...)."""
    return field.endswith("api_key")


def child_config_json(config: EngineConfig, *, engine: bool) -> str:
    """The config for a child; the engine process gets no credentials."""
    values = attrs.asdict(config, recurse=True)
    if engine:
        values = {k: (None if is_secret(k) and v is not None else v) for k, v in values.items()}
    return json.dumps(values)


def child_env() -> dict[str, str]:
    """The launcher's environment without secrets (``FDX_API_KEY`` ...):
    the children get them through the config pipe only."""
    return {k: v for k, v in os.environ.items() if not (k.startswith("FDX_") and is_secret(k[4:].lower()))}


def spawn_child(module: str, cfg_json: str, run_dir: str, parent_pid: int | None = None) -> subprocess.Popen[bytes]:
    """Start ``python -m module --config-fd FD RUN_DIR PARENT_PID``; the
    config goes through the inherited pipe FD."""
    r, w = os.pipe()
    try:
        # own session: a terminal's Ctrl-C reaches only the launcher, which
        # then stops the children in order
        argv = [sys.executable, "-m", module, "--config-fd", str(r), run_dir]
        if parent_pid is not None:
            argv.append(str(parent_pid))
        p = subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL, pass_fds=(r,), env=child_env())
    except BaseException:
        os.close(w)
        raise
    finally:
        os.close(r)
    write_config(w, cfg_json)
    return p


def hide_secrets_in_argv(secrets: list[str]) -> bool:
    """Blank ``secrets`` in this process's own command line, in place, so
    ``ps`` and ``/proc/PID/cmdline`` stop showing them (as MySQL does with
    ``--password``).  Linux only; best effort: True if anything was
    blanked.  The key is visible until this runs: prefer ``FDX_API_KEY``."""
    secrets = [s.encode() for s in secrets if s]
    if not secrets:
        return False
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        # fields 48 and 49 of proc(5) (arg_start, arg_end); fields[0] is field 3
        start, end = int(fields[45]), int(fields[46])
    except (OSError, IndexError, ValueError):
        return False
    if start <= 0 or not 0 < end - start < (1 << 21):
        return False  # hidden by the kernel, or not what we expect: touch nothing
    raw = ctypes.string_at(start, end - start)
    new = bytearray(raw)
    pos = 0
    changed = False
    for arg in raw.split(b"\0"):
        for sec in secrets:
            if arg == sec or arg.endswith(b"=" + sec):
                off = pos + len(arg) - len(sec)
                new[off:off + len(sec)] = b"*" * len(sec)
                changed = True
                break
        pos += len(arg) + 1
    if changed:
        ctypes.memmove(start, bytes(new), len(new))
    return changed


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return None


def _error(message: str) -> None:
    print(f"fdx serve: error: {message}", file=sys.stderr, flush=True)


def describe_exit(code: int | None) -> str:
    """``exited with code 1`` / ``was killed by SIGKILL``."""
    if code is None:
        return "is running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


@attrs.define(eq=False)
class EngineSlot:
    """One supervised engine process: replica ``rank`` (0 without dp), its
    IPC directory, its config and its own :class:`RestartPolicy`."""

    rank: int
    run_dir: str
    config_json: str
    policy: RestartPolicy
    proc: subprocess.Popen[bytes] | None = None
    restart_at: float | None = None
    #: how logs name it (the deployment's :attr:`~fdx.deploy.deployment.EngineProcess.name`)
    name: str = "engine"


def engine_slots(engines: list[EngineProcess]) -> list[EngineSlot]:
    """One supervised slot per engine process of the deployment (replica
    ``rank`` = its position, ``-1`` for a lone engine)."""
    return [EngineSlot(rank if len(engines) > 1 else -1, e.paths.dir, child_config_json(e.config, engine=True),
                       RestartPolicy(e.config.max_engine_restarts, e.config.restart_window), name=e.name)
            for rank, e in enumerate(engines)]


def serve(config: EngineConfig, plugins: Any = None) -> int:
    """Run ``config``'s deployment until a signal; returns the process exit code."""
    from fdx.core.plugins import get_plugins
    from fdx.deploy.deployment import create_deployment

    deployment = create_deployment(config, plugins or get_plugins(config.disable_plugins))
    code = deployment.run()
    if code is not None:  # it ran the whole foreground (e.g. the managed splitwise topology)
        return code
    setup_logging(config.log_level, process="serve")
    hide_secrets_in_argv([getattr(config, f.name) for f in attrs.fields(EngineConfig)
                          if is_secret(f.name) and isinstance(getattr(config, f.name), str)])
    stop = _Stop()
    old: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            old[sig] = signal.signal(sig, stop)
    paths = make_run_dir(config.ipc_dir)
    api_json = child_config_json(config, engine=False)
    api: subprocess.Popen[bytes] | None = None
    slots: list[EngineSlot] = []
    ready = False
    try:
        slots = engine_slots(deployment.engines(paths))
        api = spawn_child("fdx.server.api_proc", api_json, paths.dir, os.getpid())
        sockets = [os.path.join(s.run_dir, n) for s in slots for n in ("in.sock", "out.sock")]
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
        for slot in slots:
            slot.proc = spawn_child("fdx.core.engine_proc", slot.config_json, slot.run_dir, os.getpid())
        log.info("started API server (pid %d) and %s (pid %s); run dir %s", api.pid,
                 "engine" if len(slots) == 1 else f"{len(slots)} engines",
                 ", ".join(str(s.proc.pid) for s in slots if s.proc), paths.dir)
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
            for slot in slots:
                code = _supervise(slot, ready, failed_path, config)
                if code is not None:
                    return code
            stop.event.wait(POLL_S)
        log.info("received %s, shutting down", signal.Signals(stop.signal).name)
        return 0
    finally:
        _stop_children(api, [s.proc for s in slots], ready)
        paths.cleanup()
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _supervise(slot: EngineSlot, ready: bool, failed_path: str, config: EngineConfig) -> int | None:
    """One look at one engine: note its death, restart it when due; an
    exit code when ``fdx serve`` must stop."""
    engine = slot.proc
    if engine is not None and engine.poll() is not None:
        if not ready:
            # the API process may still be writing the engine's message
            t_end = time.monotonic() + 2.0
            msg = None
            while time.monotonic() < t_end and not (msg := _read(failed_path)):
                time.sleep(0.05)
            _error(msg or f"{slot.name} process exited with code {engine.returncode} before it was ready")
            return 1
        how = describe_exit(engine.returncode)
        delay = slot.policy.on_crash(time.monotonic())
        slot.proc = None
        if delay is None:
            n = len(slot.policy.crashes)
            _error(f"the {slot.name} process {engine.pid} {how}: {n} engine crash{'es' if n != 1 else ''} "
                   f"within {config.restart_window:g}s (--max-engine-restarts "
                   f"{config.max_engine_restarts}); giving up")
            return 1
        log.error("%s process %d %s; starting a new engine in %.1fs (restart %d of at most %d "
                  "within %gs)", slot.name, engine.pid, how, delay, len(slot.policy.crashes),
                  config.max_engine_restarts, config.restart_window)
        slot.restart_at = time.monotonic() + delay
    if slot.proc is None and slot.restart_at is not None and time.monotonic() >= slot.restart_at:
        slot.restart_at = None
        slot.proc = spawn_child("fdx.core.engine_proc", slot.config_json, slot.run_dir, os.getpid())
        log.info("started a new %s (pid %d)", slot.name, slot.proc.pid)
    return None


def _stop_children(api: subprocess.Popen[bytes] | None, engines: list[subprocess.Popen[bytes] | None],
                   ready: bool) -> None:
    """API first (its shutdown sends Shutdown to the engines), then the
    engines; SIGTERM, then SIGKILL, each bounded in time."""
    live = [e for e in engines if e is not None]
    for engine in live:
        if not ready and engine.poll() is None:
            # failed engines exit by themselves; one still loading reads no Shutdown
            if not wait_child(engine, 1.0):
                signal_child(engine, signal.SIGTERM)
    if api is not None and api.poll() is None:
        signal_child(api, signal.SIGTERM)
        wait_child(api, API_STOP_S)
    t_end = time.monotonic() + ENGINE_STOP_S
    for engine in live:
        if engine.poll() is None:
            wait_child(engine, max(0.0, t_end - time.monotonic()))
    for p in (api, *live):
        if p is not None and p.poll() is None:
            signal_child(p, signal.SIGTERM)
    for p in (api, *live):
        if p is not None and p.poll() is None and not wait_child(p, TERM_WAIT_S):
            signal_child(p, signal.SIGKILL)
            wait_child(p, TERM_WAIT_S)


def signal_child(p: subprocess.Popen[bytes], sig: int) -> None:
    """Send ``sig`` to the child by PID; one already gone is fine."""
    try:
        os.kill(p.pid, sig)
    except ProcessLookupError:
        pass


def wait_child(p: subprocess.Popen[bytes], timeout: float) -> bool:
    """Wait up to ``timeout`` s for the child to exit; True when it did."""
    try:
        p.wait(timeout)
        return True
    except subprocess.TimeoutExpired:
        return False
