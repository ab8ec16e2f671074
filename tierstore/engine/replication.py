"""Peer replicas: after a save commits, each rank sends its files to the ranks the peer tier's
strategy names, and keeps the files of the ranks it holds for, over torch.distributed.

One replication thread per store, with a gloo group of its own (its collectives run beside the
training's and the save's). Every rank queues one job per save that the peer tier takes, in save
order, so the jobs of all ranks pair up. A job waits until this rank's files are committed on
the tier the save went to, then all ranks agree (a small all-gather) whether the save committed
everywhere; if so, headers (file lists) and then files move point to point, and each holder
commits what it received as a checkpoint of its replica tier (``.replicas/<rank>-held-by-<me>``
under the peer tier's directory), whose manifest names the rank it came from. The coordinator's
replicas carry DCP's global ``.metadata``. Files are sent from their mapped pages and received
into the pages of replicas ``keep`` dropped (tierstore.transport.transfer), checksummed as they
land.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from dataclasses import dataclass, field

from tierstore.engine.context import StoreContext
from tierstore.engine.jobs import BackgroundJob, BackgroundJobs
from tierstore.engine.manifests import build_manifest
from tierstore.engine.parity import protect
from tierstore.engine.replica_chunks import (ChunkedReceipt, ChunkingEnd, checked_chunk_lists,
                                             checked_needs, chunk_lists, pair_transfers)
from tierstore.engine.retention import Retention
from tierstore.engine.saves import SaveLedger
from tierstore.errors import DrainError, ReplicationError
from tierstore.events import Event, EventKind, Phase
from tierstore.format.checksum import Hasher, same_digest
from tierstore.format.manifest import METADATA_NAME, FileEntry
from tierstore.transport.collectives import all_gather_message
from tierstore.transport.shapes import as_bool, as_str, as_tuple
from tierstore.tiers.chunked import ChunkedBackend, is_chunked_name
from tierstore.transport.transfer import Transfer, exchange_objects, open_to_send, run_transfers

__all__ = ["ReplicationJob", "Replicator"]

log = logging.getLogger("tierstore.replication")


@dataclass
class ReplicationJob(BackgroundJob):
    """Replicate this rank's files of ``checkpoint_id`` (saved to ``source``)."""

    step: int
    token: str
    wrote: bool  # this rank's write succeeded
    save_seq: int  # the store's save counter when the save started
    carrier: threading.Thread = field(default_factory=threading.current_thread)


@dataclass
class _Received:
    """What arrived of one replica file: the running checksum and its size so far."""

    hasher: Hasher
    size: int = 0


class Replicator(BackgroundJobs[ReplicationJob]):
    """Runs the replication jobs of one store (see the module docstring)."""

    what = "replication"

    def __init__(self, context: StoreContext, retention: Retention, ledger: SaveLedger):
        tiers = context.tiers
        assert tiers.peer is not None and tiers.strategy is not None
        self._context, self._retention, self._ledger = context, retention, ledger
        self._host, self._rank = context.host, context.rank
        self.peer = tiers.peer
        self.strategy = tiers.strategy
        self.replica_tiers = tiers.replica_tiers
        self.parity_tier = tiers.parity_tier
        self.group = context.groups.replication
        self._commit_timeout = context.config.part_timeout
        self._piece_bytes = context.copy_chunk_bytes
        super().__init__("tierstore-replicate")
        retention.spare_with(self.protected)

    # -- the jobs ------------------------------------------------------------------------------
    def run_job(self, job: ReplicationJob) -> None:
        self._replicate(job)

    def failure(self, job: ReplicationJob, exc: BaseException) -> DrainError:
        err = ReplicationError(
            f"checkpoint '{job.checkpoint_id}' was not replicated to the peers of rank "
            f"{self._rank} (tier '{self.peer.name}'): {type(exc).__name__}: {exc}; it is still "
            f"complete on tier '{job.source.name}'", job.checkpoint_id, self.peer.name)
        self._host.event(Event(EventKind.FAILED, job.checkpoint_id, self.peer.name, self._rank,
                               detail={"error": str(err)}))
        return err

    def after_job(self, job: ReplicationJob) -> None:
        # ``keep`` spared the checkpoint on its source tier while it was sent: apply it now,
        # before wait() returns. Only the rank that publishes the source's part applies keep
        # there (as after a save): another rank would not know of that rank's drains and loads.
        if job.source.layout.leader == self._rank:
            self._retention.apply_quietly(job.source)

    def _committed_files(self, job: ReplicationJob) -> dict[str, FileEntry] | None:
        """This rank's files of the save once committed on the source tier (the coordinator's
        include ``.metadata``), or None when the save is over without committing them."""
        rank = self._rank
        deadline = time.monotonic() + self._commit_timeout
        while job.wrote:
            manifest = job.source.read_manifest(job.checkpoint_id)
            if manifest is not None and manifest.save_token == job.token:
                files = {rel: e for rel, e in manifest.files.items() if e.rank == rank}
                if rank == 0 and METADATA_NAME in manifest.files:
                    files[METADATA_NAME] = manifest.files[METADATA_NAME]
                return files if rank in manifest.ranks else None
            over = (not job.carrier.is_alive() or self._ledger.save_seq != job.save_seq
                    or time.monotonic() > deadline)
            if over:
                # The save's thread is gone (or a newer save began) and nothing is committed.
                manifest = job.source.read_manifest(job.checkpoint_id)
                if manifest is None or manifest.save_token != job.token:
                    return None
                continue
            time.sleep(0.005)
        return None

    def _replicate(self, job: ReplicationJob) -> None:
        files = self._committed_files(job)
        # Ranks of a node may share the source directory, and its leader applies ``keep`` there:
        # a shared lock, taken before the agreement (which the leader's own job waits for),
        # keeps the leader from evicting the checkpoint while this rank still sends it.
        hold = None
        if files is not None:
            try:
                hold = job.source.backend.lock_directory(job.checkpoint_id, exclusive=False)
            except FileNotFoundError:
                files = None  # evicted since it committed: this rank has nothing to send
        try:
            self._agree_and_exchange(job, files)
        finally:
            if hold is not None:
                hold.release()

    def _agree_and_exchange(self, job: ReplicationJob, files: dict[str, FileEntry] | None) -> None:
        rank, world = self._rank, self._context.job.world_size
        agreed = all_gather_message([job.checkpoint_id, files is not None], self.group,
                                    lambda v: as_tuple(v, as_str, as_bool),
                                    "a checkpoint id and whether it committed there")
        if not all(ok and cid == job.checkpoint_id for cid, ok in agreed):
            log.info("not replicating %s: the save did not commit on every rank",
                     job.checkpoint_id)
            return
        assert files is not None
        self._host.phase(Phase.REPLICATE, job.checkpoint_id, self.peer.name, rank)
        started = time.perf_counter()
        manifest = job.source.read_manifest(job.checkpoint_id)
        # Plain data on the wire (no pickles between ranks): entries as their fields.
        dedup = self.peer.config.dedup
        header = {"files": {rel: dataclasses.asdict(e) for rel, e in files.items()},
                  "step": job.step, "token": job.token, "codecs": manifest.codecs,
                  "created": manifest.created, "committed": manifest.committed,
                  "world_size": world,
                  "chunks": chunk_lists(job.source, job.checkpoint_id, files) if dedup else {}}
        members = self.strategy.parity_set(rank, world)
        if members is not None:
            self._protect_with_parity(job, members, {**header, "files": files}, started)
            return
        holders = self.strategy.holders(rank, world)
        held = sorted(self.replica_tiers)
        headers = {src: _with_entries(h, src) for src, h in
                   exchange_objects(self.group, {h: header for h in holders}, held).items()}
        # With dedup, each holder answers with the chunks it lacks; only those travel.
        own_chunks = checked_chunk_lists(header["chunks"], files, rank)
        receipts: dict[int, ChunkedReceipt] = {}
        needs_of: dict[int, dict[str, list[int]] | None] = {dst: None for dst in holders}
        try:
            if dedup:
                for src in held:
                    receipts[src] = ChunkedReceipt(self.replica_tiers[src], checked_chunk_lists(
                        headers[src].get("chunks", {}), headers[src]["files"], src))
                answers = exchange_objects(self.group, {src: receipts[src].needs
                                                        for src in held}, holders)
                needs_of = {dst: checked_needs(answers[dst], own_chunks, dst) for dst in holders}
            self._exchange_files(job, files, headers, own_chunks, receipts, needs_of, started)
        finally:
            for receipt in receipts.values():
                receipt.close()

    def _exchange_files(self, job: ReplicationJob, files: dict[str, FileEntry], headers: dict,
                        own_chunks: dict, receipts: dict[int, ChunkedReceipt],
                        needs_of: dict, started: float) -> None:
        """Move this rank's files to its holders and the files of the ranks it holds for,
        and commit the replicas received."""
        rank = self._rank
        holders, held = sorted(needs_of), sorted(self.replica_tiers)
        # Each rank lists the transfers of its own pairs only (it knows their files): both
        # ranks of a pair list that pair's files alike, which is all run_transfers needs.
        transfers = [t for dst in holders
                     for t in pair_transfers(rank, dst, files, own_chunks, needs_of[dst])]
        for src in held:
            receipt = receipts.get(src)
            transfers += pair_transfers(src, rank, headers[src]["files"],
                                        receipt.chunks if receipt else {},
                                        receipt.needs if receipt else None)
        staging = {src: self.replica_tiers[src].begin_save(job.checkpoint_id, job.token)
                   for src in held}
        received_files: dict[tuple[int, str], _Received] = {}

        def open_source(t: Transfer):
            return open_to_send(job.source.backend, f"{job.checkpoint_id}/{t.key}",
                                files[t.key].size)

        def open_target(t: Transfer):
            receipt = receipts.get(t.src)
            if receipt is not None and t.key in receipt.needs:
                return receipt.target(t)  # a chunk the holder lacks
            tier = self.replica_tiers[t.src]
            entry = headers[t.src]["files"][t.key]
            # Digested as the sender's manifest records it (keyed when the store signs).
            received_files[(t.src, t.key)] = _Received(
                hasher=tier.keyring.hasher_for(entry.checksum))
            if isinstance(tier.backend, ChunkedBackend) and is_chunked_name(t.key):
                return ChunkingEnd(tier, f"{staging[t.src]}/{t.key}", entry)
            return tier.backend.receiving_end(f"{staging[t.src]}/{t.key}", t.size)

        def sink(t: Transfer, target, offset: int, data) -> None:
            receipt = receipts.get(t.src)
            if receipt is not None and t.key in receipt.needs:
                receipt.arrived(t, data)
                return
            got = received_files[(t.src, t.key)]
            got.hasher.update(memoryview(data.numpy()))
            got.size += data.numel()
            if got.size >= t.size:
                target.close(fsync=self.replica_tiers[t.src].backend.durable)

        try:
            received = run_transfers(self.group, rank, transfers, open_source, open_target, sink,
                                     self._piece_bytes)
            for src in held:
                if src in receipts:
                    receipts[src].write_recipes(staging[src])
                self._commit_replica(job, src, headers[src], staging[src], received_files,
                                     set(receipts[src].needs) if src in receipts else set())
        except BaseException:
            for src in held:
                self.replica_tiers[src].abort_save(job.checkpoint_id, staging[src])
            raise
        sent = sum(t.size for t in transfers if t.src == rank)
        self._host.event(Event(EventKind.REPLICATED, job.checkpoint_id, self.peer.name, rank,
                               time.perf_counter() - started, sent + received,
                               {"sent": sent, "received": received, "to": holders,
                                "from": held}))
        # Housekeeping once the replicas are published (it frees or recycles old replicas).
        for src in held:
            self._retention.apply_quietly(self.replica_tiers[src])

    def _protect_with_parity(self, job: ReplicationJob, members: list[int], header: dict,
                             started: float) -> None:
        """The ``erasure`` strategy: this rank's share of its set's parity instead of replicas
        (tierstore.engine.parity)."""
        tier = self.parity_tier
        assert tier is not None
        sent, received, kept = protect(
            self.group, self._rank, members, header, job.checkpoint_id, job.source, tier,
            str(self.strategy),
            lambda phase: self._host.phase(phase, job.checkpoint_id, tier.name, self._rank),
            self._piece_bytes)
        self._host.event(Event(EventKind.REPLICATED, job.checkpoint_id, self.peer.name,
                               self._rank, time.perf_counter() - started, sent + received,
                               {"sent": sent, "received": received, "parity_set": members,
                                "parity_bytes": kept}))
        self._retention.apply_quietly(tier)

    def _commit_replica(self, job: ReplicationJob, src: int, header: dict, staging: str,
                        received_files: dict[tuple[int, str], "_Received"],
                        as_chunks: set[str]) -> None:
        """Commit the replica of rank ``src``'s files once each is checked (``as_chunks``:
        files that came as the chunks the holder lacked, each checked as it landed)."""
        tier = self.replica_tiers[src]
        files: dict[str, FileEntry] = header["files"]
        for rel, entry in files.items():
            if rel in as_chunks:
                continue
            r = received_files.get((src, rel))
            got = (r.size, r.hasher.hexdigest()) if r else (0, "")
            if entry.size and (got[0] != entry.size or not same_digest(got[1], entry.checksum)):
                raise OSError(f"the replica of {rel} from rank {src} does not match its "
                              f"manifest (size {got[0]} of {entry.size}, checksum differs)")
        manifest = build_manifest(
            tier, job.checkpoint_id, files, plugins={"replication": str(self.strategy)},
            world_size=header["world_size"], codecs=header["codecs"], step=header["step"],
            part=0, parts=1, ranks=[src], save_token=header["token"], created=header["created"],
            # The save's commit time, as a drained copy keeps it: "newest" (latest(), keep)
            # orders saves, and a replica received after a newer save committed (a resumed or
            # slow replication) must not make its older save the newest.
            committed=header["committed"])
        tier.commit_save(job.checkpoint_id, staging, manifest,
                         lambda phase: self._host.phase(phase, job.checkpoint_id, tier.name,
                                                        self._rank))


def _with_entries(header: dict, src: int) -> dict:
    """``header`` as rank ``src`` sent it, its file entries rebuilt from their fields."""
    try:
        files = {rel: FileEntry(**fields) for rel, fields in header["files"].items()}
        for name in ("created", "committed"):
            if not isinstance(header[name], (int, float)) or not math.isfinite(header[name]):
                raise TypeError(f"{name} is {header[name]!r}, not a time")
    except (TypeError, KeyError, AttributeError) as exc:
        raise ReplicationError(f"rank {src} sent a replication header that is not one "
                               f"({type(exc).__name__}: {exc}); every rank of a job must run "
                               f"the same tierstore") from None
    return {**header, "files": files}
