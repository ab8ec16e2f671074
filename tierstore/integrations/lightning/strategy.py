"""What the Trainer's and Fabric's strategies share: the store's lifetime, agreeing on a path,
and moving module and optimizer states between a model and DCP.

:class:`StoreStrategy` is a mixin placed before a Lightning strategy in the bases of each of the
four classes (``tierstore.integrations.lightning.trainer`` and ``.fabric``): it takes ``tiers=``
and hands every other argument to the strategy, opens the store once the strategy has set up its
process group, and closes it at teardown. The states go through torch's distributed state-dict
API (``torch.distributed.checkpoint.state_dict``), which knows FSDP1, FSDP2 and tensor-parallel
modules alike.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Iterable

from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.nn import Module
from torch.optim import Optimizer

from tierstore.errors import CheckpointNotFound
from tierstore.store import Store

from tierstore.integrations.lightning.checkpointing import Checkpoints
from tierstore.integrations.lightning.paths import checkpoint_id, checkpoint_path

__all__ = ["StoreStrategy", "argument", "refuse_gathered_saves", "optimizer_key",
           "module_state", "optimizer_state"]


def argument(strategy: type, args: tuple, kwargs: dict, name: str, default: Any) -> Any:
    """The value of ``strategy.__init__``'s parameter ``name`` in a call with ``args`` and
    ``kwargs`` (``default`` when it is not given), to refuse a mode before anything is set up."""
    return inspect.signature(strategy).bind(*args, **kwargs).arguments.get(name, default)


def refuse_gathered_saves(strategy: type, args: tuple, kwargs: dict) -> None:
    """Refuse ``save_distributed_checkpoint=False`` in a call of a ``ModelParallelStrategy``'s
    (``strategy``) ``__init__`` with ``args`` and ``kwargs``: the whole state gathered into one
    file on rank 0 is what saving each rank's shard through the store replaces."""
    if argument(strategy, args, kwargs, "save_distributed_checkpoint", True) is not True:
        raise ValueError(
            "tierstore's ModelParallelStrategy saves each rank's shard through DCP: "
            "save_distributed_checkpoint=False (the whole state gathered into one file on "
            "rank 0) is what it replaces; leave it out")


def optimizer_key(index: int) -> str:
    """The DCP state key of the ``index``-th optimizer, as Lightning's own strategies name it."""
    return f"optimizer_{index}"


class StoreStrategy:
    """Mixin: checkpoints of a Lightning strategy go to the tierstore store built from
    ``tiers`` (the path of a TOML file, or a dict of the same shape)."""

    global_rank: int

    def __init__(self, *args: Any, tiers: str | os.PathLike | dict, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._checkpoints = Checkpoints(tiers)

    @property
    def store(self) -> Store:
        """The tierstore store the checkpoints go to: open from ``setup_environment`` (once the
        process group exists; opening is collective) until ``teardown``. Use it for what
        Lightning does not ask for (``store.list()``, ``store.pin(...)``, ``store.wait()``);
        for the newest checkpoint, :meth:`latest_checkpoint`, which first settles the save in
        flight (its pointer and pin, or its failure, raised)."""
        return self._checkpoints.store

    def setup_environment(self) -> None:
        """The strategy's set-up (process group included), then the store opens."""
        super().setup_environment()  # type: ignore[misc]
        self._checkpoints.open()

    def teardown(self) -> None:
        """Wait for the save in flight and the copies to slower tiers, close the store, then
        the strategy's own teardown."""
        try:
            self._checkpoints.close()
        finally:
            super().teardown()  # type: ignore[misc]

    def latest_checkpoint(self, dirpath: str | os.PathLike) -> str | None:
        """The path in ``dirpath`` of the store's newest complete checkpoint (what
        ``fabric.load`` takes), or None when it holds none. Waits for the save in flight first.
        A collective: every rank calls it."""
        latest = self._checkpoints.latest()
        return None if latest is None else checkpoint_path(latest, dirpath)

    def remove_checkpoint(self, filepath: Any) -> None:
        """Lightning no longer keeps ``filepath``: remove its pointer file and unpin its
        checkpoint if this strategy may have pinned it (the tiers' ``keep`` then removes it
        in its turn). Every rank calls it."""
        path = os.fspath(filepath)
        self._checkpoints.release(checkpoint_id(path), path if self.global_rank == 0 else None,
                                  unpin=self._pins())

    def _pins(self) -> bool:
        """Whether this strategy pins checkpoints, so that Lightning's removal must unpin
        them; when it does not, a pin made with ``store.pin`` is left as it is."""
        return False

    # -- helpers of the subclasses --------------------------------------------------------------
    def _agree_on_path(self, filepath: Any) -> str:
        """Rank 0's ``filepath`` on every rank, checked there first: a directory where the
        pointer file goes fails every rank alike (one rank raising alone would leave the others
        in the save's collectives). Rank 0 creates the checkpoint directory now, as Lightning's
        own save does: ``save_last="link"`` links ``last.ckpt`` in it at once, while the
        pointer file comes with the commit."""
        path = os.fspath(filepath)
        problem = None
        if self.global_rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            if os.path.isdir(path) and not os.path.islink(path):
                problem = (f"{path} is a directory (a checkpoint saved by Lightning's own "
                           f"strategy?): the tierstore strategy leaves a small pointer file "
                           f"there instead; give the checkpoints another directory, or remove "
                           f"that one")
        path, problem = self.broadcast((path, problem))  # type: ignore[attr-defined]
        if problem is not None:
            raise IsADirectoryError(problem)
        return path

    def _save(self, state: dict[str, Any], path: str, *, pin: bool,
              optimizers: Iterable[Optimizer]) -> None:
        self._checkpoints.save(state, checkpoint_id(path), path,
                               pointer=self.global_rank == 0, pin=pin, optimizers=optimizers)

    def _load(self, checkpoint: str, module: Module, optimizers: dict[str, Optimizer],
              module_key: str, strict: bool) -> dict[str, Any]:
        """Load checkpoint id ``checkpoint`` into ``module`` (saved under ``module_key``) and
        ``optimizers`` (by their keys); return Lightning's dictionary saved with it."""
        state: dict[str, Any] = {module_key: get_model_state_dict(module)}
        for key, optimizer in optimizers.items():
            state[key] = get_optimizer_state_dict(module, optimizer)
        record = self._checkpoints.load(state, checkpoint)
        set_model_state_dict(module, state[module_key], options=StateDictOptions(strict=strict))
        for key, optimizer in optimizers.items():
            set_optimizer_state_dict(module, optimizer, state[key],
                                     options=StateDictOptions(cpu_offload=True))
        return record

    def _latest(self, path: str) -> str:
        """The store's newest checkpoint, for Lightning's ``path`` (a ``last`` checkpoint)."""
        latest = self._checkpoints.latest()
        if latest is None:
            raise CheckpointNotFound(
                f"{path} names Lightning's last checkpoint, which is the store's newest complete "
                f"checkpoint, but the store holds none (were its tiers lost?): start without "
                f"ckpt_path, or remove {path} so that Lightning does not ask for it")
        return latest


def module_state(module: Module) -> dict[str, Any]:
    """A module's sharded state, on the CPU (what Lightning's own strategies give DCP)."""
    return get_model_state_dict(module, options=StateDictOptions(cpu_offload=True))


def optimizer_state(module: Module, optimizer: Optimizer) -> dict[str, Any]:
    """An optimizer's sharded state, keyed by parameter names, on the CPU."""
    return get_optimizer_state_dict(module, optimizer, options=StateDictOptions(cpu_offload=True))
