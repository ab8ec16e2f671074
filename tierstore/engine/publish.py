"""Publishing a save's commit on its first tier: the manifest, the commit protocol (through the
tier), the drains to slower tiers that take the step, then ``keep``."""

from __future__ import annotations

import logging
import time

from tierstore.engine.context import StoreContext
from tierstore.engine.drain import DrainJob, Drainer
from tierstore.engine.manifests import build_manifest
from tierstore.engine.retention import Retention
from tierstore.errors import CommitError
from tierstore.events import Event, EventKind, Phase
from tierstore.format.manifest import FileEntry, Manifest
from tierstore.tiers.tier import Tier

__all__ = ["Publisher"]

log = logging.getLogger("tierstore.publish")


class Publisher:
    """Makes saves visible on their tier and hands them to the background work.

    ``in_checkpoint_process``: this store runs in DCP's checkpoint process, whose saves leave
    drains and retention to the training process's store (``tierstore.handoff``)."""

    def __init__(self, context: StoreContext, drainer: Drainer, retention: Retention, *,
                 in_checkpoint_process: bool = False):
        self._context, self._drainer, self._retention = context, drainer, retention
        self._in_checkpoint_process = in_checkpoint_process

    def publish(self, tier: Tier, checkpoint_id: str, staging: str, token: str,
                files: dict[str, FileEntry], step: int, seconds: float,
                all_files: dict[str, FileEntry] | None = None, drain: bool = True) -> Manifest:
        """Write the manifest and make the checkpoint (this rank's part of it, on a node-local
        tier) visible on ``tier``, queue drains to slower tiers, then apply ``keep``.
        ``all_files``: every file of the checkpoint, known on the coordinator."""
        ctx = self._context
        host, rank, layout = ctx.host, ctx.rank, tier.layout
        manifest = build_manifest(
            tier, checkpoint_id, files, plugins={"staging": ctx.config.staging.name},
            world_size=ctx.job.world_size, codecs=[c.name for c in tier.config.codecs],
            step=step, part=layout.part, parts=layout.parts, ranks=list(layout.part_ranks),
            save_token=token, created=time.time() - seconds)
        host.phase(Phase.WRITE_MANIFEST, checkpoint_id, tier.name, rank)
        existing = tier.complete_manifest(checkpoint_id)
        if existing is not None and not ctx.config.overwrite:
            raise CommitError(
                f"checkpoint '{checkpoint_id}' appeared on tier '{tier.name}' while this save "
                f"was running; save under a new id or set [store] overwrite = true"
            )
        if existing is not None:
            manifest.pinned = existing.pinned
        manifest.committed = time.time()
        tier.commit_save(checkpoint_id, staging, manifest,
                         lambda phase: host.phase(phase, checkpoint_id, tier.name, rank))
        host.event(Event(EventKind.COMMITTED, checkpoint_id, tier.name, rank, seconds,
                         manifest.size_bytes, {"step": step}))
        log.info("committed %s on tier '%s' (%d bytes in %.2f s)", checkpoint_id, tier.name,
                 manifest.size_bytes, seconds)
        if self._in_checkpoint_process:
            return manifest  # the training process's store drains and applies keep
        targets = [t for t in ctx.tiers.tiers_for(step) if t is not tier] if drain else []
        if targets:
            self._drainer.submit(DrainJob(checkpoint_id, tier, targets, token,
                                          all_files or files))
        self._retention.apply_quietly(tier)
        return manifest
