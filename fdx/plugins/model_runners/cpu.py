"""Registers the ``cpu`` model runner: fdx's Paddle runner (``--dtype auto``:
the batch-invariant int8 GEMM over the GGUF blocks where the C++ ops load,
else float32; ``--dtype bfloat16``: the bf16 GEMM; a bfloat16 KV pool with int8, else float32 (``--kv-cache-dtype``); mixed prefill/decode forward; NumPy sampling), the default of the
``cpu`` device.  Paddle and the model are imported only by the factory."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fdx.core.hookspecs import hookimpl

if TYPE_CHECKING:
    from fdx.config import EngineConfig
    from fdx.core.interfaces import Device, ModelRunner


def create(config: EngineConfig, device: Device) -> ModelRunner:
    from fdx.model.runner import PaddleModelRunner  # heavy: imports Paddle

    return PaddleModelRunner(config, device)


@hookimpl
def fdx_register_model_runners(register: Any) -> None:
    register("cpu", create, description="Paddle runner: int8 or bfloat16 (batch-invariant) or float32 compute, C++ paged attention on the CPU device")
