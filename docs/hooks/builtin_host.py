"""The built-in plugins' registrations, as every store's plugin host sees them.

Both reference pages (the TOML keys, the plugin classes) are generated from these, so they list
what the code registers. Only the built-in list is registered: plugins installed in the
building environment (entry points) are not tierstore's and stay out of its reference.
"""

from __future__ import annotations

import functools
import importlib

import pluggy

from tierstore import hookspecs
from tierstore.plugin.host import BUILTIN_PLUGINS, KINDS, PluginHost, Registration

__all__ = ["builtin_registrations"]


@functools.cache
def builtin_registrations() -> dict[str, list[Registration]]:
    """Every built-in registration, by kind (in the order of ``KINDS``), sorted by name."""
    pm = pluggy.PluginManager("tierstore")
    pm.add_hookspecs(hookspecs)
    for module in BUILTIN_PLUGINS:
        pm.register(importlib.import_module(module), name=module)
    host = PluginHost(pm, {module: "built-in" for module in BUILTIN_PLUGINS})
    host.collect_registrations()
    return {kind: [host.lookup(kind, name) for name in host.names(kind)] for kind in KINDS}
