"""Helpers shared by the built-in cache backends: option parsing and
thread-safe counters.

Options come from ``--cache-backend-config`` (a JSON object).  Unknown keys
are a one-line :class:`~fdx.core.errors.ConfigError` naming the backend and
its accepted keys, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import threading
from typing import Any, Mapping

from fdx.config import parse_bytes
from fdx.core.errors import ConfigError


class BackendUnavailable(ConnectionError):
    """The backend cannot be reached (raised fast, never after a long hang)."""


def check_options(backend: str, options: Mapping[str, Any] | None, allowed: set[str]) -> dict[str, Any]:
    """Copy of ``options`` after rejecting unknown keys."""
    opts = dict(options or {})
    unknown = set(opts) - allowed
    if unknown:
        raise ConfigError(
            f"--cache-backend-config: unknown option(s) for {backend!r}: {', '.join(sorted(unknown))} "
            f"(accepted: {', '.join(sorted(allowed))})"
        )
    return opts


def size_option(backend: str, name: str, value: Any) -> int:
    """``1073741824`` or ``"1G"`` -> bytes (>= 0)."""
    if isinstance(value, bool):
        raise ConfigError(f"--cache-backend-config: {backend}.{name} must be a size, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ConfigError(f"--cache-backend-config: {backend}.{name} must be >= 0, got {value}")
        return int(value)
    if isinstance(value, str):
        if value.strip() == "0":
            return 0
        return parse_bytes(value, f"--cache-backend-config {backend}.{name}")
    raise ConfigError(f"--cache-backend-config: {backend}.{name} must be a size like 1G, got {value!r}")


def float_option(backend: str, name: str, value: Any) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"--cache-backend-config: {backend}.{name} must be a number, got {value!r}") from None
    if v <= 0:
        raise ConfigError(f"--cache-backend-config: {backend}.{name} must be > 0, got {value!r}")
    return v


class Counters:
    """``hits``/``misses``/``puts``/``errors``/... under one lock (puts run on
    the storage writer thread while gets run on the engine thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c: dict[str, float] = {
            "hits": 0, "misses": 0, "puts": 0, "bytes_read": 0, "bytes_written": 0, "evictions": 0, "errors": 0,
        }

    def add(self, **deltas: float) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._c[k] = self._c.get(k, 0) + v

    def snapshot(self, **extra: float) -> dict[str, float]:
        with self._lock:
            out = dict(self._c)
        out.update(extra)
        return out
