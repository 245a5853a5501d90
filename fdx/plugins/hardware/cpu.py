"""The CPU device: Paddle on x86 with oneDNN/MKL, plus fdx's C++ attention op.

``configure_env`` must run before Paddle is imported: MKL reads
``OMP_NUM_THREADS`` once, and ``MKL_DEBUG_CPU_TYPE=5`` selects its AVX2
code path on AMD CPUs (about 2.7x faster).  Both are ``setdefault`` so a
user's environment wins.  It does not import Paddle (the model runner does,
quietly: :func:`fdx.logs.import_paddle_quietly`).
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import Device, KVCacheSpec


def meminfo() -> tuple[int, int]:
    """``(MemTotal, MemAvailable)`` in bytes from /proc/meminfo."""
    vals: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                k, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    vals[k] = int(parts[0]) * 1024
    except OSError:
        pass
    total = vals.get("MemTotal", 0)
    return total, vals.get("MemAvailable", vals.get("MemFree", total))


class CPUDevice(Device):
    name = "cpu"
    default_runner = "cpu"

    def is_available(self) -> bool:
        return True

    def configure_env(self, num_threads: int | None = None) -> None:
        n = str(num_threads or os.cpu_count() or 1)
        if num_threads:
            os.environ["OMP_NUM_THREADS"] = n  # an explicit flag wins
        else:
            os.environ.setdefault("OMP_NUM_THREADS", n)
        os.environ.setdefault("MKL_DEBUG_CPU_TYPE", "5")

    def paddle_place(self) -> str:
        return "cpu"

    def memory_info(self) -> tuple[int, int]:
        return meminfo()

    def allocate_kv_cache(self, spec: KVCacheSpec) -> list[Any]:
        """One zeroed ``[2, num_blocks, num_kv_heads, block_size, head_dim]``
        tensor per layer, each in its own huge-page mapping (fdx/model/hugepages.py:
        a step reads the KV blocks of every running sequence)."""
        from fdx.model.hugepages import zeros
        from fdx.plugins.hardware.paddle_device import allocate_paged_kv

        return allocate_paged_kv(spec, "cpu", zeros)

    def attention_backend(self) -> str:
        return "native"  # fdx/csrc/paged_attention.cc, falls back to "paddle"

    def linear_backend(self) -> str:
        return "mkl"

    def trim_memory(self) -> None:
        """Collect garbage and hand freed heap pages back to the OS (glibc
        ``malloc_trim``): Paddle's CPU allocator frees into the C heap,
        which otherwise keeps them resident."""
        super().trim_memory()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass

    def process_rss(self) -> int:
        """``VmRSS`` of this process from ``/proc/self/status`` (0 if unknown)."""
        try:
            with open("/proc/self/status", encoding="ascii") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        return 0


@hookimpl
def fdx_register_devices(register: Any) -> None:
    register("cpu", CPUDevice, description="x86 CPU (Paddle + oneDNN/MKL, C++ paged attention)")
