"""Kunlun XPUs through Paddle's XPU build: ``--device xpu`` or ``xpu:N``
(place ``xpu:N``).

Uses the ``gpu`` model runner.  Its fused ops are probed on the XPU at
start-up; each one this Paddle build lacks for the XPU falls back to plain
Paddle and is named in a log line (``FDX_GPU_DISABLE_FUSED=op,...`` turns
ops off by hand).  float16 is the ``auto`` dtype here.
"""

from __future__ import annotations

from typing import Any

from fdx.core.hookspecs import hookimpl
from fdx.plugins.hardware.accelerator import AcceleratorDevice


class XPUDevice(AcceleratorDevice):
    name = "xpu"
    place_prefix = "xpu"
    install_hint = "install Paddle's XPU build, paddlepaddle-xpu"

    def build_supported(self) -> bool:
        from fdx.plugins.hardware.paddle_device import paddle_flag

        return paddle_flag("xpu")

    def count(self) -> int:
        import paddle

        return int(paddle.device.xpu.device_count())

    def memory_info(self) -> tuple[int, int]:
        import paddle

        total = int(paddle.device.xpu.get_device_properties(self.index).total_memory)
        used = int(paddle.device.xpu.memory_reserved(self.index))
        return total, max(0, total - used)


@hookimpl
def fdx_register_devices(register: Any) -> None:
    register("xpu", XPUDevice, description="Kunlun XPU, xpu[:N] (Paddle XPU build; gpu runner)")
