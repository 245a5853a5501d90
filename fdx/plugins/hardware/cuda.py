"""NVIDIA GPUs through ``paddlepaddle-gpu`` (``pip install 'fdx[cuda]'``):
``--device cuda`` or ``cuda:N`` (Paddle place ``gpu:N``).

Runs the ``gpu`` model runner by default (bfloat16/float16, Paddle's fused
CUDA kernels, sampling on the GPU).  Availability is probed lazily and never
raises; an unavailable GPU is a one-line reason.
"""

from __future__ import annotations

import os
from typing import Any

from fdx.core.hookspecs import hookimpl
from fdx.plugins.hardware.accelerator import AcceleratorDevice


class CUDADevice(AcceleratorDevice):
    name = "cuda"
    place_prefix = "gpu"
    install_hint = "pip install 'fdx[cuda]' for paddlepaddle-gpu"
    unsupported_fused_ops: dict[str, str] = {}  # Paddle's CUDA build has every op the gpu runner uses

    def build_supported(self) -> bool:
        from fdx.plugins.hardware.paddle_device import paddle_flag

        return paddle_flag("cuda")

    def count(self) -> int:
        import paddle

        return int(paddle.device.cuda.device_count())

    def configure_env(self, num_threads: int | None = None) -> None:
        if num_threads:
            os.environ["OMP_NUM_THREADS"] = str(num_threads)
        os.environ.setdefault("FLAGS_allocator_strategy", "auto_growth")

    def memory_info(self) -> tuple[int, int]:
        import paddle

        total = int(paddle.device.cuda.get_device_properties(self.index).total_memory)
        used = int(paddle.device.cuda.memory_reserved(self.index))
        return total, max(0, total - used)

    def trim_memory(self) -> None:
        import gc

        gc.collect()
        try:
            import paddle

            paddle.device.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - best effort
            pass


@hookimpl
def fdx_register_devices(register: Any) -> None:
    register("cuda", CUDADevice, description="NVIDIA GPU, cuda[:N] (paddlepaddle-gpu; gpu runner)")
