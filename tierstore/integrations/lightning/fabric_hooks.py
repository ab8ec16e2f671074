"""Fabric's strategies checkpointing through tierstore, for either Lightning package.

:func:`build` makes tierstore's ``ModelParallelStrategy`` and ``FSDPStrategy`` for the Fabric of
``lightning.fabric`` or of ``lightning_fabric``; :mod:`~tierstore.integrations.lightning.fabric`
and :mod:`~tierstore.integrations.lightning.lightning_fabric` export them.

``fabric.save(path, state)`` and ``fabric.load(path, state)`` keep their meaning: the modules
and optimizers in ``state`` go to DCP as their sharded state dicts (torch's distributed
state-dict API, for FSDP2 and FSDP1 alike), everything else (what Lightning's own strategies
pickle into ``meta.pt`` on rank 0) goes into the same checkpoint
(:mod:`~tierstore.integrations.lightning.record`), all through the store's writer, and
``fabric.save`` returns once the state is staged. ``path`` names the checkpoint
(:mod:`~tierstore.integrations.lightning.paths`: its directory and its file name), and a pointer
file appears there once it has committed; ``fabric.load(path, ...)`` loads the checkpoint that
pointer names. The newest complete checkpoint saved into a directory is
``fabric.strategy.latest_checkpoint(dirpath)`` (a path, or None): another run's checkpoints in a
store it shares are not that directory's. Call ``fabric.strategy.teardown()`` at the end: it
waits for the last save and the copies to slower tiers and closes the store.
"""

from __future__ import annotations

import os
from importlib import import_module
from types import ModuleType
from typing import Any

from torch.nn import Module
from torch.optim import Optimizer

from tierstore.integrations.lightning.record import KEY, pack
from tierstore.integrations.lightning.strategy import (StoreStrategy, argument, module_state,
                                                       optimizer_state, refuse_gathered_saves,
                                                       strategy_class)

__all__ = ["build", "FabricStrategy", "ModelParallelHooks", "FSDPHooks"]


class FabricStrategy(StoreStrategy):
    """Fabric's checkpoint hooks, shared by both strategies, for either Lightning package."""

    #: set by :func:`build`, from the Lightning package: the protocol of objects with a
    #: ``state_dict`` and a ``load_state_dict``
    _stateful: Any

    def teardown(self) -> None:
        """Wait for the save in flight and the copies to slower tiers, close the store, then
        Fabric's own teardown (Fabric does not call it: call ``fabric.strategy.teardown()``
        when training is over)."""
        try:
            super().teardown()
        except NotImplementedError as exc:
            # Fabric's Strategy.teardown ends with checkpoint_io.teardown(), which these
            # strategies refuse (they use no CheckpointIO): everything else is torn down by then.
            if "CheckpointIO" not in str(exc):
                raise

    def save_checkpoint(self, path: Any, state: dict[str, Any],
                        storage_options: Any | None = None, filter: Any | None = None) -> None:
        """Start saving ``state`` (one module, its optimizers, anything else) as ``path``;
        returns once it is staged (every rank calls it)."""
        if storage_options is not None:
            raise TypeError(f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` "
                            f"is not supported: checkpoints go to the tierstore store, whose "
                            f"tiers are configured in its TOML")
        if filter is not None:
            raise NotImplementedError(
                f"{type(self).__name__} saves sharded checkpoints, which DCP cannot load "
                f"filtered, so saving them filtered is disabled (as Lightning's own does)")
        path, cid = self._agree_on_path(path)
        module = _the_module(state, "save_checkpoint")
        converted: dict[str, Any] = {}
        rest: dict[str, Any] = {}
        for key, obj in state.items():
            if isinstance(obj, Module):
                converted[key] = module_state(obj)
            elif isinstance(obj, Optimizer):
                converted[key] = optimizer_state(module, obj)
            else:
                rest[key] = obj.state_dict() if isinstance(obj, self._stateful) else obj
        if self.global_rank == 0:
            converted[KEY] = pack(rest)
        optimizers = [obj for obj in state.values() if isinstance(obj, Optimizer)]
        self._save(converted, path, cid, pin=False, optimizers=optimizers)

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Restore the module and optimizers in ``state`` from the checkpoint ``path`` stands
        for (the one its pointer file names), and the other keys of ``state`` from what was
        saved with them; return what was saved but not asked for. ``weights_only`` is not
        used: non-tensor values are always read with the store's rules (torch's
        ``weights_only`` allow-list and ``[store] trusted_pickles``)."""
        if not state or isinstance(state, (Module, Optimizer)):
            raise ValueError(
                f"{type(self).__name__}.load_checkpoint needs state={{'model': model, "
                f"'optimizer': optimizer, ...}} with the keys they were saved under (got "
                f"{type(state).__name__}): a sharded checkpoint loads into a dict of objects")
        path = os.fspath(path)
        module = _the_module(state, "load_checkpoint")
        module_key = next(k for k, v in state.items() if v is module)
        optimizers = {k: v for k, v in state.items() if isinstance(v, Optimizer)}
        rest = self._load(self._checkpoint_at(path), module, optimizers, module_key, strict)
        requested = [k for k in state if k != module_key and k not in optimizers]
        missing = [k for k in requested if k not in rest]
        if strict and missing:
            raise KeyError(f"The requested state contains a key '{missing[0]}' that does not "
                           f"exist in the loaded checkpoint. To disable strict loading, set "
                           f"`strict=False`.")
        for key in requested:
            if key in rest:
                value = rest.pop(key)
                if isinstance(state[key], self._stateful):
                    state[key].load_state_dict(value)
                else:
                    state[key] = value
        return rest


def _the_module(state: dict[str, Any], what: str) -> Module:
    modules = [obj for obj in state.values() if isinstance(obj, Module)]
    if len(modules) != 1:
        raise ValueError(
            f"{what} needs exactly one model in the state, like state={{'model': model, "
            f"'optimizer': optimizer, ...}}, set up through the strategy; found {len(modules)}: "
            f"save several models under different paths")
    return modules[0]


class ModelParallelHooks(FabricStrategy):
    """Fabric's ``ModelParallelStrategy`` (FSDP2 and tensor parallelism, applied by
    ``parallelize_fn``) with its checkpoints in a tierstore store.

    ``tiers``: the path of a tierstore TOML file, or a dict of the same shape; every other
    argument is the parent's. ``save_distributed_checkpoint=False`` (one file gathered on rank
    0) is refused: each rank's shard goes to the store.
    """

    def __init__(self, *args: Any, tiers: str | os.PathLike | dict, **kwargs: Any) -> None:
        refuse_gathered_saves(self._lightning_strategy, args, kwargs)
        super().__init__(*args, tiers=tiers, **kwargs)


class FSDPHooks(FabricStrategy):
    """Fabric's ``FSDPStrategy`` (FSDP1) with its checkpoints in a tierstore store.

    ``tiers``: the path of a tierstore TOML file, or a dict of the same shape; every other
    argument is the parent's. ``state_dict_type="full"`` (one file gathered on rank 0) is
    refused: each rank's shard goes to the store.
    """

    def __init__(self, *args: Any, tiers: str | os.PathLike | dict, **kwargs: Any) -> None:
        if argument(self._lightning_strategy, args, kwargs, "state_dict_type",
                    "sharded") != "sharded":
            raise ValueError(
                "tierstore's FSDPStrategy saves each rank's shard through DCP: "
                "state_dict_type='full' (the whole state gathered into one file on rank 0) is "
                "what it replaces; leave it out")
        super().__init__(*args, tiers=tiers, **kwargs)


def build(package: ModuleType) -> tuple[type, type]:
    """tierstore's ``ModelParallelStrategy`` and ``FSDPStrategy`` for the Fabric of
    ``package``, the module ``lightning.fabric`` or ``lightning_fabric``: subclasses of its
    strategies, which only its Fabric takes."""
    name = package.__name__
    strategies = import_module(f"{name}.strategies")
    attributes = {"_stateful": import_module(f"{name}.utilities.types")._Stateful}
    return (strategy_class(ModelParallelHooks, strategies.ModelParallelStrategy, name,
                           **attributes),
            strategy_class(FSDPHooks, strategies.FSDPStrategy, name, **attributes))
