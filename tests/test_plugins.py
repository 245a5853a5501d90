"""Plugin loading, registries and name errors."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fdx.core.errors import PluginError
from fdx.core.hookspecs import hookimpl
from fdx.core.plugins import collect, load_entry_points

KINDS = ("scheduler", "token_processor", "cache_backend", "device", "model_runner")


class _Alpha:
    @hookimpl
    def fdx_register_schedulers(self, register):  # type: ignore[no-untyped-def]
        register("alpha", lambda config, kv: ("alpha-sched", config, kv), description="test")

    @hookimpl
    def fdx_register_devices(self, register):  # type: ignore[no-untyped-def]
        register("fake", lambda: "fake-device")


class _Beta:
    @hookimpl
    def fdx_register_schedulers(self, register):  # type: ignore[no-untyped-def]
        register("alpha", lambda config, kv: None)


class _Broken:
    @hookimpl
    def fdx_register_cache_backends(self, register):  # type: ignore[no-untyped-def]
        raise RuntimeError("backend table corrupt")


def test_registered_factories_are_built_by_name(plugin_manager) -> None:  # type: ignore[no-untyped-def]
    plugin_manager.register(_Alpha(), name="alpha-plugin")
    plugins = collect(plugin_manager)
    assert plugins.registry("scheduler").names() == ["alpha"]
    assert plugins.create("scheduler", "alpha", config=1, kv=2) == ("alpha-sched", 1, 2)
    assert plugins.create("device", "fake") == "fake-device"
    entry = plugins.registry("scheduler").get("alpha")
    assert entry.source.name == "alpha-plugin" and entry.description == "test"


def test_unknown_name_lists_choices(plugin_manager) -> None:  # type: ignore[no-untyped-def]
    plugin_manager.register(_Alpha(), name="alpha-plugin")
    plugins = collect(plugin_manager)
    with pytest.raises(PluginError, match=r"unknown scheduler 'nope'; choices: alpha"):
        plugins.create("scheduler", "nope", config=None, kv=None)
    with pytest.raises(PluginError, match=r"unknown cache_backend 'x'; choices: \(none installed\)"):
        plugins.registry("cache_backend").get("x")


def test_duplicate_name_names_both_plugins(plugin_manager) -> None:  # type: ignore[no-untyped-def]
    plugin_manager.register(_Alpha(), name="alpha-plugin")
    plugin_manager.register(_Beta(), name="beta-plugin")
    with pytest.raises(PluginError) as info:
        collect(plugin_manager)
    msg = str(info.value)
    assert "registered twice" in msg and "alpha-plugin" in msg and "beta-plugin" in msg


def test_failing_registry_hook_is_reported(plugin_manager) -> None:  # type: ignore[no-untyped-def]
    plugin_manager.register(_Broken(), name="broken-plugin")
    with pytest.raises(PluginError, match="broken-plugin.*RuntimeError: backend table corrupt") as info:
        collect(plugin_manager)
    assert "Traceback" in (info.value.details or "")


def test_fixture_starts_without_entry_points(plugin_manager) -> None:  # type: ignore[no-untyped-def]
    plugins = collect(plugin_manager)
    assert all(not plugins.registry(k).names() for k in KINDS)


def test_builtins_cover_all_four_kinds() -> None:
    from fdx.core.plugins import new_plugin_manager

    pm = new_plugin_manager()
    plugins = collect(pm, load_entry_points(pm))
    for kind in KINDS:
        assert plugins.registry(kind).names(), f"no built-in {kind}"
    assert {"v0", "v1"} <= set(plugins.registry("scheduler").names())
    assert "cpu" in plugins.registry("device").names()
    assert plugins.registry("scheduler").get("v1").source.distribution == "fdx"


# ---------------------------------------------------------------------------
# A third-party distribution whose plugin raises on import, installed on a
# temporary sys.path entry (a real dist-info with an entry_points.txt).
# ---------------------------------------------------------------------------


@pytest.fixture
def broken_dist(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "fdx_broken_plugin.py").write_text("raise ImportError('needs libfrobnicate')\n")
    info = tmp_path / "fdx_broken_plugin-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fdx-broken-plugin\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text("[fdx.plugins]\nbroken = fdx_broken_plugin\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tmp_path) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("FDX_PLUGINS", None)
    return env


def _fdx(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fdx", *args], env=env, capture_output=True, text=True, timeout=60)


def test_plugin_that_raises_on_import_stops_serve(broken_dist: dict[str, str]) -> None:
    r = _fdx(broken_dist, "serve", "--port", "0")
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("fdx: error: plugin 'broken' (fdx-broken-plugin 0.3) failed to load")
    assert "ImportError: needs libfrobnicate" in last
    assert "Traceback" in r.stderr


def test_disable_plugin_and_allow_list_skip_the_broken_plugin(broken_dist: dict[str, str]) -> None:
    r = _fdx(broken_dist, "plugins", "--disable-plugin", "broken")
    assert r.returncode == 0, r.stderr
    assert "scheduler" in r.stdout and "fdx-broken-plugin" not in r.stdout
    env = dict(broken_dist, FDX_PLUGINS="fdx")  # allow only the fdx distribution
    r = _fdx(env, "plugins")
    assert r.returncode == 0, r.stderr
    assert "v1" in r.stdout


def test_plugins_command_lists_kind_name_distribution_version_without_paddle() -> None:
    code = textwrap.dedent(
        """
        import sys
        from fdx.cli import main
        rc = main(["plugins"])
        assert rc == 0
        assert "paddle" not in sys.modules, "fdx plugins imported paddle"
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[:5] == ["KIND", "NAME", "PLUGIN", "DISTRIBUTION", "VERSION"]
    kinds = {ln.split()[0] for ln in lines[1:]}
    assert set(KINDS) <= kinds
    v1 = next(ln.split() for ln in lines[1:] if ln.split()[:2] == ["scheduler", "v1"])
    assert v1[3] == "fdx" and v1[4] == "0.1.0"


def test_help_does_not_import_paddle() -> None:
    code = "import sys\nfrom fdx.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\nassert 'paddle' not in sys.modules\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "serve" in r.stdout and "plugins" in r.stdout


def test_unknown_component_name_fails_with_choices() -> None:
    r = subprocess.run([sys.executable, "-m", "fdx", "serve", "--scheduler", "nope"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "unknown scheduler 'nope'; choices:" in r.stderr and "v1" in r.stderr


def test_every_hookspec_documents_each_argument() -> None:
    """pytest's style: typed parameters, a ``:param:`` line for each."""
    import inspect

    from fdx.core import hookspecs

    for name, fn in inspect.getmembers(hookspecs, inspect.isfunction):
        if not name.startswith("fdx_"):
            continue
        sig = inspect.signature(fn)
        doc = inspect.getdoc(fn) or ""
        for arg, p in sig.parameters.items():
            assert f":param {arg}:" in doc, f"{name}: no ':param {arg}:'"
            assert p.annotation is not inspect.Parameter.empty and "Any" not in str(p.annotation), f"{name}({arg}) untyped"
        assert "Return" in doc, f"{name}: says nothing about its return value"
