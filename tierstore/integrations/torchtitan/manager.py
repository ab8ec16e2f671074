"""torchtitan's DCP checkpoint manager with its checkpoints in a tierstore store.

:class:`TierstoreCheckpointMixin` goes before torchtitan's ``CheckpointManager`` (or a subclass
of it) in a class's bases and takes over where bytes go, nothing else: torchtitan still decides
when to save (``interval``, the first step, the model-only last save), what a checkpoint holds
and what a load restores (``exclude_from_loading``, model-only at step 0), and the trainer's
calls stay as they are. The manager's ``dcp_save``/``dcp_load`` pass the store's writer and
reader and its own gloo group; finding the checkpoint to resume from asks ``store.latest()``;
the tiers' ``keep`` is the retention, and torchtitan's purge thread is never started.

:class:`TierstoreCheckpointManager` is the mixin over ``CheckpointManager``, with a ``Config``
that adds ``tiers``: choosing it in a trainer's config (``checkpoint=...Config(...)``) is all it
takes, since the trainer builds its checkpointer from that config.
"""

from __future__ import annotations

import dataclasses
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torchtitan.components.checkpointer import MODEL, AsyncMode, CheckpointManager
from torchtitan.tools import filesystem
from torchtitan.tools.logging import logger
from torchtitan.tools.utils import GarbageCollection

# tierstore's public API from the modules that define it (the store's facade and its errors):
# nothing under the package imports the package itself (tests/test_architecture.py).
from tierstore.errors import ConfigError
from tierstore.integrations.torchtitan.ids import checkpoint_id, is_store_id, step_of
from tierstore.integrations.torchtitan.settings import store_settings
from tierstore.store import Store
from tierstore.store import open as open_store

__all__ = ["TierstoreCheckpointMixin", "TierstoreCheckpointManager"]


class TierstoreCheckpointMixin:
    """Mixin: the checkpoints of a torchtitan DCP checkpoint manager go through the tierstore
    store of ``config.tiers`` (the path of a tierstore TOML file).

    Place it first in the bases, before ``CheckpointManager`` or a subclass of it; the class's
    ``Config`` must carry ``tiers`` (see :class:`TierstoreCheckpointManager`). The store opens
    when the manager is built (every rank, once the process group exists: opening is
    collective) and closes with the manager; :attr:`store` is there for what torchtitan does
    not ask for (``store.pin``, ``store.wait``, ``store.list``).
    """

    #: the store the checkpoints go to (None while checkpointing is disabled, or once closed)
    store: Store | None = None
    #: during a first start, what the store said: torchtitan's own ``_load`` asks again
    _known_load_step: int | None = None

    def __init__(self, config: Any, **kwargs: Any) -> None:
        self.store = None
        # torchtitan's own set-up without what the store replaces: the gloo group an async mode
        # makes (the store has its own) and the purge thread (the tiers' keep is retention).
        super().__init__(dataclasses.replace(config, async_mode="disabled", keep_latest_k=0),
                         **kwargs)
        if not self.enable:
            return
        self.async_mode = AsyncMode(config.async_mode)
        self.tiers = os.fspath(config.tiers or "")
        if not self.tiers.strip():
            raise ValueError("checkpoint.tiers is empty: set it to the path of a tierstore TOML "
                             "file (its [[tier]] tables say where checkpoints go)")
        self.store = _open_store(self.tiers, config.async_mode, config.keep_latest_k)
        # CheckpointManager._save builds DCP's DefaultStager on the first pinned-memory save
        # when it has no stager; here the store's writer is the stager (DCP stages through a
        # writer that is an AsyncStager), so none is built.
        self.stager = self.store.writer()

    # -- where bytes go ----------------------------------------------------------------------
    @torch.no_grad()
    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False,
                 to_hf: bool = False) -> Future | AsyncSaveResponse | None:
        """Save ``state_dict`` as ``checkpoint_id`` through the store: ``dcp.save`` when
        ``async_mode`` is disabled, else ``dcp.async_save`` (a ``Future`` with eager staging, an
        ``AsyncSaveResponse`` with lazy staging), on the store's process group and with the
        store's writer as the stager. A Hugging Face export (``to_hf``) and a checkpoint torchtitan
        names by a path (torchft's per-replica ones) are written as files, as torchtitan does."""
        if to_hf:
            return super().dcp_save(state_dict, self._folder_path(checkpoint_id), async_mode,
                                    enable_garbage_collection, to_hf)
        if not is_store_id(checkpoint_id):
            return super().dcp_save(state_dict, checkpoint_id, async_mode,
                                    enable_garbage_collection, to_hf)
        store = self._require_store()
        where = {"storage_writer": store.writer(), "checkpoint_id": checkpoint_id,
                 "process_group": store.process_group}
        result = None
        if async_mode == AsyncMode.DISABLED:
            dcp.save(state_dict, **where)
        else:
            result = dcp.async_save(state_dict, **where)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return result

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool,
                 from_quantized: bool) -> None:
        """Load ``checkpoint_id`` from the store into ``state_dict`` (each file from the fastest
        tier holding a good copy) and hand the model its part, as torchtitan's load does. A
        checkpoint named by a path (``initial_load_path``, Hugging Face weights, torchft's
        per-replica ones) is read from files, as torchtitan does."""
        if from_hf or not is_store_id(checkpoint_id):
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        store = self._require_store()
        dcp.load(state_dict, storage_reader=store.reader(), checkpoint_id=checkpoint_id,
                 process_group=store.process_group)
        # torchtitan flattens the model's states into the top level; the model takes them back.
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)

    def _create_checkpoint_id(self, step: int, folder: str = "") -> str:
        """The store id ``step-<N>`` for the manager's own checkpoints; a path for those of
        another folder (torchft's per-replica ones)."""
        if folder and folder != self.folder:
            return super()._create_checkpoint_id(step, folder)
        return checkpoint_id(step)

    def _folder_path(self, store_id: str) -> str:
        """Where torchtitan would have put checkpoint ``store_id`` as files."""
        return filesystem.join(self.folder, store_id)

    # -- which checkpoint to load ------------------------------------------------------------
    def _find_load_step(self, folder: str = "") -> int:
        """The step of ``store.latest()``: the newest checkpoint that every rank can load from
        some tier (the same answer on every rank; collective), or -1 when there is none."""
        if folder and folder != self.folder:
            return super()._find_load_step(folder)
        if self._known_load_step is not None:
            return self._known_load_step
        latest = self._require_store().latest()
        if latest is None:
            return -1
        step = step_of(latest)
        if step is None:
            raise ValueError(
                f"the newest checkpoint in the store of {self.tiers} is {latest!r}, which is not "
                f"one of torchtitan's 'step-<N>' checkpoints: give this job tiers of its own, or "
                f"set checkpoint.load_step to the step to resume from")
        return step

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        """Resume from the store: ``step`` (``checkpoint.load_step``), or with -1 the newest
        checkpoint there. With nothing in the store, torchtitan's first start: its
        ``initial_load_path`` or Hugging Face weights when configured, else a fresh start."""
        load_step = self._find_load_step() if step == -1 else step
        if load_step == -1:
            # torchtitan's _load asks _find_load_step again, but only where checkpoint.folder
            # exists (which a node-local folder may on some nodes only): it gets this answer,
            # not a collective some ranks would not join.
            self._known_load_step = -1
            try:
                return super()._load(step)
            finally:
                self._known_load_step = None
        store_id = self._create_checkpoint_id(load_step)
        logger.info(f"Loading the checkpoint {store_id} from tierstore ({self.tiers}).")
        begin = time.monotonic()
        # As torchtitan's resume: step 0 is the seed checkpoint, which holds the model only.
        states = self._states_to_load(model_only=load_step == 0)
        self.dcp_load(states, checkpoint_id=store_id, from_hf=False, from_quantized=False)
        GarbageCollection.collect("GC collection for checkpoint loading.")
        logger.info(f"Finished loading the checkpoint in {time.monotonic() - begin:.2f} seconds.")
        return True

    # -- staging, retention, closing -----------------------------------------------------------
    def _maybe_wait_for_staging(self) -> None:
        """Before the optimizer step (the trainer calls it there): wait for the lazy staging in
        flight (``store.wait_staging()``; on CUDA the training stream waits for the copies, not
        the host). A failed staging fails its save's future, which the next save waits on."""
        if self.staging_future is None:
            return
        self._require_store().wait_staging()
        self.staging_future = None

    def _purge_stale_checkpoints(self) -> None:
        """Nothing: each tier keeps the newest checkpoints its ``keep`` says."""

    def _close(self) -> None:
        """Close torchtitan's part, then the store (it waits for the copies to slower tiers,
        raising their failures)."""
        try:
            super()._close()
        finally:
            store, self.store = self.store, None
            if store is not None:
                store.close()

    def _require_store(self) -> Store:
        if self.store is None:
            raise RuntimeError("this checkpoint manager is closed (or checkpointing is disabled):"
                               " build a new one from its config to save or load")
        return self.store


def _open_store(tiers: str, async_mode: str, keep_latest_k: int) -> Store:
    """The store of the TOML file ``tiers``, its staging as ``async_mode`` asks for."""
    settings = store_settings(tiers, async_mode, keep_latest_k)
    for note in settings.warnings:
        logger.warning(note)
    try:
        return open_store(settings.config)
    except ConfigError as exc:
        if not settings.changed:
            raise
        # The store was given the file's contents, not the file: say which file it was.
        message = str(exc).removeprefix("<dict>: ")
        raise ConfigError(f"{tiers}: {message} (the store's config was "
                          f"{settings.changed})") from None


class TierstoreCheckpointManager(TierstoreCheckpointMixin, CheckpointManager):
    """torchtitan's ``CheckpointManager``, checkpointing through tierstore. Choose it in the
    trainer's config: ``checkpoint=TierstoreCheckpointManager.Config(tiers="tiers.toml", ...)``
    (every other field is torchtitan's)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        """torchtitan's DCP checkpoint config, plus the tierstore TOML file."""

        tiers: str = ""
        """Path of the tierstore TOML file: its tiers (RAM, local disk, peers, object stores)
        hold the checkpoints, and its ``keep`` values are the retention. Required when
        ``enable`` is true. ``folder`` only holds what is still written as files (Hugging Face
        exports)."""

        keep_latest_k: int = 0
        """Deletes nothing here: each tier keeps what its ``keep`` says. A value other than 0
        that some tier's ``keep`` differs from draws a warning."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            if self.enable and not str(self.tiers).strip():
                raise ValueError("checkpoint.tiers is empty: set it to the path of a tierstore "
                                 "TOML file (its [[tier]] tables say where checkpoints go)")
