"""NVIDIA GPUs through ``paddlepaddle-gpu`` (place ``gpu:N``).

Uses the pure-Paddle attention path; availability is probed lazily and never
raises.
"""

from __future__ import annotations

import os
from typing import Any

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import Device, KVCacheSpec


class CUDADevice(Device):
    name = "cuda"

    def __init__(self, index: int = 0) -> None:
        self.index = index

    def is_available(self) -> bool:
        from fdx.plugins.hardware._common import paddle_flag

        if not paddle_flag("cuda"):
            return False
        try:
            import paddle

            return paddle.device.cuda.device_count() > self.index
        except Exception:  # noqa: BLE001
            return False

    def configure_env(self, num_threads: int | None = None) -> None:
        if num_threads:
            os.environ["OMP_NUM_THREADS"] = str(num_threads)
        os.environ.setdefault("FLAGS_allocator_strategy", "auto_growth")

    def paddle_place(self) -> str:
        return f"gpu:{self.index}"

    def memory_info(self) -> tuple[int, int]:
        import paddle

        props = paddle.device.cuda.get_device_properties(self.index)
        total = int(props.total_memory)
        used = int(paddle.device.cuda.memory_reserved(self.index))
        return total, max(0, total - used)

    def allocate_kv_cache(self, spec: KVCacheSpec) -> list[Any]:
        from fdx.plugins.hardware._common import allocate_paged_kv

        return allocate_paged_kv(spec, self.paddle_place())


@hookimpl
def fdx_register_devices(register: Any) -> None:
    register("cuda", CUDADevice, description="NVIDIA GPU (paddlepaddle-gpu)")
