"""Paddle's collective backends: all-reduce and gather between
tensor-parallel ranks on any hosts, through ``paddle.distributed``:

* ``gloo`` (:class:`GlooComm`; a ProcessGroupGloo over host tensors): the
  ``cpu`` runner's pick of ``auto`` across ``--nnodes``, and the ``gpu``
  runner's on the CPU place;
* ``nccl`` (:class:`NcclComm`; a ProcessGroupNCCL over device tensors): the
  ``gpu`` runner's on CUDA GPUs, each rank on its own device
  (``FLAGS_selected_gpus``).  **Untested here** (no GPU in the test
  machines): it runs the very code path gloo's tests cover, with the
  backend's name, the device id and a device synchronize swapped in.

Every rank calls :meth:`GlooComm.join` with Paddle's launcher variables set
(``PADDLE_TRAINER_ID``, ``PADDLE_TRAINERS_NUM``, ``PADDLE_TRAINER_ENDPOINTS``,
``PADDLE_CURRENT_ENDPOINT``; the group's TCP store listens on the first
endpoint, rank 0's host).  ``handle`` is 0: the fused decoder-layer op,
which calls the shm all-reduce itself, is off; the per-layer path makes the
all-reduces here.

Invariants (as :mod:`fdx.parallel.shm_comm`):

* every rank makes the same sequence of calls;
* a dead peer fails the waiting rank's collective (gloo's own error, about a
  second after the peer's sockets close): :class:`GroupBroken`;
* a stopped or unreachable peer: gloo would wait its own 30 s, so a watchdog
  armed around each collective ends this process after ``timeout`` seconds
  with one line naming the collective -- never a hang past ``--step-timeout``.
  NCCL waits forever for a dead *or* stopped peer, on the device: its
  collective synchronizes the device inside the watchdog's window, so the
  same watchdog ends the rank.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import numpy as np

from fdx.core.errors import FdxError
from fdx.parallel.shm_comm import GroupBroken

#: the store of the group this process joined (Paddle's ``init_parallel_env``
#: makes its one global group once per process: a second join would wait on
#: a store its peers never see)
_joined: str | None = None

log = logging.getLogger("fdx.parallel")

#: exit status of a rank its watchdog ended
WATCHDOG_EXIT = 71
#: seconds a rank waits for every rank to join the gloo group (they join before loading)
JOIN_TIMEOUT = 120.0


def _give_up(why: str) -> None:
    log.critical("%s", why)
    logging.shutdown()
    os._exit(WATCHDOG_EXIT)


class GlooComm:
    """This rank's side of a gloo group (see the module docstring)."""

    backend = "gloo"
    #: no shared-memory handle: the fused decoder-layer op is off under gloo
    handle = 0

    def __init__(self, rank: int, world: int, timeout: float) -> None:
        self.rank, self.world, self.timeout = rank, world, timeout
        self._since: float | None = None  # when the current collective began (None: not in one)
        self._what = ""
        self._error = ""
        threading.Thread(target=self._watch, name="fdx-gloo-watchdog", daemon=True).start()

    @classmethod
    def _device_env(cls, device_id: int | None) -> dict[str, str]:
        """Launcher variables of this backend's device (gloo: none)."""
        return {}

    @classmethod
    def _first_call(cls, world: int) -> None:
        """A collective made while joining, under the join's timer (gloo: none needed)."""

    @classmethod
    def join(cls, rank: int, world: int, store: str, timeout: float, device_id: int | None = None) -> GlooComm:
        """Join the group whose TCP store is ``store`` (``HOST:PORT``, rank 0's host);
        blocks until every rank joined.  ``device_id``: nccl's device of this rank."""
        global _joined
        if _joined is not None:
            raise FdxError(f"tensor-parallel rank {rank}: this process already joined a Paddle collective group (store "
                           f"{_joined}); Paddle makes one per process, so a second tensor-parallel runner needs a "
                           "process of its own")
        host, port = store.rsplit(":", 1)
        eps = [f"{host}:{int(port) + r}" for r in range(world)]
        os.environ.update(PADDLE_DISTRI_BACKEND=cls.backend, PADDLE_TRAINER_ID=str(rank),
                          PADDLE_TRAINERS_NUM=str(world), PADDLE_TRAINER_ENDPOINTS=",".join(eps),
                          PADDLE_CURRENT_ENDPOINT=eps[rank], PADDLE_RANK_IN_NODE=str(rank),
                          **cls._device_env(device_id))
        import paddle.distributed as dist

        t0 = time.monotonic()
        late = threading.Timer(JOIN_TIMEOUT, _give_up, (f"tensor-parallel rank {rank}: the {cls.backend} group (store "
                                                       f"{store}) was not complete within {JOIN_TIMEOUT:g} s; ending "
                                                       "this rank",))
        late.daemon = True
        late.start()
        try:
            dist.init_parallel_env()
            cls._first_call(world)
        finally:
            late.cancel()
        _joined = store
        log.info("%s group joined as rank %d of %d in %.1f s (store %s)", cls.backend, rank, world,
                 time.monotonic() - t0, store)
        return cls(rank, world, timeout)

    # ------------------------------------------------------------------ the watchdog

    def _watch(self) -> None:
        while True:
            time.sleep(0.1)
            since = self._since
            if since is not None and time.monotonic() - since > self.timeout:
                _give_up(f"tensor-parallel rank {self.rank}: {self._what} did not complete within {self.timeout:.1f} s "
                         "(a peer is stopped or unreachable); ending this rank")

    def _run(self, what: str, fn: Any, *args: Any) -> Any:
        self._what = what
        self._since = time.monotonic()
        try:
            out = fn(*args)
            self._sync()  # nccl: the collective has really completed (a hang stays inside the watchdog's window)
            return out
        except (RuntimeError, OSError) as exc:
            first = (str(exc).strip().splitlines() or ["error"])[-1][:300]
            self._error = f"tensor-parallel {what} failed on rank {self.rank} ({self.backend}: {first}; a peer died)"
            raise GroupBroken(self._error) from None
        finally:
            self._since = None

    def _sync(self) -> None:
        """gloo's collectives return once done: nothing to wait for."""

    # ------------------------------------------------------------------ collectives

    def all_reduce(self, x: Any) -> Any:
        """The sum over ranks of ``x`` (a Paddle tensor: float32 on the host for gloo), in place."""
        import paddle.distributed as dist

        if not x.is_contiguous():
            x = x.contiguous()
        self._run("all-reduce", dist.all_reduce, x)
        return x

    def gather(self, x: Any) -> Any:
        """Rank 0: the ranks' ``x`` [rows, cols] side by side; the others: ``None``."""
        import paddle
        import paddle.distributed as dist

        parts: list[Any] = []
        self._run("gather", dist.all_gather, parts, x.contiguous() if not x.is_contiguous() else x)
        return paddle.concat(parts, axis=1) if self.rank == 0 else None

    def all_reduce_numpy(self, x: np.ndarray) -> np.ndarray:
        """:meth:`all_reduce` of a host array (tests, the benchmark)."""
        import paddle

        return self.all_reduce(paddle.to_tensor(np.ascontiguousarray(x, dtype=np.float32))).numpy()

    # ------------------------------------------------------------------ the group's life (as ShmComm's)

    def last_error(self) -> str:
        return self._error

    def abort(self) -> None:
        """Nothing to break in place: the peers' next collective fails once this process is gone."""

    def unlink(self) -> None:
        pass

    def close(self) -> None:
        pass


class NcclComm(GlooComm):
    """This rank's side of an NCCL group: :class:`GlooComm`'s calls, invariants
    and watchdog over device tensors (``--tp-backend nccl``, the ``gpu``
    runner's pick of ``auto`` on CUDA GPUs).  Untested without GPUs."""

    backend = "nccl"

    @classmethod
    def _device_env(cls, device_id: int | None) -> dict[str, str]:
        """Paddle's launcher names this rank's GPU in ``FLAGS_selected_gpus``
        (``init_parallel_env`` sets the place from it)."""
        return {"FLAGS_selected_gpus": str(device_id or 0)}

    @classmethod
    def _first_call(cls, world: int) -> None:
        """NCCL makes its communicator at the first collective (seconds): make it
        here, under the join's timer, not inside the first step's watchdog window."""
        import paddle
        import paddle.distributed as dist

        x = paddle.ones([1], dtype="float32")
        dist.all_reduce(x)
        paddle.device.synchronize()
        if float(x) != world:
            raise GroupBroken(f"nccl: the first all-reduce gave {float(x)}, not {world}")

    def _sync(self) -> None:
        """NCCL's calls return once queued on the device: wait for them (inside the watchdog)."""
        import paddle

        paddle.device.synchronize()


def paddle_comm(backend: str) -> type[GlooComm]:
    """The class of Paddle backend ``backend`` (``gloo`` or ``nccl``)."""
    return NcclComm if backend == "nccl" else GlooComm
