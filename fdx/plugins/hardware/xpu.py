"""Kunlun XPUs through Paddle's XPU build (place ``xpu:N``)."""

from __future__ import annotations

from typing import Any

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import Device, KVCacheSpec


class XPUDevice(Device):
    name = "xpu"

    def __init__(self, index: int = 0) -> None:
        self.index = index

    def is_available(self) -> bool:
        from fdx.plugins.hardware._common import paddle_flag

        if not paddle_flag("xpu"):
            return False
        try:
            import paddle

            return paddle.device.xpu.device_count() > self.index
        except Exception:  # noqa: BLE001
            return False

    def paddle_place(self) -> str:
        return f"xpu:{self.index}"

    def memory_info(self) -> tuple[int, int]:
        import paddle

        total = int(paddle.device.xpu.get_device_properties(self.index).total_memory)
        used = int(paddle.device.xpu.memory_reserved(self.index))
        return total, max(0, total - used)

    def allocate_kv_cache(self, spec: KVCacheSpec) -> list[Any]:
        from fdx.plugins.hardware._common import allocate_paged_kv

        return allocate_paged_kv(spec, self.paddle_place())


@hookimpl
def fdx_register_devices(register: Any) -> None:
    register("xpu", XPUDevice, description="Kunlun XPU (Paddle XPU build)")
