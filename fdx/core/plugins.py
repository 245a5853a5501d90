"""Plugin loading and the name -> factory registries.

Plugins come from the entry-point group :data:`ENTRY_POINT_GROUP`.  The
registries are collected once (:func:`collect`); after that a component is
built by name through :meth:`Registry.create` and used through its plain
methods.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import traceback
from typing import Any, Callable, Iterable

import attrs
import pluggy

from fdx.core import hookspecs
from fdx.core.errors import PluginError

ENTRY_POINT_GROUP = "fdx.plugins"
ALLOW_ENV = "FDX_PLUGINS"

#: component kind -> registry hook name
KINDS: dict[str, str] = {
    "scheduler": "fdx_register_schedulers",
    "token_processor": "fdx_register_token_processors",
    "cache_backend": "fdx_register_cache_backends",
    "device": "fdx_register_devices",
    "model_runner": "fdx_register_model_runners",
    "grammar_backend": "fdx_register_grammar_backends",
    "tool_parser": "fdx_register_tool_parsers",
    "kv_connector": "fdx_register_kv_connectors",
    "speculator": "fdx_register_speculators",
    "architecture": "fdx_register_architectures",
    "deployment": "fdx_register_deployments",
}


@attrs.frozen
class PluginInfo:
    """Where a plugin came from."""

    name: str
    distribution: str
    version: str

    def describe(self) -> str:
        return f"plugin {self.name!r} ({self.distribution} {self.version})"


@attrs.frozen
class Entry:
    kind: str
    name: str
    factory: Callable[..., Any]
    source: PluginInfo
    description: str = ""


class Registry:
    """Named factories of one component kind."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.entries: dict[str, Entry] = {}

    def add(self, entry: Entry) -> None:
        old = self.entries.get(entry.name)
        if old is not None:
            raise PluginError(
                f"{self.kind} {entry.name!r} is registered twice: by {old.source.describe()} "
                f"and by {entry.source.describe()}"
            )
        self.entries[entry.name] = entry

    def names(self) -> list[str]:
        return sorted(self.entries)

    def get(self, name: str) -> Entry:
        try:
            return self.entries[name]
        except KeyError:
            choices = ", ".join(self.names()) or "(none installed)"
            raise PluginError(f"unknown {self.kind} {name!r}; choices: {choices}") from None

    def create(self, name: str, **kwargs: Any) -> Any:
        return self.get(name).factory(**kwargs)


@attrs.define
class Plugins:
    """A plugin manager plus the registries collected from it."""

    pm: pluggy.PluginManager
    registries: dict[str, Registry]
    infos: dict[str, PluginInfo]  # plugin name -> info

    @property
    def hook(self) -> Any:
        return self.pm.hook

    def registry(self, kind: str) -> Registry:
        return self.registries[kind]

    def create(self, kind: str, name: str, **kwargs: Any) -> Any:
        return self.registries[kind].create(name, **kwargs)


def new_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    return pm


def _allowed(name: str, dist: str, allow: set[str] | None, disabled: set[str]) -> bool:
    if name in disabled or dist in disabled:
        return False
    return allow is None or name in allow or dist in allow


def load_entry_points(pm: pluggy.PluginManager, disabled: Iterable[str] = ()) -> dict[str, PluginInfo]:
    """Import and register every plugin of :data:`ENTRY_POINT_GROUP`.

    ``FDX_PLUGINS`` (comma-separated plugin or distribution names) is an
    allow-list; ``disabled`` is a deny-list.  A plugin that fails to import
    raises :class:`PluginError` naming the plugin, its distribution and the
    exception (with traceback).
    """
    allow_env = os.environ.get(ALLOW_ENV, "").strip()
    allow = {x.strip() for x in allow_env.split(",") if x.strip()} if allow_env else None
    deny = set(disabled)
    infos: dict[str, PluginInfo] = {}
    for ep in md.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist is not None else "?"
        version = ep.dist.version if ep.dist is not None else "?"
        if not _allowed(ep.name, dist, allow, deny):
            continue
        info = PluginInfo(ep.name, dist, version)
        try:
            obj = ep.load()
        except Exception as exc:  # noqa: BLE001 - reported, never swallowed
            tb = traceback.format_exc()
            raise PluginError(
                f"{info.describe()} failed to load: {type(exc).__name__}: {exc}", details=tb
            ) from exc
        if pm.get_plugin(ep.name) is None:
            pm.register(obj, name=ep.name)
        infos[ep.name] = info
    return infos


def collect(pm: pluggy.PluginManager, infos: dict[str, PluginInfo] | None = None) -> Plugins:
    """Call every registry hook once and build the registries.

    Plugins registered on ``pm`` without an entry point (``pm.register(obj)``
    in tests) are described as distribution ``<registered>``.
    """
    infos = dict(infos or {})
    registries = {kind: Registry(kind) for kind in KINDS}
    for kind, hook_name in KINDS.items():
        hook = getattr(pm.hook, hook_name)
        for impl in hook.get_hookimpls():
            pname = pm.get_name(impl.plugin) or repr(impl.plugin)
            info = infos.setdefault(pname, PluginInfo(pname, "<registered>", "-"))

            def register(
                name: str,
                factory: Callable[..., Any],
                *,
                description: str = "",
                _kind: str = kind,
                _info: PluginInfo = info,
            ) -> None:
                registries[_kind].add(Entry(_kind, name, factory, _info, description))

            try:
                impl.function(register=register)
            except PluginError:
                raise
            except Exception as exc:  # noqa: BLE001
                raise PluginError(
                    f"{info.describe()} failed in {hook_name}: {type(exc).__name__}: {exc}",
                    details=traceback.format_exc(),
                ) from exc
    return Plugins(pm, registries, infos)


def load_plugins(disabled: Iterable[str] = (), extra: Iterable[Any] = ()) -> Plugins:
    """The normal start-up path: entry points (+ ``extra`` objects) -> registries."""
    pm = new_plugin_manager()
    infos = load_entry_points(pm, disabled)
    for obj in extra:
        pm.register(obj)
    return collect(pm, infos)


_default: Plugins | None = None


def get_plugins(disabled: Iterable[str] = ()) -> Plugins:
    """Process-wide plugins, loaded on first use."""
    global _default
    if _default is None:
        _default = load_plugins(disabled)
    return _default


def set_plugins(plugins: Plugins | None) -> None:
    """Install (or clear, with ``None``) the process-wide plugins; for tests
    and for processes that received their plugin set from a parent."""
    global _default
    _default = plugins
