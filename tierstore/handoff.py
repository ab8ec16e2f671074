"""Saves handed to DCP's checkpoint process (``AsyncCheckpointerType.PROCESS``).

DCP pickles the storage writer and sends it to a long-lived process of its own, which calls it
like any writer. That process opens the same store from a :class:`StoreSpec` (the config and the
plugins, by reference) and writes and commits the first tier; it leaves drains to slower tiers
and retention to the training process, whose store owns the drain threads, ``wait()`` and the
exit handler (see ``Store.adopt_handed_off_saves``).
"""

from __future__ import annotations

import importlib
import threading
import types
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tierstore.store import Store

__all__ = ["StoreSpec", "checkpoint_process_store"]


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


_stores: dict[str, "Store"] = {}
_stores_lock = threading.Lock()


def checkpoint_process_store(spec: StoreSpec) -> "Store":
    """The store of this (checkpoint) process for ``spec``, opened on first use.

    Opening is collective under torch.distributed; DCP calls ``writer.reset`` on every rank in
    the same order, which is where this runs."""
    from tierstore.store import Store

    with _stores_lock:
        store = _stores.get(spec.key)
        if store is None:
            store = Store(spec.config, plugins=spec.resolved_plugins(), hand_off=True)
            _stores[spec.key] = store
        return store
