"""How to open the same store again in another process (DCP's checkpoint process)."""

from __future__ import annotations

import importlib
import types
import uuid
from dataclasses import dataclass, field
from typing import Any

__all__ = ["StoreSpec"]


@dataclass(frozen=True)
class StoreSpec:
    """What it takes to open a store again in another process: the config as given to
    ``tierstore.open`` (a path or a dict) and the extra plugins (modules by name)."""

    config: Any
    plugins: tuple[Any, ...] = ()
    key: str = field(default_factory=lambda: uuid.uuid4().hex)

    @classmethod
    def of(cls, config: Any, plugins: tuple[object, ...]) -> "StoreSpec":
        """A spec for ``tierstore.open(config, plugins=plugins)``; plugin modules travel by name,
        other plugin objects must be picklable."""
        refs = tuple(_ModuleRef(p.__name__) if isinstance(p, types.ModuleType) else p
                     for p in plugins)
        return cls(config if isinstance(config, (str, dict)) else str(config), refs)

    def resolved_plugins(self) -> tuple[object, ...]:
        """The plugin objects, modules imported again."""
        return tuple(importlib.import_module(p.name) if isinstance(p, _ModuleRef) else p
                     for p in self.plugins)


@dataclass(frozen=True)
class _ModuleRef:
    name: str
