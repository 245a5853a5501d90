"""``--cache-backend mooncake``: KV blocks in a Mooncake distributed store
(``mooncake.store.MooncakeDistributedStore`` over TCP, no RDMA needed).

Configuration, first match wins: ``--cache-backend-config`` options, then
environment variables, then the JSON file named by ``config_path`` /
``MOONCAKE_CONFIG_PATH`` (the FastDeploy/vLLM format), then defaults:

=====================  ============================  =====================  ==================
option                 environment variable          JSON file key          default
=====================  ============================  =====================  ==================
``master``             ``MOONCAKE_MASTER``           master_server_address  ``127.0.0.1:50051``
``local_hostname``     ``MOONCAKE_LOCAL_HOSTNAME``   local_hostname         ``127.0.0.1``
``metadata_server``    ``MOONCAKE_METADATA_SERVER``  metadata_server        ``P2PHANDSHAKE``
``protocol``           ``MOONCAKE_PROTOCOL``         protocol               ``tcp``
``device_name``        ``MOONCAKE_DEVICE_NAME``      device_name            ``""``
``global_segment_size``  ``MOONCAKE_GLOBAL_SEGMENT_SIZE``  global_segment_size  ``256M``
``local_buffer_size``  ``MOONCAKE_LOCAL_BUFFER_SIZE``  local_buffer_size    ``128M``
``timeout``            ``MOONCAKE_TIMEOUT``          --                     ``0.5`` (seconds)
=====================  ============================  =====================  ==================

No master configured (no ``master`` option, no ``MOONCAKE_MASTER``, none in
the config file): ``fdx serve`` (and ``fdx.LLM``) start a ``mooncake_master``
of their own (from the Python's ``bin`` folder, else ``PATH``) on a free
loopback port, as a managed child (:class:`ManagedMaster`, through the
``fdx_adjust_config`` hook, which then sets ``master``): it is stopped by
PID when the launcher exits (SIGTERM, SIGINT, a normal exit) and dies with
it otherwise (Linux parent-death signal).  An explicit ``master`` points at
a shared master and starts nothing.

``global_segment_size`` is the memory this engine contributes to the pool.
Objects live in the segment that received them, so they vanish when the
contributing process exits: to share blocks across engine restarts, run a
standalone ``mooncake_client`` pool and give the engines ``0``.

Invariants: a missing key (Mooncake answers ``b''``) is a miss; a master
that is unreachable raises :class:`BackendUnavailable` within ``timeout``
(the client library itself retries for seconds, so every call is preceded
by a TCP probe of the master, about 30 us on loopback); a failed put raises.
Batches are split so each transfer fits the local buffer.
"""

from __future__ import annotations

import atexit
import json
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
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from fdx.core.errors import ConfigError
from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import CacheBackend
from fdx.plugins.cache_backends.backend_options import (
    BackendUnavailable,
    Counters,
    check_options,
    float_option,
    size_option,
)

#: option -> (environment variable, JSON file key, default)
SETTINGS: dict[str, tuple[str, str | None, Any]] = {
    "master": ("MOONCAKE_MASTER", "master_server_address", "127.0.0.1:50051"),
    "local_hostname": ("MOONCAKE_LOCAL_HOSTNAME", "local_hostname", "127.0.0.1"),
    "metadata_server": ("MOONCAKE_METADATA_SERVER", "metadata_server", "P2PHANDSHAKE"),
    "protocol": ("MOONCAKE_PROTOCOL", "protocol", "tcp"),
    "device_name": ("MOONCAKE_DEVICE_NAME", "device_name", ""),
    "global_segment_size": ("MOONCAKE_GLOBAL_SEGMENT_SIZE", "global_segment_size", "256M"),
    "local_buffer_size": ("MOONCAKE_LOCAL_BUFFER_SIZE", "local_buffer_size", "128M"),
    "timeout": ("MOONCAKE_TIMEOUT", None, 0.5),
}


class MooncakeBackend(CacheBackend):
    name = "mooncake"

    def __init__(
        self,
        master: str,
        *,
        local_hostname: str = "127.0.0.1",
        metadata_server: str = "P2PHANDSHAKE",
        protocol: str = "tcp",
        device_name: str = "",
        global_segment_size: int = 256 << 20,
        local_buffer_size: int = 128 << 20,
        timeout: float = 0.5,
    ) -> None:
        host, _, port = master.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"mooncake master must be HOST:PORT, got {master!r}")
        self.master = master
        self._master_addr = (host, int(port))
        self._setup_args = (local_hostname, metadata_server, global_segment_size, local_buffer_size,
                            protocol, device_name, master)
        self.local_buffer_size = local_buffer_size
        self.timeout = timeout
        self._store: Any = None
        self._lock = threading.Lock()
        # calls in flight; close() waits for them (closing the native store
        # under a running call crashes the process)
        self._cond = threading.Condition()
        self._inflight = 0
        self._closed = False
        self._max_value = 0
        self._counters = Counters()

    # ------------------------------------------------------------------
    def _probe(self) -> None:
        """Raise fast when the master does not accept connections."""
        try:
            socket.create_connection(self._master_addr, timeout=self.timeout).close()
        except OSError as exc:
            raise BackendUnavailable(f"mooncake master {self.master} unreachable: {exc}") from None

    def _enter(self) -> Any:
        """Register a call in flight and return the store (raises when
        closed or unreachable)."""
        with self._cond:
            if self._closed:
                raise BackendUnavailable("mooncake backend is closed")
            self._inflight += 1
        try:
            return self._get_store()
        except BaseException:
            self._exit()
            raise

    def _exit(self) -> None:
        with self._cond:
            self._inflight -= 1
            self._cond.notify_all()

    @contextmanager
    def _call(self) -> Iterator[Any]:
        """A data call in flight: the store, with failures to reach it
        counted as backend errors."""
        try:
            store = self._enter()
        except Exception as exc:
            raise self._fail(exc) from None
        try:
            yield store
        finally:
            self._exit()

    def _get_store(self) -> Any:
        self._probe()
        store = self._store
        if store is not None:
            return store
        with self._lock:
            if self._store is None:
                os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
                from mooncake.store import MooncakeDistributedStore

                s = MooncakeDistributedStore()
                rc = s.setup(*self._setup_args)
                if rc != 0:
                    raise BackendUnavailable(f"mooncake setup against master {self.master} failed (rc={rc})")
                self._store = s
            return self._store

    def _budget(self) -> int:
        """Bytes one transfer may move (half the registered local buffer)."""
        return max(1, self.local_buffer_size // 2)

    def _fail(self, exc_or_msg: Exception | str) -> BaseException:
        self._counters.add(errors=1)
        return exc_or_msg if isinstance(exc_or_msg, Exception) else RuntimeError(exc_or_msg)

    # ------------------------------------------------------------------
    def get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        with self._call() as store:
            if not self._max_value:  # first get in this process: size the chunks from one value
                size = int(store.get_size(keys[0]))
                if size > 0:
                    self._max_value = size
            per = max(1, self._budget() // self._max_value) if self._max_value else 16
            out: list[bytes | None] = []
            for i in range(0, len(keys), per):
                part = list(keys[i : i + per])
                vals = store.get_batch(part)
                if len(vals) != len(part):
                    raise self._fail(f"mooncake get_batch returned {len(vals)} values for {len(part)} keys")
                out.extend(v if v else None for v in vals)
        hits = sum(1 for v in out if v is not None)
        if hits:
            self._max_value = max(self._max_value, max(len(v) for v in out if v is not None))
        self._counters.add(hits=hits, misses=len(keys) - hits, bytes_read=sum(len(v) for v in out if v))
        return out

    def put_batch(self, items: Sequence[tuple[str, bytes]]) -> None:
        if not items:
            return
        with self._call() as store:
            budget = self._budget()
            i = 0
            while i < len(items):
                keys: list[str] = []
                vals: list[bytes] = []
                nbytes = 0
                while i < len(items) and (not keys or nbytes + len(items[i][1]) <= budget):
                    keys.append(items[i][0])
                    vals.append(items[i][1])
                    nbytes += len(items[i][1])
                    i += 1
                rc = store.put_batch(keys, vals)
                if rc != 0:
                    raise self._fail(f"mooncake put_batch of {len(keys)} values failed (rc={rc})")
                self._max_value = max(self._max_value, max(len(v) for v in vals))
        self._counters.add(puts=len(items), bytes_written=sum(len(v) for _, v in items))

    def exists_batch(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        with self._call() as store:
            res = store.batch_is_exist(list(keys))
        if len(res) != len(keys) or any(r < 0 for r in res):
            raise self._fail(f"mooncake batch_is_exist failed: {sorted(set(r for r in res if r < 0))}")
        return [r == 1 for r in res]

    def stats(self) -> dict[str, float]:
        return self._counters.snapshot()

    def health(self) -> bool:
        try:
            store = self._enter()
        except Exception:  # noqa: BLE001 - unhealthy is the answer
            return False
        try:
            return int(store.health_check()) == 0
        except Exception:  # noqa: BLE001
            return False
        finally:
            self._exit()

    def clear(self, prefix: str = "") -> None:
        """Remove every object (or those whose key starts with ``prefix``)."""
        store = self._enter()
        try:
            if prefix:
                store.remove_by_regex("^" + "".join(c if c.isalnum() or c == "_" else "\\" + c for c in prefix), True)
            else:
                store.remove_all(True)
        finally:
            self._exit()

    def close(self, timeout: float = 10.0) -> None:
        """Refuse new calls, wait (bounded) for those in flight, then close
        the native client."""
        with self._cond:
            self._closed = True
            if not self._cond.wait_for(lambda: self._inflight == 0, timeout):
                return  # a call is stuck in the library: leak the client rather than crash
        with self._lock:
            store, self._store = self._store, None
        if store is not None:
            try:
                store.close()
            except Exception:  # noqa: BLE001
                pass


def resolve_settings(options: dict[str, Any] | None) -> dict[str, Any]:
    """Options > environment > JSON config file > defaults (see module doc)."""
    opts = check_options("mooncake", options, set(SETTINGS) | {"config_path"})
    path = opts.pop("config_path", None) or os.environ.get("MOONCAKE_CONFIG_PATH")
    file_cfg: dict[str, Any] = {}
    if path:
        try:
            with open(path) as f:
                file_cfg = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"mooncake config file {path!r} unreadable: {exc}") from None
        if not isinstance(file_cfg, dict):
            raise ConfigError(f"mooncake config file {path!r} must hold a JSON object")
    out: dict[str, Any] = {}
    for name, (env, file_key, default) in SETTINGS.items():
        if name in opts:
            out[name] = opts[name]
        elif os.environ.get(env):
            out[name] = os.environ[env]
        elif file_key and file_key in file_cfg:
            out[name] = file_cfg[file_key]
        else:
            out[name] = default
    for name in ("global_segment_size", "local_buffer_size"):
        out[name] = size_option("mooncake", name, out[name])
    out["timeout"] = float_option("mooncake", "timeout", out["timeout"])
    return out


def create(options: dict[str, Any] | None = None) -> MooncakeBackend:
    s = resolve_settings(options)
    try:
        import mooncake.store  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - ImportError or a missing shared library
        raise ConfigError(
            f"--cache-backend mooncake needs mooncake-transfer-engine-non-cuda (pip install 'fdx[mooncake]') "
            f"and libibverbs1: {exc}"
        ) from None
    return MooncakeBackend(s.pop("master"), **s)


log = logging.getLogger("fdx.mooncake")


def master_configured(options: dict[str, Any] | None) -> bool:
    """Whether a master address is given (option, environment or config file)."""
    opts = dict(options or {})
    if opts.get("master") or os.environ.get("MOONCAKE_MASTER"):
        return True
    path = opts.get("config_path") or os.environ.get("MOONCAKE_CONFIG_PATH")
    if path:
        try:
            with open(path) as f:
                return bool(json.load(f).get("master_server_address"))
        except (OSError, ValueError, AttributeError):
            return False  # resolve_settings reports the unreadable file
    return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:  # runs in the child before exec (Linux: SIGTERM when the parent dies)
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class ManagedMaster:
    """A ``mooncake_master`` child on free loopback ports, stopped by PID."""

    def __init__(self, binary: str, *, timeout: float = 20.0) -> None:
        self.port = _free_port()
        self.metrics_port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(prefix="fdx-mooncake-master-", suffix=".log", delete=False)
        cmd = [binary, "--rpc_address=127.0.0.1", f"--rpc_port={self.port}", "--metrics_host=127.0.0.1",
               f"--metrics_port={self.metrics_port}"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "WARNING")},
                                     preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise ConfigError(f"mooncake_master exited with code {self.proc.returncode} at start-up: "
                                  f"{self.log_tail()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise ConfigError(f"mooncake_master did not listen on {self.address} within {timeout:g}s") \
                        from None
                time.sleep(0.05)
        log.info("started mooncake_master (pid %d) on %s for --cache-backend mooncake", self.proc.pid, self.address)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, n: int = 2000) -> str:
        try:
            with open(self._log.name, errors="replace") as f:
                return f.read()[-n:].strip()
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM by PID, then SIGKILL after 5 s; idempotent."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        try:
            os.unlink(self._log.name)
        except OSError:
            pass


def master_binary() -> str | None:
    """``mooncake_master`` next to the running Python, else on ``PATH``."""
    here = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    return here if os.access(here, os.X_OK) else shutil.which("mooncake_master")


#: the masters this process started (one per distinct configuration)
MANAGED: list[ManagedMaster] = []


@hookimpl
def fdx_adjust_config(config: Any, args: Any) -> dict[str, Any] | None:
    """``--cache-backend mooncake`` without a master: start a managed one."""
    if getattr(config, "cache_backend", None) != "mooncake":
        return None
    opts = dict(config.cache_backend_config or {})
    if master_configured(opts):
        return None
    binary = master_binary()
    if binary is None:
        raise ConfigError("--cache-backend mooncake with no master configured needs the mooncake_master program "
                          "(pip install 'fdx[mooncake]'), or give one: --cache-backend-config "
                          "'{\"master\": \"HOST:PORT\"}'")
    master = ManagedMaster(binary)
    MANAGED.append(master)
    return {"cache_backend_config": {**opts, "master": master.address}}


@hookimpl
def fdx_register_cache_backends(register: Any) -> None:
    register("mooncake", lambda options=None: create(options), description="a Mooncake distributed store (TCP)")
