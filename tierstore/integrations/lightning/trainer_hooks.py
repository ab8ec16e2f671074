"""The Trainer's strategies checkpointing through tierstore, for either Lightning package.

:func:`build` makes tierstore's ``ModelParallelStrategy`` and ``FSDPStrategy`` for the Trainer of
``lightning.pytorch`` or of ``pytorch_lightning``; :mod:`~tierstore.integrations.lightning.pytorch`
and :mod:`~tierstore.integrations.lightning.pytorch_lightning` export them.

What changes against Lightning's own ``ModelParallelStrategy`` and ``FSDPStrategy`` with
sharded checkpoints is where the bytes go and what waits for them:

- ``save_checkpoint`` gives ``dcp.async_save`` the same module and optimizer states as Lightning
  (``"state_dict"``, resp. ``"model"``, and ``"optimizer_<i>"``), plus the rest of Lightning's
  checkpoint dictionary, which Lightning pickles into ``meta.pt`` on rank 0
  (:mod:`~tierstore.integrations.lightning.record`), through the store's writer; it returns once
  the state is staged. At Lightning's path, a pointer file appears once the checkpoint has
  committed (:mod:`~tierstore.integrations.lightning.pointers`).
- ``load_checkpoint`` reads through the store's reader. A path Lightning resolved for
  ``ckpt_path="last"`` (``last.ckpt``, ``last-v1.ckpt``: exactly ``ModelCheckpoint``'s last
  name, with its version suffix) loads this run's newest complete checkpoint: the newest of those
  saved into its checkpoint callbacks' directories, never another run's in a store they share;
  any other path loads the checkpoint its pointer file names, or else the one its path maps to
  (:mod:`~tierstore.integrations.lightning.paths`).
- ``ModelCheckpoint``: a checkpoint in the top-k of a checkpoint callback with a ``monitor`` is
  pinned, so that no tier's ``keep`` evicts it; when Lightning removes a checkpoint
  (``remove_checkpoint``), its pointer file is removed and it is unpinned, unless another path
  Lightning keeps for a metric names it, and ``keep`` evicts it in its turn. Checkpoints kept
  for recency only are ``keep``'s alone.
"""

from __future__ import annotations

import os
import re
from importlib import import_module
from types import ModuleType
from typing import Any

from tierstore.integrations.lightning.record import KEY, pack
from tierstore.integrations.lightning.strategy import (StoreStrategy, optimizer_key,
                                                      refuse_gathered_saves, strategy_class)

__all__ = ["build", "TrainerStrategy", "ModelParallelHooks", "FSDPHooks"]


class TrainerStrategy(StoreStrategy):
    """The Trainer's checkpoint hooks, shared by both strategies (which differ in the key of the
    module's state, as Lightning's own do), for either Lightning package."""

    #: where Lightning's own strategy puts the module's state in the DCP state
    _module_key: str
    #: set by :func:`build`, from the Lightning package: its ``ModelCheckpoint`` and the
    #: ``TrainerFn`` of ``trainer.fit``
    _model_checkpoint: Any
    _fitting: Any
    lightning_module: Any
    model: Any
    optimizers: list

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any | None = None) -> None:
        """Start saving Lightning's ``checkpoint`` for ``filepath`` into the store; returns once
        it is staged (every rank calls it)."""
        if storage_options is not None:
            raise TypeError(f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` "
                            f"is not supported: checkpoints go to the tierstore store, whose "
                            f"tiers are configured in its TOML")
        path, cid = self._agree_on_path(filepath)
        state: dict[str, Any] = {self._module_key: checkpoint.pop("state_dict")}
        for index, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
            state[optimizer_key(index)] = optimizer_state
        if self.global_rank == 0:
            state[KEY] = pack(checkpoint)
        self._save(state, path, cid, pin=self._kept_for_a_metric(path),
                   optimizers=self.optimizers)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        """Restore the module (and, when fitting, the optimizers) from the checkpoint
        ``checkpoint_path`` stands for; return the rest of Lightning's checkpoint.
        ``weights_only`` is not used: non-tensor values are always read with the store's rules
        (torch's ``weights_only`` allow-list and ``[store] trusted_pickles``)."""
        path = os.fspath(checkpoint_path)
        cid = (self._latest(path) if self._agreed(lambda: self._is_last(path))
               else self._checkpoint_at(path))
        module = self.lightning_module
        fitting = module.trainer.state.fn == self._fitting
        optimizers = ({optimizer_key(i): o for i, o in enumerate(self.optimizers)}
                      if fitting else {})
        return self._load(cid, self.model, optimizers, self._module_key, module.strict_loading)

    def _checkpoint_callbacks(self) -> list[Any]:
        """The trainer's ``ModelCheckpoint`` callbacks."""
        trainer = self.lightning_module.trainer
        return [cb for cb in trainer.checkpoint_callbacks
                if isinstance(cb, self._model_checkpoint)]

    def _is_last(self, path: str) -> bool:
        """Whether ``path`` is a name Lightning resolves ``ckpt_path="last"`` to: a checkpoint
        callback's last name, exactly as ``ModelCheckpoint`` makes it (``last``, then
        ``last-v1``, ``last-v2``, ... with its ``CHECKPOINT_JOIN_CHAR``, and its
        ``FILE_EXTENSION``). ``lastly.ckpt`` is not one, though Lightning's own search for
        ``last*`` files matches any name starting with ``last``: it is a checkpoint of its own,
        loaded as any other path."""
        callbacks = self._checkpoint_callbacks() or [self._model_checkpoint]
        name = os.path.basename(path)
        return any(cb.CHECKPOINT_NAME_LAST and _last_name(cb).fullmatch(name)
                   for cb in callbacks)

    def _pins(self) -> bool:
        return any(cb.monitor is not None for cb in self._checkpoint_callbacks())

    def _kept_paths(self) -> set[str]:
        return {os.fspath(p) for cb in self._checkpoint_callbacks() if cb.monitor is not None
                for p in cb.best_k_models}

    def _checkpoint_dirs(self) -> list[str]:
        return [os.fspath(cb.dirpath) for cb in self._checkpoint_callbacks() if cb.dirpath]

    def _kept_for_a_metric(self, path: str) -> bool:
        """Whether ``path`` is in the top-k of a checkpoint callback ranking by a ``monitor``
        (Lightning keeps it for its score, whatever its age: it is pinned)."""
        return any(cb.monitor is not None and path in cb.best_k_models
                   for cb in self._checkpoint_callbacks())


def _last_name(callback: Any) -> re.Pattern[str]:
    """The file names ``callback`` gives its last checkpoint: ``CHECKPOINT_NAME_LAST`` as
    ``format_checkpoint_name`` fills it in (a ``{metric}`` in it is any value, after
    ``metric=`` with ``auto_insert_metric_name``), then an optional version suffix (``-v1``),
    then ``FILE_EXTENSION``."""
    template = callback.CHECKPOINT_NAME_LAST
    insert = getattr(callback, "auto_insert_metric_name", True)  # an instance's setting
    pattern, end = "", 0
    for field in re.finditer(r"\{([^{}:]*)(?::[^{}]*)?\}", template):
        pattern += re.escape(template[end:field.start()])
        if insert:
            pattern += re.escape(field.group(1) + callback.CHECKPOINT_EQUALS_CHAR)
        pattern += ".+"
        end = field.end()
    pattern += re.escape(template[end:])
    version = re.escape(callback.CHECKPOINT_JOIN_CHAR) + r"v\d+"
    return re.compile(f"{pattern}(?:{version})?{re.escape(callback.FILE_EXTENSION)}")


class ModelParallelHooks(TrainerStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2 and tensor parallelism, set up in
    ``LightningModule.configure_model``) with its checkpoints in a tierstore store.

    ``tiers``: the path of a tierstore TOML file, or a dict of the same shape; every other
    argument is the parent's. ``save_distributed_checkpoint=False`` (one file gathered on rank
    0) is refused: each rank's shard goes to the store.
    """

    _module_key = "state_dict"

    def __init__(self, *args: Any, tiers: str | os.PathLike | dict, **kwargs: Any) -> None:
        refuse_gathered_saves(self._lightning_strategy, args, kwargs)
        super().__init__(*args, tiers=tiers, **kwargs)


class FSDPHooks(TrainerStrategy):
    """Lightning's ``FSDPStrategy`` (FSDP1) with its checkpoints in a tierstore store.

    ``tiers``: the path of a tierstore TOML file, or a dict of the same shape; every other
    argument is the parent's, but ``state_dict_type``, which is ``"sharded"`` (each rank saves
    its shard): ``"full"``, the whole state gathered into one file on rank 0, is refused.
    """

    _module_key = "model"

    def __init__(self, *args: Any, tiers: str | os.PathLike | dict,
                 state_dict_type: str = "sharded", **kwargs: Any) -> None:
        if state_dict_type != "sharded":
            raise ValueError(
                f"tierstore's FSDPStrategy saves each rank's shard through DCP: "
                f"state_dict_type={state_dict_type!r} is not supported, only 'sharded'")
        super().__init__(*args, tiers=tiers, state_dict_type=state_dict_type, **kwargs)


def build(package: ModuleType) -> tuple[type, type]:
    """tierstore's ``ModelParallelStrategy`` and ``FSDPStrategy`` for the Trainer of
    ``package``, the module ``lightning.pytorch`` or ``pytorch_lightning``: subclasses of its
    strategies, which only its Trainer takes."""
    name = package.__name__
    strategies = import_module(f"{name}.strategies")
    attributes = {"_model_checkpoint": import_module(f"{name}.callbacks").ModelCheckpoint,
                  "_fitting": import_module(f"{name}.trainer.states").TrainerFn.FITTING}
    return (strategy_class(ModelParallelHooks, strategies.ModelParallelStrategy, name,
                           **attributes),
            strategy_class(FSDPHooks, strategies.FSDPStrategy, name, **attributes))
