"""Host memory in transparent huge pages, for what a step streams through.

A decode step reads every packed weight once (~95 MB for the embedded
model), in 4 KiB pages through Paddle's allocator: a TLB miss and a page
walk every 4 KiB.  Where Linux offers transparent huge pages on request
(``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise``, the common
default, or ``always``), memory mapped here is ``madvise(MADV_HUGEPAGE)``\\ d
before its first touch, so the kernel backs it with 2 MiB pages where it
can: the same single-sequence decode step measured 6.1 ms against 6.9-7.2
with 4 KiB pages (docs/PERFORMANCE.md, "Weights in huge pages").

:class:`HugePageArena` hands out 64-byte-aligned slices of 32 MiB anonymous
mappings (a larger request gets its own), each 2 MiB-aligned inside its
mapping; :meth:`HugePageArena.tensor` copies an array in and returns a CPU
Paddle tensor over that memory (DLPack, no second copy).  A tensor keeps its
mapping alive, so dropping the tensors (a model's ``release``) frees it.
Without ``mmap.MADV_HUGEPAGE`` (not Linux) or with THP ``never`` the memory
is ordinary pages: the same bytes, only slower.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

_HUGE = 2 << 20
_CHUNK = 32 << 20
_ALIGN = 64


def _mapping(nbytes: int) -> np.ndarray:
    """A zeroed uint8 array of ``nbytes`` (+ slack) whose start is 2 MiB aligned, in huge pages where possible."""
    m = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP compiled out: ordinary pages
            pass
    buf = np.frombuffer(m, dtype=np.uint8)  # keeps the mapping alive
    start = (-buf.ctypes.data) % _HUGE
    return buf[start : start + nbytes]


class HugePageArena:
    """Bump allocation of CPU tensors in huge-page-backed mappings (module docstring)."""

    def __init__(self) -> None:
        self._chunk: np.ndarray | None = None
        self._off = 0

    def _take(self, nbytes: int) -> np.ndarray:
        if nbytes > _CHUNK // 4:
            return _mapping(nbytes)
        if self._chunk is None or self._off + nbytes > len(self._chunk):
            self._chunk, self._off = _mapping(_CHUNK), 0
        out = self._chunk[self._off : self._off + nbytes]
        self._off += -(-nbytes // _ALIGN) * _ALIGN
        return out

    def tensor(self, a: np.ndarray) -> Any:
        """A CPU Paddle tensor holding a copy of ``a`` in the arena's memory."""
        import paddle

        a = np.ascontiguousarray(a)
        view = self._take(a.nbytes).view(a.dtype).reshape(a.shape)
        view[...] = a
        return paddle.from_dlpack(view)


def zeros(shape: list[int], dtype: str) -> Any:
    """A zeroed CPU tensor of ``shape`` in its own huge-page mapping (a KV
    pool's: each step reads the blocks of every running sequence), resident
    at once as ``paddle.zeros``' memory was (the pool's size is what
    ``sleep`` frees and what the operator sized).  float32 and bfloat16 (a
    float32 mapping of half the last dim, viewed as bfloat16); any other
    dtype: ``paddle.zeros``."""
    import paddle

    if dtype not in ("float32", "bfloat16") or (dtype == "bfloat16" and shape[-1] % 2):
        return paddle.zeros(shape, dtype=dtype)
    half = dtype == "bfloat16"
    inner = [*shape[:-1], shape[-1] // 2] if half else list(shape)
    n = int(np.prod(inner))
    a = _mapping(4 * n).view(np.float32).reshape(inner)
    a.fill(0.0)  # fault every page in now (2 MiB ones where the kernel can)
    t = paddle.from_dlpack(a)
    return paddle.view(t, paddle.bfloat16) if half else t
