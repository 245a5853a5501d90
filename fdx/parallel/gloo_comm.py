"""The ``gloo`` collective backend: all-reduce and gather between
tensor-parallel ranks on any hosts, through Paddle's own collectives
(``paddle.distributed`` over a ProcessGroupGloo; ``--tp-backend gloo``, the
pick of ``auto`` across ``--nnodes``).

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
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import numpy as np

from fdx.parallel.shm_comm import GroupBroken

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
    def join(cls, rank: int, world: int, store: str, timeout: float) -> GlooComm:
        """Join the group whose TCP store is ``store`` (``HOST:PORT``, rank 0's host);
        blocks until every rank joined."""
        host, port = store.rsplit(":", 1)
        eps = [f"{host}:{int(port) + r}" for r in range(world)]
        os.environ.update(PADDLE_DISTRI_BACKEND="gloo", PADDLE_TRAINER_ID=str(rank),
                          PADDLE_TRAINERS_NUM=str(world), PADDLE_TRAINER_ENDPOINTS=",".join(eps),
                          PADDLE_CURRENT_ENDPOINT=eps[rank], PADDLE_RANK_IN_NODE=str(rank))
        import paddle.distributed as dist

        t0 = time.monotonic()
        late = threading.Timer(JOIN_TIMEOUT, _give_up, (f"tensor-parallel rank {rank}: the gloo group (store {store}) "
                                                       f"was not complete within {JOIN_TIMEOUT:g} s; ending this rank",))
        late.daemon = True
        late.start()
        try:
            dist.init_parallel_env()
        finally:
            late.cancel()
        log.info("gloo group joined as rank %d of %d in %.1f s (store %s)", rank, world, time.monotonic() - t0, store)
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
            return fn(*args)
        except RuntimeError as exc:
            first = (str(exc).strip().splitlines() or ["error"])[-1][:300]
            self._error = f"tensor-parallel {what} failed on rank {self.rank} (gloo: {first}; a peer died)"
            raise GroupBroken(self._error) from None
        finally:
            self._since = None

    # ------------------------------------------------------------------ collectives

    def all_reduce(self, x: Any) -> Any:
        """The sum over ranks of ``x`` (a float32 Paddle tensor), in place."""
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
