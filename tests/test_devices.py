"""Device plugins: registration, availability probes, ``--device NAME:INDEX``,
env set-up, KV allocation -- on any machine.

Nothing here asserts that an accelerator is absent: on a machine without one
the GPU tests skip with the reason, on a GPU machine they run (CUDA KV
allocation, and greedy parity of the ``gpu`` runner on the GPU against the
``cpu`` runner).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from fdx.core.errors import ConfigError, FdxError
from fdx.core.interfaces import Device, KVCacheSpec

ACCELERATORS = ("cuda", "xpu", "iluvatar")


@pytest.fixture(scope="module")
def plugins():  # noqa: ANN201
    from fdx.core.plugins import load_plugins

    return load_plugins()


@pytest.fixture
def cuda_device() -> Any:
    """``cuda:0``, or a skip that says why there is none here."""
    from fdx.plugins.hardware.cuda import CUDADevice

    dev = CUDADevice(0)
    if not dev.is_available():
        pytest.skip(f"needs a CUDA GPU: {dev.unavailable_reason()}")
    return dev


def test_all_devices_registered_and_probe_without_raising(plugins) -> None:  # noqa: ANN001
    names = plugins.registry("device").names()
    for name in ("cpu",) + ACCELERATORS:
        assert name in names
        dev = plugins.create("device", name)
        assert isinstance(dev, Device)
        assert isinstance(dev.is_available(), bool)
        assert isinstance(dev.paddle_place(), str)
    assert plugins.create("device", "cpu").is_available()
    for name in ACCELERATORS:
        dev = plugins.create("device", name)
        reason = dev.unavailable_reason()
        assert isinstance(reason, str) and "\n" not in reason
        assert (reason == "") == dev.is_available()  # a reason exactly when unavailable
        if reason:
            assert name in reason


def test_default_runners(plugins) -> None:  # noqa: ANN001
    assert plugins.create("device", "cpu").default_runner == "cpu"
    runners = plugins.registry("model_runner").names()
    assert "gpu" in runners and "cpu" in runners
    for name in ACCELERATORS:
        assert plugins.create("device", name).default_runner == "gpu"


def test_device_index_selects_the_place() -> None:
    from fdx.config import make_config, split_device
    from fdx.plugins.hardware.cuda import CUDADevice
    from fdx.plugins.hardware.iluvatar import IluvatarDevice
    from fdx.plugins.hardware.xpu import XPUDevice

    assert split_device("cuda:1") == ("cuda", 1) and split_device("cuda") == ("cuda", None)
    assert make_config(device="cuda:3").device == "cuda:3"
    assert CUDADevice(2).paddle_place() == "gpu:2"
    assert XPUDevice(1).paddle_place() == "xpu:1"
    assert IluvatarDevice(0).paddle_place() == "iluvatar_gpu:0"
    for bad in ("cuda:x", "cuda:-1", ":0", "cuda:1.5"):
        with pytest.raises(ConfigError) as e:
            make_config(device=bad)
        assert "\n" not in str(e.value) and "--device" in str(e.value)
    with pytest.raises(ConfigError):
        CUDADevice(-1)


def test_bad_device_index_is_a_one_line_error(plugins) -> None:  # noqa: ANN001
    """An index past the visible devices (or a build without CUDA) stops
    start-up with the device's reason, before any model is loaded."""
    from fdx.config import make_config
    from fdx.core.engine import build_runner

    with pytest.raises(FdxError) as e:
        build_runner(make_config(device="cuda:4096"), plugins)
    msg = str(e.value)
    assert "\n" not in msg and "cuda:4096" in msg and ("requested" in msg or "no cuda support" in msg)
    with pytest.raises(FdxError, match="takes no index"):
        build_runner(make_config(device="cpu:1"), plugins)


def test_cli_rejects_a_bad_device_in_one_line() -> None:
    out = subprocess.run([sys.executable, "-m", "fdx", "serve", "--device", "cuda:zero"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    lines = [ln for ln in out.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "--device cuda:zero" in lines[0]


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


# --------------------------------------------------------------------------
# on a GPU machine
# --------------------------------------------------------------------------


def test_cuda_memory_and_bf16_kv_allocation(cuda_device: Any) -> None:
    dev = cuda_device
    dev.configure_env(None)
    total, avail = dev.memory_info()
    assert total > 0 and 0 < avail <= total
    spec = KVCacheSpec(num_layers=2, num_blocks=4, block_size=16, num_kv_heads=3, head_dim=64, dtype="bfloat16")
    caches = dev.allocate_kv_cache(spec)
    assert len(caches) == 2
    for c in caches:
        assert list(c.shape) == [2, 4, 3, 16, 64] and "bfloat16" in str(c.dtype) and "gpu" in str(c.place).lower()
        assert float(c.astype("float32").abs().sum()) == 0.0


def _greedy(runner: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    from fdx.core.interfaces import ScheduledBatch, ScheduledSeq
    from fdx.core.messages import SamplingParams
    from fdx.core.request import Request

    reqs = []
    for i, p in enumerate(prompts):
        r = Request(f"r{i}", list(p), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                    eos_token_ids=runner.eos_token_ids, max_model_len=runner.max_model_len)
        nb = -(-(len(p) + n) // runner.block_size)
        r.block_ids = list(range(i * nb, (i + 1) * nb))
        reqs.append(r)
    for _ in range(n):
        seqs = [ScheduledSeq(r, r.num_tokens - r.num_computed_tokens) for r in reqs]
        out = runner.execute(ScheduledBatch(seqs))
        for s, t in zip(seqs, out.token_ids):
            s.request.num_computed_tokens += s.num_new_tokens
            s.request.append_token(int(t))
    return [r.output_token_ids for r in reqs]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_runner_on_cuda_matches_cpu_runner(cuda_device: Any, dtype: str) -> None:
    """float32 on the GPU: the same greedy tokens as the cpu runner.
    bfloat16: the same first tokens (later ones may part at near-ties)."""
    from fdx.config import make_config
    from fdx.model.gpu_runner import GPUModelRunner
    from fdx.model.loader import load_tokenizer
    from fdx.model.runner import PaddleModelRunner
    from fdx.plugins.hardware.cpu import CPUDevice

    tok = load_tokenizer(None)
    prompts = [tok.encode_chat([{"role": "user", "content": p}])
               for p in ("What is the capital of France?", "def fibonacci(n):", "Name three colours.")]
    n = 12
    gpu = GPUModelRunner(make_config(num_kv_blocks=64, max_model_len=512, dtype=dtype), cuda_device)
    got = _greedy(gpu, prompts, n)
    del gpu
    cpu = PaddleModelRunner(make_config(num_kv_blocks=64, max_model_len=512), CPUDevice())
    want = _greedy(cpu, prompts, n)
    if dtype == "float32":
        assert got == want
    else:
        assert [g[:3] for g in got] == [w[:3] for w in want]
