"""Device plugins: registration, availability probes, env set-up, KV allocation."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fdx.core.interfaces import Device, KVCacheSpec


@pytest.fixture(scope="module")
def plugins():  # noqa: ANN201
    from fdx.core.plugins import load_plugins

    return load_plugins()


def test_all_devices_registered_and_probe_without_raising(plugins) -> None:  # noqa: ANN001
    names = plugins.registry("device").names()
    for name in ("cpu", "cuda", "xpu", "iluvatar"):
        assert name in names
        dev = plugins.create("device", name)
        assert isinstance(dev, Device)
        assert isinstance(dev.is_available(), bool)
        assert isinstance(dev.paddle_place(), str)
    assert plugins.create("device", "cpu").is_available()
    # this machine has no accelerators
    for name in ("cuda", "xpu", "iluvatar"):
        assert plugins.create("device", name).is_available() is False


def test_importing_device_plugins_does_not_import_paddle() -> None:
    code = (
        "import sys, fdx\n"
        "from fdx.core.plugins import load_plugins\n"
        "p = load_plugins()\n"
        "d = p.create('device', 'cpu'); d.configure_env(None)\n"
        "[p.create('device', n) for n in ('cuda', 'xpu', 'iluvatar')]\n"
        "assert 'paddle' not in sys.modules, 'paddle imported'\n"
        "import os; print(os.environ['OMP_NUM_THREADS'], os.environ['MKL_DEBUG_CPU_TYPE'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_DEBUG_CPU_TYPE")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(os.cpu_count()), "5"]


def test_cpu_configure_env_respects_user_values(monkeypatch: pytest.MonkeyPatch) -> None:
    from fdx.plugins.hardware.cpu import CPUDevice

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("MKL_DEBUG_CPU_TYPE", "4")
    CPUDevice().configure_env(None)
    assert os.environ["OMP_NUM_THREADS"] == "3" and os.environ["MKL_DEBUG_CPU_TYPE"] == "4"
    CPUDevice().configure_env(1)  # an explicit --num-threads wins
    assert os.environ["OMP_NUM_THREADS"] == "1"


def test_cpu_memory_and_kv_allocation() -> None:
    from fdx.plugins.hardware.cpu import CPUDevice

    dev = CPUDevice()
    total, avail = dev.memory_info()
    assert total > 0 and 0 < avail <= total
    spec = KVCacheSpec(num_layers=3, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
    caches = dev.allocate_kv_cache(spec)
    assert len(caches) == 3
    for c in caches:
        assert list(c.shape) == [2, 5, 2, 4, 8] and "float32" in str(c.dtype)
        assert float(c.abs().sum()) == 0.0
    assert dev.attention_backend() in ("native", "paddle")
