"""The plugin kinds: small abstract classes with a few primitives each, and every optional
capability the core uses, declared here with its contract (never discovered by probing).

A plugin registers a *factory* (usually the class itself) under a name; the core builds an
instance per tier or per store with the validated options as keyword arguments. Each class lists
its config keys in ``options`` (see :class:`tierstore.plugin.options.Option`). Observers, the
sixth kind, have no base class: they implement the ``tierstore_event`` hook.

Paths given to a :class:`Backend` are relative to the tier root and use ``/``; ``""`` is the root.
"""

from __future__ import annotations

import abc
import os
from typing import IO, TYPE_CHECKING, Any, Callable, ClassVar, Collection

from tierstore.format.streams import write_all
from tierstore.plugin.options import Option
from tierstore.transport.ends import TransferEnd, WrittenFile

if TYPE_CHECKING:
    from tierstore.plugin.staging import StagingJob

__all__ = ["Backend", "DirectoryLock", "CommitProtocol", "Codec", "Stager", "ReplicationStrategy"]


class DirectoryLock:
    """A lock on a checkpoint directory (:meth:`Backend.lock_directory`); this one holds
    nothing. ``release()`` ends it."""

    def release(self) -> None:
        """End the lock (a no-op here)."""


class _CommitForRename:
    """:attr:`Backend.default_commit` of a backend that names none: the protocol it can run.

    Read when asked, not fixed when the class is made, so that it follows ``supports_rename``
    wherever the backend sets it: on the class, or on the instance in ``__init__`` (one
    backend class for several kinds of storage). A non-data descriptor: a subclass's own
    ``default_commit``, or one an instance sets, takes its place."""

    def __get__(self, obj: "Backend | None", owner: "type[Backend]") -> str:
        # ``atomic`` renames a staging directory into place, so it needs rename; without
        # one, every commit would fail with the defaults.
        holder = owner if obj is None else obj
        return "atomic" if holder.supports_rename else "manifest-last"


class Backend(abc.ABC):
    """Persistence: where a tier's bytes live (a directory, tmpfs, an object store, peers).

    Primitives a backend implements; everything else (manifests, checksums, retention) is derived
    by the core. Built with ``root`` (the tier's expanded path or URL) plus its declared options.
    """

    #: config keys of this backend, beside the core tier keys (name, backend, every, keep, codecs)
    options: ClassVar[tuple[Option, ...]] = ()
    #: name of the commit protocol used when ``[store] commit`` is not set. A backend that
    #: names none (nor does a base class of it below this one) gets the one its
    #: ``supports_rename`` can run: ``atomic`` (a staging directory renamed into place) with
    #: rename, ``manifest-last`` (files in place, the manifest written last) without
    default_commit: ClassVar[str] = _CommitForRename()  # type: ignore[assignment]
    #: True when ``rename`` is cheap and atomic (POSIX); object stores say False
    supports_rename: ClassVar[bool] = False
    #: True when the backend survives a power loss (files are fsynced); tmpfs says False
    durable: ClassVar[bool] = True
    #: True when :meth:`put_files` uploads whole local files faster than the drain's copy loop
    #: (an object store's concurrent multipart upload)
    bulk_upload: ClassVar[bool] = False
    #: True when :meth:`lock_directory` writes to the storage (leases on an object store): a
    #: load of a checkpoint on a tier the whole job shares then holds no lock there, since a
    #: restart must write nothing to a tier it only reads
    locks_write: ClassVar[bool] = False
    #: A backend holding peers' replicas (the ``peer`` tier) sets this to its ``replication``
    #: table: ``strategy`` names a replication strategy, the rest are its options. None: this
    #: backend holds no replicas.
    replication: dict[str, Any] | None = None

    root: str

    @abc.abstractmethod
    def check_reachable(self) -> str | None:
        """Return None if the tier can be written, else a sentence saying why not (a wrong
        path, credentials or bucket: the store does not open). Writes nothing.

        A storage that cannot be connected to right now (a dead server) is no wrong
        configuration: raise the connection failure instead (``retry.cannot_connect`` is true
        for it, also through ``GaveUp``'s cause); the store then opens with the tier marked
        unreachable, as if it had died after the open. Runs inside ``retry.foreground``."""

    @abc.abstractmethod
    def open_write(self, path: str) -> IO[bytes]:
        """Create (truncate) ``path`` for writing; parents exist. ``close()`` makes it durable."""

    @abc.abstractmethod
    def open_read(self, path: str) -> IO[bytes]:
        """Open ``path`` for reading: seekable, with ``readinto``. Missing -> FileNotFoundError.

        Optional: a reader with ``read_ranges(starts, ends) -> list[bytes]`` (bytes ``[starts[i],
        ends[i])`` each, fetched at once: an object store's concurrent ranged requests) is used
        when a load needs some blocks of the file only; others are read by seek and readinto."""

    @abc.abstractmethod
    def size(self, path: str) -> int | None:
        """Size in bytes of the file ``path``, or None when it does not exist."""

    @abc.abstractmethod
    def list(self, path: str) -> list[str]:
        """Names directly under the directory ``path`` (files and directories); [] if missing."""

    @abc.abstractmethod
    def makedirs(self, path: str) -> None:
        """Create directory ``path`` and its parents (no-op where directories are implicit)."""

    @abc.abstractmethod
    def delete(self, path: str) -> None:
        """Remove the file or the whole directory tree ``path``; missing is not an error."""

    def discard(self, path: str) -> None:
        """Remove the directory tree ``path`` of a checkpoint ``keep`` evicted, which nobody in
        this store reads any more: a backend may reuse its storage for the next files (the
        ``peer`` tier recycles its pages). Optional; the default is :meth:`delete`."""
        self.delete(path)

    def lock_directory(self, path: str, *, exclusive: bool) -> "DirectoryLock | None":
        """Lock checkpoint directory ``path`` against other processes sharing this directory
        (the ranks of a node): shared while a process writes it or sends it to peers,
        exclusive (never waiting) before ``keep`` evicts it or gc collects it; None when the
        exclusive lock is refused because another process holds it shared. A shared lock on a
        directory that is not there, or that was removed while the lock waited, raises
        FileNotFoundError (a writer then makes its directory again). Optional: the default
        locks nothing, refuses nothing."""
        return DirectoryLock()

    def claim(self, job: str) -> "DirectoryLock | str":
        """Claim this tier's directory for the job whose token is ``job`` before its first
        save (every process of the job that writes here claims it, with the same token): the
        claim, held until the store closes, or, when live processes of another job hold it,
        who they are, in words (the save is then refused: two jobs saving into one directory
        replace each other's checkpoints). Optional: the default claims nothing, refuses
        nothing (an object store cannot tell a live job from a dead one)."""
        return DirectoryLock()

    def claimed_by(self, job: str) -> str | None:
        """Who, other than the job whose token is ``job``, holds this tier's directory (see
        :meth:`claim`), in words; None when nobody else does. Asks without claiming and writes
        nothing. Optional: the default says nobody."""
        return None

    def rename(self, src: str, dst: str, *, replace: bool = False) -> None:
        """Atomically move ``src`` to ``dst``. Without ``replace``, raise ``FileExistsError`` when
        ``dst`` exists (even an empty directory: the ``atomic`` protocol relies on it); with
        ``replace`` (files only) overwrite it. Optional: backends with
        ``supports_rename = False`` leave it out."""
        raise NotImplementedError(f"{type(self).__name__} does not support rename")

    def sync_dir(self, path: str) -> None:
        """Make the entries of directory ``path`` durable (fsync of a directory). Optional."""

    def local_path(self, path: str) -> str | None:
        """An OS path for ``path`` when the bytes are on a local filesystem, else None."""
        return None

    def close(self) -> None:
        """Release clients and threads; called by ``Store.close()``."""

    def prepare(self) -> None:
        """Make ready, without a request, what the first request will need (a client made on
        first use, its imports), so that the first copy to the tier does not wait for it.
        Called once, in the background, when the job first saves: a restart that never
        touches the tier never pays for it. Optional."""

    # -- optional capabilities -----------------------------------------------------------------
    def put_files(self, pairs: list[tuple[str, str]], sizes: dict[str, int]) -> None:
        """Upload local files: ``pairs`` of (local OS path, path on this backend); ``sizes``
        gives each target path's expected size, to confirm. Only called when ``bulk_upload``
        is True; the drain checks the sources' checksums beside it."""
        raise NotImplementedError(f"{type(self).__name__} has no bulk upload")

    def sending_end(self, path: str, size: int) -> TransferEnd | None:
        """The end a peer transfer sends ``path`` (``size`` bytes) from, or None to let the
        core map the file (a local one) or read it through :meth:`open_read`. Backends that
        keep files mapped return their own mapping."""
        return None

    def receiving_end(self, path: str, size: int) -> TransferEnd:
        """The end a peer transfer writes ``path`` (``size`` bytes) into, parents created.
        The default writes a new local file (:meth:`local_path`); backends of replica tiers
        may hand out recycled pages instead."""
        local = self.local_path(path)
        if local is None:
            raise NotImplementedError(f"{type(self).__name__} cannot receive peer transfers")
        os.makedirs(os.path.dirname(local), exist_ok=True)
        return WrittenFile(local, size)

    def replica_backend(self, src: int, holder: int) -> "Backend":
        """Where rank ``holder`` keeps the replicas of rank ``src``'s files: a backend beside
        this one. Required when :attr:`replication` is set."""
        raise NotImplementedError(f"{type(self).__name__} holds no replicas")

    def replica_sets(self) -> list[tuple[int, int]]:
        """``(src, holder)`` of every set of replicas this directory holds now, whichever job
        (world size, strategy) made them: a job that comes back in another shape serves them
        too. [] where :attr:`replication` is not set."""
        return []

    def inventory(self, path: str) -> dict[str, int] | None:
        """Every file under directory ``path`` with its size, by path relative to ``path``
        (``"step-1/__0_0.distcp"``), from one listing; {} when ``path`` is missing. Optional:
        an object store offers it (one paginated LIST answers for every file of every
        checkpoint, where asking each file's size is a request per file); None (the default)
        where asking :meth:`size` file by file costs nothing remote."""
        return None

    def open_read_sized(self, path: str, size: int) -> IO[bytes]:
        """:meth:`open_read` of a file whose size is known already (a manifest records it): an
        object store then makes no request before the reads themselves. The file is still
        checked against its manifest when read. Optional; the default is :meth:`open_read`."""
        return self.open_read(path)

    # -- derived ----------------------------------------------------------------------------
    def write_bytes(self, path: str, data: bytes) -> None:
        """Write a whole small file (manifest, metadata)."""
        with self.open_write(path) as f:
            write_all(f, data)

    def read_bytes(self, path: str) -> bytes:
        """Read a whole small file."""
        with self.open_read(path) as f:
            return f.read()

    def free_bytes(self) -> int | None:
        """Bytes free for this tier's files (``tierstore status``); None when unknown, as for
        an object store. Optional."""
        return None

    def describe(self) -> str:
        """Where this backend writes, for messages (never includes credentials)."""
        return self.root


class CommitProtocol(abc.ABC):
    """How a checkpoint becomes visible on a backend, all at once or not at all.

    Sequence per tier and save: ``begin`` -> data files written under the returned directory ->
    ``commit`` (writes the manifest last and publishes) or ``abort``. Readers only ever look at
    ``<checkpoint_id>/`` with a manifest that matches its files; ``is_leftover`` tells ``gc`` what
    an interrupted save left behind.
    """

    options: ClassVar[tuple[Option, ...]] = ()
    #: True when a checkpoint is deleted by first moving it aside to :meth:`trash_name` (on
    #: backends with rename); False: by :meth:`begin_delete`, then the manifest, then the rest
    moves_aside_to_delete: ClassVar[bool] = False

    @abc.abstractmethod
    def begin(self, backend: Backend, checkpoint_id: str, token: str) -> str:
        """Prepare a save; return the directory (relative to the root) the files go into."""

    @abc.abstractmethod
    def commit(self, backend: Backend, checkpoint_id: str, staging: str, manifest: bytes,
               announce: Callable[[str], None]) -> None:
        """Write ``manifest`` last and make ``checkpoint_id`` visible, replacing whatever was at
        ``checkpoint_id`` (the core has already refused an existing id unless overwrite is on).
        Call ``announce(Phase.PUBLISH)`` right before the step that makes it visible."""

    @abc.abstractmethod
    def update_manifest(self, backend: Backend, checkpoint_id: str, manifest: bytes,
                        token: str) -> None:
        """Replace the manifest of a committed checkpoint atomically (pin / unpin)."""

    @abc.abstractmethod
    def abort(self, backend: Backend, checkpoint_id: str, staging: str) -> None:
        """Throw away what a failed save wrote."""

    @abc.abstractmethod
    def is_leftover(self, name: str) -> bool:
        """True when the root entry ``name`` is what an unfinished save of this protocol left."""

    def token_of(self, name: str) -> str | None:
        """The save token in a leftover's name (so an in-flight save is not collected)."""
        return None

    def find_leftovers(self, backend: Backend, names: list[str],
                       protect: Collection[str]) -> list[str]:
        """Root entries (of ``names``) that interrupted saves, drains or deletes left, except
        those of the save tokens in ``protect``. By default: ``is_leftover`` names whose
        ``token_of`` is not protected; protocols that must look inside entries override it."""
        return [n for n in names if self.is_leftover(n) and self.token_of(n) not in protect]

    def begin_delete(self, backend: Backend, checkpoint_id: str) -> None:
        """Called before a checkpoint is deleted on a backend without rename: mark it so that
        ``find_leftovers`` recognises what an interrupted delete leaves. Optional."""

    def trash_name(self, checkpoint_id: str, token: str) -> str:
        """A root entry name to move a checkpoint to before deleting it; ``is_leftover`` must
        recognise it, so gc finishes a delete that a crash cut short. Required when
        ``moves_aside_to_delete`` is True."""
        raise NotImplementedError(f"{type(self).__name__} does not move checkpoints aside")


class Codec(abc.ABC):
    """A byte transform applied to each item on the way to a tier (compression, encryption)."""

    options: ClassVar[tuple[Option, ...]] = ()

    @abc.abstractmethod
    def extension(self) -> Any:
        """A ``torch.distributed.checkpoint._extension.StreamTransformExtension`` doing the work,
        so that stock DCP readers can undo it from the descriptor stored in the metadata."""


class Stager(abc.ABC):
    """Copies a state dict off the training tensors (device -> host) for ``dcp.async_save``."""

    options: ClassVar[tuple[Option, ...]] = ()
    #: bytes of tensors copied by the last :meth:`stage` (None: not reported); the ``staged``
    #: event carries it
    last_bytes: int | None = None
    #: whether the last :meth:`stage` reused the buffers of the one before (None: not reported)
    last_reused: bool | None = None

    #: True: ``dcp.async_save`` returns before the copy is done (see :meth:`start`)
    lazy: bool = False

    @abc.abstractmethod
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Return a copy of ``state_dict`` whose tensors are on the host and will not change when
        training updates the originals. The copy may live in buffers the next ``stage`` reuses
        (and overwrites): the core stages again only once the save of the previous copy is
        over (one save in flight per store)."""

    def start(self, state_dict: dict[str, Any], spill: Callable[[], Any]) -> "StagingJob":
        """Begin staging ``state_dict`` for one save; the core calls this (not :meth:`stage`)
        and runs the job it returns (``job.run()``: now when eager, on the job's own thread
        when lazy). Non-tensor values must be taken here, at the call.

        ``spill()`` gives the save's spill (:class:`tierstore.dcp.spill.Spill`: ``write_wave``
        and ``finish``) for a plugin that stages in waves under a memory budget; call it only
        then. The default: a finished job holding :meth:`stage`'s copy."""
        from tierstore.plugin.staging import StagingJob, StagingStats
        staged = self.stage(state_dict)
        return StagingJob.finished(staged, StagingStats(nbytes=self.last_bytes or 0,
                                                        reused=bool(self.last_reused)))

    def close(self) -> None:
        """Free staging buffers."""


class ReplicationStrategy(abc.ABC):
    """Which ranks hold a copy of whose data (used by the ``peer`` backend)."""

    options: ClassVar[tuple[Option, ...]] = ()

    @abc.abstractmethod
    def check_world_size(self, world_size: int) -> str | None:
        """None if this strategy can serve ``world_size`` ranks, else a sentence naming sizes that work."""

    @abc.abstractmethod
    def holders(self, rank: int, world_size: int) -> list[int]:
        """Ranks (other than ``rank``) that keep a replica of ``rank``'s files."""

    def parity_set(self, rank: int, world_size: int) -> list[int] | None:
        """The ranks (``rank`` among them, in rank order) that protect each other's files with
        parity instead of replicas: each keeps an equal share of the set's parity, and any one
        lost member's files are rebuilt from the others. None (the default): this strategy
        keeps whole replicas (:meth:`holders`)."""
        return None
