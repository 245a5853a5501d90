"""What every Paddle device plugin shares: the paged KV allocation and the
capability probes (no Paddle import at module level)."""

from __future__ import annotations

from typing import Any, Callable

from fdx.core.interfaces import KVCacheSpec


def allocate_paged_kv(spec: KVCacheSpec, place: str, zeros: Callable[[list[int], str], Any] | None = None) -> list[Any]:
    """One zeroed ``[2, num_blocks, num_kv_heads, block_size, head_dim]``
    tensor per layer (K at index 0, V at 1) on ``place``, each made by
    ``zeros(shape, dtype)`` (default ``paddle.zeros``)."""
    import paddle

    paddle.set_device(place)
    shape = [2, spec.num_blocks, spec.num_kv_heads, spec.block_size, spec.head_dim]
    make = zeros or (lambda shp, dtype: paddle.zeros(shp, dtype=dtype))
    return [make(shape, spec.dtype) for _ in range(spec.num_layers)]


def paddle_flag(name: str) -> bool:
    """``paddle.is_compiled_with_<name>()`` without raising (False if Paddle
    is missing or the query fails)."""
    try:
        import paddle

        fn = getattr(paddle, f"is_compiled_with_{name}", None)
        return bool(fn()) if fn is not None else False
    except Exception:  # noqa: BLE001 - availability probes must never raise
        return False


def custom_device_count(kind: str) -> int:
    """Number of Paddle custom devices of type ``kind`` (0 on any failure)."""
    try:
        import paddle

        if kind not in paddle.device.get_all_custom_device_type():
            return 0
        return len([d for d in paddle.device.get_available_custom_device() if d.split(":")[0] == kind])
    except Exception:  # noqa: BLE001
        return 0
