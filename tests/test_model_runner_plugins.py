"""Model runners are a plugin kind: a runner registered programmatically
serves requests through ``fdx serve``'s own parsing path, the device picks
the default, and an unknown name lists the choices."""

from __future__ import annotations

import pytest

import fdx.core.hookspecs
import fdx.plugins.hardware.cpu
import fdx.plugins.schedulers.v1
import fdx.plugins.token_processors.default
import fdx.plugins.grammar.llguidance_backend
import fdx.plugins.tool_parsers.hermes
from fdx.cli import build_parser, config_from_args
from fdx.core.errors import PluginError
from fdx.core.plugins import collect, set_plugins
from fdx.testing import EchoRunner, EchoRunnerPlugin

# the built-ins the CLI checks at start-up for its defaults (scheduler, token
# processor, grammar backend, tool parser, device); the model runner is the toy
BUILTINS = (fdx.plugins.hardware.cpu, fdx.plugins.schedulers.v1, fdx.plugins.token_processors.default,
            fdx.plugins.grammar.llguidance_backend, fdx.plugins.tool_parsers.hermes)


def _plugins(pm, *extra):  # type: ignore[no-untyped-def]
    for mod in BUILTINS:
        pm.register(mod)
    for obj in extra:
        pm.register(obj)
    return collect(pm)


def test_toy_runner_serves_requests_through_the_serve_path(plugin_manager) -> None:  # type: ignore[no-untyped-def]
    toy = EchoRunnerPlugin()
    try:
        plugins = _plugins(plugin_manager, toy)
        assert plugins.registry("model_runner").names() == ["echo"]
        args = build_parser(plugins).parse_args(["serve", "--model-runner", "echo", "--num-kv-blocks", "32"])
        cfg = config_from_args(args, plugins)
        assert cfg.model_runner == "echo"
        set_plugins(plugins)
        try:
            import fdx

            llm = fdx.LLM(model=cfg.model, model_runner=cfg.model_runner, num_kv_blocks=cfg.num_kv_blocks)
            assert isinstance(llm.engine.runner, EchoRunner)
            prompts = ["The capital of France is", "Once upon a time there was"]
            ids = [llm.tokenizer.encode(p, add_special_tokens=True) for p in prompts]
            results = llm.generate(prompts, [fdx.SamplingParams(temperature=0, max_tokens=len(i)) for i in ids])
        finally:
            set_plugins(None)
        for res, want in zip(results, ids):
            assert list(res.token_ids) == want  # the echo runner repeats the prompt
            assert res.finish_reason == "length"
            assert res.text == llm.tokenizer.decode(want)
        assert llm.engine.kv.num_used_blocks == 0
    finally:
        plugin_manager.unregister(toy)


def test_runner_defaults_to_the_devices_choice(plugin_manager) -> None:  # type: ignore[no-untyped-def]
    from fdx.config import make_config
    from fdx.core.engine import build_runner
    from fdx.core.interfaces import Device

    class EchoDevice(fdx.plugins.hardware.cpu.CPUDevice):
        name = "echo-device"
        default_runner = "echo"

    class DevicePlugin:
        @fdx.core.hookspecs.hookimpl
        def fdx_register_devices(self, register):  # type: ignore[no-untyped-def]
            register("echo-device", EchoDevice)

    dev, toy = DevicePlugin(), EchoRunnerPlugin()
    try:
        plugins = _plugins(plugin_manager, dev, toy)
        runner = build_runner(make_config(device="echo-device", num_kv_blocks=8), plugins)
        assert isinstance(runner, EchoRunner) and isinstance(runner.device, EchoDevice)
        assert Device.default_runner == "cpu" and fdx.plugins.hardware.cpu.CPUDevice.default_runner == "cpu"
        with pytest.raises(PluginError, match=r"unknown model_runner 'cpu'; choices: echo"):
            build_runner(make_config(num_kv_blocks=8), plugins)  # cpu's default runner is not registered here
    finally:
        plugin_manager.unregister(dev)
        plugin_manager.unregister(toy)


def test_kv_cache_dtype_must_be_what_the_runner_keeps(plugin_manager) -> None:  # type: ignore[no-untyped-def]
    """``--kv-cache-dtype`` is not silently ignored by a third-party runner:
    one that does not name its KV dtype (the echo runner) is refused any
    value but auto, one that names it is refused any other value."""
    from fdx.config import make_config
    from fdx.core.engine import build_runner
    from fdx.core.errors import FdxError

    class Bf16Echo(EchoRunner):
        kv_cache_dtype = "bfloat16"

    class Bf16Plugin:
        @fdx.core.hookspecs.hookimpl
        def fdx_register_model_runners(self, register):  # type: ignore[no-untyped-def]
            register("echo-bf16", Bf16Echo)

    toy, bf16 = EchoRunnerPlugin(), Bf16Plugin()
    try:
        plugins = _plugins(plugin_manager, toy, bf16)
        assert isinstance(build_runner(make_config(model_runner="echo", num_kv_blocks=8), plugins), EchoRunner)
        with pytest.raises(FdxError, match=r"--kv-cache-dtype float32: the echo model runner does not implement it"):
            build_runner(make_config(model_runner="echo", num_kv_blocks=8, kv_cache_dtype="float32"), plugins)
        assert build_runner(make_config(model_runner="echo-bf16", num_kv_blocks=8, kv_cache_dtype="bfloat16"),
                            plugins).kv_cache_dtype == "bfloat16"
        with pytest.raises(FdxError, match=r"the echo-bf16 model runner keeps its KV cache in bfloat16"):
            build_runner(make_config(model_runner="echo-bf16", num_kv_blocks=8, kv_cache_dtype="float32"), plugins)
    finally:
        plugin_manager.unregister(toy)
        plugin_manager.unregister(bf16)


def test_unknown_runner_name_lists_the_choices(plugin_manager) -> None:  # type: ignore[no-untyped-def]
    toy = EchoRunnerPlugin()
    try:
        plugins = _plugins(plugin_manager, toy)
        args = build_parser(plugins).parse_args(["serve", "--model-runner", "nope"])
        with pytest.raises(PluginError, match=r"unknown model_runner 'nope'; choices: echo"):
            config_from_args(args, plugins)
    finally:
        plugin_manager.unregister(toy)


def test_builtin_cpu_runner_is_an_entry_point() -> None:
    from fdx.core.plugins import load_entry_points, new_plugin_manager

    pm = new_plugin_manager()
    plugins = collect(pm, load_entry_points(pm))
    entry = plugins.registry("model_runner").get("cpu")
    assert entry.source.distribution == "fdx" and entry.source.name == "model_runner_cpu"
