"""Real KV-store servers for tests and benches: redis-server, mooncake_master
and a standalone mooncake_client memory pool.

Every server binds 127.0.0.1 on a free port, is started as a child process
(never daemonized) and is stopped by its PID -- never by name.  Each helper
is a context manager; :meth:`Service.kill` simulates a crash mid-run.

Binaries: ``redis-server`` from Debian (``apt-get install redis-server``) and
``mooncake_master`` / ``mooncake_client`` from the PyPI wheel
``mooncake-transfer-engine-non-cuda`` (installed next to the Python that runs
the tests).  :func:`have_redis` / :func:`have_mooncake` tell whether they
exist, so tests can skip with a clear reason instead of failing.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import IO, Any

HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port that was free on loopback a moment ago."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _bin(name: str) -> str | None:
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    return shutil.which(name)


def have_redis() -> bool:
    return _bin("redis-server") is not None


def have_mooncake() -> bool:
    if _bin("mooncake_master") is None:
        return False
    try:
        import mooncake.store  # noqa: F401
    except Exception:  # noqa: BLE001 - e.g. libibverbs missing
        return False
    return True


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the test process dies, so a
    crashed test run never leaves a server behind (Linux ``PR_SET_PDEATHSIG``;
    it fires when the *thread* that started the service exits: start services
    from the main thread)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.2):
            return True
    except OSError:
        return False


class Service:
    """One child process; ``stop()`` is SIGTERM then SIGKILL, by PID."""

    name = "service"

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.workdir = Path(tempfile.mkdtemp(prefix=f"fdx-{self.name}-"))
        self.log_path = self.workdir / f"{self.name}.log"
        self._log: IO[bytes] | None = None

    def _spawn(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})}, cwd=self.workdir, preexec_fn=_die_with_parent,
        )

    def _wait_ready(self, check: Any, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.log_tail()}")
            if check():
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.name} not ready after {timeout}s: {self.log_tail()}")

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """Crash it (SIGKILL) and reap it."""
        if self.alive():
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.alive():
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self._log is not None:
            self._log.close()
            self._log = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Service:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


class RedisServer(Service):
    """``redis-server`` in the foreground, no persistence, LRU-capped."""

    name = "redis"

    def __init__(self, port: int | None = None, maxmemory: str = "2gb") -> None:
        super().__init__()
        self.port = port or free_port()
        self.maxmemory = maxmemory
        self.start()

    def start(self) -> None:
        binary = _bin("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found (apt-get install -y redis-server)")
        self._spawn([
            binary, "--port", str(self.port), "--bind", HOST, "--save", "", "--appendonly", "no",
            "--daemonize", "no", "--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru",
            "--protected-mode", "yes", "--dir", str(self.workdir),
        ])
        self._wait_ready(lambda: _port_open(self.port))

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"


class MooncakeMaster(Service):
    """``mooncake_master`` (RPC + HTTP metrics/health) on free ports."""

    name = "mooncake-master"

    def __init__(self, port: int | None = None, lease_ttl_ms: int = 500) -> None:
        super().__init__()
        self.port = port or free_port()
        self.metrics_port = free_port()
        self.lease_ttl_ms = lease_ttl_ms
        self.start()

    def start(self) -> None:
        binary = _bin("mooncake_master")
        if binary is None:
            raise RuntimeError("mooncake_master not found (pip install mooncake-transfer-engine-non-cuda)")
        self._spawn(
            [
                binary, f"--rpc_address={HOST}", f"--rpc_port={self.port}", f"--metrics_host={HOST}",
                f"--metrics_port={self.metrics_port}", f"--default_kv_lease_ttl={self.lease_ttl_ms}",
            ],
            env={"MC_LOG_LEVEL": "WARNING"},
        )
        self._wait_ready(self._healthy)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{HOST}:{self.metrics_port}/health", timeout=0.5) as r:
                return r.status == 200
        except OSError:
            return False

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def metric(self, name: str) -> float:
        """One unlabelled sample from the master's Prometheus endpoint (0 if absent)."""
        with urllib.request.urlopen(f"http://{HOST}:{self.metrics_port}/metrics", timeout=2) as r:
            text = r.read().decode()
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def capacity(self) -> int:
        """Bytes of memory segments mounted in the store."""
        return int(self.metric("master_total_capacity_bytes"))

    def key_count(self) -> int:
        return int(self.metric("master_key_count"))


class MooncakePool(Service):
    """A standalone ``mooncake_client`` contributing a memory segment, so
    objects outlive the engine processes that put them."""

    name = "mooncake-pool"

    def __init__(self, master: MooncakeMaster, size: str = "1 GB") -> None:
        super().__init__()
        self.master = master
        self.port = free_port()
        self.size = size
        self.start()

    def start(self) -> None:
        binary = _bin("mooncake_client")
        if binary is None:
            raise RuntimeError("mooncake_client not found (pip install mooncake-transfer-engine-non-cuda)")
        self._spawn(
            [
                binary, f"--host={HOST}", f"--port={self.port}", f"--global_segment_size={self.size}",
                "--metadata_server=P2PHANDSHAKE", f"--master_server_address={self.master.address}",
                "--protocol=tcp",
            ],
            env={"MC_LOG_LEVEL": "WARNING"},
        )
        before = self.master.capacity()
        # ready once the master counts this pool's segment
        self._wait_ready(lambda: _port_open(self.port) and self.master.capacity() > before)
