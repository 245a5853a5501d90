"""The tensor-parallel rank group: rank 0 is the engine's model runner, ranks
1..N-1 are worker processes (:mod:`fdx.parallel.worker`) it starts.

Start-up (rank 0, :meth:`RankGroup.start`): create the shared-memory segment,
bind two ZMQ sockets (commands out, one per worker; replies in), start the
workers, send each the engine config.  Every rank then loads only its shard
straight from the checkpoint; rank 0 shows one progress bar summing all
ranks' layers and waits for every worker's ``ready`` (or its error, or its
exit, or ``--tp-start-timeout``), naming the rank that failed.

Each step rank 0 sends the step's :class:`~fdx.model.runner_base.StepLayout`
to every worker, then all ranks run the same forward; the collectives
(:mod:`fdx.parallel.shm_comm`) keep them in lock step, and only rank 0
samples.  Control calls (sleep/wakeup, update_weights, KV block I/O) go to
every rank (:meth:`RankGroup.call`), in the same order as the steps.

Faults: a worker that exits, stops or fails breaks the group
(:class:`~fdx.parallel.shm_comm.GroupBroken`, raised by the next collective
within ``timeout``).  A broken group cannot be repaired in place: rank 0
ends its process (:meth:`RankGroup.fatal`), the supervisor restarts the
engine and with it the whole group, and in-flight requests get the 503 of
any engine crash.  Workers die with rank 0 (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import attrs

from fdx.core.errors import FdxError, ModelLoadError
from fdx.parallel.shm_comm import GroupBroken, ShmComm

log = logging.getLogger("fdx.parallel")


@attrs.frozen
class RankLink:
    """What a worker needs to join its group (passed on its command line)."""

    rank: int
    world: int
    shm_name: str
    slot_elems: int
    #: ZMQ addresses: this worker's command socket (rank 0 binds), the replies (rank 0 binds)
    cmd_addr: str
    reply_addr: str
    #: seconds a collective waits for a peer before the group counts as broken
    timeout: float
    #: compute threads of this rank
    threads: int

    def to_argv(self) -> list[str]:
        return [f"{f.name}={getattr(self, f.name)}" for f in attrs.fields(RankLink)]

    @classmethod
    def from_argv(cls, argv: list[str]) -> RankLink:
        kv = dict(a.split("=", 1) for a in argv)
        conv = {f.name: f.type for f in attrs.fields(cls)}
        casts: dict[Any, Callable[[str], Any]] = {"int": int, "float": float, "str": str, int: int, float: float, str: str}
        return cls(**{k: casts[conv[k]](v) for k, v in kv.items()})


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent (rank 0) exits."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class RankGroup:
    """Rank 0's side of the group (see the module docstring)."""

    def __init__(self, world: int, timeout: float, start_timeout: float) -> None:
        import zmq

        self.world = world
        self.timeout = timeout
        self.start_timeout = start_timeout
        self.comm = ShmComm.create(world, timeout)
        self._dir = tempfile.mkdtemp(prefix="fdx-tp-")
        self._ctx = zmq.Context.instance()
        self._reply = self._ctx.socket(zmq.PULL)
        self._reply_addr = f"ipc://{self._dir}/reply"
        self._reply.bind(self._reply_addr)
        self._cmd: list[Any] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.pids: list[int] = [os.getpid()]
        self._ready: set[int] = set()
        self._bar: Any = None
        self.layers_loaded = 0

    # ------------------------------------------------------------------ start-up

    @classmethod
    def start(cls, config: Any, threads: int) -> RankGroup:
        """Start workers 1..N-1 and send them ``config`` (they start loading at once)."""
        import zmq

        world = int(config.tensor_parallel_size)
        g = cls(world, timeout=0.8 * float(config.step_timeout), start_timeout=float(config.tp_start_timeout))
        try:
            for r in range(1, world):
                sock = g._ctx.socket(zmq.PUSH)
                addr = f"ipc://{g._dir}/cmd-{r}"
                sock.bind(addr)
                g._cmd.append(sock)
                link = RankLink(r, world, g.comm.name, g.comm.slot_elems, addr, g._reply_addr, g.timeout, threads)
                env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
                p = subprocess.Popen([sys.executable, "-m", "fdx.parallel.worker", *link.to_argv()], env=env)
                g.procs.append(p)
                g.pids.append(p.pid)
                sock.send(pickle.dumps(("init", config)))
        except BaseException:
            g.close()
            raise
        return g

    def start_progress(self, num_layers: int, name: str) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(total=num_layers * self.world, desc=f"loading {name} ({self.world} ranks)",
                         unit="layer", leave=False)

    def on_layer(self) -> None:
        """Rank 0 loaded one layer of its shard: count it, and the workers' news."""
        self._advance(1)
        self._drain(0)

    def _advance(self, n: int) -> None:
        self.layers_loaded += n
        if self._bar is not None:
            self._bar.update(n)

    def _drain(self, wait_ms: int) -> None:
        """Handle the start-up messages that have arrived (waiting up to ``wait_ms``)."""
        while self._reply.poll(wait_ms):
            wait_ms = 0
            kind, rank, payload = pickle.loads(self._reply.recv())
            if kind == "progress":
                self._advance(int(payload))
            elif kind == "ready":
                self._ready.add(rank)
            elif kind == "error":
                raise ModelLoadError(f"tensor-parallel rank {rank} failed to start: {payload}")
            else:
                raise FdxError(f"tensor-parallel rank {rank}: unexpected {kind!r} message during start-up")

    def wait_ready(self) -> None:
        """Block until every worker said ``ready``; a worker's error, exit or
        silence past the start timeout is a :class:`ModelLoadError` naming it."""
        deadline = time.monotonic() + self.start_timeout
        try:
            while len(self._ready) < self.world - 1:
                self._drain(200)
                self._check_alive()
                if time.monotonic() > deadline:
                    missing = sorted(set(range(1, self.world)) - self._ready)
                    raise ModelLoadError(f"tensor-parallel rank {missing[0]} (pid {self.pids[missing[0]]}) was not "
                                         f"ready within --tp-start-timeout {self.start_timeout:g} s")
        finally:
            if self._bar is not None:
                self._bar.close()
                self._bar = None
        self.comm.unlink()  # every rank has mapped it: nothing is left in /dev/shm whatever happens next
        log.info("tensor-parallel group of %d ranks ready (pids %s, backend %s)", self.world,
                 " ".join(map(str, self.pids)), self.comm.backend)

    def _check_alive(self) -> None:
        for r, p in enumerate(self.procs, start=1):
            rc = p.poll()
            if rc is not None:
                raise GroupBroken(f"tensor-parallel rank {r} (pid {p.pid}) exited with status {rc}")

    # ------------------------------------------------------------------ steps and calls

    def send(self, msg: tuple[Any, ...]) -> None:
        """Send ``msg`` to every worker (no reply)."""
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for sock in self._cmd:
            sock.send(data, copy=False)

    def send_each(self, msgs: list[tuple[Any, ...]]) -> None:
        """Worker ``r`` gets ``msgs[r - 1]``."""
        for sock, msg in zip(self._cmd, msgs):
            sock.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL), copy=False)

    def collect(self, what: str) -> list[Any]:
        """Every worker's reply to the last call, in rank order (1..N-1); a
        worker's error is an :class:`FdxError` naming it."""
        got: dict[int, Any] = {}
        errors: list[str] = []
        deadline = time.monotonic() + self.timeout
        while len(got) + len(errors) < self.world - 1:
            if not self._reply.poll(100):
                self._check_alive()
                if time.monotonic() > deadline:
                    raise GroupBroken(f"tensor-parallel ranks did not answer {what} within {self.timeout:g} s")
                continue
            kind, rank, payload = pickle.loads(self._reply.recv())
            if kind == "result":
                got[rank] = payload
            elif kind == "error":
                errors.append(f"rank {rank}: {payload}")
        if errors:
            raise FdxError(f"{what} failed on tensor-parallel {'; '.join(errors)}")
        return [got[r] for r in range(1, self.world)]

    def fatal(self, exc: BaseException) -> None:
        """The group is broken: end rank 0's process (the supervisor restarts the group)."""
        why = self.comm.last_error() or (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        log.critical("%s; ending the engine so the supervisor restarts the whole tensor-parallel group", why)
        self.comm.abort()
        self.kill()
        logging.shutdown()
        os._exit(70)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass

    def close(self) -> None:
        """Stop the workers (they exit on ``stop``; killed if they do not)."""
        try:
            self.send(("stop",))
        except Exception:  # noqa: BLE001 - closing goes on
            pass
        deadline = time.monotonic() + 5
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
        self.comm.unlink()
        for s in self._cmd:
            s.close(0)
        self._reply.close(0)
        self.comm.close()
