"""A tier: one backend and its commit protocol, with the rules of the TOML (every, keep).

Derives everything the store needs from the backend's primitives: which checkpoints are complete
(manifest present and matching the files' sizes), verification (sizes and checksums), which
checkpoints ``keep`` drops, and what interrupted saves left behind. It is the only code that
talks to a commit protocol: saves, drains and replicas begin, commit and abort through it. Bytes
written here go through :meth:`Tier.writing` (``open_write``, ``write_bytes``): a tier without
room is a ``TierFullError`` whatever the backend and whichever write found it.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import threading
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import IO, Callable, Iterator

from tierstore.config.validate import TierConfig
from tierstore.errors import IntegrityError, TierFullError
from tierstore.format.checksum import hash_stream, same_digest
from tierstore.format.manifest import MANIFEST_NAME, Manifest, ManifestError
from tierstore.format.signing import UNSIGNED, Keyring
from tierstore.plugin.bases import Backend, CommitProtocol, DirectoryLock
from tierstore.tiers.chunked import ChunkedBackend
from tierstore.tiers.chunks import Collected, MissingChunk
from tierstore.tiers.layout import SINGLE, TierLayout
from tierstore.tiers.schedule import AutoSchedule
from tierstore.tiers.reports import Problem

__all__ = ["Holding", "Tier"]

log = logging.getLogger("tierstore.tiers")

#: how often a save makes its staging directory again when gc in another process removes it
#: between its creation and its lock
_BEGIN_ATTEMPTS = 3

#: what a filesystem says when it (or the user's quota on it) has no room left
_FULL = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True)
class Holding:
    """A checkpoint with a manifest on a tier, as one look at the tier saw it."""

    checkpoint_id: str
    manifest: Manifest
    #: the manifest's bytes as stored (to share with other ranks, who check them themselves)
    raw: bytes
    #: files of the manifest stored with their recorded size
    present: frozenset[str]

    @property
    def complete(self) -> bool:
        """Whether every file of the manifest is there."""
        return len(self.present) == len(self.manifest.files)


@dataclass
class Tier:
    """A configured tier of this process (paths already expanded for its rank and node)."""

    config: TierConfig
    backend: Backend
    commit: CommitProtocol
    commit_name: str
    #: which ranks share this tier's directory (set by the store at open)
    layout: TierLayout = SINGLE
    #: codec instances, in the order they are applied on write
    codecs: list = field(default_factory=list)
    #: for ``every = "auto"``: which saves it takes (set when the store builds the tier)
    schedule: AutoSchedule | None = None
    #: the store's signing keys: what manifests here must be sealed with, and how file
    #: digests are computed (tierstore.format.signing)
    keyring: Keyring = UNSIGNED
    # staging directory -> (the lock this process holds on it while it writes there, the
    # writer's token) (see begin_save); gc in any process spares a directory someone holds
    _writing: dict[str, tuple[DirectoryLock | None, str]] = field(
        default_factory=dict, compare=False, repr=False)
    # tokens of the writers of this process from before their directory exists until they
    # let go of it: gc here never collects them, not even between creation and lock
    _tokens_writing: collections.Counter = field(
        default_factory=collections.Counter, compare=False, repr=False)
    _guard: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)
    #: how many times this process changed what the tier holds (a commit, a pin, a delete): a
    #: look at the tier taken at another count is out of date (engine.listings)
    changes: int = field(default=0, compare=False, repr=False)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def auto(self) -> bool:
        """Whether its interval is chosen as the job runs (``every = "auto"``)."""
        return self.schedule is not None

    def takes(self, step: int) -> bool:
        """Whether this tier takes the save numbered ``step``: its ``every`` divides it, or,
        for ``every = "auto"``, its schedule says so (and counts it taken)."""
        if self.schedule is not None:
            return self.schedule.takes(step)
        return step % self.config.every == 0

    def due(self, step: int) -> bool:
        """Whether the save of ``step`` would go to this tier (asking changes nothing)."""
        if self.schedule is not None:
            return self.schedule.due(step)
        return step % self.config.every == 0

    # -- reading what is there ---------------------------------------------------------------
    def read_manifest(self, checkpoint_id: str) -> Manifest | None:
        """The manifest stored for ``checkpoint_id`` here, or None when there is none or it is
        rejected (logged). Says nothing about the files beside it (see ``present_files``)."""
        manifest, problem = self.checked_manifest(checkpoint_id)
        if problem is not None:
            log.warning("tier '%s': ignoring %s: %s", self.name, checkpoint_id, problem)
        return manifest

    def checked_manifest(self, checkpoint_id: str) -> tuple[Manifest | None, str | None]:
        """``(manifest, None)``; ``(None, None)`` when there is none; ``(None, why)`` when the
        one stored is rejected: unreadable, unsealed against its contents, unsigned or signed
        with another key where the store signs, a field out of shape, a path out of the tier,
        or the manifest of another id."""
        raw, why = self.manifest_bytes(checkpoint_id)
        if raw is None:
            return None, why
        return self.manifest_from(checkpoint_id, raw)

    def manifest_bytes(self, checkpoint_id: str) -> tuple[bytes | None, str | None]:
        """The stored manifest's bytes, unchecked: ``(raw, None)``; ``(None, None)`` when there
        is none; ``(None, why)`` when it cannot be read here (a link out of the tier)."""
        try:
            return self.backend.read_bytes(f"{checkpoint_id}/{MANIFEST_NAME}"), None
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None, None
        except IntegrityError as exc:  # a link out of the tier, a hostile name
            return None, f"{MANIFEST_NAME}: {exc}"

    def manifest_from(self, checkpoint_id: str, raw: bytes) -> tuple[Manifest | None, str | None]:
        """:meth:`checked_manifest` of manifest bytes read already (here, or by another rank
        that shared them): ``(manifest, None)``, or ``(None, why)`` when they are rejected."""
        try:
            manifest = Manifest.from_json(raw, self.keyring)
        except ManifestError as exc:
            return None, f"{MANIFEST_NAME} rejected: {exc}"
        if manifest.checkpoint_id != checkpoint_id:
            return None, (f"{MANIFEST_NAME} is the manifest of checkpoint "
                          f"{manifest.checkpoint_id!r}, not of {checkpoint_id!r}")
        return manifest, None

    def holdings(self) -> tuple[list[Holding], bool]:
        """Each checkpoint with a manifest here, as one look at the tier sees it, and whether
        the look was remote: on a backend with an :meth:`~tierstore.plugin.Backend.inventory`
        (an object store) one listing and a read of each manifest, whatever the number of
        files (True); elsewhere a listing of the root and a size per file (False)."""
        sizes = self.backend.inventory("")
        names = self.checkpoint_names(None if sizes is None else {k.split("/", 1)[0]
                                                                 for k in sizes})
        out = []
        for cid in names:
            if sizes is not None and f"{cid}/{MANIFEST_NAME}" not in sizes:
                continue  # no manifest: nothing committed there
            raw, problem = self.manifest_bytes(cid)
            manifest = None
            if raw is not None:
                manifest, problem = self.manifest_from(cid, raw)
            if manifest is None:
                if problem is None:
                    continue  # gone since the listing
                log.warning("tier '%s': ignoring %s: %s", self.name, cid, problem)
                continue
            present = (self.present_files(cid, manifest) if sizes is None else
                       {rel for rel, e in manifest.files.items()
                        if sizes.get(f"{cid}/{rel}") == e.size})
            out.append(Holding(cid, manifest, raw, frozenset(present)))
        return out, sizes is not None

    def present_files(self, checkpoint_id: str, manifest: Manifest) -> set[str]:
        """Files of ``manifest`` stored here with their recorded size (checksums are checked
        when they are read)."""
        sizes = self.backend.inventory(checkpoint_id)  # an object store: one listing
        if sizes is not None:
            return {rel for rel, entry in manifest.files.items() if sizes.get(rel) == entry.size}
        return {rel for rel, entry in manifest.files.items()
                if self.stored_size(f"{checkpoint_id}/{rel}") == entry.size}

    def stored_size(self, path: str) -> int | None:
        """Size of file ``path`` here; None when missing, or a link out of the tier."""
        try:
            return self.backend.size(path)
        except IntegrityError:  # a link out of the tier is no copy of the file
            return None

    def complete_manifest(self, checkpoint_id: str) -> Manifest | None:
        """The manifest of ``checkpoint_id`` if it is committed here and every file has its
        recorded size; None otherwise (a checkpoint without a matching manifest does not exist)."""
        manifest = self.read_manifest(checkpoint_id)
        if manifest is None or \
                len(self.present_files(checkpoint_id, manifest)) != len(manifest.files):
            return None
        return manifest

    def checkpoint_names(self, entries: Collection[str] | None = None) -> list[str]:
        """Entries of the root that may be checkpoints (not hidden, not leftovers), sorted;
        ``entries``: the root's entries as a listing already gave them."""
        listed = self.backend.list("") if entries is None else entries
        return sorted(n for n in listed if not n.startswith(".")
                      and not self.commit.is_leftover(n))

    def complete(self) -> dict[str, Manifest]:
        """Every complete checkpoint here, by id."""
        out = {}
        for name in self.checkpoint_names():
            manifest = self.complete_manifest(name)
            if manifest is not None:
                out[name] = manifest
        return out

    def verify(self, checkpoint_id: str,
               announce: Callable[[str, int], None] = lambda file, size: None
               ) -> list[Problem]:
        """Re-read every file of ``checkpoint_id`` and compare sizes and checksums
        (``announce(file, recorded size)`` before each file is read)."""
        def problem(file, what):
            return Problem(self.name, checkpoint_id, file, what)

        manifest, why = self.checked_manifest(checkpoint_id)
        if manifest is None:
            return [problem(MANIFEST_NAME, why or "missing (the checkpoint is not committed "
                                                  "here)")]
        problems = []
        for rel, entry in sorted(manifest.files.items()):
            announce(rel, entry.size)
            try:
                size, checksum = self.checksum_file(f"{checkpoint_id}/{rel}", entry.checksum)
            except MissingChunk as exc:  # a deduplicated file: which of its chunks
                problems.append(problem(rel, f"missing: {exc}"))
                continue
            except FileNotFoundError:
                problems.append(problem(rel, "missing"))
                continue
            except IntegrityError as exc:  # a link out of the tier
                problems.append(problem(rel, str(exc)))
                continue
            if size != entry.size:
                problems.append(problem(rel, f"size {size} bytes, manifest says {entry.size}"))
            elif not same_digest(checksum, entry.checksum):
                problems.append(problem(rel, f"checksum {checksum}, manifest says {entry.checksum}"))
        return problems

    def checksum_file(self, path: str, like: str) -> tuple[int, str]:
        """Size and digest of file ``path``, read whole, computed the way the recorded digest
        ``like`` was (keyed or not): compare the two. IntegrityError when ``like`` is keyed
        with a key this store does not hold."""
        hasher = self.keyring.hasher_for(like)
        with self.backend.open_read(path) as f:
            return hash_stream(f, hasher=hasher)

    # -- the commit protocol (nothing else calls it) ------------------------------------------
    def begin_save(self, checkpoint_id: str, token: str) -> str:
        """Prepare a save (or a drained copy, or a replica) of ``checkpoint_id``; returns the
        staging directory its files go into.

        The directory belongs to its writer until :meth:`commit_save` or :meth:`abort_save`:
        this process holds a shared lock on it (``Backend.lock_directory``; several ranks may
        write one directory), and :meth:`remove_leftover` refuses to hand it to gc, in this
        process or any other, while someone holds it. The lock dies with its process, so what a
        killed writer left is collected. Between the directory's creation and its lock, gc in
        this process spares it by its token; gc in another process may remove it there, which
        the lock notices (FileNotFoundError), and the directory is made again."""
        with self._guard:
            self._tokens_writing[token] += 1
        try:
            for _attempt in range(_BEGIN_ATTEMPTS):
                with self.writing(checkpoint_id):  # its staging directory (a marker, a lease)
                    staging = self.commit.begin(self.backend, checkpoint_id, token)
                try:
                    with self.writing(staging):
                        lock = self.backend.lock_directory(staging, exclusive=False)
                except FileNotFoundError:
                    log.info("tier '%s': %s was collected before it was locked; making it "
                             "again", self.name, staging)
                    continue
                with self._guard:
                    previous = self._writing.get(staging)
                    self._writing[staging] = (lock, token)
                if previous is not None:  # a second writer of one directory in this process
                    self._forget_token(previous[1])
                return staging
            raise FileNotFoundError(
                f"tier '{self.name}' ({self.backend.describe()}): the staging directory of "
                f"'{checkpoint_id}' was removed {_BEGIN_ATTEMPTS} times before it could be "
                f"locked; another process collects this directory's leftovers in a loop "
                f"(is a `tierstore gc` running on it?)")
        except BaseException:
            self._forget_token(token)
            raise

    @property
    def replaces_in_place(self) -> bool:
        """Whether a copy here can only be replaced where it lies, object by object: the tier
        cannot move a whole checkpoint at once (no rename, or a protocol such as
        ``manifest-last`` that writes a checkpoint where it will stay), so a replacement staged
        beside could never take the old copy's place without deleting it first."""
        return not (self.backend.supports_rename and self.commit.moves_aside_to_delete)

    def begin_repair(self, checkpoint_id: str, token: str) -> str:
        """Take the copy of ``checkpoint_id`` here for a repair in place
        (:attr:`replaces_in_place`); returns the directory its files are written into: the
        checkpoint's own. Nothing there is removed: this process holds the shared lock on it
        (a lease on an object store) so that neither gc nor ``keep`` takes it meanwhile;
        :meth:`commit_save` with that directory writes the manifest last, and a repair that
        fails only lets go of it (:meth:`end_writing`, never :meth:`abort_save`)."""
        with self._guard:
            self._tokens_writing[token] += 1
        try:
            with self.writing(checkpoint_id):
                self.backend.makedirs(checkpoint_id)
                lock = self.backend.lock_directory(checkpoint_id, exclusive=False)
        except BaseException:
            self._forget_token(token)
            raise
        with self._guard:
            previous = self._writing.get(checkpoint_id)
            self._writing[checkpoint_id] = (lock, token)
        if previous is not None:
            self._forget_token(previous[1])
        return checkpoint_id

    def commit_save(self, checkpoint_id: str, staging: str, manifest: Manifest,
                    announce: Callable[[str], None]) -> None:
        """Write ``manifest`` last and make the checkpoint visible (``announce(phase)`` right
        before the step that publishes it)."""
        try:
            raw = manifest.to_json(self.keyring)
            with self.writing(f"{staging}/{MANIFEST_NAME}", len(raw)):
                self.commit.commit(self.backend, checkpoint_id, staging, raw, announce)
        finally:
            self.changes += 1
            self.end_writing(staging)

    def abort_save(self, checkpoint_id: str, staging: str) -> None:
        """Throw away what a failed save, drain or replica wrote under ``staging``."""
        try:
            self.commit.abort(self.backend, checkpoint_id, staging)
        finally:
            self.end_writing(staging)

    def end_writing(self, staging: str) -> None:
        """This process no longer writes under ``staging`` (a rank that does not commit it,
        or a save that is over without a commit): let go of it; committing or aborting does
        this too. Idempotent."""
        with self._guard:
            held = self._writing.pop(staging, None)
        if held is None:
            return
        lock, token = held
        if lock is not None:
            lock.release()
        self._forget_token(token)

    def _forget_token(self, token: str) -> None:
        with self._guard:
            self._tokens_writing[token] -= 1
            if self._tokens_writing[token] <= 0:
                del self._tokens_writing[token]

    # -- writing bytes here (saves, spills, drains, pins) -----------------------------------
    @contextlib.contextmanager
    def writing(self, path: str, needed: int | None = None) -> Iterator[None]:
        """Run a write of ``path`` (about ``needed`` bytes) to this tier. The rule for a tier
        without room, whatever its backend: ENOSPC or EDQUOT, wherever it strikes (a write, the
        flush or fsync of a close, a directory or lease made, a rename), is a
        :class:`TierFullError` naming the tier, the path and the bytes; a nested write's error
        (the more precise one) goes through as it is."""
        try:
            yield
        except TierFullError:
            raise
        except OSError as exc:
            if exc.errno not in _FULL:
                raise
            raise self.full_error(path, needed, exc) from exc

    @contextlib.contextmanager
    def open_write(self, path: str, needed: int | None = None,
                   cuts: list[int] | None = None, repair: bool = False) -> Iterator[IO[bytes]]:
        """``backend.open_write(path)`` under :meth:`writing`, closed (durable) when the block
        ends; ``needed``: about how many bytes the file takes, for the error's message;
        ``cuts``: where the file's items start, where it has a manifest entry that recorded
        them (a deduplicated tier cuts its chunks there); ``repair``: the file replaces a
        bad one (a deduplicated tier checks the chunks it holds already, and rewrites bad
        ones)."""
        self.changes += 1  # (what it writes may change what a look saw: a repair, a copy)
        with self.writing(path, needed), self.backend.open_write(path) as f:
            if cuts and hasattr(f, "set_cuts"):
                f.set_cuts(cuts)
            if repair and hasattr(f, "recheck_chunks"):
                f.recheck_chunks()
            yield f

    def write_bytes(self, path: str, data: bytes) -> None:
        """``backend.write_bytes(path, data)`` under :meth:`writing`."""
        self.changes += 1
        with self.writing(path, len(data)):
            self.backend.write_bytes(path, data)

    def full_error(self, path: str, needed: int | None, cause: OSError) -> TierFullError:
        """The error of a write of ``path`` that found this tier full (``cause``): the tier,
        where, how much it needed, how much is free."""
        try:
            free = self.backend.free_bytes()
        except Exception:  # noqa: BLE001 - the message does without it
            free = None
        root = self.backend.describe()
        where = f"{root.rstrip('/')}/{path}" if path else root
        return TierFullError(
            cause.errno,
            f"tier '{self.name}' is full ({os.strerror(cause.errno)}): writing {where} "
            + (f"needed about {needed:,} bytes" if needed is not None else "needed more room")
            + f" and {'an unknown number of' if free is None else f'{free:,}'} bytes are free. "
            f"Nothing was committed by this write and the checkpoints already there are intact; "
            f"free space there, lower the tier's keep, or point it at a larger filesystem")

    # -- changing what is there --------------------------------------------------------------
    def set_pinned(self, checkpoint_id: str, pinned: bool) -> bool:
        """Rewrite the manifest's pinned flag; False when the checkpoint is not complete here.

        The checkpoint's directory is held shared from the read of its manifest to the
        rewrite: ``keep`` (this process's, or another's sharing the directory: a node's leader)
        evicts only under an exclusive lock, and a rewrite after an eviction would bring back
        the manifest of a checkpoint whose files are gone (on an object store, where writing a
        key needs no directory), or fail on the missing directory."""
        try:
            hold = self.backend.lock_directory(checkpoint_id, exclusive=False)
        except FileNotFoundError:
            return False  # evicted (or never here)
        try:
            manifest = self.complete_manifest(checkpoint_id)
            if manifest is None:
                return False
            if manifest.pinned != pinned:
                manifest.pinned = pinned
                raw = manifest.to_json(self.keyring)
                with self.writing(f"{checkpoint_id}/{MANIFEST_NAME}", len(raw)):
                    self.commit.update_manifest(self.backend, checkpoint_id, raw,
                                                uuid.uuid4().hex[:12])
                self.changes += 1
            return True
        finally:
            hold.release()

    def delete(self, checkpoint_id: str, *, evicted: bool = False) -> None:
        """Remove a checkpoint so that a crash part-way leaves nothing visible and nothing gc
        cannot recognise: moved aside first where the backend renames atomically and the
        protocol names a trash entry, else marked (``begin_delete``) and the manifest first.
        ``evicted``: ``keep`` drops it and nothing reads it (the backend may reuse its storage,
        :meth:`Backend.discard`)."""
        remove = self.backend.discard if evicted else self.backend.delete
        self.changes += 1
        if self.backend.supports_rename and self.commit.moves_aside_to_delete:
            aside = self.commit.trash_name(checkpoint_id, uuid.uuid4().hex[:16])
            self.backend.rename(checkpoint_id, aside)
            self.backend.sync_dir("")
            remove(aside)
            return
        self.commit.begin_delete(self.backend, checkpoint_id)
        self.backend.delete(f"{checkpoint_id}/{MANIFEST_NAME}")
        remove(checkpoint_id)

    def collect_chunks(self, force: bool = False) -> Collected | None:
        """On a deduplicated tier, remove the chunks no checkpoint here (committed, pending,
        being written or deleted) names any more (``force``: even where a pass is not due,
        see ``ChunkStore.due``); None on any other tier."""
        if not isinstance(self.backend, ChunkedBackend):
            return None
        return self.backend.collect_chunks(force)

    def retention_victims(self, manifests: dict[str, Manifest]) -> list[str]:
        """Ids that ``keep`` removes: all but the newest ``keep``, never pinned ones."""
        if self.config.keep is None:
            return []
        newest_first = sorted(manifests, key=lambda i: (manifests[i].committed, i), reverse=True)
        return [i for i in newest_first[self.config.keep:] if not manifests[i].pinned]

    def leftovers(self, protect: Collection[str] = ()) -> list[str]:
        """Root entries left by interrupted saves, deletes and overwrites (their names say so),
        except those of the save tokens in ``protect`` (saves still in flight). Anything else in
        the root, such as a user's own DCP checkpoint without a manifest, is never touched.
        What this process is writing here is never one of them."""
        with self._guard:
            protect = set(protect) | set(self._tokens_writing)
        return self.commit.find_leftovers(self.backend, self.backend.list(""), protect)

    def remove_leftover(self, name: str) -> bool:
        """Delete one entry :meth:`leftovers` named (never a committed checkpoint), unless a
        writer still holds it (a save, drain or replica in progress in this or another
        process); returns whether it was removed."""
        lock = self.backend.lock_directory(name, exclusive=True)
        if lock is None:
            log.info("tier '%s': not collecting %s: a writer still holds it", self.name, name)
            return False
        try:
            self.backend.delete(name)
        finally:
            lock.release()
        return True
