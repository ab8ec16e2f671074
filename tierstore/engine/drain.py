"""The drain: copying committed checkpoints, byte for byte, down to slower tiers.

A save commits on the fastest tier that takes it; the drain then copies its files to every slower
tier whose ``every`` takes the same step and commits them there with that tier's protocol, in
background threads, so a save is never slowed down by a slower tier. Memory is bounded by
``copy_threads x chunk_bytes``. Every byte is checked against the manifest on the way: a bad
source copy is never propagated. ``Store.wait()`` waits for the drain and raises its failures.
"""

from __future__ import annotations

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

from torch.distributed.checkpoint.filesystem import _StorageInfo

from tierstore.format.checksum import Hasher, checksum_of
from tierstore.errors import DrainError
from tierstore.events import Event, EventKind, Phase
from tierstore.format.item_io import HashingWriter, decode_item, encode_to
from tierstore.format.manifest import METADATA_NAME, FileEntry, Manifest

if TYPE_CHECKING:
    from tierstore.store import Store
    from tierstore.tiers.tier import Tier

__all__ = ["DrainJob", "Drainer", "PendingCopy"]

log = logging.getLogger("tierstore.engine.drain")


@dataclass(frozen=True)
class PendingCopy:
    """A copy the drain has not finished: which checkpoint, to which tier (plain data)."""

    checkpoint_id: str
    tier: str

    def __str__(self) -> str:
        return f"{self.checkpoint_id} -> {self.tier}"


@dataclass
class DrainJob:
    """Copy ``checkpoint_id`` from ``source`` to each of ``targets`` (in order).

    ``token`` is the save's token; ``all_files`` every file of the checkpoint (all parts), which
    the rank that commits a shared copy of a node-local checkpoint waits for."""

    checkpoint_id: str
    source: "Tier"
    targets: list["Tier"]
    token: str
    all_files: dict[str, FileEntry]
    done: list[str] = field(default_factory=list)
    copied: bool = False  # every target tried: retention may evict it from ``source`` again


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

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put(None)


def wait_until_empty(cond: threading.Condition, pending: list, timeout: float | None,
                     message: Callable[[], str]) -> None:
    """With ``cond`` held: wait until ``pending`` is empty (its owner notifies ``cond`` when it
    shrinks); ``TimeoutError(message())`` after ``timeout`` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while pending:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise TimeoutError(message())
        cond.wait(left)


class Drainer:
    """One drain worker per store: jobs run in submission order (the order of saves)."""

    def __init__(self, store: "Store", copy_threads: int, chunk_bytes: int,
                 part_timeout: float = 600.0):
        self._store = store
        self._chunk = chunk_bytes
        self._part_timeout = part_timeout
        self._pool = _CopyPool(copy_threads)
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Condition()
        self._pending: list[DrainJob] = []
        self._failures: list[DrainError] = []
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="tierstore-drain", daemon=True)
        self._worker.start()

    # -- called by the store --------------------------------------------------------------------
    def submit(self, job: DrainJob) -> None:
        """Queue a drain; returns at once."""
        with self._lock:
            self._pending.append(job)
        self._jobs.put(job)

    def protected(self, tier: "Tier") -> set[str]:
        """Ids that retention must not delete from ``tier`` yet: drains still read them."""
        with self._lock:
            return {j.checkpoint_id for j in self._pending if j.source is tier and not j.copied}

    def pending(self) -> list[PendingCopy]:
        """Copies not finished yet, in order."""
        with self._lock:
            return [PendingCopy(j.checkpoint_id, t.name) for j in self._pending
                    for t in j.targets if t.name not in j.done]

    def wait(self, timeout: float | None = None) -> None:
        """Block until every queued drain is done; raise the first failure since the last call."""
        with self._lock:
            wait_until_empty(self._lock, self._pending, timeout,
                             lambda: f"drains still running after {timeout} s: "
                             + ", ".join(map(str, self.pending())))
            failures, self._failures = self._failures, []
        if failures:
            first = failures[0]
            if len(failures) > 1:
                others = "; ".join(str(f) for f in failures[1:])
                raise DrainError(f"{first} (and {len(failures) - 1} more: {others})",
                                 first.checkpoint_id, first.tier) from first
            raise first

    def unreported_failures(self) -> list[DrainError]:
        """Failures no ``wait()`` has raised yet."""
        with self._lock:
            return list(self._failures)

    def close(self) -> None:
        """Stop the threads (after ``wait``)."""
        self._closed = True
        self._jobs.put(None)
        self._pool.close()

    # -- the worker --------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                for target in job.targets:
                    try:
                        self._drain_one(job, target)
                    except BaseException as exc:
                        self._record_failure(job, target, exc)
                    job.done.append(target.name)
            finally:
                # Retention on the source may have spared this id while it was being copied:
                # apply it before wait() returns.
                with self._lock:
                    job.copied = True
                self._store.retain_quietly(job.source)
                with self._lock:
                    self._pending.remove(job)
                    self._lock.notify_all()

    def _safely(self, fn: Callable[[], object], what: str) -> None:
        try:
            fn()
        except Exception:
            log.exception("%s failed", what)

    def _record_failure(self, job: DrainJob, target: "Tier", exc: BaseException) -> None:
        store = self._store
        err = exc if isinstance(exc, DrainError) else DrainError(
            f"checkpoint '{job.checkpoint_id}' was not copied to tier '{target.name}' "
            f"({target.backend.describe()}): {type(exc).__name__}: {exc}; it is still complete "
            f"on tier '{job.source.name}'", job.checkpoint_id, target.name)
        with self._lock:
            self._failures.append(err)
        log.error("%s", err)
        store.host.event(Event(EventKind.FAILED, job.checkpoint_id, target.name, store.ctx.rank,
                               detail={"during": "drain", "error": str(err)}))

    def _drain_one(self, job: DrainJob, target: "Tier") -> None:
        store, source, cid = self._store, job.source, job.checkpoint_id
        host, rank = store.host, store.ctx.rank
        host.phase(Phase.DRAIN_BEGIN, cid, target.name, rank, source=source.name)
        manifest = source.manifest(cid)
        if manifest is None:
            raise DrainError(f"checkpoint '{cid}' is no longer complete on tier "
                             f"'{source.name}', so it cannot be copied to '{target.name}'",
                             cid, target.name)
        # A node-local checkpoint going to a shared tier: every group copies its part into one
        # staging directory (named by the save), and rank 0 commits once all parts are there.
        gathering = target.layout.shared and not source.layout.shared
        commits = not gathering or rank == 0
        started = time.perf_counter()
        host.event(Event(EventKind.DRAIN_STARTED, cid, target.name, rank,
                         nbytes=manifest.size_bytes, detail={"source": source.name}))
        if rank == target.layout.leader:
            store.collect_garbage(target, protect={job.token})
        token = job.token if gathering else uuid.uuid4().hex[:16]
        transcode = manifest.codecs != [c.name for c in target.config.codecs]
        if transcode and gathering:
            raise DrainError(
                f"checkpoint '{cid}': tier '{source.name}' (node-local, codecs "
                f"{manifest.codecs}) cannot be drained to the shared tier '{target.name}' with "
                f"other codecs ({[c.name for c in target.config.codecs]}) yet; give both tiers "
                f"the same codecs", cid, target.name)
        staging = target.commit.begin(target.backend, cid, token)
        try:
            if transcode:
                copy = self._transcode(job, source, target, manifest, staging)
            elif self._can_upload(source, target, cid, manifest):
                self._upload(source, target, cid, staging, manifest)
            else:
                self._run_all([(self._copy_file, source, target, cid, staging, rel, manifest,
                                gathering)
                               for rel in sorted(manifest.files,
                                                 key=lambda r: -manifest.files[r].size)])
            if commits:
                if not transcode:
                    copy = self._target_manifest(job, source, target, manifest, gathering)
                if gathering:
                    self._wait_for_parts(job, target, staging)
                host.phase(Phase.DRAIN_COMMIT, cid, target.name, rank)
                target.commit.commit(target.backend, cid, staging, copy.to_json(),
                                     lambda phase: host.phase(phase, cid, target.name, rank))
        except BaseException:
            if commits:
                self._safely(lambda: target.commit.abort(target.backend, cid, staging),
                             f"removing the partial copy of {cid} on '{target.name}'")
            raise
        seconds = time.perf_counter() - started
        host.event(Event(EventKind.DRAIN_FINISHED, cid, target.name, rank, seconds,
                         manifest.size_bytes, {"source": source.name, "committed": commits}))
        log.info("drained %s from '%s' to '%s' (%d bytes in %.2f s)", cid, source.name,
                 target.name, manifest.size_bytes, seconds)
        if commits:
            store.retain_quietly(target)

    @staticmethod
    def _can_upload(source: "Tier", target: "Tier", cid: str, manifest: Manifest) -> bool:
        """Whether the target takes whole local files in one concurrent transfer (object
        stores through fsspec) and the source has them as local files."""
        return (target.backend.bulk_upload
                and target.backend.local_path("") is None
                and all(source.backend.local_path(f"{cid}/{rel}") for rel in manifest.files))

    def _upload(self, source: "Tier", target: "Tier", cid: str, staging: str,
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

    def _check_local_file(self, source: "Tier", target: "Tier", cid: str, rel: str,
                          manifest: Manifest) -> None:
        store = self._store
        store.host.phase(Phase.DRAIN_FILE, cid, target.name, store.ctx.rank, file=rel)
        entry = manifest.files[rel]
        hasher = Hasher()
        size = 0
        buf = bytearray(self._chunk)
        view = memoryview(buf)
        with source.backend.open_read(f"{cid}/{rel}") as fin:
            while n := fin.readinto(view):
                hasher.update(view[:n])
                size += n
        _check_source(cid, rel, source, target, entry, size, hasher.hexdigest())

    def _run_all(self, calls: list[tuple]) -> list:
        """Run ``(fn, *args)`` calls on the copy pool; raise the first failure after all end."""
        futures = [self._pool.submit(fn, *args) for fn, *args in calls]
        errors = [e for e in (f.exception() for f in futures) if e is not None]
        if errors:
            raise errors[0]
        return [f.result() for f in futures]

    def _transcode(self, job: DrainJob, source: "Tier", target: "Tier", manifest: Manifest,
                   staging: str) -> Manifest:
        """Copy a checkpoint to a tier with other codecs: every item is decoded from the
        source's stream transforms and encoded with the target's, and DCP's metadata is
        rewritten with the new offsets. Every source byte is still checked on the way."""
        cid = job.checkpoint_id
        entry = manifest.files[METADATA_NAME]
        raw = source.backend.read_bytes(f"{cid}/{METADATA_NAME}")
        if len(raw) != entry.size or checksum_of(raw) != entry.checksum:
            raise DrainError(f"checkpoint '{cid}': {METADATA_NAME} on tier '{source.name}' does "
                             f"not match its manifest; it was not copied to '{target.name}'",
                             cid, target.name)
        metadata = pickle.loads(raw)
        by_file: dict[str, list] = {}
        for index, info in metadata.storage_data.items():
            by_file.setdefault(info.relative_path, []).append((index, info))
        results = self._run_all([
            (self._transcode_file, source, target, cid, staging, rel, manifest,
             sorted(by_file.get(rel, []), key=lambda ii: ii[1].offset))
            for rel in manifest.files if rel != METADATA_NAME])
        files: dict[str, FileEntry] = {}
        for rel, file_entry, infos in results:
            files[rel] = file_entry
            metadata.storage_data.update(infos)
        raw = pickle.dumps(metadata)
        target.backend.write_bytes(f"{staging}/{METADATA_NAME}", raw)
        files[METADATA_NAME] = FileEntry(len(raw), checksum_of(raw), None)
        copy = self._target_manifest(job, source, target, manifest, False)
        copy.files = files
        copy.codecs = [c.name for c in target.config.codecs]
        return copy

    def _transcode_file(self, source: "Tier", target: "Tier", cid: str, staging: str, rel: str,
                        manifest: Manifest, items: list) -> tuple[str, FileEntry, dict]:
        store = self._store
        store.host.phase(Phase.DRAIN_FILE, cid, target.name, store.ctx.rank, file=rel)
        entry = manifest.files[rel]
        extensions = [c.extension() for c in target.codecs]
        hasher = Hasher()
        infos = {}
        with source.backend.open_read(f"{cid}/{rel}") as fin, \
                target.backend.open_write(f"{staging}/{rel}") as raw:
            out = HashingWriter(raw)
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
            while chunk := fin.read(self._chunk):
                hasher.update(chunk)
                pos += len(chunk)
        if pos != entry.size or hasher.hexdigest() != entry.checksum:
            raise DrainError(
                f"checkpoint '{cid}': {rel} on tier '{source.name}' does not match its manifest; "
                f"it was not copied to '{target.name}'", cid, target.name)
        return rel, FileEntry(out.offset, out.hasher.hexdigest(), entry.rank), infos

    def _target_manifest(self, job: DrainJob, source: "Tier", target: "Tier",
                         manifest: Manifest, gathering: bool) -> Manifest:
        copy = Manifest.from_json(manifest.to_json())
        # The pin may have changed while copying: take the source's flag as it is now.
        now = source.read_manifest(job.checkpoint_id)
        copy.pinned = now.pinned if now is not None else manifest.pinned
        copy.plugins = dict(manifest.plugins, backend=target.config.backend,
                            commit=target.commit_name)
        if gathering:
            copy.files = dict(job.all_files)
            copy.part, copy.parts, copy.ranks = 0, 1, list(range(manifest.world_size))
        return copy

    def _wait_for_parts(self, job: DrainJob, target: "Tier", staging: str) -> None:
        """Wait until the other groups' files are in the shared staging directory."""
        deadline = time.monotonic() + self._part_timeout
        delay = 0.02
        while True:
            missing = [rel for rel, e in job.all_files.items()
                       if target.backend.size(f"{staging}/{rel}") != e.size]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise DrainError(
                    f"checkpoint '{job.checkpoint_id}': the other nodes' files did not reach "
                    f"tier '{target.name}' within {self._part_timeout:.0f} s (missing: "
                    f"{', '.join(sorted(missing)[:5])}); see those ranks' store.wait() errors",
                    job.checkpoint_id, target.name)
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def _copy_file(self, source: "Tier", target: "Tier", cid: str, staging: str, rel: str,
                   manifest: Manifest, publish_each: bool) -> int:
        """Copy one file, checking it against the manifest. ``publish_each``: the file appears
        under its name only once complete (others wait for it by name)."""
        store = self._store
        store.host.phase(Phase.DRAIN_FILE, cid, target.name, store.ctx.rank, file=rel)
        entry = manifest.files[rel]
        hasher = Hasher()
        buf = bytearray(self._chunk)
        view = memoryview(buf)
        copied = 0
        dest = f"{staging}/{rel}"
        partial = f"{dest}.part" if publish_each and target.backend.supports_rename else dest
        with source.backend.open_read(f"{cid}/{rel}") as fin, \
                target.backend.open_write(partial) as fout:
            while True:
                n = fin.readinto(view)
                if not n:
                    break
                chunk = view[:n]
                hasher.update(chunk)
                fout.write(chunk)
                copied += n
        _check_source(cid, rel, source, target, entry, copied, hasher.hexdigest())
        if partial != dest:
            target.backend.rename(partial, dest, replace=True)
        return copied


def _check_source(cid: str, rel: str, source: "Tier", target: "Tier", entry: FileEntry,
                  size: int, checksum: str) -> None:
    """Raise when the bytes read from the source differ from its manifest: a bad copy is never
    propagated to a slower tier."""
    if size != entry.size or checksum != entry.checksum:
        raise DrainError(
            f"checkpoint '{cid}': {rel} on tier '{source.name}' does not match its manifest "
            f"({size} bytes, {checksum}; expected {entry.size} bytes, {entry.checksum}); it was "
            f"not copied to '{target.name}'. Run store.verify('{cid}') to see what else is "
            f"damaged", cid, target.name)


def report_unfinished(pending: list[PendingCopy], failures: list[DrainError]) -> None:
    """Say on stderr what did not reach which tier (used when the process exits)."""
    if pending:
        print("tierstore: the process exits with drains unfinished; these copies were not made: "
              + ", ".join(map(str, pending)), file=sys.stderr)
    for failure in failures:
        print(f"tierstore: drain failed: {failure}", file=sys.stderr)
