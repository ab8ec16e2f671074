"""tierstore's built-in plugins (import name ``tierstore_plugins``), one module per feature.

They are registered from a list in the core (``tierstore.plugin.host.BUILTIN_PLUGINS``), use the
same hooks as third-party plugins and import only the public plugin API, ``tierstore.plugin``
(an import-linter contract in ``pyproject.toml`` checks it). Its docstring shows how to write
your own; ``examples/tierstore-example-plugin`` is a complete plugin package, and the
conformance kit ``tierstore_conformance`` checks a plugin of any kind.
"""
