"""What the Trainer's and Fabric's strategies share: the store's lifetime, agreeing on a path,
and moving module and optimizer states between a model and DCP.

:class:`StoreStrategy` is a mixin placed before a Lightning strategy in the bases of each
strategy class (made by :func:`strategy_class` for one Lightning package: see
:mod:`~tierstore.integrations.lightning.packages`): it takes ``tiers=`` and hands every other
argument to the strategy, opens the store once the strategy has set up its process group, and
closes it at teardown. The states go through torch's distributed state-dict API
(``torch.distributed.checkpoint.state_dict``), which knows FSDP1, FSDP2 and tensor-parallel
modules alike.
"""

from __future__ import annotations

import inspect
import os
import types
from typing import Any, Callable, Iterable, TypeVar

from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.nn import Module
from torch.optim import Optimizer

from tierstore.errors import CheckpointNotFound
from tierstore.store import Store

from tierstore.integrations.lightning.checkpointing import Checkpoints
from tierstore.integrations.lightning.packages import MODULES, counterpart, runner
from tierstore.integrations.lightning.paths import checkpoint_id, checkpoint_path
from tierstore.integrations.lightning.pointers import pointed_id

__all__ = ["StoreStrategy", "strategy_class", "argument", "refuse_gathered_saves",
           "optimizer_key", "module_state", "optimizer_state"]

_T = TypeVar("_T")


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


def strategy_class(hooks: type, parent: type, package: str, **attributes: Any) -> type:
    """The class ``hooks`` (a :class:`StoreStrategy` subclass) over Lightning's strategy
    ``parent``, of Lightning module ``package`` (``"lightning.pytorch"``, ...), with the name of
    ``parent`` and the class ``attributes`` ``hooks`` asks for, as the adapter's module for
    ``package`` exports it (so that pickle finds it by name there)."""
    name, module = parent.__name__, MODULES[package]
    other, other_module = counterpart(package)
    doc = (f"{(hooks.__doc__ or '').rstrip()}\n\n    For the {runner(package)} of ``{package}``, "
           f"whose strategy it extends; with ``{other}``, use\n    "
           f"``{other_module}.{name}``.\n")

    def body(namespace: dict[str, Any]) -> None:
        namespace.update(attributes)
        namespace.update(__module__=module, __qualname__=name, __doc__=doc,
                         _lightning_package=package, _lightning_strategy=parent)

    return types.new_class(name, (hooks, parent), exec_body=body)


class StoreStrategy:
    """Mixin: checkpoints of a Lightning strategy go to the tierstore store built from
    ``tiers`` (the path of a TOML file, or a dict of the same shape)."""

    global_rank: int
    #: set by :func:`strategy_class`: the Lightning module whose strategy this class extends
    #: (``"lightning.pytorch"``, ``"pytorch_lightning"``, ...) and that strategy
    _lightning_package: str
    _lightning_strategy: type

    def __init__(self, *args: Any, tiers: str | os.PathLike | dict, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._checkpoints = Checkpoints(tiers)

    def __repr__(self) -> str:
        # Lightning's refusal of a strategy of the other package prints this: it says which
        # class that package takes.
        cls = type(self)
        other, module = counterpart(self._lightning_package)
        return (f"<{cls.__module__}.{cls.__qualname__} for {self._lightning_package}; "
                f"with {other}, use {module}.{self._lightning_strategy.__name__}>")

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
        """The path in ``dirpath`` of the newest complete checkpoint saved there (what
        ``fabric.load`` takes), or None when the store holds none of them: another run's
        checkpoints in a store it shares are not this directory's. Waits for the save in
        flight first. A collective: every rank calls it."""
        directory = self._agreed(lambda: os.path.abspath(os.fspath(dirpath)))
        found = self._checkpoints.newest_in([directory], scan=self.global_rank == 0)
        if found is None:
            return None
        cid, pointer = found
        name = os.path.basename(pointer if pointer is not None
                                else checkpoint_path(cid, directory))
        return os.path.join(os.fspath(dirpath), name)

    def remove_checkpoint(self, filepath: Any) -> None:
        """Lightning no longer keeps ``filepath``: remove its pointer file and, if this
        strategy may have pinned its checkpoint and no other path Lightning keeps for a metric
        names that checkpoint, unpin it (the tiers' ``keep`` then removes it in its turn). A
        link there (``save_last="link"``) is removed alone: the checkpoint it leads to is
        another path's. Every rank calls it."""
        path = os.fspath(filepath)

        def decide() -> tuple[str, bool]:
            if os.path.islink(path):
                return checkpoint_id(path), False
            cid = self._saved_as(path)
            # Two paths can name one checkpoint (pointers of the adapter's earlier id rule,
            # made from the file name alone): while one is kept, its pin stays.
            kept = {self._saved_as(p) for p in self._kept_paths() if p != path}
            return cid, self._pins() and cid not in kept

        cid, unpin = self._agreed(decide)
        self._checkpoints.release(cid, path if self.global_rank == 0 else None, unpin=unpin)

    def _pins(self) -> bool:
        """Whether this strategy pins checkpoints, so that Lightning's removal must unpin
        them; when it does not, a pin made with ``store.pin`` is left as it is."""
        return False

    def _kept_paths(self) -> set[str]:
        """The paths Lightning keeps for a metric now (pinned checkpoints); none here."""
        return set()

    def _checkpoint_dirs(self) -> list[str]:
        """The directories this run's checkpoint callbacks save into; none here."""
        return []

    # -- helpers of the subclasses --------------------------------------------------------------
    def _agreed(self, decide: Callable[[], _T]) -> _T:
        """``decide()``, run on rank 0 (the rank that sees the checkpoint directory), on every
        rank; its failure is raised on every rank alike (one rank raising alone would leave
        the others in the next collective)."""
        answer: Any = None
        problem: BaseException | None = None
        if self.global_rank == 0:
            try:
                answer = decide()
            except Exception as exc:  # noqa: BLE001 - raised on every rank below
                problem = exc
        answer, problem = self.broadcast((answer, problem))  # type: ignore[attr-defined]
        if problem is not None:
            raise problem
        return answer

    def _agree_on_path(self, filepath: Any) -> tuple[str, str]:
        """Rank 0's ``filepath`` and its checkpoint id on every rank (the id is made from the
        path made absolute on rank 0: a relative path names one checkpoint whatever each rank's
        working directory), checked there first: a directory where the pointer file goes fails
        every rank alike. Rank 0 creates the checkpoint directory now, as Lightning's own save
        does: ``save_last="link"`` links ``last.ckpt`` in it at once, while the pointer file
        comes with the commit."""
        path = os.fspath(filepath)

        def decide() -> tuple[str, str]:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            if os.path.isdir(path) and not os.path.islink(path):
                raise IsADirectoryError(
                    f"{path} is a directory (a checkpoint saved by Lightning's own strategy?): "
                    f"the tierstore strategy leaves a small pointer file there instead; give "
                    f"the checkpoints another directory, or remove that one")
            return path, checkpoint_id(path)

        return self._agreed(decide)

    def _save(self, state: dict[str, Any], path: str, cid: str, *, pin: bool,
              optimizers: Iterable[Optimizer]) -> None:
        """Start saving ``state`` as checkpoint ``cid`` for Lightning's ``path``."""
        self._checkpoints.save(state, cid, path, pointer=self.global_rank == 0, pin=pin,
                               optimizers=optimizers)

    @staticmethod
    def _saved_as(path: str) -> str:
        """(Rank 0) The id the checkpoint at ``path`` was saved as: what the pointer file
        there names (an id of the adapter's earlier rule included: a pointer names its id),
        else the id the path maps to (a save whose pointer is yet to come)."""
        return pointed_id(path) or checkpoint_id(path)

    def _checkpoint_at(self, path: str) -> str:
        """The id to load for Lightning's ``path`` (a collective: decided on rank 0)."""
        return self._agreed(lambda: self._saved_as(path))

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
        """The id to load for Lightning's ``path``, a ``last`` name (what
        ``ckpt_path="last"`` resolves to): the newest complete checkpoint of this run, that is
        of the directories of its checkpoint callbacks when ``path`` is in one of them, else
        of ``path``'s directory; never one another run sharing the store saved. A collective.
        """
        directories = self._agreed(lambda: self._last_directories(path))
        found = self._checkpoints.newest_in(directories, scan=self.global_rank == 0)
        if found is None:
            raise CheckpointNotFound(
                f"{path} names Lightning's last checkpoint, which is the newest complete "
                f"checkpoint saved in {', '.join(directories)}, but the store holds none of "
                f"them (did the tiers' keep evict them, or were the tiers lost?): start "
                f"without ckpt_path, or remove {path} so that Lightning does not ask for it")
        return found[0]

    def _last_directories(self, path: str) -> list[str]:
        """(Rank 0) Where the checkpoints ``path``, a last name, chooses from (absolute)."""
        own = os.path.dirname(os.path.abspath(path))
        run = {os.path.abspath(d) for d in self._checkpoint_dirs()}
        return sorted(run) if own in run else [own]


def module_state(module: Module) -> dict[str, Any]:
    """A module's sharded state, on the CPU (what Lightning's own strategies give DCP)."""
    return get_model_state_dict(module, options=StateDictOptions(cpu_offload=True))


def optimizer_state(module: Module, optimizer: Optimizer) -> dict[str, Any]:
    """An optimizer's sharded state, keyed by parameter names, on the CPU."""
    return get_optimizer_state_dict(module, optimizer, options=StateDictOptions(cpu_offload=True))
