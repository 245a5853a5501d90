"""Registers the ``gpu`` model runner (fdx.model.gpu_runner): bfloat16/float16
weights and KV, Paddle's fused GPU kernels with plain-Paddle fallbacks,
sampling on the device.  The default of the ``cuda``, ``xpu`` and
``iluvatar`` devices.  Paddle and the model are imported only by the factory."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fdx.core.hookspecs import hookimpl

if TYPE_CHECKING:
    from fdx.config import EngineConfig
    from fdx.core.interfaces import Device, ModelRunner


def create(config: EngineConfig, device: Device) -> ModelRunner:
    from fdx.model.gpu_runner import GPUModelRunner  # heavy: imports Paddle

    return GPUModelRunner(config, device)


@hookimpl
def fdx_register_model_runners(register: Any) -> None:
    register("gpu", create, description="Paddle bf16/fp16 runner: fused GPU kernels, on-device sampling")
