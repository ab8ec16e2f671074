"""Builds one pluggy plugin manager per store and the registry of named factories.

Plugins come from three places, in this order: the built-in list below, the entry-point group
``tierstore`` of installed distributions, and the modules named in ``[store] plugins``. No global
manager exists: ``tierstore.open()`` calls :func:`build_plugin_host` each time.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

import pluggy

from tierstore import hookspecs
from tierstore.errors import PluginError
from tierstore.events import Event
from tierstore.plugin.bases import Backend, Codec, CommitProtocol, ReplicationStrategy, Stager

__all__ = ["BUILTIN_PLUGINS", "KINDS", "Registration", "PluginHost", "build_plugin_host",
           "hookimpl"]

log = logging.getLogger("tierstore.plugins")

hookimpl = pluggy.HookimplMarker("tierstore")

#: Built-in plugins, one module per feature, registered by every store.
BUILTIN_PLUGINS: tuple[str, ...] = (
    "tierstore_plugins.local",
    "tierstore_plugins.atomic",
    "tierstore_plugins.manifest_last",
    "tierstore_plugins.fsspec_backend",
    "tierstore_plugins.obstore_backend",
    "tierstore_plugins.staging_cpu",
    "tierstore_plugins.zstd",
    "tierstore_plugins.peer",
    "tierstore_plugins.replication",
)

ENTRY_POINT_GROUP = "tierstore"


@dataclass(frozen=True)
class Kind:
    """A plugin kind: its registration hook and the base class its factories build."""

    name: str
    hook: str
    base: type
    config_key: str


KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind("backend", "tierstore_register_backends", Backend, "backend"),
        Kind("commit", "tierstore_register_commit_protocols", CommitProtocol, "commit"),
        Kind("codec", "tierstore_register_codecs", Codec, "codecs"),
        Kind("staging", "tierstore_register_staging", Stager, "staging"),
        Kind("replication", "tierstore_register_replication_strategies", ReplicationStrategy,
             "replication.strategy"),
    )
}


@dataclass(frozen=True)
class Registration:
    """A named factory and who registered it (for messages and ``tierstore plugins``)."""

    kind: str
    name: str
    factory: Callable[..., Any]
    plugin: str
    origin: str

    @property
    def options(self) -> tuple:
        """Config keys the factory declares (empty when it declares none)."""
        return tuple(getattr(self.factory, "options", ()))


class PluginHost:
    """Typed facade over the plugin manager: the core never calls ``pm.hook.x`` untyped."""

    def __init__(self, pm: pluggy.PluginManager, origins: dict[str, str]):
        self.pm = pm
        self.origins = origins
        self.registry: dict[str, dict[str, Registration]] = {k: {} for k in KINDS}

    # -- registry --------------------------------------------------------------------------
    def collect_registrations(self) -> None:
        """Call every registration hook one plugin at a time so each name knows its owner."""
        for kind in KINDS.values():
            caller = getattr(self.pm.hook, kind.hook)
            for impl in caller.get_hookimpls():
                register = self._register_callback(kind, impl.plugin_name)
                try:
                    impl.function(register=register)
                except PluginError:
                    raise
                except Exception as exc:
                    raise PluginError(
                        f"plugin '{impl.plugin_name}' ({self.origin(impl.plugin_name)}) failed in "
                        f"{kind.hook}: {type(exc).__name__}: {exc}"
                    ) from exc

    def _register_callback(self, kind: Kind, plugin: str) -> Callable[..., None]:
        def register(name: str, factory: Callable[..., Any]) -> None:
            if not isinstance(name, str) or not name:
                raise PluginError(
                    f"plugin '{plugin}' ({self.origin(plugin)}) registered a {kind.name} with "
                    f"an invalid name {name!r}; names are non-empty strings"
                )
            if isinstance(factory, type) and not issubclass(factory, kind.base):
                raise PluginError(
                    f"plugin '{plugin}' ({self.origin(plugin)}) registered {kind.name} '{name}' as "
                    f"{factory.__qualname__}, which does not subclass "
                    f"tierstore.plugin.{kind.base.__name__}"
                )
            if not callable(factory):
                raise PluginError(
                    f"plugin '{plugin}' ({self.origin(plugin)}) registered {kind.name} '{name}' "
                    f"with {factory!r}, which is not callable; pass a class or factory function"
                )
            existing = self.registry[kind.name].get(name)
            if existing is not None:
                raise PluginError(
                    f"{kind.name} '{name}' is registered twice: by plugin '{existing.plugin}' "
                    f"({existing.origin}) and by plugin '{plugin}' ({self.origin(plugin)}); "
                    f"rename one of them or remove one plugin"
                )
            self.registry[kind.name][name] = Registration(
                kind.name, name, factory, plugin, self.origin(plugin)
            )

        return register

    def origin(self, plugin: str) -> str:
        """Where a plugin came from, in words."""
        return self.origins.get(plugin, "registered at run time")

    def names(self, kind: str) -> list[str]:
        """Registered names of a kind, sorted."""
        return sorted(self.registry[kind])

    def lookup(self, kind: str, name: str) -> Registration | None:
        """The registration for ``name`` or None."""
        return self.registry[kind].get(name)

    # -- lifecycle hooks -------------------------------------------------------------------
    def phase(self, phase: str, checkpoint_id: str | None = None, tier: str | None = None,
              rank: int = 0, **detail: Any) -> None:
        """Announce that ``phase`` starts; exceptions from plugins propagate on purpose."""
        self.pm.hook.tierstore_phase(phase=phase, checkpoint_id=checkpoint_id, tier=tier,
                                     rank=rank, detail=detail)

    def event(self, event: Event) -> None:
        """Deliver an event to every observer through pluggy's own call path (so
        ``@hookimpl(wrapper=True)`` observers wrap the others); a failing observer is logged,
        never fatal, and the others still get the event (see :meth:`isolate_observers`)."""
        try:
            self.pm.hook.tierstore_event(event=event)
        except Exception:  # a wrapper's own failure; plain observers are isolated already
            log.exception("an observer wrapper failed on event %s", event.kind)

    def isolate_observers(self) -> None:
        """Make each plain ``tierstore_event`` implementation log its exceptions instead of
        raising them, so that one failing observer never stops the others (pluggy stops a
        hook call at the first exception). Wrappers are left as they are: they see the
        outcome of the others."""
        for impl in self.pm.hook.tierstore_event.get_hookimpls():
            if not (impl.wrapper or impl.hookwrapper):
                impl.function = _isolated(impl.function, impl.plugin_name)

    def store_opened(self, store: Any) -> None:
        self.pm.hook.tierstore_store_opened(store=store)

    def store_closing(self, store: Any) -> None:
        self.pm.hook.tierstore_store_closing(store=store)


def _isolated(function: Callable[..., Any], plugin: str) -> Callable[..., Any]:
    """``function`` (an observer's ``tierstore_event``), logging its exceptions."""

    def observe(*args: Any) -> None:
        try:
            function(*args)
        except Exception:  # observers must not break checkpointing
            log.exception("observer '%s' failed on an event", plugin)

    return observe


def _register(pm: pluggy.PluginManager, plugin: object, name: str, origin: str,
              origins: dict[str, str]) -> None:
    if pm.has_plugin(name) or pm.get_plugin(name) is not None:
        return  # the same module named twice (e.g. entry point and [store] plugins)
    if plugin in pm.get_plugins():
        return
    origins[name] = origin
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as exc:
        raise PluginError(
            f"plugin '{name}' ({origin}) has a bad hook: {exc}. Hooks and their arguments are "
            f"listed in tierstore/hookspecs.py; an implementation may take a subset of them"
        ) from exc
    except ValueError as exc:
        raise PluginError(f"plugin '{name}' ({origin}) could not be registered: {exc}") from exc


def _import(module: str, origin: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except Exception as exc:
        raise PluginError(
            f"plugin module '{module}' ({origin}) failed to import: {type(exc).__name__}: {exc}. "
            f"Check that it is installed in this environment (python -c 'import {module}')"
        ) from exc


def build_plugin_host(extra_modules: list[str] | tuple[str, ...] = (),
                      extra_origin: str = "[store] plugins",
                      extra_plugins: tuple[object, ...] = (),
                      store_builtins: dict[str, object] | None = None) -> PluginHost:
    """A fresh plugin manager with built-ins, entry points and ``extra_modules`` registered and
    every registration hook collected. ``store_builtins`` are built-in plugin objects that hold
    one store's state (the stats observer), by name. Raises PluginError on any plugin problem."""
    pm = pluggy.PluginManager("tierstore")
    pm.add_hookspecs(hookspecs)
    origins: dict[str, str] = {}
    for module in BUILTIN_PLUGINS:
        _register(pm, _import(module, "built-in"), module, "built-in", origins)
    for name, plugin in (store_builtins or {}).items():
        _register(pm, plugin, name, "built-in", origins)
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        where = f"entry point '{ep.name} = {ep.value}'" + (
            f" of distribution {dist.name} {dist.version}" if dist is not None else "")
        try:
            plugin = ep.load()
        except Exception as exc:
            raise PluginError(
                f"plugin '{ep.name}' ({where}) failed to load: {type(exc).__name__}: {exc}. "
                f"Reinstall or uninstall that distribution"
            ) from exc
        _register(pm, plugin, ep.name, where, origins)
    for module in extra_modules:
        _register(pm, _import(module, extra_origin), module, extra_origin, origins)
    for i, plugin in enumerate(extra_plugins):
        name = getattr(plugin, "__name__", None) or f"{type(plugin).__name__}-{i}"
        _register(pm, plugin, name, "passed to tierstore.open(plugins=...)", origins)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        plugin_name = pm.get_name(exc.plugin) or "?"
        raise PluginError(
            f"plugin '{plugin_name}' ({origins.get(plugin_name, '?')}): {exc}. Hook names start "
            f"with 'tierstore_' and must be one of those in tierstore/hookspecs.py: "
            f"{', '.join(sorted(h for h in dir(hookspecs) if h.startswith('tierstore_')))}"
        ) from exc
    host = PluginHost(pm, origins)
    host.collect_registrations()
    host.isolate_observers()
    return host
