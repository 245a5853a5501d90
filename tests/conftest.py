"""Shared fixtures.

``plugin_manager`` builds a fresh pluggy manager with NO entry points, so
installed plugins don't leak into a test; tests register what they need with
``pm.register(obj)`` and the fixture unregisters everything afterwards.
"""

from __future__ import annotations

import os
from typing import Iterator

import pluggy
import pytest

# Speed switches must be set before any test imports paddle.
os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 2))
os.environ.setdefault("MKL_DEBUG_CPU_TYPE", "5")


@pytest.fixture
def plugin_manager() -> Iterator[pluggy.PluginManager]:
    from fdx.core.plugins import new_plugin_manager

    pm = new_plugin_manager()
    try:
        yield pm
    finally:
        for plugin in list(pm.get_plugins()):
            pm.unregister(plugin)
