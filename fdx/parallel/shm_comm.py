"""The ``shm`` collective backend: all-reduce and gather between the
tensor-parallel ranks of one host, through one shared-memory segment
(fdx/csrc/tp_comm.cc, loaded with :mod:`ctypes` so a waiting rank releases
the GIL).

Why not Paddle's gloo here: one gloo all-reduce of 2,304 floats between two
ranks costs milliseconds on this machine, and a step makes two a layer;
the shared-memory round costs microseconds (``bench/bench_tp.py`` measures
both).  Paddle's collectives remain the path across hosts.

Invariants:

* every rank makes the same sequence of calls (the forward pass is the same
  code on every rank);
* the all-reduce sums the ranks' tensors in rank order, so every rank gets
  the same bits;
* a dead, stopped or failing rank fails every other rank's next collective
  within ``timeout`` seconds (or at once, when it broke the group itself):
  :class:`GroupBroken`, never a hang.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import uuid
from typing import Any

import numpy as np

from fdx.core.errors import FdxError
from fdx.model.native import build_library
#: floats per slot: a larger tensor takes several rounds
DEFAULT_SLOT_ELEMS = 1 << 20

_lib: Any = None


class GroupBroken(FdxError):
    """A rank died, hung past the timeout, or failed: the group is unusable."""


def load_library() -> Any:
    """fdx/csrc/tp_comm.cc, built at install time or once into the cache
    (:func:`fdx.model.native.build_library`)."""
    global _lib
    if _lib is not None:
        return _lib
    try:
        so = build_library("tp_comm.cc")
    except RuntimeError as exc:
        raise FdxError(f"tensor parallelism's shm backend: {exc}") from None
    lib = ctypes.CDLL(so)
    vp, i32, i64, fp, cp = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_char_p
    lib.fdx_tp_data_offset.argtypes, lib.fdx_tp_data_offset.restype = [i32], i64
    lib.fdx_tp_set_pid.argtypes, lib.fdx_tp_set_pid.restype = [vp, i32, i32], None
    lib.fdx_tp_abort.argtypes, lib.fdx_tp_abort.restype = [vp, i32, i32], None
    lib.fdx_tp_all_reduce.argtypes = [vp, i32, i32, i64, fp, fp, i64, i64, cp, i32]
    lib.fdx_tp_all_reduce.restype = i32
    lib.fdx_tp_gather.argtypes = [vp, i32, i32, i64, fp, fp, i64, i64, i64, cp, i32]
    lib.fdx_tp_gather.restype = i32
    _lib = lib
    return lib


def segment_size(world: int, slot_elems: int) -> int:
    return int(load_library().fdx_tp_data_offset(world)) + 2 * world * slot_elems * 4


class TPCommHandle(ctypes.Structure):
    """fdx::TPComm (fdx/csrc/paddle_ops.cc): the all-reduce the fused
    decoder-layer op calls between its halves, with this rank's arguments."""

    _fields_ = [("all_reduce", ctypes.c_void_p), ("base", ctypes.c_void_p), ("rank", ctypes.c_int32),
                ("world", ctypes.c_int32), ("slot_elems", ctypes.c_int64), ("timeout_ms", ctypes.c_int64),
                ("err", ctypes.c_char * 256)]


class ShmComm:
    """One rank's handle on the group's segment.

    Rank 0 creates it (:meth:`create`), the workers attach by name
    (:meth:`attach`); rank 0 unlinks the name once all have attached, so a
    crash leaves nothing in /dev/shm.
    """

    backend = "shm"

    def __init__(self, name: str, rank: int, world: int, slot_elems: int, timeout: float, create: bool) -> None:
        self.lib = load_library()
        self.name, self.rank, self.world, self.slot_elems = name, rank, world, slot_elems
        self.timeout_ms = int(timeout * 1000)
        path = os.path.join("/dev/shm", name)
        size = segment_size(world, slot_elems)
        fd = os.open(path, (os.O_CREAT | os.O_EXCL | os.O_RDWR) if create else os.O_RDWR, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._buf = ctypes.c_char.from_buffer(self._mm)
        self.base = ctypes.addressof(self._buf)
        self._err = ctypes.create_string_buffer(256)
        self.lib.fdx_tp_set_pid(self.base, rank, os.getpid())
        self._handle = TPCommHandle(ctypes.cast(self.lib.fdx_tp_all_reduce, ctypes.c_void_p).value, self.base,
                                    rank, world, slot_elems, self.timeout_ms)
        #: the address of :class:`TPCommHandle` for ``fdx_decoder_layers`` (``tp_comm``)
        self.handle = ctypes.addressof(self._handle)

    @classmethod
    def create(cls, world: int, timeout: float, slot_elems: int = DEFAULT_SLOT_ELEMS) -> ShmComm:
        return cls(f"fdx-tp-{os.getpid()}-{uuid.uuid4().hex[:8]}", 0, world, slot_elems, timeout, create=True)

    @classmethod
    def attach(cls, name: str, rank: int, world: int, slot_elems: int, timeout: float) -> ShmComm:
        return cls(name, rank, world, slot_elems, timeout, create=False)

    def unlink(self) -> None:
        try:
            os.unlink(os.path.join("/dev/shm", self.name))
        except FileNotFoundError:
            pass

    # ------------------------------------------------------------------ collectives

    def _check(self, rc: int) -> None:
        if rc != 0:
            raise GroupBroken(self._err.value.decode(errors="replace"))

    def all_reduce(self, x: Any) -> Any:
        """The sum over ranks of ``x`` (a contiguous float32 Paddle tensor), in place."""
        if not x.is_contiguous():
            x = x.contiguous()
        ptr = x.data_ptr()
        self._check(self.lib.fdx_tp_all_reduce(self.base, self.rank, self.world, self.slot_elems, ptr, ptr,
                                               int(x.numel()), self.timeout_ms, self._err, 256))
        return x

    def gather(self, x: Any) -> Any:
        """Rank 0: the ranks' ``x`` [rows, cols] side by side, [rows, world * cols];
        the other ranks: ``None``."""
        import paddle

        if not x.is_contiguous():
            x = x.contiguous()
        rows, cols = int(x.shape[0]), int(x.shape[1])
        out = paddle.empty([rows, self.world * cols], dtype="float32") if self.rank == 0 else None
        self._check(self.lib.fdx_tp_gather(self.base, self.rank, self.world, self.slot_elems, x.data_ptr(),
                                           out.data_ptr() if out is not None else None, rows, cols,
                                           self.timeout_ms, self._err, 256))
        return out

    def all_reduce_numpy(self, x: np.ndarray) -> np.ndarray:
        """:meth:`all_reduce` of a host array (tests, the benchmark)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty_like(x)
        self._check(self.lib.fdx_tp_all_reduce(self.base, self.rank, self.world, self.slot_elems,
                                               x.ctypes.data, out.ctypes.data, x.size, self.timeout_ms,
                                               self._err, 256))
        return out

    def last_error(self) -> str:
        """Why the last collective failed (the fused decoder-layer op's, else this handle's), or ``""``."""
        return (self._handle.err or self._err.value).decode(errors="replace")

    def abort(self) -> None:
        """Break the group: every rank's next (or current) collective fails."""
        self.lib.fdx_tp_abort(self.base, self.world, self.rank)

    def close(self) -> None:
        try:
            del self._buf
            self._mm.close()
        except (BufferError, ValueError):
            pass
