"""The tensor-parallel rank group: rank 0 is the engine's model runner, ranks
1..N-1 are worker processes (:mod:`fdx.parallel.worker`) it starts.

Start-up (rank 0, :meth:`RankGroup.start`): create the shared-memory segment
(``shm``), bind one ZMQ ROUTER (ipc on one host; tcp at ``--master-port``
across ``--nnodes``), start this node's workers; the other nodes' agents
(:mod:`fdx.parallel.node`) say hello and are told how to start theirs.  Each
worker joins with its rank and the group's id (a worker of an older group is
ignored) and is sent the engine config; ``gloo`` or ``nccl``: every rank
then joins Paddle's group (:mod:`fdx.parallel.gloo_comm`).  Every rank then loads only its shard
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
any engine crash.  Workers die with their parent (``PR_SET_PDEATHSIG``), and
with rank 0 when its control connection drops (other hosts).
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
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
    #: ``shm``, ``gloo`` or ``nccl`` (:mod:`fdx.parallel.gloo_comm`)
    backend: str
    #: shm: the segment's name and floats per slot
    shm_name: str
    slot_elems: int
    #: rank 0's control socket (a ZMQ ROUTER: ipc on one host, tcp across hosts)
    ctrl_addr: str
    #: the group's id: a worker of an older group (rank 0 restarted) is ignored
    group_id: str
    #: gloo, nccl: the group's TCP store, ``HOST:PORT``
    store: str
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

    def spawn(self, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start this rank's worker process (``python -m fdx.parallel.worker``)."""
        env = dict(env or os.environ, OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads))
        return subprocess.Popen([sys.executable, "-m", "fdx.parallel.worker", *self.to_argv()], env=env)


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent (rank 0, or its node's agent) exits."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def worker_comm(link: RankLink, device_id: int | None = None) -> Any:
    """A worker's collectives: the group's shm segment, or its place in Paddle's
    gloo or nccl group (``device_id``: nccl's device of this rank)."""
    if link.backend != "shm":
        from fdx.parallel.gloo_comm import paddle_comm

        return paddle_comm(link.backend).join(link.rank, link.world, link.store, link.timeout, device_id)
    return ShmComm.attach(link.shm_name, link.rank, link.world, link.slot_elems, link.timeout)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RankGroup:
    """Rank 0's side of the group (see the module docstring)."""

    def __init__(self, config: Any) -> None:
        import zmq

        self.world = world = int(config.tensor_parallel_size)
        self.timeout = 0.8 * float(config.step_timeout)
        self.start_timeout = float(config.tp_start_timeout)
        b = config.tp_backend  # auto (resolved by make_config): resolved here too
        self.backend = b if b in ("gloo", "nccl") else "gloo" if config.nnodes > 1 else "shm"
        self.nnodes, self.per_node = int(config.nnodes), int(config.ranks_per_node)
        self.group_id = uuid.uuid4().hex[:12]
        self._dir = tempfile.mkdtemp(prefix="fdx-tp-")
        self._ctx = zmq.Context.instance()
        self._ctrl = self._ctx.socket(zmq.ROUTER)
        self._ctrl.setsockopt(zmq.LINGER, 0)
        self._ctrl.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone worker fails instead of vanishing
        if self.nnodes > 1:
            self._ctrl.bind(f"tcp://{config.master_addr}:{config.master_port}")  # node 0's own address
            self.ctrl_addr = f"tcp://{config.master_addr}:{config.master_port}"
            self.store = f"{config.master_addr}:{int(config.master_port) + 1}"
        else:
            self.ctrl_addr = f"ipc://{self._dir}/ctrl"
            self._ctrl.bind(self.ctrl_addr)
            self.store = f"127.0.0.1:{_free_port()}" if self.backend != "shm" else ""
        self.comm: Any = ShmComm.create(world, self.timeout) if self.backend == "shm" else None
        #: rank -> its routing id on the control socket, and its pid
        self._ids: dict[int, bytes] = {}
        self._rank_of: dict[bytes, int] = {}
        self._pid: dict[int, int] = {0: os.getpid()}
        self._config: Any = None
        self.procs: list[subprocess.Popen[bytes]] = []
        self._ready: set[int] = set()
        self._bar: Any = None
        self.layers_loaded = 0

    @property
    def pids(self) -> list[int]:
        """The ranks' pids in rank order (0 for a rank not joined yet)."""
        return [self._pid.get(r, 0) for r in range(self.world)]

    def link(self, rank: int, threads: int) -> RankLink:
        return RankLink(rank, self.world, self.backend, self.comm.name if self.backend == "shm" else "",
                        self.comm.slot_elems if self.backend == "shm" else 0, self.ctrl_addr, self.group_id,
                        self.store, self.timeout, threads)

    # ------------------------------------------------------------------ start-up

    @classmethod
    def start(cls, config: Any, threads: int, device_id: int | None = None) -> RankGroup:
        """Start this node's workers (ranks 1..per-node-1), let the other nodes'
        agents start theirs, send every rank ``config`` as it joins (they start
        loading at once); gloo, nccl: join the group's collectives (nccl on
        device ``device_id``)."""
        g = cls(config)
        g._config = config
        try:
            for r in range(1, g.per_node):
                p = g.link(r, threads).spawn()
                g.procs.append(p)
                g._pid[r] = p.pid
            deadline = time.monotonic() + g.start_timeout
            while len(g._ids) < g.world - 1:
                g._drain(200)
                g._check_alive()
                if time.monotonic() > deadline:
                    missing = sorted(set(range(1, g.world)) - set(g._ids))
                    raise ModelLoadError(f"tensor-parallel rank {missing[0]} did not join within --tp-start-timeout "
                                         f"{g.start_timeout:g} s" + (f" (is node {missing[0] // g.per_node}'s fdx "
                                                                     f"serve --node-rank running?)"
                                                                     if missing[0] >= g.per_node else ""))
            if g.backend != "shm":
                from fdx.parallel.gloo_comm import paddle_comm

                g.comm = paddle_comm(g.backend).join(0, g.world, g.store, g.timeout, device_id)
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
        while self._ctrl.poll(wait_ms):
            wait_ms = 0
            msg = self._recv()
            if msg is None:
                continue
            kind, rank, payload = msg
            if kind == "progress":
                self._advance(int(payload))
            elif kind == "ready":
                self._ready.add(rank)
            elif kind == "error":
                raise ModelLoadError(f"tensor-parallel rank {rank} failed to start: {payload}")
            else:
                raise FdxError(f"tensor-parallel rank {rank}: unexpected {kind!r} message during start-up")

    def _recv(self) -> tuple[str, int, Any] | None:
        """The next control message from a rank of this group, answering the
        node agents' hellos and the ranks' joins on the way (``None``: handled)."""
        ident, data = self._ctrl.recv_multipart()
        kind, rank, payload = pickle.loads(data)
        if kind == "hello":  # a node agent waits for this group's ranks: tell it how to start them
            if len(self._ids) < self.world - 1:
                link = self.link(0, 0)
                self._send(ident, ("spawn", attrs.asdict(link)))
            return None
        if kind == "join":
            gid, pid = payload
            if gid == self.group_id and rank not in self._ids:
                self._ids[rank], self._rank_of[ident], self._pid[rank] = ident, rank, int(pid)
                self._send(ident, ("init", self._config))
            return None
        if kind == "exit" and payload[0] == self.group_id:  # a node agent: one of this group's ranks exited
            raise GroupBroken(f"tensor-parallel rank {rank} (pid {self._pid.get(rank, '?')}) exited with "
                              f"status {payload[1]}")
        if self._rank_of.get(ident) != rank:
            return None  # a worker of an older group
        return kind, rank, payload

    def _send(self, ident: bytes, msg: Any) -> None:
        import zmq

        try:
            self._ctrl.send_multipart([ident, pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)], copy=False)
        except zmq.ZMQError as exc:  # ROUTER_MANDATORY: that peer is gone
            rank = self._rank_of.get(ident, -1)
            raise GroupBroken(f"tensor-parallel rank {rank} (pid {self._pid.get(rank, '?')}) is not connected "
                              f"({exc})") from None

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
                    raise ModelLoadError(f"tensor-parallel rank {missing[0]} (pid {self._pid.get(missing[0])}) was not "
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
        import zmq

        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for r in range(1, self.world):
            try:
                self._ctrl.send_multipart([self._ids[r], data], copy=False)
            except (zmq.ZMQError, KeyError) as exc:
                raise GroupBroken(f"tensor-parallel rank {r} (pid {self._pid.get(r, '?')}) is not connected "
                                  f"({exc!r})") from None

    def send_each(self, msgs: list[tuple[Any, ...]]) -> None:
        """Worker ``r`` gets ``msgs[r - 1]``."""
        for r, msg in zip(range(1, self.world), msgs):
            self._send(self._ids[r], msg)

    def collect(self, what: str) -> list[Any]:
        """Every worker's reply to the last call, in rank order (1..N-1); a
        worker's error is an :class:`FdxError` naming it."""
        got: dict[int, Any] = {}
        errors: list[str] = []
        deadline = time.monotonic() + self.timeout
        while len(got) + len(errors) < self.world - 1:
            if not self._ctrl.poll(100):
                self._check_alive()
                if time.monotonic() > deadline:
                    raise GroupBroken(f"tensor-parallel ranks did not answer {what} within {self.timeout:g} s")
                continue
            msg = self._recv()
            if msg is None:
                continue
            kind, rank, payload = msg
            if kind == "result":
                got[rank] = payload
            elif kind == "error":
                errors.append(f"rank {rank}: {payload}")
        if errors:
            raise FdxError(f"{what} failed on tensor-parallel {'; '.join(errors)}")
        return [got[r] for r in range(1, self.world)]

    def fatal(self, exc: BaseException) -> None:
        """The group is broken: end rank 0's process (the supervisor restarts the group)."""
        why = ((self.comm.last_error() if self.comm is not None else "")
               or (str(exc).strip().splitlines() or [type(exc).__name__])[0])
        log.critical("%s; ending the engine so the supervisor restarts the whole tensor-parallel group", why)
        if self.comm is not None:
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
        if self.comm is not None:
            self.comm.unlink()
            self.comm.close()
        self._ctrl.close(0)
        shutil.rmtree(self._dir, ignore_errors=True)  # the control socket's directory
