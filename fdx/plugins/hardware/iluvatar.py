"""Iluvatar CoreX GPUs through Paddle's custom-device plugin
``iluvatar_gpu``: ``--device iluvatar`` or ``iluvatar:N``.

Uses the ``gpu`` model runner.  Each fused op it uses (RMSNorm, RoPE,
SwiGLU, variable-length flash attention) is probed on the custom device at
start-up; one the ``iluvatar_gpu`` plugin does not register falls back to
plain Paddle and is named in a log line (``FDX_GPU_DISABLE_FUSED=op,...``
turns ops off by hand).  float16 is the ``auto`` dtype here.
"""

from __future__ import annotations

from typing import Any

from fdx.core.hookspecs import hookimpl
from fdx.plugins.hardware.accelerator import AcceleratorDevice

DEVICE_TYPE = "iluvatar_gpu"


class IluvatarDevice(AcceleratorDevice):
    name = "iluvatar"
    place_prefix = DEVICE_TYPE
    install_hint = "install Paddle's custom-device package for iluvatar_gpu"

    def build_supported(self) -> bool:
        try:
            import paddle

            return DEVICE_TYPE in paddle.device.get_all_custom_device_type()
        except Exception:  # noqa: BLE001
            return False

    def count(self) -> int:
        from fdx.plugins.hardware.paddle_device import custom_device_count

        return custom_device_count(DEVICE_TYPE)

    def memory_info(self) -> tuple[int, int]:
        import paddle

        try:
            total = int(paddle.device.get_device_properties(self.paddle_place()).total_memory)
        except Exception:  # noqa: BLE001 - not every plugin reports properties
            total = 0
        return total, total


@hookimpl
def fdx_register_devices(register: Any) -> None:
    register("iluvatar", IluvatarDevice, description="Iluvatar CoreX GPU, iluvatar[:N] (custom device iluvatar_gpu; gpu runner)")
