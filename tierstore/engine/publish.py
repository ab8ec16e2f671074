"""Publishing a save's commit on its first tier: the manifest, the commit protocol (through the
tier), the drains to slower tiers that take the step, then ``keep``.

On a node-local tier the groups of ranks other than the coordinator's publish their part inside
DCP's ``write_data``, before the coordinator's ``finish`` commits the checkpoint as a whole
(writes DCP's ``.metadata`` and its own part). Until that commit is known to this node, such a
part is *pending*: it carries the marker :data:`PENDING_PART` in its directory, and ``keep``
neither counts it nor evicts anything for it (:meth:`Publisher.unconfirmed`), so that a
coordinator failing in ``finish`` never costs a node its last loadable part. The next save
settles pending parts on every rank (``TierstoreWriter.reset``): a part whose save token the
coordinator committed (:meth:`Publisher.committed`) is confirmed (the marker goes); a part of a
save the coordinator never committed is an orphan, which gc removes. A pending part drained to
a slower node-local tier is pending there too (the drain copies the marker in before its
commit), and is settled the same way: by the coordinator's commit, not by the coordinator's
copy on that tier, which its own drain may not have brought there yet.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Collection, Sequence

from tierstore.engine.context import StoreContext
from tierstore.engine.drain import DrainJob, Drainer
from tierstore.engine.manifests import build_manifest
from tierstore.engine.notices import CommitNotices, NoticeJob
from tierstore.engine.parts import PENDING_PART, KnownCommits, is_pending, unmark
from tierstore.engine.retention import Retention
from tierstore.errors import CommitError
from tierstore.events import Event, EventKind, Phase
from tierstore.format.manifest import FileEntry, Manifest
from tierstore.tiers.tier import Tier

__all__ = ["Publisher", "PENDING_PART"]

log = logging.getLogger("tierstore.publish")



class Publisher:
    """Makes saves visible on their tier and hands them to the background work.

    ``in_checkpoint_process``: this store runs in DCP's checkpoint process, whose saves leave
    drains and retention to the training process's store (``tierstore.handoff``)."""

    def __init__(self, context: StoreContext, drainer: Drainer, retention: Retention,
                 commits: KnownCommits, *, in_checkpoint_process: bool = False):
        self._context, self._drainer, self._retention = context, drainer, retention
        self._commits = commits
        self._in_checkpoint_process = in_checkpoint_process
        #: the coordinator's word to the nodes that a save committed (node-local tiers only)
        self.notices = (CommitNotices(self.settle_committed, context.config.collective_timeout)
                        if context.tiers.node_local else None)
        retention.spare_with(self.unconfirmed)

    @staticmethod
    def pending_parts(tier: Tier) -> dict[str, str]:
        """The pending parts on ``tier`` (see the module docstring): id -> save token."""
        out = {}
        for cid in tier.checkpoint_names():
            if not Publisher.is_pending(tier, cid):
                continue
            manifest = tier.read_manifest(cid)
            if manifest is not None:
                out[cid] = manifest.save_token
        return out

    @staticmethod
    def is_pending(tier: Tier, checkpoint_id: str) -> bool:
        """Whether ``checkpoint_id`` on ``tier`` is a pending part."""
        return is_pending(tier, checkpoint_id)

    @staticmethod
    def confirm(tier: Tier, checkpoint_id: str) -> None:
        """The checkpoint of the pending part ``checkpoint_id`` on ``tier`` is committed."""
        unmark(tier, checkpoint_id)

    def committed(self, checkpoint_id: str, token: str) -> bool | None:
        """On the coordinator's rank: whether it committed ``checkpoint_id`` as a whole (with
        DCP's ``.metadata``) under save ``token``. True when this process made that commit or a
        complete copy of that save with its metadata is on any tier this rank reads on its own
        machine (the first tier that took it, or a slower one it was drained to); False when
        none is; None when a tier could not be read and nothing else answered (the part stays
        pending). Object-store tiers are not asked: a save's start never waits on a server.

        What is judged False was never committed, or no longer exists on the coordinator's
        machine (``keep`` evicted every copy there, or the node was lost): a part of it cannot
        load anyway, and removing it is what ``keep`` would have done."""
        if self._commits.knows(checkpoint_id, token):
            return True
        unreadable = False
        for tier in self._context.tiers:
            if tier.layout.shared and tier.backend.local_path("") is None:
                continue
            try:
                manifest = tier.complete_manifest(checkpoint_id)
            except Exception:  # noqa: BLE001 - another tier may still answer
                log.warning("tier '%s': could not read the manifest of %s to settle its "
                            "parts", tier.name, checkpoint_id, exc_info=True)
                unreadable = True
                continue
            if manifest is not None and manifest.has_metadata and manifest.save_token == token:
                return True
        return None if unreadable else False

    def settle_committed(self, checkpoint_id: str, token: str) -> None:
        """This node learned that the save ``token`` of ``checkpoint_id`` committed (a notice,
        ``tierstore.engine.notices``): its pending part of that save is confirmed on every
        node-local tier this rank leads (the part, and its copies drained to slower tiers
        meanwhile), and ``keep`` applies there at once."""
        self._commits.record(checkpoint_id, token)
        ctx = self._context
        for tier in ctx.tiers:
            if tier.layout.shared or tier.layout.leader != ctx.rank:
                continue
            if not is_pending(tier, checkpoint_id):
                continue
            manifest = tier.read_manifest(checkpoint_id)
            if manifest is None or manifest.save_token != token:
                continue
            self.confirm(tier, checkpoint_id)
            self._retention.apply_quietly(tier)

    def copy_own_files(self, tier: Tier, checkpoint_id: str, token: str,
                       all_files: dict[str, FileEntry], drain: Sequence[Tier],
                       save_over: Callable[[], bool]) -> None:
        """A rank of a node that does not publish the node's part of a save on ``tier``: copy
        the files it wrote to the shared tiers of ``drain`` itself, beside the part's leader,
        once the leader has committed the part (a gathered copy: see ``DrainJob``).
        ``all_files``: every data file of the save, as the ranks told each other;
        ``save_over``: whether the save call is over."""
        targets = [t for t in drain if t is not tier and t.layout.shared]
        if targets and not self._in_checkpoint_process:
            self._drainer.submit(DrainJob(checkpoint_id, tier, targets, token, all_files,
                                          save_over=save_over))

    def tell_failed(self, tier: Tier, checkpoint_id: str, token: str) -> None:
        """The coordinator: the save ``token`` of ``checkpoint_id`` on ``tier`` failed; unless
        it committed before it failed, the nodes stop waiting for it (their parts stay pending
        for the next save's settle)."""
        if self.notices is not None and tier.layout.parts > 1 \
                and not self._commits.knows(checkpoint_id, token):
            self.notices.tell(token, committed=False)

    def unconfirmed(self, tier: Tier) -> set[str]:
        """What ``keep`` must spare on a node-local tier holding pending parts: the pending
        parts themselves (their checkpoint may or may not exist yet) and the newest ``keep``
        confirmed checkpoints, so that ``keep`` counts only checkpoints known to be complete."""
        if tier.layout.shared or tier.config.keep is None:
            return set()
        complete = tier.complete()
        pending = {cid for cid in complete if self.is_pending(tier, cid)}
        if not pending:
            return set()
        confirmed = sorted((c for c in complete if c not in pending),
                           key=lambda c: (complete[c].committed, c), reverse=True)
        return pending | set(confirmed[:tier.config.keep])

    def publish(self, tier: Tier, checkpoint_id: str, staging: str, token: str,
                files: dict[str, FileEntry], step: int, seconds: float,
                all_files: dict[str, FileEntry] | None = None, drain: Sequence[Tier] = (),
                pending: bool = False, replaces: Collection[str] = ()) -> Manifest:
        """Write the manifest and make the checkpoint (this rank's part of it, on a node-local
        tier) visible on ``tier``, queue drains to slower tiers, then apply ``keep``.
        ``all_files``: every file of the checkpoint, known on the coordinator. ``drain``: the
        slower tiers that take this save, as its ``reset`` decided (never asked again here:
        an ``every = "auto"`` tier's schedule must see each save once). ``pending``: a
        node-local part published before the checkpoint's commit (see the module docstring),
        marked so in the same commit; ``keep`` neither counts it nor evicts anything for it.
        ``replaces``: save tokens of copies of this id that the save found here at its start
        and judged no loadable checkpoint (tierstore.engine.existing); any other copy that is
        complete here now appeared meanwhile, and is kept (CommitError) unless ``overwrite``."""
        ctx = self._context
        host, rank, layout = ctx.host, ctx.rank, tier.layout
        manifest = build_manifest(
            tier, checkpoint_id, files, plugins={"staging": ctx.config.staging.name},
            world_size=ctx.job.world_size, codecs=[c.name for c in tier.config.codecs],
            step=step, part=layout.part, parts=layout.parts, ranks=list(layout.part_ranks),
            save_token=token, created=time.time() - seconds)
        host.phase(Phase.WRITE_MANIFEST, checkpoint_id, tier.name, rank)
        existing = tier.complete_manifest(checkpoint_id)
        if existing is not None and not ctx.config.overwrite \
                and existing.save_token not in replaces:
            raise CommitError(
                f"checkpoint '{checkpoint_id}' appeared on tier '{tier.name}' while this save "
                f"was running; save under a new id or set [store] overwrite = true"
            )
        if existing is not None:
            manifest.pinned = existing.pinned
        manifest.committed = time.time()
        if pending:  # inside the staging directory: the part is never visible unmarked
            tier.write_bytes(f"{staging}/{PENDING_PART}", token.encode())
        tier.commit_save(checkpoint_id, staging, manifest,
                         lambda phase: host.phase(phase, checkpoint_id, tier.name, rank))
        if manifest.has_metadata:
            self._commits.record(checkpoint_id, token)
            if self.notices is not None and layout.parts > 1:
                self.notices.tell(token, committed=True)  # every node, in this save
        elif pending and self.notices is not None:
            self.notices.expect(NoticeJob(checkpoint_id, tier, token=token))
        host.event(Event(EventKind.COMMITTED, checkpoint_id, tier.name, rank, seconds,
                         manifest.size_bytes, {"step": step}))
        log.info("committed %s on tier '%s' (%d bytes in %.2f s)", checkpoint_id, tier.name,
                 manifest.size_bytes, seconds)
        if self._in_checkpoint_process:
            return manifest  # the training process's store drains and applies keep
        targets = [t for t in drain if t is not tier]
        if targets:
            self._drainer.submit(DrainJob(checkpoint_id, tier, targets, token,
                                          all_files or files))
        self._retention.apply_quietly(tier)  # (it spares pending parts: see unconfirmed)
        return manifest
