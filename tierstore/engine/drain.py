"""The drain: copying committed checkpoints, byte for byte, down to slower tiers.

A save commits on the fastest tier that takes it; the drain then copies its files to every slower
tier whose ``every`` takes the same step and commits them there with that tier's protocol, in
background threads, so a save is never slowed down by a slower tier. Memory is bounded by
``copy_threads x chunk_bytes``. Every byte is checked against the manifest on the way: a bad
source copy is never propagated. ``Store.wait()`` waits for the drain and raises its failures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import pickle
import queue
import sys
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from tierstore.engine.context import StoreContext
from tierstore.engine.gc import GarbageCollector
from tierstore.engine.jobs import BackgroundJob, BackgroundJobs
from tierstore.engine.manifests import build_manifest
from tierstore.engine.mismatch import explain_mismatch
from tierstore.engine.notices import FAILED as NOTICE_FAILED
from tierstore.engine.notices import notice_key
from tierstore.engine.parts import PENDING_PART, KnownCommits, is_pending, unmark
from tierstore.engine.retention import Retention
from tierstore.errors import DrainError, IntegrityError
from tierstore.events import Event, EventKind, Phase
from tierstore.format.checksum import hash_stream
from tierstore.format.manifest import METADATA_NAME, FileEntry, Manifest
from tierstore.format.checksum import same_digest
from tierstore.tiers.layout import TierLayout
from tierstore.tiers.tier import Tier
from tierstore.transport.collectives import all_posted, drop_posts, post, read_post, seen_lost
from tierstore.transport.messages import MessageError, decode_message, encode_message

if TYPE_CHECKING:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

__all__ = ["DrainJob", "Drainer", "PendingCopy", "report_unfinished", "finish_at_exit",
           "own_share"]

log = logging.getLogger("tierstore.drain")

#: what a rank that does not commit a gathered copy leaves in the shared staging directory for
#: the committing rank: its report on the files it copied (see Drainer._part_done)
_RANK_REPORT = ".tierstore-rank-{}.json"
#: longest wait between two looks of the committing rank for the other parts of a gathered
#: copy: a look is one listing, and the wait is straight on the time to durable
_PART_POLL_MAX_S = 0.1
#: a gathered copy's words in the job's key-value store (see _drain_key) are asked for at waits
#: growing to this (a question each is a small request to the store's server, from every rank
#: that waits), and the tier itself is looked at once per _LOOK_EVERY_S meanwhile (a word that
#: never comes: a rank that could not leave it)
_WORD_POLL_MAX_S, _LOOK_EVERY_S = 0.2, 1.0
#: the first and the longest wait between two looks at a tier on this machine's filesystems
#: (a look is a local listing or a read of a small file, cheap)
_LOCAL_POLL_FIRST_S, _LOCAL_POLL_MAX_S = 0.005, 0.02


def _drain_key(token: str, tier: str, what: str) -> str:
    """A word about the gathered copy of save ``token`` to ``tier`` in the job's key-value
    store: ``begun`` (the committing rank began the copy: the others begin theirs) or
    ``reported-<rank>`` (that rank reported its part on the tier, where the committing rank
    reads it)."""
    return f"tierstore/drain/{token}/{tier}/{what}"


def _wake(key: str) -> None:
    """Leave the word ``key`` (best effort: the ranks waiting for it look at the tier every
    ``_LOOK_EVERY_S`` without it)."""
    try:
        post(key, b"1")
    except Exception:  # noqa: BLE001 - the waiters find the tier's answer without it
        log.debug("could not leave the word %s", key, exc_info=True)


class _Polls:
    """The waits between one rank's looks at ``tier`` for what other ranks make there (a
    node's committed part, the other ranks' reports): each wait is straight on the time to
    durable. On a tier of this machine's filesystems a look is cheap, so the waits stay short;
    on a remote one (an object store) each look is a request, so they grow, from ``first`` up
    to ``most``. Only for looks that do not grow with the job: one rank's, or a node-local
    tier's (every rank waiting for the committing rank's begin on a shared tier keeps a
    schedule that grows to half a second)."""

    def __init__(self, tier: Tier, first: float, most: float):
        local = tier.backend.local_path("") is not None
        self._delay = _LOCAL_POLL_FIRST_S if local else first
        self._most = min(most, _LOCAL_POLL_MAX_S) if local else most

    def wait(self) -> None:
        """Sleep until the next look."""
        time.sleep(self._delay)
        self._delay = min(self._delay * 2, self._most)


@dataclass(frozen=True)
class PendingCopy:
    """A copy the drain has not finished: which checkpoint, to which tier (plain data)."""

    checkpoint_id: str
    tier: str

    def __str__(self) -> str:
        return f"{self.checkpoint_id} -> {self.tier}"


@dataclass
class DrainJob(BackgroundJob):
    """Copy ``checkpoint_id`` from ``source`` to each of ``targets`` (in order).

    ``token`` is the save's token; ``all_files`` every file of the checkpoint (all parts), which
    the rank that commits a shared copy of a node-local checkpoint waits for.

    A copy of a node-local checkpoint to a shared tier is *gathered*: every rank of every node
    runs its own job of it and copies the files it wrote (its part's leader also those no rank
    of the part wrote, such as ``.metadata``), so that the ranks of a node upload side by side;
    each reports what it copied, and rank 0 commits once every rank's files are there."""

    targets: list[Tier]
    token: str
    all_files: dict[str, FileEntry]
    done: list[str] = field(default_factory=list)
    #: replace a copy already on a target (``promote``, ``scrub --repair``), not refuse it
    replace: bool = False
    #: commit the copies pinned (``promote --pin``): ``keep`` there never evicts them
    pin: bool = False
    #: a gathered copy queued by a rank that does not commit its node's part: whether the
    #: save call that queued it is over (its part is committed by then, or never will be)
    save_over: Callable[[], bool] | None = None


class _CopyPool:
    """A fixed set of daemon threads running file copies.

    Not a ThreadPoolExecutor: those refuse new work once the interpreter starts shutting down,
    and the drain must still be able to finish pending copies from an atexit handler."""

    def __init__(self, threads: int):
        self._queue: queue.Queue = queue.Queue()
        self._threads = [threading.Thread(target=self._run, name=f"tierstore-copy-{i}",
                                          daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable, *args) -> Future:
        fut: Future = Future()
        self._queue.put((fut, fn, args))
        return fut

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # reported through the future
                fut.set_exception(exc)

    def close(self, timeout: float = 0) -> None:
        """Stop the threads once the copies queued before are done, waiting up to ``timeout``
        seconds for them to end."""
        for _ in self._threads:
            self._queue.put(None)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()) if timeout else 0)


class Drainer(BackgroundJobs[DrainJob]):
    """The drain of one store: jobs run in submission order (the order of saves)."""

    what = "drains"

    def __init__(self, context: StoreContext, retention: Retention, gc: GarbageCollector,
                 commits: KnownCommits | None = None):
        self._context, self._retention, self._gc = context, retention, gc
        self._commits = commits if commits is not None else KnownCommits()
        # (checkpoint id, tier name) -> (lock, users): see _copying
        self._copy_locks: dict[tuple[str, str], tuple[threading.Lock, int]] = {}
        self._copy_locks_guard = threading.Lock()
        self._host, self._rank = context.host, context.rank
        self._chunk = context.copy_chunk_bytes
        self._part_timeout = context.config.part_timeout
        #: set at interpreter exit (:meth:`exiting`): waits for other ranks end by then
        self._exit_deadline: float | None = None
        self._pool = _CopyPool(context.config.drain_threads)
        super().__init__("tierstore-drain")
        retention.spare_with(self.protected)

    def exiting(self) -> None:
        """The process is exiting: a drain waiting for another rank (the committing rank's
        begin, another node's part) waits at most ``collective_timeout`` more, the time after
        which the job takes a rank that did not answer for lost. A rank that died or hangs
        (its peer's collective timed out, and the process ends) would else hold this one
        for ``part_timeout`` after its work is over."""
        self._exit_deadline = time.monotonic() + min(self._part_timeout,
                                                     self._context.config.collective_timeout)

    def _past_exit_deadline(self) -> bool:
        return self._exit_deadline is not None and time.monotonic() > self._exit_deadline

    def pending(self) -> list[PendingCopy]:
        """Copies not finished yet, in order."""
        return [PendingCopy(j.checkpoint_id, t.name) for j in self.pending_jobs()
                for t in j.targets if t.name not in j.done]

    def describe_pending(self) -> list[str]:
        return [str(c) for c in self.pending()]

    def close(self, timeout: float = 0) -> None:
        """Stop the threads (after ``wait``), waiting up to ``timeout`` seconds for them to
        end: a copy still running (``store.close(wait=False)``, timeout 0) ends with the
        process, but after a store's drains are done no thread of theirs outlives its close."""
        self._jobs.put(None)
        self._pool.close(timeout)
        if timeout:
            self._thread.join(timeout)

    def copy_now(self, job: DrainJob) -> float:
        """Run ``job`` in this thread, now, whatever the targets' ``every`` (``promote``,
        ``scrub --repair``): the drain's checks and commit, its events; raises the first
        target's failure as a :class:`DrainError`. Returns the seconds it took."""
        if job.source.complete_manifest(job.checkpoint_id) is None:
            raise DrainError(f"checkpoint '{job.checkpoint_id}' is not complete on tier "
                             f"'{job.source.name}'", job.checkpoint_id, None)
        started = time.perf_counter()
        for target in job.targets:
            try:
                if job.replace and target.replaces_in_place:
                    with self._copying(job.checkpoint_id, target):
                        self._repair_in_place(job, target)
                else:  # a new copy, or one staged beside the old and swapped in at commit
                    self._drain_one(job, target)
            except Exception as exc:
                raise _not_copied(job, target, exc) from exc
            job.done.append(target.name)
        return time.perf_counter() - started

    def _repair_in_place(self, job: DrainJob, target: Tier) -> None:
        """Replace a bad copy on a tier that cannot swap a whole copy at once
        (:attr:`Tier.replaces_in_place`: object stores, ``manifest-last``) without ever
        removing what is good of it. The drain's own way (``begin_save``) would delete the old
        copy before the new one exists, and a repair that then fails (the store is flaky: that
        is often why the copy was bad) would leave no copy at all. Here the files that already
        match the source's manifest stay; each other file is written over where it lies (on
        an object store a PUT replaces an object whole, or not at all), every byte checked
        against the source's manifest; the manifest is written last. A repair that fails
        part-way leaves the old manifest and every file it did not reach as they were, and
        the files it did write are good ones."""
        source, cid = job.source, job.checkpoint_id
        host, rank = self._host, self._rank
        manifest = self._source_manifest(job, target)
        codecs = [c.name for c in target.config.codecs]
        if manifest.codecs != codecs:
            # Re-encoding would rewrite every file, the good ones too, with bytes the old
            # manifest may not match: not a repair that keeps what is good.
            raise DrainError(
                f"checkpoint '{cid}': the copy on tier '{target.name}' (codecs {codecs}) is "
                f"not repaired in place from tier '{source.name}' (codecs {manifest.codecs}): "
                f"every file would be re-encoded over the old ones. Nothing was changed there; "
                f"repair it from a copy with the same codecs", cid, target.name)
        started = time.perf_counter()
        host.event(Event(EventKind.DRAIN_STARTED, cid, target.name, rank,
                         nbytes=manifest.size_bytes, detail={"source": source.name}))
        staging = target.begin_repair(cid, uuid.uuid4().hex[:16])
        try:
            order = sorted(manifest.files, key=lambda r: -manifest.files[r].size)
            good = self._run_all([(self._holds, target, cid, rel, manifest.files[rel])
                                  for rel in order])
            self._run_all([(self._replace_file, source, target, cid, rel, manifest)
                           for rel, ok in zip(order, good) if not ok])
            copy = self._target_manifest(job, source, target, manifest, False)
            host.phase(Phase.DRAIN_COMMIT, cid, target.name, rank)
            target.commit_save(cid, staging, copy,
                               lambda phase: host.phase(phase, cid, target.name, rank))
            self._settle_pin(job, source, target, copy)
        finally:
            target.end_writing(staging)  # a failed repair lets go; it deletes nothing
        seconds = time.perf_counter() - started
        host.event(Event(EventKind.DRAIN_FINISHED, cid, target.name, rank, seconds,
                         manifest.size_bytes, {"source": source.name, "committed": True}))
        log.info("repaired %s on '%s' in place from '%s' (%d of %d files rewritten, %.2f s)",
                 cid, target.name, source.name, good.count(False), len(good), seconds)
        self._retention.apply_quietly(target)

    @staticmethod
    def _holds(target: Tier, cid: str, rel: str, entry: FileEntry) -> bool:
        """Whether ``target`` already holds file ``rel`` of ``cid`` as ``entry`` says."""
        if target.stored_size(f"{cid}/{rel}") != entry.size:
            return False
        try:
            size, checksum = target.checksum_file(f"{cid}/{rel}", entry.checksum)
        except (FileNotFoundError, IntegrityError):
            return False
        return size == entry.size and same_digest(checksum, entry.checksum)

    def _replace_file(self, source: Tier, target: Tier, cid: str, rel: str,
                      manifest: Manifest) -> None:
        """Write file ``rel`` of ``cid`` from ``source`` over the bad one on ``target``."""
        entry = manifest.files[rel]
        self._host.phase(Phase.DRAIN_FILE, cid, target.name, self._rank, file=rel,
                         size=entry.size)
        with source.backend.open_read(f"{cid}/{rel}") as fin, \
                target.open_write(f"{cid}/{rel}", entry.size, entry.cuts, repair=True) as fout:
            copied, checksum = hash_stream(fin, self._chunk, fout.write,
                                           source.keyring.hasher_for(entry.checksum))
        _check_source(cid, rel, source, target, entry, copied, checksum)

    # -- the jobs ------------------------------------------------------------------------------
    def run_job(self, job: DrainJob) -> None:
        for target in job.targets:
            self._drain_target(job, target)

    def _drain_target(self, job: DrainJob, target: Tier) -> None:
        """Copy ``job``'s checkpoint to ``target``; a failure is reported (an event, the
        store's errors), never raised."""
        try:
            self._drain_one(job, target)
        except BaseException as exc:
            if isinstance(exc, DrainError) and self._overwritten(job):
                # A newer save of the same id replaced the source under the copy (the
                # bytes read are that save's, not those of the manifest the copy began
                # with): its own drain copies it; this one gives way.
                log.info("%s on tier '%s' was saved again while it was being copied to "
                         "'%s'; the newer save's drain copies it", job.checkpoint_id,
                         job.source.name, target.name)
            else:
                self._target_failed(job, target, exc)
        job.done.append(target.name)

    @staticmethod
    def _overwritten(job: DrainJob) -> bool:
        """Whether the source now holds another save of the job's id than the job's own."""
        if not job.token:
            return False
        try:
            now = job.source.read_manifest(job.checkpoint_id)
        except Exception:  # noqa: BLE001 - a source that cannot be read says nothing
            return False
        return now is not None and now.save_token != job.token

    def after_job(self, job: DrainJob) -> None:
        # Retention on the source may have spared this id while it was being copied: apply it
        # before wait() returns. Only the rank that publishes the source's part applies keep
        # there (as after a save): another rank would not know of that rank's drains and loads.
        if job.source.layout.leader == self._rank:
            self._retention.apply_quietly(job.source)

    def failure(self, job: DrainJob, exc: BaseException) -> DrainError:
        return DrainError(f"the drain of checkpoint '{job.checkpoint_id}' failed: "
                          f"{type(exc).__name__}: {exc}", job.checkpoint_id, None)

    @staticmethod
    def _safely(fn: Callable[[], object], what: str) -> None:
        try:
            fn()
        except Exception:
            log.exception("%s failed", what)

    def _target_failed(self, job: DrainJob, target: Tier, exc: BaseException) -> None:
        if _PartExchange.applies(job.source, target):
            _PartExchange.withdraw(job, target, exc)  # the other nodes' drains stop waiting
        err = _not_copied(job, target, exc)
        self.record_failure(err)
        log.error("%s", err)
        self._host.event(Event(EventKind.FAILED, job.checkpoint_id, target.name, self._rank,
                               detail={"during": "drain", "error": str(err)}))

    def _source_manifest(self, job: DrainJob, target: Tier, *,
                         same_save: bool = False) -> Manifest:
        """Announce a copy's begin; the manifest of its source, complete, or DrainError
        (``same_save``: also where the source holds another save's copy of the id, as a
        gathered copy's node part may after an overwrite)."""
        source, cid = job.source, job.checkpoint_id
        self._host.phase(Phase.DRAIN_BEGIN, cid, target.name, self._rank, source=source.name)
        manifest = source.complete_manifest(cid)
        if manifest is not None and same_save and manifest.save_token != job.token:
            manifest = None
        if manifest is None:
            raise DrainError(f"checkpoint '{cid}' is no longer complete on tier "
                             f"'{source.name}', so it cannot be copied to '{target.name}'",
                             cid, target.name)
        return manifest

    def _wait_for_part(self, job: DrainJob, target: Tier) -> None:
        """Wait until the node's part of ``job``'s save is committed on its source tier
        (an older copy of the same id may still be there until then); DrainError once the
        save is over without it."""
        source, cid, leader = job.source, job.checkpoint_id, job.source.layout.leader
        deadline = time.monotonic() + self._part_timeout
        polls = _Polls(source, 0.005, _PART_POLL_MAX_S)
        over = False
        while True:
            manifest = source.read_manifest(cid)
            if manifest is not None and manifest.save_token == job.token:
                return
            if over:
                raise DrainError(f"checkpoint '{cid}': its save ended without committing this "
                                 f"node's part on tier '{source.name}', so it was not copied "
                                 f"to tier '{target.name}'", cid, target.name)
            if job.save_over is not None and job.save_over():
                over = True  # one more look: the commit may have come just before
                continue
            if read_post(notice_key(job.token)) == NOTICE_FAILED:
                raise DrainError(f"checkpoint '{cid}': its save failed on the coordinator, so "
                                 f"it was not copied to tier '{target.name}'", cid, target.name)
            if seen_lost(self._context.groups.main, [leader]) or self._past_exit_deadline() \
                    or time.monotonic() > deadline:
                raise DrainError(
                    f"checkpoint '{cid}': rank {leader}, which commits this node's part on tier "
                    f"'{source.name}', did not commit it (lost, the process is exiting, or "
                    f"past part_timeout); this rank's files were not copied to "
                    f"'{target.name}'", cid, target.name)
            polls.wait()

    def _reporters(self, job: DrainJob, source: Tier) -> dict[int, str]:
        """The ranks whose reports the committing rank waits for, with their reports' names:
        every other rank that wrote files of the checkpoint (files of no rank, or of a rank
        no part holds, are their part leader's to copy and report)."""
        placed = {r for ranks in source.layout.all_parts for r in ranks}
        writers = {e.rank for e in job.all_files.values() if e.rank in placed}
        return {r: _RANK_REPORT.format(r) for r in sorted(writers) if r != self._rank}

    @staticmethod
    def _copy_there(target: Tier, cid: str) -> Manifest | None:
        """The manifest of the copy of ``cid`` that ``target`` holds and a drain must not
        replace, or None: on a tier of this machine, a complete one (what is left of a damaged
        copy is replaced, as a save replaces it: tierstore.engine.existing); on a remote tier,
        any manifest (only ``promote`` and ``scrub --repair`` replace a copy there, in place;
        written last, it is there once the copy is)."""
        if target.backend.local_path("") is not None:
            return target.complete_manifest(cid)
        return target.read_manifest(cid)

    @contextlib.contextmanager
    def _copying(self, checkpoint_id: str, target: Tier):
        """Held while this process copies ``checkpoint_id`` to ``target``: a drain and a
        ``promote`` of the same checkpoint to the same tier (or two promotes) copy one after
        the other, never side by side, where each would find the other's copy in its way or
        replace its directory under it."""
        key = (checkpoint_id, target.name)
        with self._copy_locks_guard:
            lock, users = self._copy_locks.get(key, (threading.Lock(), 0))
            self._copy_locks[key] = (lock, users + 1)
        try:
            waited = not lock.acquire(blocking=False)
            if waited:
                lock.acquire()
            try:
                yield waited  # whether another copy of it to that tier went first
            finally:
                lock.release()
        finally:
            with self._copy_locks_guard:
                lock, users = self._copy_locks[key]
                if users == 1:
                    del self._copy_locks[key]
                else:
                    self._copy_locks[key] = (lock, users - 1)

    def _drain_one(self, job: DrainJob, target: Tier) -> None:
        with self._copying(job.checkpoint_id, target) as waited, \
                self._holding_part(job, target):
            self._copy_one(job, target, waited)

    @contextlib.contextmanager
    def _holding_part(self, job: DrainJob, target: Tier):
        """A rank that copies its own files of its node's part, not the part's leader (a
        gathered copy: see :class:`DrainJob`): wait until the leader (on the coordinator's
        node, the coordinator) has committed the part of this save on the node's tier, then hold the
        part's directory shared while copying, so that the leader's ``keep`` does not evict it
        under this rank. It queued its copy when its own files were written, a moment before
        that commit. Anywhere else: nothing to wait for or hold."""
        source = job.source
        if not (target.layout.shared and not source.layout.shared
                and self._rank != source.layout.leader):
            yield
            return
        self._wait_for_part(job, target)
        try:
            hold = source.backend.lock_directory(job.checkpoint_id, exclusive=False)
        except FileNotFoundError:
            hold = None  # evicted meanwhile: the copy finds it gone and says so
        try:
            yield
        finally:
            if hold is not None:
                hold.release()

    def _copy_one(self, job: DrainJob, target: Tier, waited: bool = False) -> None:
        source, cid = job.source, job.checkpoint_id
        host, rank = self._host, self._rank
        # A node-local checkpoint going to a shared tier: every rank copies its own files into
        # one staging directory (named by the save), and rank 0 commits once all are there.
        gathering = target.layout.shared and not source.layout.shared
        manifest = self._source_manifest(job, target, same_save=gathering)
        # What this rank copies: the whole checkpoint (or part), or its own files of it.
        share = own_share(manifest, source.layout, rank) if gathering else manifest
        overwrite = self._context.config.overwrite
        # The copy there, read once: asked where a copy of it must not be replaced, or where
        # another copy of it to this tier (a promote, or the drain it raced) went first.
        there = (self._copy_there(target, cid)
                 if not gathering and not job.replace and (waited or not overwrite) else None)
        if there is not None and there.save_token == manifest.save_token:
            self._keep_copy_there(job, target, there)
            return
        commits = not gathering or rank == 0
        started = time.perf_counter()
        host.event(Event(EventKind.DRAIN_STARTED, cid, target.name, rank,
                         nbytes=share.size_bytes, detail={"source": source.name}))
        if there is not None and not overwrite:
            # The save asked only this machine's tiers up front (see TierstoreWriter.reset).
            raise DrainError(
                f"checkpoint '{cid}' already exists on tier '{target.name}' "
                f"({target.backend.describe()}), so it was not replaced there; it is complete "
                f"on tier '{source.name}'. Save under a new id, or set [store] overwrite = true",
                cid, target.name)
        # What interrupted saves left on the target goes before the copy where it takes room
        # the copy may need (a filesystem), and after it on an object store, where looking
        # for it reads every checkpoint's markers there: requests not on the time to durable.
        collects = rank == target.layout.leader
        collect_after = collects and target.backend.local_path("") is None
        if collects and not collect_after:
            self._gc.collect(target, protect={job.token})
        token = job.token if gathering else uuid.uuid4().hex[:16]
        transcode = manifest.codecs != [c.name for c in target.config.codecs]
        if transcode and gathering:
            raise DrainError(
                f"checkpoint '{cid}': tier '{source.name}' (node-local, codecs "
                f"{manifest.codecs}) cannot be drained to the shared tier '{target.name}' with "
                f"other codecs ({[c.name for c in target.config.codecs]}) yet; give both tiers "
                f"the same codecs", cid, target.name)
        if not commits:
            # The committing rank prepares the shared staging directory (a protocol's begin may
            # clear what an old or interrupted copy left there); beginning beside it, two
            # ranks could each find it unprepared and each clear the other's uploads.
            self._wait_for_begin(job, target)
        staging = target.begin_save(cid, token)
        if gathering and commits:
            # The other ranks wait for this begin (see _wait_for_begin): they go on now.
            _wake(_drain_key(token, target.name, "begun"))
        marked = False  # the copy carries the part's pending marker
        try:
            if transcode:
                copy = self._transcode(job, source, target, manifest, staging)
            elif self._can_upload(source, target, cid, share):
                self._upload(source, target, cid, staging, share)
            else:
                self._run_all([(self._copy_file, source, target, cid, staging, rel, share,
                                gathering, job.replace)
                               for rel in sorted(share.files,
                                                 key=lambda r: -share.files[r].size)])
            if gathering and not commits:
                self._part_done(target, staging, _RANK_REPORT.format(rank), share, None)
                _wake(_drain_key(token, target.name, f"reported-{rank}"))
            if commits:
                if not transcode:
                    copy = self._target_manifest(job, source, target, manifest, gathering)
                if gathering:
                    self._wait_for_parts(job, target, staging, source, share)
                elif is_pending(source, cid) and \
                        not self._commits.knows(cid, manifest.save_token):
                    # A node's part whose checkpoint's commit is not known yet: pending on the
                    # node's slower tier too, never visible unmarked (a coordinator that failed
                    # leaves an orphan the next save removes, not a copy in its way).
                    target.write_bytes(f"{staging}/{PENDING_PART}", manifest.save_token.encode())
                    marked = True
                host.phase(Phase.DRAIN_COMMIT, cid, target.name, rank)
                target.commit_save(cid, staging, copy,
                                   lambda phase: host.phase(phase, cid, target.name, rank))
                self._settle_pin(job, source, target, copy)
                if marked and self._commits.knows(cid, manifest.save_token):
                    # The commit's notice came while this copy was made: confirmed here too
                    # (the node settled the tiers it found the part on before this commit).
                    unmark(target, cid)
        except BaseException as exc:
            if commits:
                if gathering:
                    # The other ranks may still be uploading: removed now, what they write
                    # after would stay behind, a copy nobody commits or collects.
                    self._safely(lambda: self._await_reports(job, target, staging, source),
                                 f"waiting for the other ranks' files of {cid}")
                self._safely(lambda: target.abort_save(cid, staging),
                             f"removing the partial copy of {cid} on '{target.name}'")
            elif gathering:
                # Objects go straight to their final names where the tier cannot rename: what
                # this rank wrote is removed, and the committing rank is told why, so that it
                # never commits the shared copy with this part's files (sizes alone would not
                # tell it that they failed their check).
                self._safely(lambda exc=exc: self._part_done(
                    target, staging, _RANK_REPORT.format(rank), share, exc),
                    f"withdrawing this rank's part of {cid} on '{target.name}'")
                _wake(_drain_key(token, target.name, f"reported-{rank}"))
            raise
        finally:
            target.end_writing(staging)  # this rank's part is there; rank 0 commits the rest
            if gathering and commits:  # every other rank has begun and reported, or never will
                drop_posts([_drain_key(token, target.name, what) for what in
                            ["begun", *(f"reported-{r}" for r in self._reporters(job, source))]])
        seconds = time.perf_counter() - started
        host.event(Event(EventKind.DRAIN_FINISHED, cid, target.name, rank, seconds,
                         share.size_bytes, {"source": source.name, "committed": commits}))
        log.info("drained %s from '%s' to '%s' (%d bytes in %.2f s)", cid, source.name,
                 target.name, share.size_bytes, seconds)
        if commits:
            self._retention.apply_quietly(target)
        if collect_after:
            self._safely(lambda: self._gc.collect(target, protect={job.token}),
                         f"removing what interrupted saves left on '{target.name}'")

    @staticmethod
    def _can_upload(source: Tier, target: Tier, cid: str, manifest: Manifest) -> bool:
        """Whether the target takes whole local files in one concurrent transfer (object
        stores through fsspec) and the source has them as local files."""
        return (target.backend.bulk_upload
                and target.backend.local_path("") is None
                and all(source.backend.local_path(f"{cid}/{rel}") for rel in manifest.files))

    def _upload(self, source: Tier, target: Tier, cid: str, staging: str,
                manifest: Manifest) -> None:
        """Hand the source files to the object store's own concurrent multipart upload while
        checking them against the manifest on the copy pool (a local read); a mismatch fails
        the drain before the commit, so a bad copy is never published."""
        checks = [self._pool.submit(self._check_local_file, source, target, cid, rel, manifest)
                  for rel in manifest.files]
        pairs = [(source.backend.local_path(f"{cid}/{rel}"), f"{staging}/{rel}")
                 for rel in sorted(manifest.files, key=lambda r: -manifest.files[r].size)]
        try:
            target.backend.put_files(pairs, {f"{staging}/{rel}": e.size
                                             for rel, e in manifest.files.items()})
        finally:
            errors = [e for e in (f.exception() for f in checks) if e is not None]
        if errors:
            raise errors[0]

    def _check_local_file(self, source: Tier, target: Tier, cid: str, rel: str,
                          manifest: Manifest) -> None:
        self._host.phase(Phase.DRAIN_FILE, cid, target.name, self._rank, file=rel,
                         size=manifest.files[rel].size)
        hasher = source.keyring.hasher_for(manifest.files[rel].checksum)
        with source.backend.open_read(f"{cid}/{rel}") as fin:
            size, checksum = hash_stream(fin, self._chunk, hasher=hasher)
        _check_source(cid, rel, source, target, manifest.files[rel], size, checksum)

    def _run_all(self, calls: list[tuple]) -> list:
        """Run ``(fn, *args)`` calls on the copy pool; raise the first failure after all end."""
        futures = [self._pool.submit(fn, *args) for fn, *args in calls]
        errors = [e for e in (f.exception() for f in futures) if e is not None]
        if errors:
            raise errors[0]
        return [f.result() for f in futures]

    def _transcode(self, job: DrainJob, source: Tier, target: Tier, manifest: Manifest,
                   staging: str) -> Manifest:
        """Copy a checkpoint to a tier with other codecs: every item is decoded from the
        source's stream transforms and encoded with the target's, and DCP's metadata is
        rewritten with the new offsets. Every source byte is still checked on the way.

        A node-local checkpoint is re-encoded part by part, each node's drain its own part
        (:class:`_PartExchange`): only the coordinator's part holds ``.metadata``, so the
        coordinator's drain hands each other part the items of its files, and writes the
        target's ``.metadata`` once every part has said where its items are now."""
        cid = job.checkpoint_id
        # (A failure is told to the other side by the job's failure: Drainer._target_failed.)
        exchange = (_PartExchange(self._context, self._part_timeout, job, source, target,
                                  manifest) if manifest.parts > 1 else None)
        if manifest.has_metadata:
            metadata = self._source_metadata(cid, source, target, manifest)
            if exchange is not None:
                exchange.hand_out(metadata)
        elif exchange is not None:
            metadata = exchange.receive()
        else:
            raise DrainError(f"checkpoint '{cid}': its copy on tier '{source.name}' has no "
                             f"{METADATA_NAME}; it was not copied to '{target.name}'",
                             cid, target.name)
        files, infos = self._transcode_files(source, target, cid, staging, manifest, metadata)
        if exchange is not None and not exchange.coordinates:
            exchange.answer(infos)
        elif exchange is not None:
            infos.update(exchange.collect())
        codecs = [c.name for c in target.config.codecs]
        if manifest.has_metadata:
            metadata.storage_data.update(infos)
            raw = pickle.dumps(metadata)
            target.write_bytes(f"{staging}/{METADATA_NAME}", raw)
            files[METADATA_NAME] = FileEntry(len(raw), target.keyring.digest(raw), None)
        # (Another node's part: the coordinator's copy holds the .metadata of every part.)
        return self._target_manifest(job, source, target, manifest, False, files=files,
                                     codecs=codecs)

    @staticmethod
    def _source_metadata(cid: str, source: Tier, target: Tier, manifest: Manifest):
        """The source copy's ``.metadata``, checked against its manifest and unpickled with
        the allow-list (``load_metadata``)."""
        # DCP's metadata and items are imported where a drain handles them: a store that only
        # lists checkpoints (`tierstore ls`) builds a drainer and never needs DCP (seconds).
        from tierstore.format.metadata import load_metadata

        entry = manifest.files[METADATA_NAME]
        raw = source.backend.read_bytes(f"{cid}/{METADATA_NAME}")
        if len(raw) != entry.size or not same_digest(
                source.keyring.digest(raw, like=entry.checksum), entry.checksum):
            raise DrainError(f"checkpoint '{cid}': {METADATA_NAME} on tier '{source.name}' does "
                             f"not match its manifest; it was not copied to '{target.name}'",
                             cid, target.name)
        return load_metadata(raw, f"tier '{source.name}': {cid}/{METADATA_NAME}")

    def _transcode_files(self, source: Tier, target: Tier, cid: str, staging: str,
                         manifest: Manifest, metadata) -> tuple[dict[str, FileEntry], dict]:
        """Re-encode every data file of ``manifest`` with the items ``metadata`` places in
        it; the new files' entries and where each of their items is now."""
        by_file: dict[str, list] = {}
        for index, info in metadata.storage_data.items():
            by_file.setdefault(info.relative_path, []).append((index, info))
        results = self._run_all([
            (self._transcode_file, source, target, cid, staging, rel, manifest,
             sorted(by_file.get(rel, []), key=lambda ii: ii[1].offset))
            for rel in manifest.files if rel != METADATA_NAME])
        files: dict[str, FileEntry] = {}
        infos: dict = {}
        for rel, file_entry, file_infos in results:
            files[rel] = file_entry
            infos.update(file_infos)
        return files, infos

    def _transcode_file(self, source: Tier, target: Tier, cid: str, staging: str, rel: str,
                        manifest: Manifest, items: list) -> tuple[str, FileEntry, dict]:
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        from tierstore.format.item_io import HashingWriter, decode_item, encode_to

        self._host.phase(Phase.DRAIN_FILE, cid, target.name, self._rank, file=rel,
                         size=manifest.files[rel].size)
        entry = manifest.files[rel]
        extensions = [c.extension() for c in target.codecs]
        hasher = source.keyring.hasher_for(entry.checksum)
        infos = {}
        with source.backend.open_read(f"{cid}/{rel}") as fin, \
                target.open_write(f"{staging}/{rel}", entry.size) as raw:
            out = HashingWriter(raw, target.keyring.new_hasher())
            pos = 0

            def read(n: int) -> bytes:
                nonlocal pos
                data = fin.read(n)
                if len(data) != n:
                    raise DrainError(f"checkpoint '{cid}': {rel} on tier '{source.name}' is "
                                     f"shorter than its manifest says", cid, target.name)
                hasher.update(data)
                pos += n
                return data

            for index, info in items:
                read(info.offset - pos)
                data = decode_item(read(info.length), info.transform_descriptors)
                stream, descriptors = encode_to(out, extensions)
                start = out.offset
                stream.write(data)
                if stream is not out:
                    stream.close()
                infos[index] = _StorageInfo(rel, start, out.offset - start,
                                            transform_descriptors=descriptors)
            out.flush()
            while chunk := fin.read(self._chunk):
                hasher.update(chunk)
                pos += len(chunk)
        _check_source(cid, rel, source, target, entry, pos, hasher.hexdigest())
        return rel, FileEntry(out.offset, out.hasher.hexdigest(), entry.rank), infos

    def _target_manifest(self, job: DrainJob, source: Tier, target: Tier, manifest: Manifest,
                         gathering: bool, files: dict[str, FileEntry] | None = None,
                         codecs: list[str] | None = None) -> Manifest:
        """The manifest of the copy on ``target``: the source's, with the target's plugins,
        the pin as it is now, and (``gathering``) every part's files as one part."""
        fields = {"pinned": self._pin_now(job, source, manifest.pinned)}
        if codecs is not None:
            fields["codecs"] = codecs
        if gathering:
            files = dict(job.all_files)
            fields.update(part=0, parts=1, ranks=list(range(manifest.world_size)))
        return build_manifest(target, job.checkpoint_id,
                              manifest.files if files is None else files, like=manifest,
                              **fields)

    def _keep_copy_there(self, job: DrainJob, target: Tier, there: Manifest) -> None:
        """``target`` holds a copy of this very save already (a promote, or the drain it
        raced, made it): nothing to copy. Its flag is the one its own copy settled (a promote
        may have pinned it); only a ``promote --pin`` pins it."""
        log.info("%s is on tier '%s' already (save %s): not copied again", job.checkpoint_id,
                 target.name, there.save_token)
        if job.pin and not there.pinned:
            with self._retention.pinning():
                self._set_copy_pin(job, target, True)

    def _pin_now(self, job: DrainJob, source: Tier, otherwise: bool) -> bool:
        """Whether the copy of ``job`` is to be pinned, asked now (a pin may have changed
        since the job began): pinned by the job itself (``promote --pin``), else as this
        store was last asked (``store.pin``/``unpin``, told to retention before any tier
        changes), else as the source's manifest says (another process's pin), else
        ``otherwise``."""
        if job.pin:
            return True
        asked = self._retention.pin_asked(job.checkpoint_id)
        if asked is not None:
            return asked
        now = source.read_manifest(job.checkpoint_id)
        return now.pinned if now is not None else otherwise

    def _settle_pin(self, job: DrainJob, source: Tier, target: Tier, copy: Manifest) -> None:
        """Right after a copy's commit: a pin (or unpin) that landed between the read of the
        flag and the commit found no complete copy on ``target`` to change, and would be lost
        there (``keep`` then evicting a pinned checkpoint); the flag is asked again and, where
        it changed, the copy is changed too. A pin landing after this finds the copy
        complete and changes it itself."""
        with self._retention.pinning():  # a pin or unpin now in progress ends first
            want = self._pin_now(job, source, copy.pinned)
            if want != copy.pinned:
                self._set_copy_pin(job, target, want)

    @staticmethod
    def _set_copy_pin(job: DrainJob, target: Tier, want: bool) -> None:
        try:
            target.set_pinned(job.checkpoint_id, want)
        except Exception:  # noqa: BLE001 - the copy is committed: never undo it for its flag
            log.warning("tier '%s': could not %s %s after copying it; call store.%s again",
                        target.name, "pin" if want else "unpin", job.checkpoint_id,
                        "pin" if want else "unpin", exc_info=True)

    def _wait_for_begin(self, job: DrainJob, target: Tier) -> None:
        """A rank that does not commit a gathered copy: wait until the committing rank has
        begun it: its word in the job's key-value store says so, or the tier holds work in
        progress of this save's token (a staging directory, a prefix marked with it), which
        only the committing rank's begin makes. Beginning after it, this rank's own begin finds
        the directory prepared for this very save and clears nothing."""
        cid, token = job.checkpoint_id, job.token
        deadline = time.monotonic() + self._part_timeout
        delay = 0.01  # (every rank of the job waits: its questions grow slowly)
        begun = _drain_key(token, target.name, "begun")
        next_look = time.monotonic() + _LOOK_EVERY_S  # (at once where there is no store)
        while True:
            # The committing rank's word, left in this job's key-value store under the save's
            # token right after its begin (and removed once its copy is over), is enough; the
            # tier's own state (a look reads every checkpoint's markers there: requests to an
            # object store, from every rank) is looked at only without the store, and once a
            # second while the word has not come.
            told = all_posted([begun])
            if told:
                return
            if told is None or time.monotonic() >= next_look:
                if set(target.leftovers()) - set(target.leftovers(protect={token})):
                    return
                next_look = time.monotonic() + _LOOK_EVERY_S
            if seen_lost(self._context.groups.main, [0]):
                # A dead rank 0 never begins the copy: waiting out part_timeout would only
                # hold this process (at exit, the job's restart) for nothing.
                raise DrainError(
                    f"checkpoint '{cid}': rank 0, which commits the shared copy on tier "
                    f"'{target.name}', was lost (it did not answer a collective of the store); "
                    f"this node's part was not copied", cid, target.name)
            if self._past_exit_deadline():
                raise DrainError(
                    f"checkpoint '{cid}': the process is exiting and rank 0, which commits the "
                    f"shared copy on tier '{target.name}', did not begin it within "
                    f"collective_timeout; this node's part was not copied", cid, target.name)
            if time.monotonic() > deadline:
                raise DrainError(
                    f"checkpoint '{cid}': the committing rank did not begin the shared copy on "
                    f"tier '{target.name}' within {self._part_timeout:.0f} s; this node's part "
                    f"was not copied (see rank 0's store.wait() errors)", cid, target.name)
            time.sleep(delay)
            delay = min(delay * 2, 0.5 if told is None else _WORD_POLL_MAX_S)

    def _part_done(self, target: Tier, staging: str, report: str, manifest: Manifest,
                   failure: BaseException | None) -> None:
        """A rank that does not commit a gathered copy reports what it copied (``manifest``:
        its node's part, or its own files of it) to the committing rank, in the shared staging
        directory, as ``report``: the checksums it checked every file against (``failure``
        None), or why it failed, once the objects it wrote are removed."""
        if failure is None:
            record = {"ok": True, "files": {rel: e.checksum for rel, e in manifest.files.items()}}
        else:
            for rel in manifest.files:
                for path in (f"{staging}/{rel}", f"{staging}/{rel}.part"):
                    try:
                        target.backend.delete(path)
                    except FileNotFoundError:
                        pass
            record = {"ok": False, "error": f"{type(failure).__name__}: {failure}"}
        target.write_bytes(f"{staging}/{report}", json.dumps(record).encode())

    def _wait_for_parts(self, job: DrainJob, target: Tier, staging: str, source: Tier,
                        manifest: Manifest) -> None:
        """Wait until every other rank that wrote files has reported them in the shared
        staging directory as checked (see :meth:`_part_done`) and every file is there with its
        size; a rank whose copy failed its check, or that vouches for other bytes than this
        copy's manifest lists, fails the copy before anything is committed. The reports are removed before the
        commit (they are not files of the checkpoint).

        Each look at the staging directory is one listing where the tier offers it (an object
        store): what the committing rank asks per look does not grow with the parts or their
        files, and each report is read once."""
        cid = job.checkpoint_id
        reporters = self._reporters(job, source)
        vouched = {rel: e.checksum for rel, e in manifest.files.items()}
        reported: set[int] = set()
        deadline = time.monotonic() + self._part_timeout
        polls = _Polls(target, 0.02, _PART_POLL_MAX_S)
        keys = {r: _drain_key(job.token, target.name, f"reported-{r}") for r in reporters}
        next_look = 0.0
        while True:
            # The other ranks' words say when to look (each left right after its report): once
            # they all reported, and once a second while they have not (a lost rank is noticed
            # then); without the key-value store, at every wait.
            unreported = [keys[r] for r in reporters if r not in reported]
            told = all_posted(unreported) if unreported else None
            if told is False and time.monotonic() < next_look:
                polls.wait()
                continue
            next_look = time.monotonic() + _LOOK_EVERY_S
            listed = target.backend.inventory(staging)
            for r, name in reporters.items():
                if r in reported or (listed is not None and name not in listed):
                    continue
                record = self._read_report(target, f"{staging}/{name}")
                if record is None:
                    continue
                if not record.get("ok"):
                    raise DrainError(
                        f"checkpoint '{cid}': rank {r} failed to copy its files, so the copy "
                        f"on tier '{target.name}' was not committed: {record.get('error')}",
                        cid, target.name)
                files = record.get("files", {})
                vouched.update(files if isinstance(files, dict) else {})
                reported.add(r)
            waiting = [r for r in reporters if r not in reported]
            lost = seen_lost(self._context.groups.main, waiting) if waiting else []
            if lost:
                raise DrainError(
                    f"checkpoint '{cid}': the files of ranks {lost} will not come: they were "
                    f"lost (they did not answer a collective of the store), so the copy on "
                    f"tier '{target.name}' was not committed", cid, target.name)
            missing = [rel for rel, e in job.all_files.items()
                       if (listed.get(rel) if listed is not None
                           else target.backend.size(f"{staging}/{rel}")) != e.size]
            if not waiting and not missing:
                wrong = sorted(rel for rel, e in job.all_files.items()
                               if not isinstance(vouched.get(rel), str)
                               or not same_digest(vouched[rel], e.checksum))
                if wrong:
                    raise DrainError(
                        f"checkpoint '{cid}': no part vouches for {', '.join(wrong[:5])} with "
                        f"the checksum the save recorded; the copy on tier '{target.name}' was "
                        f"not committed", cid, target.name)
                for name in reporters.values():
                    target.backend.delete(f"{staging}/{name}")
                return
            if self._past_exit_deadline():
                raise DrainError(
                    f"checkpoint '{cid}': the process is exiting and the other ranks' files "
                    f"(of ranks not reported: {waiting or 'none'}) did not reach tier "
                    f"'{target.name}' within collective_timeout; the copy was not committed",
                    cid, target.name)
            if time.monotonic() > deadline:
                raise DrainError(
                    f"checkpoint '{cid}': the other ranks' files did not reach "
                    f"tier '{target.name}' within {self._part_timeout:.0f} s (missing: "
                    f"{', '.join(sorted(missing)[:5]) or 'none'}; ranks not reported: "
                    f"{waiting or 'none'}); see those ranks' store.wait() errors",
                    cid, target.name)
            polls.wait()

    def _await_reports(self, job: DrainJob, target: Tier, staging: str, source: Tier) -> None:
        """The committing rank, whose gathered copy failed: wait until every other rank has
        reported (done or failed, its objects then removed by itself), was lost, or the wait
        is past ``part_timeout`` (or the exit's deadline), so that the copy is removed after
        the last upload to it."""
        reporters = self._reporters(job, source)
        deadline = time.monotonic() + self._part_timeout
        polls = _Polls(target, 0.02, _PART_POLL_MAX_S)
        while True:
            listed = target.backend.inventory(staging)
            waiting = [r for r, name in reporters.items()
                       if (name not in listed if listed is not None
                           else target.backend.size(f"{staging}/{name}") is None)]
            if waiting:  # (a lost rank uploads nothing more)
                lost = seen_lost(self._context.groups.main, waiting)
                waiting = [r for r in waiting if r not in lost]
            if not waiting or self._past_exit_deadline() or time.monotonic() > deadline:
                return
            polls.wait()

    @staticmethod
    def _read_report(target: Tier, path: str) -> dict | None:
        """A part's report (untrusted: a JSON object or nothing), or None while it is not
        there or not whole yet: a report is written in one call, but on a filesystem another
        node can read it between its creation and its last byte, so it is read again until it
        is whole (or the part times out, naming it)."""
        try:
            record = json.loads(target.backend.read_bytes(path))
        except (FileNotFoundError, ValueError):
            return None
        return record if isinstance(record, dict) else None

    def _copy_file(self, source: Tier, target: Tier, cid: str, staging: str, rel: str,
                   manifest: Manifest, publish_each: bool, repair: bool = False) -> int:
        """Copy one file, checking it against the manifest. ``publish_each``: the file appears
        under its name only once complete (others wait for it by name); ``repair``: it
        replaces a bad copy (see ``Tier.open_write``)."""
        self._host.phase(Phase.DRAIN_FILE, cid, target.name, self._rank, file=rel,
                         size=manifest.files[rel].size)
        dest = f"{staging}/{rel}"
        partial = f"{dest}.part" if publish_each and target.backend.supports_rename else dest
        with source.backend.open_read(f"{cid}/{rel}") as fin, \
                target.open_write(partial, manifest.files[rel].size,
                                  manifest.files[rel].cuts, repair) as fout:
            copied, checksum = hash_stream(fin, self._chunk, fout.write,
                                           source.keyring.hasher_for(manifest.files[rel].checksum))
        _check_source(cid, rel, source, target, manifest.files[rel], copied, checksum)
        if partial != dest:
            target.backend.rename(partial, dest, replace=True)
        return copied


class _PartExchange:
    """Re-encoding a node-local checkpoint to a node-local tier with other codecs, each node's
    drain its own part (as every drain between node-local tiers does).

    An item's place in a file is known only from DCP's ``.metadata``, which only the
    coordinator's part holds; and the target's ``.metadata``, again only in the coordinator's
    part, must say where every part's items are once re-encoded. So the coordinator's drain
    (rank 0) hands each other part the items of that part's files, and each other part's
    drain answers with where those items are in its re-encoded files; the coordinator writes
    the target's ``.metadata`` once every part has answered, and fails its copy (never
    writing a ``.metadata`` that misplaces a part's items) when one does not. Both messages
    are those items' ``storage_data`` as a typed message (plain data, never a pickle between
    ranks; under the save's id and token), left in the job's key-value store under the
    save's token and the target tier's name (drains are not paired across ranks the way
    collectives are). Each side checks every field of what it reads, and checks it against
    the save: its id and token, and exactly the files and items it expects. Either side waits
    at most ``part_timeout``; a part
    stops waiting when rank 0 is seen lost, or when its own source part went (collected as an
    orphan: the coordinator never committed the save), and the coordinator when a part's ranks
    are seen lost. A side whose drain fails says so at once (:meth:`withdraw`), so that the
    other does not wait its time out."""

    _ITEMS = "tierstore/transcode/{token}/{tier}/items-{part}"  # rank 0 -> part
    _DONE = "tierstore/transcode/{token}/{tier}/done-{part}"  # part -> rank 0
    _OK, _FAILED = b"M", b"E"  # a post's first byte: a pickled Metadata, or why (UTF-8)

    def __init__(self, context: StoreContext, timeout: float, job: DrainJob, source: Tier,
                 target: Tier, manifest: Manifest):
        layout = source.layout
        self._cid, self._token, self._tier = job.checkpoint_id, job.token, target.name
        self._job, self._source, self._manifest = job, source, manifest
        self._group, self._timeout = context.groups.main, timeout
        if layout.parts != manifest.parts or layout.part != manifest.part \
                or manifest.save_token != job.token:
            raise self._error(
                f"its part on tier '{source.name}' (part {manifest.part} of {manifest.parts}, "
                f"save {manifest.save_token}) is not this job's part {layout.part} of "
                f"{layout.parts} of save {job.token}, which the nodes re-encode together")
        self._all_parts = layout.all_parts
        #: whether this is the coordinator's part (it holds and writes ``.metadata``)
        self.coordinates = manifest.has_metadata
        self._others = [p for p in range(manifest.parts) if p != manifest.part]
        self._handed: dict[int, dict] = {}

    def _key(self, template: str, part: int) -> str:
        return template.format(token=self._token, tier=self._tier, part=part)

    def _error(self, message: str) -> DrainError:
        return DrainError(f"checkpoint '{self._cid}': {message}; it was not copied to tier "
                          f"'{self._tier}'", self._cid, self._tier)

    def _post(self, key: str, data: bytes) -> None:
        if not post(key, data):
            raise self._error("re-encoding a node-local checkpoint part by part needs the "
                              "job's key-value store (torch.distributed), which is out of reach")

    def _message(self, storage_data: dict) -> bytes:
        """Items as a typed message (plain data: never a pickle between ranks)."""
        items = [[index.fqn, None if index.offset is None else list(index.offset), index.index,
                  info.relative_path, info.offset, info.length,
                  None if info.transform_descriptors is None
                  else list(info.transform_descriptors)]
                 for index, info in storage_data.items()]
        return self._OK + encode_message({"id": self._cid, "token": self._token,
                                          "items": items})

    def _read(self, raw: bytes, sender: str) -> dict:
        """The ``storage_data`` of a message from ``sender``, every field checked; raises a
        failure."""
        if raw[:1] == self._FAILED:
            reason = raw[1:].decode("utf-8", "replace")[:2000]
            raise self._error(f"{sender} failed to re-encode its part: {reason}")
        if raw[:1] != self._OK:
            raise self._error(f"{sender} left a message that is not one of this exchange")
        try:
            doc = decode_message(raw[1:], sender)
        except MessageError as exc:
            raise self._error(str(exc)) from None
        if not isinstance(doc, dict) or doc.get("id") != self._cid \
                or doc.get("token") != self._token:
            raise self._error(f"{sender} sent items of another save than {self._token}")
        try:
            return dict(_item_of(item) for item in doc["items"])
        except (TypeError, ValueError, KeyError) as exc:
            raise self._error(f"{sender} sent a malformed item ({exc})") from None

    def _wait(self, keys: dict[int, str], sender: Callable[[int], str],
              gone: Callable[[int], str | None]) -> dict[int, bytes]:
        """Poll until every key of ``keys`` (part -> key) holds a message; ``gone(part)``
        says why one will never come (None: it may still)."""
        deadline = time.monotonic() + self._timeout
        delay = 0.02
        got: dict[int, bytes] = {}
        while True:
            for part, key in keys.items():
                if part not in got:
                    raw = read_post(key)
                    if raw is not None:
                        got[part] = raw
            waiting = [p for p in keys if p not in got]
            if not waiting:
                return got
            for part in waiting:
                why = gone(part)
                if why is not None:
                    raise self._error(why)
            if time.monotonic() > deadline:
                raise self._error(f"{', '.join(sender(p) for p in waiting)} did not answer "
                                  f"within {self._timeout:.0f} s ([store] part_timeout; see "
                                  f"its store.wait() errors)")
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def _part_name(self, part: int) -> str:
        return f"the part of ranks {list(self._all_parts[part])}"

    # -- the coordinator's side ----------------------------------------------------------------
    def hand_out(self, metadata) -> None:
        """Give every other part the items of its files, from the checked source
        ``metadata`` (their part told by the rank that wrote each file, as the save recorded)."""
        own = self._manifest.files
        part_of = {rank: p for p, ranks in enumerate(self._all_parts) for rank in ranks}
        handed: dict[int, dict] = {p: {} for p in self._others}
        for index, info in metadata.storage_data.items():
            rel = info.relative_path
            if rel in own:
                continue
            entry = self._job.all_files.get(rel)
            part = part_of.get(entry.rank) if entry is not None and entry.rank is not None \
                else None
            if part not in handed:
                raise self._error(f"its {METADATA_NAME} places an item in {rel}, which no other "
                                  f"node's part of the save holds")
            handed[part][index] = info
        self._handed = handed
        for part, items in handed.items():
            self._post(self._key(self._ITEMS, part), self._message(items))

    def collect(self) -> dict:
        """Every other part's answer: where the items handed to it are now, checked to be
        exactly those items, in the same files."""
        group = self._group
        keys = {p: self._key(self._DONE, p) for p in self._others}
        got = self._wait(
            keys, self._part_name,
            lambda p: (f"{self._part_name(p)} will not answer: a rank of it was lost"
                       if seen_lost(group, list(self._all_parts[p])) else None))
        infos: dict = {}
        for part, raw in got.items():
            items = self._read(raw, self._part_name(part))
            handed = self._handed[part]
            if set(items) != set(handed) or any(
                    items[i].relative_path != handed[i].relative_path for i in handed):
                raise self._error(f"{self._part_name(part)} answered for other items than "
                                  f"those of its files")
            infos.update(items)
        drop_posts([*keys.values(), *(self._key(self._ITEMS, p) for p in self._others)])
        return infos

    # -- another part's side -------------------------------------------------------------------
    def receive(self):
        """The items of this part's files, from the coordinator's drain: a Metadata whose
        ``storage_data`` places items in exactly this part's data files."""
        from torch.distributed.checkpoint.metadata import Metadata

        key = self._key(self._ITEMS, self._manifest.part)
        group, source, cid, token = self._group, self._source, self._cid, self._token

        def gone(_: int) -> str | None:
            if seen_lost(group, [0]):
                return ("rank 0, whose part holds its metadata, was lost (it did not answer a "
                        "collective of the store)")
            now = source.read_manifest(cid)
            if now is None or now.save_token != token:
                return (f"its part on tier '{source.name}' is gone (the coordinator never "
                        f"committed save {token})")
            return None

        raw = self._wait({0: key}, lambda _: "the coordinator's drain (rank 0)", gone)[0]
        storage_data = self._read(raw, "the coordinator's drain (rank 0)")
        data_files = {rel for rel in self._manifest.files if rel != METADATA_NAME}
        placed = {info.relative_path for info in storage_data.values()}
        if placed != data_files:
            raise self._error(
                f"the coordinator's drain placed items in {sorted(placed - data_files)[:5]} "
                f"and none in {sorted(data_files - placed)[:5]} of this part's files")
        return Metadata(state_dict_metadata={}, storage_data=storage_data)

    def answer(self, infos: dict) -> None:
        """Tell the coordinator's drain where this part's items are now."""
        self._post(self._key(self._DONE, self._manifest.part), self._message(infos))

    # -- either side ---------------------------------------------------------------------------
    @staticmethod
    def applies(source: Tier, target: Tier) -> bool:
        """Whether a drain from ``source`` to ``target`` re-encodes part by part: between
        node-local tiers of several parts, with other codecs."""
        return (source.layout.parts > 1 and not target.layout.shared
                and [c.name for c in source.config.codecs]
                != [c.name for c in target.config.codecs])

    @classmethod
    def withdraw(cls, job: DrainJob, target: Tier, exc: BaseException) -> None:
        """This node's drain of ``job`` to ``target`` failed: tell the other side now (the
        coordinator's drain: every other part; another part's: the coordinator), so that it
        fails at once rather than when its wait times out. Never raises."""
        layout = job.source.layout
        why = cls._FAILED + f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")[:4000]
        keys = [cls._ITEMS.format(token=job.token, tier=target.name, part=p)
                for p in range(layout.parts) if p != layout.part] \
            if layout.part == layout.part_of(0) else \
            [cls._DONE.format(token=job.token, tier=target.name, part=layout.part)]
        try:
            for key in keys:
                post(key, why)
        except Exception:  # noqa: BLE001 - the other side waits its time out instead
            log.warning("could not tell the other nodes' drains of %s that this one failed",
                        job.checkpoint_id, exc_info=True)


def own_share(manifest: Manifest, layout: TierLayout, rank: int) -> Manifest:
    """The part of ``manifest`` (a node's part) that ``rank`` copies when every rank copies
    its own files: those it wrote, and for the part's leader also those no rank of the part
    wrote (``.metadata``, files of a rank the layout no longer places there)."""
    ours = set(layout.part_ranks)
    leads = rank == layout.leader
    files = {rel: e for rel, e in manifest.files.items()
             if e.rank == rank or (leads and (e.rank is None or e.rank not in ours))}
    return dataclasses.replace(manifest, files=files)


def _item_of(item) -> tuple[MetadataIndex, _StorageInfo]:
    """One item of a :class:`_PartExchange` message, checked field by field (ValueError,
    TypeError: not one)."""
    fqn, offset, index, rel, start, length, transforms = item
    ints = (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0)
    if not isinstance(fqn, str) or not isinstance(rel, str) or not ints(start) \
            or not ints(length) or not (index is None or ints(index)) \
            or not (offset is None or (isinstance(offset, list) and all(map(ints, offset)))) \
            or not (transforms is None or (isinstance(transforms, list)
                                           and all(isinstance(t, str) for t in transforms))):
        raise ValueError(f"an item of fields {item!r:.200}")
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    return (MetadataIndex(fqn, None if offset is None else torch.Size(offset), index),
            _StorageInfo(rel, start, length, None if transforms is None else list(transforms)))


def _check_source(cid: str, rel: str, source: Tier, target: Tier, entry: FileEntry,
                  size: int, checksum: str) -> None:
    """Raise when the bytes read from the source differ from its manifest: a bad copy is never
    propagated to a slower tier."""
    if size != entry.size or not same_digest(checksum, entry.checksum):
        raise DrainError(
            f"checkpoint '{cid}': {rel} on tier '{source.name}' does not match its manifest "
            f"({size} bytes, {checksum}; expected {entry.size} bytes, {entry.checksum}; "
            f"{explain_mismatch(source, f'{cid}/{rel}', entry)}); it was not copied to "
            f"'{target.name}'. Run store.verify('{cid}') to see what else is damaged",
            cid, target.name)


def report_unfinished(pending: list[PendingCopy], failures: list[DrainError]) -> None:
    """Say on stderr what did not reach which tier (used when the process exits)."""
    if pending:
        print("tierstore: the process exits with drains unfinished; these copies were not made: "
              + ", ".join(map(str, pending)), file=sys.stderr)
    for failure in failures:
        print(f"tierstore: drain failed: {failure}", file=sys.stderr)


def finish_at_exit(drainer: Drainer, adopt: Callable[[], None], timeout: float) -> None:
    """At interpreter exit: queue what DCP's checkpoint process committed (``adopt``), finish
    pending drains for at most ``timeout`` seconds, and say on stderr what did not reach which
    tier."""
    failures: list[DrainError] = []
    drainer.exiting()
    try:
        adopt()
        drainer.wait(timeout)
    except TimeoutError:
        pass
    except DrainError as exc:
        failures.append(exc)
    report_unfinished(drainer.pending(), failures)


def _not_copied(job: DrainJob, target: Tier, exc: BaseException) -> DrainError:
    """``exc`` (a failure copying ``job`` to ``target``) as the DrainError a user sees."""
    if isinstance(exc, DrainError):
        return exc
    return DrainError(
        f"checkpoint '{job.checkpoint_id}' was not copied to tier '{target.name}' "
        f"({target.backend.describe()}): {type(exc).__name__}: {exc}; it is still complete "
        f"on tier '{job.source.name}'", job.checkpoint_id, target.name)
