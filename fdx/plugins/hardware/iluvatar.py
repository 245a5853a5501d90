"""Iluvatar CoreX GPUs through Paddle's custom-device plugin ``iluvatar_gpu``."""

from __future__ import annotations

from typing import Any

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import Device, KVCacheSpec

DEVICE_TYPE = "iluvatar_gpu"


class IluvatarDevice(Device):
    name = "iluvatar"

    def __init__(self, index: int = 0) -> None:
        self.index = index

    def is_available(self) -> bool:
        from fdx.plugins.hardware._common import custom_device_count

        return custom_device_count(DEVICE_TYPE) > self.index

    def paddle_place(self) -> str:
        return f"{DEVICE_TYPE}:{self.index}"

    def memory_info(self) -> tuple[int, int]:
        import paddle

        try:
            total = int(paddle.device.get_device_properties(self.paddle_place()).total_memory)
        except Exception:  # noqa: BLE001 - not every plugin reports properties
            total = 0
        return total, total

    def allocate_kv_cache(self, spec: KVCacheSpec) -> list[Any]:
        from fdx.plugins.hardware._common import allocate_paged_kv

        return allocate_paged_kv(spec, self.paddle_place())


@hookimpl
def fdx_register_devices(register: Any) -> None:
    register("iluvatar", IluvatarDevice, description="Iluvatar CoreX GPU (custom device iluvatar_gpu)")
