"""One strategy's checkpoints in one tierstore store, whatever the framework around it.

:class:`Checkpoints` is what the four strategies share: it opens the store once the process
group exists and closes it at teardown, saves with ``dcp.async_save`` (the caller gets control
back once the state is staged, and the first tier commits in the background), does what must
follow a commit (the pointer file Lightning looks for, a pin), loads, and lets a checkpoint go.

Ordering, the reason for most of what is here:

- A pointer file is written by the thread that sees the save committed (rank 0 only), at once:
  a job killed a moment later still leaves Lightning the name of its newest checkpoint, and a
  save that never committed never leaves one.
- Pins are applied on the training thread before the next save starts (``keep`` only evicts
  after a commit, and the next commit is that save's), on every rank, so that each node's part
  of a checkpoint on a node-local tier is pinned too.
- A failed background save is raised by the next save, a load or the teardown, naming the
  checkpoint: training does not run on for hours on checkpoints that are not there.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import weakref
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

# tierstore's public API (``tierstore.open``, ``tierstore.Store``, its errors), imported from the
# modules that define it: no module inside the ``tierstore`` package imports the package itself
# (tests/test_architecture.py), and this adapter lives inside it.
from tierstore.errors import CheckpointNotFound, CommitError, TierstoreError
from tierstore.store import Store
from tierstore.store import open as open_store

from tierstore.integrations.lightning.paths import is_checkpoint_of
from tierstore.integrations.lightning.pointers import pointed_id, remove_pointer, write_pointer
from tierstore.integrations.lightning.record import KEY, unpack

__all__ = ["Checkpoints", "CheckpointSaveFailed"]

log = logging.getLogger("tierstore.integrations.lightning")

# what write_pointer writes before its rename (a leftover of a process killed in between)
_POINTER_TMP = re.compile(r"\.[0-9a-f]{12}\.tmp$")


class CheckpointSaveFailed(RuntimeError):
    """A checkpoint saved in the background did not commit; raised by the next save, load or
    teardown. ``checkpoint_id`` and ``path`` name it; the cause is chained."""

    def __init__(self, message: str, checkpoint_id: str, path: str):
        super().__init__(message)
        self.checkpoint_id = checkpoint_id
        self.path = path


class _Save:
    """One ``dcp.async_save`` until it is settled: its id, Lightning's path, whether rank 0
    writes a pointer and whether it is to be pinned once committed."""

    def __init__(self, checkpoint_id: str, path: str, pointer: bool, pin: bool):
        self.checkpoint_id, self.path, self.pointer, self.pin = checkpoint_id, path, pointer, pin
        self.future: Any = None
        self.dropped = False  # Lightning let it go before it committed: no pointer, no pin
        self.pointer_error: BaseException | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()

    def committed(self, future: Any) -> None:
        """The future's done-callback (any thread): write the pointer of a committed save."""
        try:
            with self._lock:
                if self.pointer and not self.dropped and future.exception() is None:
                    write_pointer(self.path, self.checkpoint_id)
        except BaseException as exc:  # noqa: BLE001 - raised on the training thread instead
            self.pointer_error = exc
        finally:
            self._done.set()

    def drop(self) -> None:
        """Lightning removed this checkpoint: no pointer and no pin from now on."""
        with self._lock:
            self.dropped = True

    def wait(self) -> None:
        """Until the save is over and its callback has run; raises its failure."""
        try:
            self.future.result()
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is one
            hint = ""
            if isinstance(exc, CommitError):
                hint = (" Lightning saves some names again (ModelCheckpoint's last.ckpt at "
                        "every save): set [store] overwrite = true in the tiers' config, or use "
                        "ModelCheckpoint(save_last='link'), which saves nothing twice.")
            raise CheckpointSaveFailed(
                f"checkpoint {self.path} (tierstore id '{self.checkpoint_id}') was not saved: "
                f"{exc}. The checkpoints committed before it are intact.{hint}",
                self.checkpoint_id, self.path) from exc
        finally:
            self._done.wait()
        if self.pointer_error is not None:
            raise self.pointer_error


class Checkpoints:
    """A strategy's checkpoints in the store built from ``tiers`` (a TOML path or a dict of the
    same shape, as :func:`tierstore.open` takes)."""

    def __init__(self, tiers: str | os.PathLike | dict):
        if tiers is None or not isinstance(tiers, (str, os.PathLike, dict)):
            raise TypeError(f"tiers= takes the path of a tierstore TOML file or a dict of the "
                            f"same shape, not {type(tiers).__name__}")
        self._tiers = tiers
        self._store: Store | None = None
        self._saves: list[_Save] = []
        # optimizer -> the handle of its staging hook (weakly: an optimizer may go before)
        self._hooks: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self._pointer_dirs: set[str] = set()  # where this process wrote pointer files

    # -- the store's lifetime ------------------------------------------------------------------
    def open(self) -> None:
        """Open the store (a collective: every rank, once the process group exists); nothing
        when it is open."""
        if self._store is None:
            self._store = open_store(self._tiers)

    @property
    def store(self) -> Store:
        """The open store."""
        if self._store is None:
            raise RuntimeError("the tierstore store opens with the strategy's process group "
                               "(setup_environment) and closes at teardown; it is not open now")
        return self._store

    def close(self) -> None:
        """Settle every save (raising a failure), wait for the copies to slower tiers, remove
        the pointer files of checkpoints ``keep`` has evicted from every tier, and close the
        store. Nothing when it is closed."""
        if self._store is None:
            return
        try:
            self.settle()
            if self._pointer_dirs:  # rank 0
                self._store.wait()
                self._prune_pointers()
        finally:
            for handle in list(self._hooks.values()):
                handle.remove()
            self._hooks.clear()
            store, self._store = self._store, None
            store.close()

    # -- saves ---------------------------------------------------------------------------------
    def save(self, state: dict[str, Any], checkpoint_id: str, path: str, *, pointer: bool,
             pin: bool, optimizers: Iterable[Any] = ()) -> None:
        """Start saving ``state`` as ``checkpoint_id``; returns once it is staged. ``path`` is
        Lightning's name for it; ``pointer``: write the pointer file there once it commits
        (rank 0); ``pin``: pin it once committed. ``optimizers`` get a step pre-hook that waits
        for the staging in flight (with lazy staging, ``async_save`` returns before the copy)."""
        self.settle()
        store = self.store
        for optimizer in optimizers:
            if optimizer not in self._hooks:
                self._hooks[optimizer] = store.hook_optimizer(optimizer)
        save = _Save(checkpoint_id, path, pointer, pin)
        if pointer:
            self._pointer_dirs.add(os.path.dirname(os.path.abspath(path)))
        response = dcp.async_save(state, storage_writer=store.writer(),
                                  checkpoint_id=checkpoint_id,
                                  process_group=store.process_group)
        # Lazy staging gives DCP's AsyncSaveResponse, eager staging a future: both complete
        # when the first tier has committed.
        save.future = getattr(response, "upload_completion", response)
        self._saves.append(save)
        save.future.add_done_callback(save.committed)

    def settle(self) -> None:
        """Wait for the saves started so far, apply their pins; raise the first failure."""
        while self._saves:
            save = self._saves.pop(0)
            save.wait()
            if save.pin and not save.dropped:
                try:
                    self.store.pin(save.checkpoint_id)
                except (CheckpointNotFound, FileNotFoundError):
                    log.warning("checkpoint '%s' was gone before it could be pinned",
                                save.checkpoint_id)

    def release(self, checkpoint_id: str, pointer: str | None, *, unpin: bool) -> None:
        """Lightning removed the checkpoint: remove its pointer file at ``pointer`` (rank 0)
        and, with ``unpin`` (it may have been pinned), unpin it, so that ``keep`` may evict it.
        A save of it still in flight is let go too (it gets no pointer and no pin). Every rank
        calls it."""
        for save in self._saves:
            if save.checkpoint_id == checkpoint_id:
                save.drop()
        if unpin:
            try:
                self.store.unpin(checkpoint_id)
            except (CheckpointNotFound, FileNotFoundError):
                # Not committed (yet, or any more), or evicted while being unpinned: another
                # rank's unpin of a shared tier can make it a victim of a retention pass.
                pass
        if pointer is not None:
            remove_pointer(pointer)

    def _prune_pointers(self) -> None:
        """Remove the pointer files, in the directories this process saved to, of checkpoints
        no tier holds any more (``keep`` evicted them): once per run, since listing every
        tier's checkpoints may take a while on an object store."""
        held = {info.id for info in self.store.list()}
        for directory in self._pointer_dirs:
            try:
                names = os.listdir(directory)
            except FileNotFoundError:
                continue
            for name in names:
                path = os.path.join(directory, name)
                if os.path.islink(path):
                    continue  # a link (save_last="link") is Lightning's own
                named = pointed_id(path)
                if named is not None and named not in held:
                    remove_pointer(path)

    # -- loads ---------------------------------------------------------------------------------
    def latest(self) -> str | None:
        """The store's newest checkpoint the job can load, whoever saved it (a collective)."""
        self.settle()
        return self.store.latest()

    def newest_in(self, directories: Iterable[str], *, scan: bool
                  ) -> tuple[str, str | None] | None:
        """The newest checkpoint the job can load of those saved into ``directories``
        (absolute, the same on every rank), as ``(id, path of a pointer file naming it, or
        None)``; None when the store holds none of them. A collective: every rank calls it,
        ``scan`` on the rank that sees the directories (rank 0).

        A checkpoint is one of theirs when its id was made for one of them
        (:func:`~tierstore.integrations.lightning.paths.is_checkpoint_of`) or a pointer file
        there names it (ids of the adapter's earlier rule say no directory). A store may be
        shared by several runs: its newest checkpoint, ``store.latest()``, is taken when it is
        one of theirs, with every rule of the store's (replicas, parity, another world size);
        when another run saved since, the newest of theirs that every rank of this job holds
        complete on some tier (``store.list()``) is."""
        self.settle()
        store = self.store
        directories = sorted(set(directories))
        # rank 0's pointers on every rank, so that every rank takes the same branch below
        views = self._gather(self._pointers_in(directories) if scan else {})
        named: dict[str, str] = {}
        for view in views:
            for cid, path in view.items():
                named.setdefault(cid, path)

        def theirs(cid: str) -> bool:
            return cid in named or any(is_checkpoint_of(cid, d) for d in directories)

        newest = store.latest()
        if newest is not None and not theirs(newest):
            held = self._gather({c.id: c.committed for c in store.list() if theirs(c.id)})
            everywhere = set(held[0]).intersection(*held[1:])
            newest = max(everywhere, key=lambda c: (held[0][c], c), default=None)
        return None if newest is None else (newest, named.get(newest))

    def _gather(self, obj: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's ``obj`` (checkpoint id -> a string or a number) on every rank, in rank
        order, over the store's group: as JSON, never a pickle (unpickling what another rank
        sent would run whatever code that rank chose). A rank that sent anything else raises
        TierstoreError naming it."""
        group = self.store.process_group
        if group is None:
            return [obj]
        raw = json.dumps(obj).encode()
        world = dist.get_world_size(group)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([len(raw)], dtype=torch.int64), group=group)
        lengths = [int(t.item()) for t in sizes]
        longest = max(lengths)
        mine = torch.zeros(max(longest, 0), dtype=torch.uint8)
        if raw:
            mine[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        bufs = [torch.empty(max(longest, 0), dtype=torch.uint8) for _ in range(world)]
        dist.all_gather(bufs, mine, group=group)
        return [_gathered_view(buf, n, r) for r, (buf, n) in enumerate(zip(bufs, lengths))]

    @staticmethod
    def _pointers_in(directories: Iterable[str]) -> dict[str, str]:
        """The ids the pointer files in ``directories`` name -> the path of one of them
        (the first by name). Links (``save_last="link"``) are Lightning's own and name what
        their target names: skipped."""
        named: dict[str, str] = {}
        for directory in directories:
            try:
                names = sorted(os.listdir(directory))
            except (FileNotFoundError, NotADirectoryError):
                continue
            for name in names:
                path = os.path.join(directory, name)
                if (os.path.islink(path) or _POINTER_TMP.search(name)
                        or not os.path.isfile(path)):
                    continue
                cid = pointed_id(path)
                if cid is not None:
                    named.setdefault(cid, path)
        return named

    def load(self, state: dict[str, Any], checkpoint_id: str) -> dict[str, Any]:
        """Load ``checkpoint_id`` into ``state`` (DCP templates, in place) and return the
        Lightning dictionary saved beside it (:mod:`~tierstore.integrations.lightning.record`).
        The record is read first, alone: a checkpoint that has none is refused before any
        state changes."""
        self.settle()
        store = self.store
        record: dict[str, Any] = {KEY: None}
        dcp.load(record, storage_reader=store.reader(), checkpoint_id=checkpoint_id,
                 process_group=store.process_group,
                 planner=DefaultLoadPlanner(allow_partial_load=True))
        checkpoint = unpack(record[KEY], checkpoint_id)
        if state:
            dcp.load(state, storage_reader=store.reader(), checkpoint_id=checkpoint_id,
                     process_group=store.process_group)
        return checkpoint


def _gathered_view(buf: torch.Tensor, length: int, rank: int) -> dict[str, Any]:
    """What rank ``rank`` sent (``length`` bytes of ``buf``): checkpoint id -> a path or a
    commit time. TierstoreError naming the rank when it is not that."""
    try:
        if length < 0 or length > buf.numel():
            raise ValueError(f"a length of {length} bytes")
        view = json.loads(buf[:length].numpy().tobytes().decode())
        if not isinstance(view, dict) or not all(
                isinstance(k, str) and (isinstance(v, str) or (
                    isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)))
                for k, v in view.items()):
            raise ValueError("not a table of checkpoint id -> path or time")
    except (ValueError, UnicodeDecodeError) as exc:
        raise TierstoreError(f"rank {rank} sent a malformed list of checkpoints ({exc}); every "
                             f"rank of a job must run the same tierstore") from None
    return view
