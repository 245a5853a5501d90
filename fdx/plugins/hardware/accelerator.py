"""What the accelerator devices (cuda, xpu, iluvatar) share: a device index
(``--device NAME:INDEX``), the ``gpu`` model runner as their default, a
one-line reason when they are unavailable, and the fused ops each gates off
for the GPU runner.  No Paddle import at module level."""

from __future__ import annotations

from typing import Any

from fdx.core.errors import ConfigError
from fdx.core.interfaces import Device, KVCacheSpec


class AcceleratorDevice(Device):
    """Base of the accelerator device plugins.

    Subclasses set ``name``, ``place_prefix`` (Paddle's device type),
    ``install_hint`` and implement :meth:`build_supported` (Paddle has this
    backend) and :meth:`count` (how many such devices are visible).
    """

    default_runner = "gpu"
    place_prefix = ""
    install_hint = ""
    #: fused ops the ``gpu`` runner must not use on this device (op -> why);
    #: ops not named here are still probed at start-up and fall back to
    #: plain Paddle, with a log line, where this Paddle build lacks them
    unsupported_fused_ops: dict[str, str] = {}

    def __init__(self, index: int = 0) -> None:
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise ConfigError(f"--device {self.name}:{index}: the index must be a non-negative integer")
        self.index = index

    # ---------------------------------------------------------------- probes

    def build_supported(self) -> bool:  # pragma: no cover - overridden
        raise NotImplementedError

    def count(self) -> int:  # pragma: no cover - overridden
        raise NotImplementedError

    def _count(self) -> int:
        try:
            return int(self.count()) if self.build_supported() else 0
        except Exception:  # noqa: BLE001 - probes never raise
            return 0

    def is_available(self) -> bool:
        return self._count() > self.index

    def unavailable_reason(self) -> str:
        """Why :meth:`is_available` is False, in one line ("" when it is True)."""
        if not self.build_supported():
            return f"the installed Paddle has no {self.name} support ({self.install_hint})"
        n = self._count()
        if n <= self.index:
            have = f"{self.name}:0..{n - 1}" if n > 1 else (f"{self.name}:0" if n == 1 else "none")
            return f"{self.name}:{self.index} requested but {n} {self.name} device(s) are visible ({have})"
        return ""

    # ---------------------------------------------------------------- device

    def paddle_place(self) -> str:
        return f"{self.place_prefix}:{self.index}"

    def allocate_kv_cache(self, spec: KVCacheSpec) -> list[Any]:
        from fdx.plugins.hardware.paddle_device import allocate_paged_kv

        return allocate_paged_kv(spec, self.paddle_place())
