"""Every hook tierstore calls, grouped by lifecycle. Plugins implement them with
``@tierstore.hookimpl``.

Registration hooks run once, when ``tierstore.open()`` builds its plugin manager, on every rank.
Each receives a ``register(name, factory)`` callback: the core owns the names, so two plugins
claiming one name is a :class:`~tierstore.PluginError` naming both. A factory is called with the
validated options of its config table as keyword arguments (backends also get ``root``).

Lifecycle hooks run while the store works; they are called on the rank where the thing happens,
through pluggy's own call path: ``@tierstore.hookimpl(wrapper=True)`` implementations wrap the
others (to time them, trace them, or retry), as pluggy documents.

Layer: plugin (with ``tierstore.plugin``); it imports nothing of tierstore but the events, and
those only for type checking.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import pluggy

if TYPE_CHECKING:
    from tierstore.events import Event

#: what ``tierstore_store_opened`` / ``tierstore_store_closing`` receive: the ``tierstore.Store``
#: (named, not imported: this layer sits below the store)
Store = Any

hookspec = pluggy.HookspecMarker("tierstore")

Register = Callable[..., None]

# -- registration (once per store, all ranks) ------------------------------------------------


@hookspec
def tierstore_register_backends(register: Register) -> None:
    """Register persistence backends: ``register("local", LocalBackend)``.

    Called once per ``tierstore.open()``, on every rank. A tier's ``backend`` key names one of
    these. Factories subclass :class:`tierstore.plugin.Backend`. Returns nothing; not
    firstresult (every implementation is called).
    """


@hookspec
def tierstore_register_commit_protocols(register: Register) -> None:
    """Register commit protocols: ``register("atomic", AtomicCommit)``.

    Called once per ``tierstore.open()``, on every rank. ``[store] commit`` names one; by default
    each backend's ``default_commit``. Factories subclass :class:`tierstore.plugin.CommitProtocol`.
    Returns nothing; not firstresult.
    """


@hookspec
def tierstore_register_codecs(register: Register) -> None:
    """Register codecs: ``register("zstd", ZstdCodec)``.

    Called once per ``tierstore.open()``, on every rank. A tier's ``codecs`` list names them in
    the order they are applied on write. Factories subclass :class:`tierstore.plugin.Codec`.
    Returns nothing; not firstresult.
    """


@hookspec
def tierstore_register_staging(register: Register) -> None:
    """Register staging plugins: ``register("cpu", CpuStager)``.

    Called once per ``tierstore.open()``, on every rank. ``[store] staging`` names one.
    Factories subclass :class:`tierstore.plugin.Stager`. Returns nothing; not firstresult.
    """


@hookspec
def tierstore_register_replication_strategies(register: Register) -> None:
    """Register replication strategies: ``register("clique", CliqueStrategy)``.

    Called once per ``tierstore.open()``, on every rank. A peer tier's ``replication.strategy``
    names one. Factories subclass :class:`tierstore.plugin.ReplicationStrategy`. Returns
    nothing; not firstresult.
    """


# -- lifecycle (while the store works) --------------------------------------------------------


@hookspec
def tierstore_store_opened(store: Store) -> None:
    """Called at the end of ``tierstore.open()``, on every rank, once the config is validated and
    the tiers are built. Observers can keep a reference to the store. Returns nothing; not
    firstresult."""


@hookspec
def tierstore_store_closing(store: Store) -> None:
    """Called at the start of ``Store.close()`` on every rank, before background work is waited
    for and backends are closed. Returns nothing; not firstresult."""


@hookspec
def tierstore_phase(phase: str, checkpoint_id: str | None, tier: str | None, rank: int,
                    detail: dict[str, Any]) -> None:
    """Called just *before* the engine enters ``phase`` (one of :class:`tierstore.events.Phase`),
    on the rank that runs it. Raising an exception here fails the operation as a real fault at
    that point would (the fault-injection suite uses this); a plugin may also time phases.
    ``detail`` carries phase-specific data, e.g. ``{"file": "__0_0.distcp"}``. Returns nothing;
    not firstresult.
    """


@hookspec
def tierstore_event(event: Event) -> None:
    """Called after something happened (:class:`tierstore.events.Event`: staged, written,
    committed, evicted, collected, fell back, failed, ...), on the rank where it happened, with
    its duration and byte count. Observers must not raise; exceptions are logged and ignored.
    Returns nothing; not firstresult."""
