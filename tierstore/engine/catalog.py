"""Queries about what is stored: which checkpoints this job can load (``latest``), what each
tier holds (``list``), whether a copy is intact (``verify``), and pins."""

from __future__ import annotations

import time
from dataclasses import dataclass

from tierstore.engine.context import StoreContext
from tierstore.engine.health import TierHealth
from tierstore.engine.listings import Listings
from tierstore.engine.retention import Retention
from tierstore.errors import LIST_HINT, CheckpointNotFound
from tierstore.events import Phase
from tierstore.format.ids import validate_checkpoint_id
from tierstore.format.manifest import MANIFEST_NAME, Manifest
from tierstore.tiers.parity_sets import parity_held, recoverable
from tierstore.tiers.reports import CheckpointInfo, StoreStatus, TierStatus, VerifyReport
from tierstore.tiers.tier import Tier
from tierstore.transport.collectives import all_gather_message
from tierstore.transport.messages import MessageError

__all__ = ["Catalog", "Coverage"]


@dataclass(frozen=True)
class Coverage:
    """What one process holds of a checkpoint (see :meth:`Catalog.coverage`)."""

    ranks: frozenset[int]
    has_metadata: bool
    committed: float
    #: ranks of the job that saved it: whose files a load needs, whatever this job's size
    world_size: int = 1


class Catalog:
    """Answers the store's queries from the tiers' manifests."""

    def __init__(self, context: StoreContext, retention: Retention, health: TierHealth,
                 listings: Listings):
        self._context, self._retention, self._health = context, retention, health
        #: the looks at object stores, shared with the resumed drains' scan and the loads
        self.listings = listings

    def latest(self) -> str | None:
        """Newest checkpoint this job can load: the files of every rank of the job that saved it
        (whatever this job's size) are on some tier (of some node, for node-local tiers, or
        held as a peer's replica) with their recorded sizes, and DCP's ``.metadata`` is too,
        all written by one save (one save token: parts left by two saves of one id, where one
        node's part is stale, are never counted together). A collective on the store's group
        under torch.distributed."""
        ctx = self._context
        told = all_gather_message(_views_message(self.coverage(), self.parity()),
                                  ctx.groups.main)
        gathered = [_views_from(message, f"rank {r}") for r, message in enumerate(told)]
        views = [cov for cov, _ in gathered]
        world = len(gathered)
        best: tuple[float, str] | None = None
        for key in set().union(*views):
            held = [v[key] for v in views if key in v]
            ranks = set().union(*(h.ranks for h in held))
            # A member of a parity set that no rank holds is rebuilt by the load (from the
            # other members' files and parity, at their ranks in this job).
            parity = {holder: members for holder, (_, par) in enumerate(gathered)
                      for members in [par.get(key)] if members is not None}
            self_held = {r for r, v in enumerate(views) if key in v and r in v[key].ranks}
            rebuilt = {lost for lost, members in recoverable(ranks, parity, self_held).items()
                       if max(members) < world}
            ranks |= rebuilt
            # Every rank of the save, however many ranks this job has: DCP reshards the rest.
            saved = set(range(max(h.world_size for h in held)))
            # (The coordinator's parity covers .metadata with its files.)
            if ranks >= saved and (0 in rebuilt or any(h.has_metadata for h in held)):
                newest = (max(h.committed for h in held), key[0])
                best = newest if best is None or newest > best else best
        return best[1] if best else None

    def parity(self) -> dict[tuple[str, str], tuple[int, ...]]:
        """The saves this rank holds its share of parity of (``erasure`` strategy): (id, save
        token) -> the set's ranks."""
        tier = self._context.tiers.parity_tier
        if tier is None:
            return {}
        held = self._health.ask(tier, "latest()", lambda: parity_held(tier), {})
        return {(cid, token): members for cid, (token, members) in held.items()}

    def coverage(self) -> dict[tuple[str, str], Coverage]:
        """What this process holds of each checkpoint, by (id, save token), over all its
        tiers: the ranks whose files are all present (a file may come from any tier), whether
        ``.metadata`` is, and when it was committed. A tier with one directory for the whole
        job (an object store) is listed by its leader alone under torch.distributed: the
        others would list the same objects, each with a client of its own to make, on a
        restart's path (``latest()`` gathers every rank's coverage). A node-local tier is
        listed by every rank of its node (a local listing; which ranks hold their own files
        there is what a rebuild from parity goes by)."""
        ctx = self._context
        parts: dict[tuple[str, str, tuple[int, ...]], tuple[Manifest, set[str]]] = {}
        for tier in ctx.tiers.read_order():
            if (ctx.groups.main is not None and tier.layout.shared
                    and not ctx.tiers.is_replica(tier) and tier.layout.leader != ctx.rank):
                continue  # (its leader lists it for the job)
            held = self._health.ask(tier, "latest()",
                                    lambda tier=tier: self.listings.look(tier).holdings, ())
            for cid, manifest, files in ((h.checkpoint_id, h.manifest, h.present) for h in held):
                _, present = parts.setdefault((cid, manifest.save_token, tuple(manifest.ranks)),
                                              (manifest, set()))
                present |= files
        out: dict[tuple[str, str], Coverage] = {}
        for (cid, token, ranks), (manifest, present) in parts.items():
            if len(present) != len(manifest.files):
                continue
            prev = out.get((cid, token), Coverage(frozenset(), False, manifest.committed,
                                                  manifest.world_size))
            out[(cid, token)] = Coverage(prev.ranks | frozenset(ranks),
                                         prev.has_metadata or manifest.has_metadata,
                                         max(prev.committed, manifest.committed),
                                         max(prev.world_size, manifest.world_size))
        return out

    def list(self) -> list[CheckpointInfo]:
        """Every checkpoint complete on some tier of this process, newest first."""
        found: dict[str, tuple[list[str], Manifest]] = {}
        pinned: set[str] = set()  # pinned on some tier (promote --pin pins one copy)
        for tier in self._context.tiers:
            for cid, manifest in self._health.ask(
                    tier, "list()", lambda t=tier: self.listings.complete(t), {}).items():
                names, _ = found.setdefault(cid, ([], manifest))
                names.append(tier.name)
                if manifest.pinned:
                    pinned.add(cid)
        infos = [
            CheckpointInfo(id=cid, tiers=names, size_bytes=m.size_bytes, created=m.created,
                           committed=m.committed, pinned=cid in pinned, step=m.step,
                           files=len(m.files))
            for cid, (names, m) in found.items()
        ]
        return sorted(infos, key=lambda c: (c.committed, c.id), reverse=True)

    def status(self, pending: list[tuple[str, str]]) -> StoreStatus:
        """What a failure would cost now, per tier (fastest first): its newest complete
        checkpoint, how old and how many steps behind the newest anywhere it is, the bytes it
        holds and the space left. A tier that does not answer is reported unreachable."""
        held: dict[str, dict[str, Manifest] | None] = {}
        for tier in self._context.tiers:
            held[tier.name] = self._health.ask(tier, "status()",
                                               lambda t=tier: self.listings.complete(t), None)
        steps = [m.step for found in held.values() if found for m in found.values()
                 if m.step is not None]
        newest_step = max(steps) if steps else None
        down = self._health.unreachable()
        now = time.time()
        tiers = []
        for tier in self._context.tiers:
            found = held[tier.name]
            if found is None:
                tiers.append(TierStatus(tier.name, False, None, None, None, 0, None,
                                        problem=down.get(tier.name, "did not answer")))
                continue
            newest = max(found, key=lambda c: (found[c].committed, c)) if found else None
            manifest = found.get(newest) if newest else None
            behind = (newest_step - manifest.step if manifest is not None
                      and manifest.step is not None and newest_step is not None else None)
            free = self._health.ask(tier, "status()", tier.backend.free_bytes, None)
            tiers.append(TierStatus(
                tier.name, True, newest,
                None if manifest is None else max(0.0, now - manifest.committed), behind,
                sum(m.size_bytes for m in found.values()), free, len(found)))
        return StoreStatus(tiers, pending)

    def complete_copies(self, cid: str, what: str) -> list[tuple[Tier, Manifest]]:
        """(tier, manifest) of every complete copy of ``cid``, fastest first (tiers that do not
        answer left out); CheckpointNotFound, saying ``what`` could not be done, when none."""
        found = []
        for tier in self._context.tiers:
            manifest = self._health.ask(tier, f"{what}()",
                                        lambda t=tier: t.complete_manifest(cid), None)
            if manifest is not None:
                found.append((tier, manifest))
        if not found:
            raise CheckpointNotFound(
                f"cannot {what} '{cid}': it is not complete on any tier "
                f"({', '.join(t.name for t in self._context.tiers)}); {LIST_HINT}")
        return found

    def verify(self, checkpoint_id: str, tier: str | None = None) -> VerifyReport:
        """Re-read ``checkpoint_id`` on one tier (or every tier holding it) and check every
        file's size and checksum against the manifest. Like a load, it keeps ``keep`` from
        evicting the checkpoint meanwhile. CheckpointNotFound when no tier holds it."""
        cid = validate_checkpoint_id(checkpoint_id)
        ctx = self._context
        chosen = [ctx.tiers.named(tier)] if tier else list(ctx.tiers)
        checked, problems = [], []
        self._retention.loading(cid, begins=True)
        try:
            for t in chosen:
                def check(t=t):
                    return t.verify(cid, lambda rel, size: ctx.host.phase(
                        Phase.VERIFY_FILE, cid, t.name, ctx.rank, file=rel, size=size))
                if tier is None:  # every tier: one that does not answer is left out
                    found = self._health.ask(t, "verify()", check, None)
                    if found is None:
                        continue
                else:
                    found = check()
                if tier is None and found and found[0].file == MANIFEST_NAME \
                        and found[0].what.startswith("missing"):
                    continue  # not on this tier at all: nothing to report of it
                checked.append(t.name)
                problems.extend(found)
        finally:
            self._retention.loading(cid, begins=False)
        if not checked:
            raise CheckpointNotFound(
                f"cannot verify '{cid}': no tier holds it ({', '.join(t.name for t in chosen)}); "
                f"{LIST_HINT}")
        return VerifyReport(cid, checked, problems)

    def set_pinned(self, checkpoint_id: str, pinned: bool) -> None:
        """Pin (or unpin) ``checkpoint_id`` on every tier holding it; CheckpointNotFound when
        none does."""
        cid = validate_checkpoint_id(checkpoint_id)
        # Retention and drains learn it first: a pass that already chose this checkpoint as
        # a victim, or a copy about to commit unpinned, then follows it (see Retention).
        with self._retention.pinning():
            self._retention.ask_pin(cid, pinned)
            done = [t.name for t in self._context.tiers if t.set_pinned(cid, pinned)]
            if not done:
                self._retention.ask_pin(cid, None)
                raise CheckpointNotFound(
                    f"cannot {'pin' if pinned else 'unpin'} '{cid}': it is not complete on any "
                    f"tier; {LIST_HINT}")


# -- what latest() gathers: plain data, compact ---------------------------------------------------
#
# A rank's coverage names the ranks whose files it holds: on a tier the whole job shares, every
# rank of every checkpoint. As runs ([first, last + 1] pairs) that is a pair per checkpoint
# whatever the rank count, where a set of N ranks would make the gather (every rank receives N
# messages, each padded to the longest) grow with N squared.


def _runs(ranks) -> list[list[int]]:
    """``ranks`` as sorted runs ``[start, end)``."""
    out: list[list[int]] = []
    for r in sorted(ranks):
        if out and out[-1][1] == r:
            out[-1][1] = r + 1
        else:
            out.append([r, r + 1])
    return out


def _views_message(coverage: dict[tuple[str, str], Coverage],
                   parity: dict[tuple[str, str], tuple[int, ...]]) -> dict:
    """One rank's part of ``latest()``'s gather, as a message."""
    return {"coverage": [[cid, token, _runs(c.ranks), c.has_metadata, float(c.committed),
                          c.world_size] for (cid, token), c in coverage.items()],
            "parity": [[cid, token, list(members)] for (cid, token), members in parity.items()]}


def _views_from(message, sender: str
                ) -> tuple[dict[tuple[str, str], Coverage], dict[tuple[str, str], tuple[int, ...]]]:
    """The coverage and parity a rank sent (see :func:`_views_message`), checked field by
    field; MessageError naming ``sender`` when it is not such a message."""
    def count(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 31

    try:
        coverage = {}
        for cid, token, runs, has_metadata, committed, world in message["coverage"]:
            if not (isinstance(cid, str) and isinstance(token, str)
                    and isinstance(has_metadata, bool) and isinstance(committed, float)
                    and count(world) and all(count(a) and count(b) and a < b
                                             for a, b in runs)):
                raise ValueError("a field out of shape")
            ranks = frozenset(r for a, b in runs for r in range(a, min(b, world)))
            coverage[(cid, token)] = Coverage(ranks, has_metadata, committed, world)
        parity = {}
        for cid, token, members in message["parity"]:
            if not (isinstance(cid, str) and isinstance(token, str)
                    and all(map(count, members))):
                raise ValueError("a field out of shape")
            parity[(cid, token)] = tuple(members)
    except (KeyError, TypeError, ValueError) as exc:
        raise MessageError(f"{sender} sent a malformed view of what it holds "
                           f"({type(exc).__name__}: {exc}); every rank of a job must run the "
                           f"same tierstore") from None
    return coverage, parity
