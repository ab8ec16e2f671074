"""torchtitan checkpointing through tierstore (``pip install 'tierstore[torchtitan]'``).

torchtitan's trainer builds its checkpointer from its config (``config.checkpoint.build(...)``),
so choosing this manager there is the whole change; the trainer's calls (``load`` at the start,
``save`` every step, ``maybe_wait_for_staging`` before the optimizer step) stay as they are::

    from tierstore.integrations.torchtitan import TierstoreCheckpointManager

    checkpoint=TierstoreCheckpointManager.Config(
        enable=True, tiers="tiers.toml", interval=10, async_mode="async_with_pinned_mem"),

- :mod:`~tierstore.integrations.torchtitan.manager`: :class:`TierstoreCheckpointManager` and the
  mixin it is made of, :class:`TierstoreCheckpointMixin` (for a subclass of torchtitan's
  manager, such as its torchft one).
- :mod:`~tierstore.integrations.torchtitan.settings`: ``async_mode`` -> eager or lazy staging,
  and ``keep_latest_k`` against the tiers' ``keep``.
- :mod:`~tierstore.integrations.torchtitan.ids`: torchtitan's ``step-<N>`` checkpoints and the
  store's ids.

Nothing of torchtitan is imported until the manager is asked for.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TierstoreCheckpointManager", "TierstoreCheckpointMixin"]


def __getattr__(name: str) -> Any:
    # The manager subclasses torchtitan's: import it (and torchtitan) only when asked for, and
    # say how to install it when it is missing.
    if name in __all__:
        try:
            from tierstore.integrations.torchtitan import manager
        except ModuleNotFoundError as exc:
            if exc.name is None or exc.name.split(".")[0] != "torchtitan":
                raise
            raise ModuleNotFoundError(
                f"tierstore.integrations.torchtitan.{name} needs torchtitan, which is not "
                f"installed here: pip install 'tierstore[torchtitan]'", name=exc.name) from exc
        return getattr(manager, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
