"""Copies made on demand: scrubbing (re-reading every copy on every tier, and repairing a bad
copy from a good one) and promoting (copying a checkpoint to a tier whatever its ``every``).

A copy that sits on a tier for weeks can rot (a flipped bit, a truncated object, a file an
operator deleted by hand) while nobody reads it: a load would find out only when that copy is
the one left. :meth:`Scrubber.scrub` re-reads every committed copy (sizes and checksums, as
``verify`` does); with ``repair`` it replaces a bad copy with a fresh copy of a good one from
another tier, through the drain (every byte checked against the good copy's manifest, committed
with the target tier's protocol, the old copy replaced atomically where the tier can rename), and
re-reads the result. :class:`BackgroundScrub` does the same at a bounded rate, one copy at a
time, for ``[store] scrub_every_s``.

A repair never removes a copy before its replacement is complete and verified, and only a copy
proven bad is repaired:

- A copy is *bad* when its tier answered and what it returned is wrong: the manifest missing or
  rejected, a file missing, of another size or checksum. A copy whose tier did not answer (a
  timeout, a dropped connection, retries given up, the tier skipped as unreachable) is
  *unknown*: reported, never repaired, never used as a source. A background scrub against a
  flaky object store must not take "no answer" for "bad" and rewrite a good archive copy.
- Where the tier can swap a whole copy at once (``atomic``: rename), the new copy is staged
  beside the old and takes its place at the commit. Where it cannot (object stores,
  ``manifest-last``), the copy is repaired in place (``Drainer.copy_now``): the files that match
  stay, the others are written over one by one, the manifest last, under a lease; a repair that
  fails part-way leaves what it did not reach as it was.
- The source is counted as being read while it is copied (as promote does), so ``keep`` on its
  tier does not evict it from under the repair.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass

from tierstore.engine.catalog import Catalog
from tierstore.engine.context import StoreContext
from tierstore.engine.drain import DrainJob, Drainer
from tierstore.engine.health import TierHealth
from tierstore.engine.retention import Retention
from tierstore.errors import LIST_HINT, CheckpointNotFound, DrainError
from tierstore.events import Event, EventKind, Phase
from tierstore.format.manifest import Manifest
from tierstore.tiers.reports import Problem, PromoteResult, Repair, ScrubReport
from tierstore.tiers.tier import Tier

__all__ = ["BackgroundScrub", "Scrubber"]

_UNANSWERED = object()  # what TierHealth.ask returns for a tier that did not answer

log = logging.getLogger("tierstore.scrub")


@dataclass
class _Copy:
    """One copy of a checkpoint on one tier, and what re-reading it found."""

    tier: Tier
    checkpoint_id: str
    manifest: Manifest | None  # None: the manifest itself is missing or rejected
    problems: list[Problem]
    #: why the copy could not be re-read (its tier did not answer): neither good nor bad
    unknown: str | None = None

    def unknown_problem(self) -> Problem:
        """The report's line for a copy that could not be re-read."""
        return Problem(self.tier.name, self.checkpoint_id, None,
                       f"not re-read: the tier did not answer ({self.unknown}); nothing was "
                       f"changed there, scrub it again once the tier answers")


class Scrubber:
    """Re-reads, repairs and promotes the copies of one store's tiers (see the module
    docstring)."""

    def __init__(self, context: StoreContext, drainer: Drainer, retention: Retention,
                 health: TierHealth, catalog: Catalog):
        self._context, self._drainer = context, drainer
        self._retention, self._health, self._catalog = retention, health, catalog

    def promote(self, cid: str, target: Tier, pin: bool) -> PromoteResult:
        """Copy ``cid`` to ``target`` through the drain from the fastest whole copy that copies
        cleanly (see ``Store.promote``)."""
        there = target.complete_manifest(cid)
        if there is not None:
            if pin:
                target.set_pinned(cid, True)
            return PromoteResult(cid, target.name, there.size_bytes, 0.0, target.name,
                                 pin or there.pinned)
        sources = [(t, m) for t, m in self._catalog.complete_copies(cid, "promote")
                   if t is not target and m.parts == 1]
        if not sources:
            raise CheckpointNotFound(
                f"cannot promote '{cid}': no tier holds a whole copy of it (node-local tiers "
                f"hold one node's part); {LIST_HINT}")
        failures = []
        self._retention.loading(cid, begins=True)  # keep spares the source meanwhile
        try:
            for source, manifest in sources:
                job = DrainJob(cid, source, targets=[target], token=manifest.save_token,
                               all_files=manifest.files, pin=pin)
                try:
                    seconds = self._drainer.copy_now(job)
                except DrainError as exc:
                    failures.append(exc)
                    continue
                return PromoteResult(cid, target.name, manifest.size_bytes, seconds,
                                     source.name, pin)
        finally:
            self._retention.loading(cid, begins=False)
        raise failures[-1]

    def copies(self) -> list[tuple[Tier, str]]:
        """Every (tier, entry) that may be a checkpoint, on every tier that answers (``check``
        says which are copies: those with a manifest)."""
        return [(tier, cid) for tier in self._context.tiers
                for cid in self._health.ask(tier, "scrub()", tier.checkpoint_names, [])]

    def scrub(self, repair: bool = False) -> ScrubReport:
        """Re-read every copy; with ``repair``, replace each bad one from a good copy on
        another tier and re-read it. Nothing is deleted without a good copy to replace it."""
        copies = [c for c in (self.check(tier, cid) for tier, cid in self.copies())
                  if c is not None]
        unknown = [c.unknown_problem() for c in copies if c.unknown is not None]
        read = [c for c in copies if c.unknown is None]
        bad = [p for c in read for p in c.problems]
        if not repair:
            return ScrubReport(len(read), bad, [], bad + unknown)
        repaired, unrepaired = [], []
        for copy in (c for c in read if c.problems):
            fixed, left = self.repair(copy, copies)
            if fixed is not None:
                repaired.append(fixed)
            unrepaired += left
        return ScrubReport(len(read), bad, repaired, unrepaired + unknown)

    def check(self, tier: Tier, checkpoint_id: str) -> _Copy | None:
        """Re-read one copy (kept from ``keep`` meanwhile, as a load is); None when the entry
        has no manifest at all (not a copy: a user's own directory, say). A tier that fails
        to answer, or is skipped as unreachable, gives an *unknown* copy, not a bad one."""
        ctx = self._context

        def announce(rel: str, size: int) -> None:
            ctx.host.phase(Phase.VERIFY_FILE, checkpoint_id, tier.name, ctx.rank,
                           file=rel, size=size)

        def reread():
            manifest, why = tier.checked_manifest(checkpoint_id)
            if manifest is None and why is None:
                return None
            return manifest, tier.verify(checkpoint_id, announce)

        self._retention.loading(checkpoint_id, begins=True)
        try:
            answer = self._health.ask(tier, "scrub()", reread, _UNANSWERED)
        finally:
            self._retention.loading(checkpoint_id, begins=False)
        if answer is None:
            return None
        if answer is _UNANSWERED:
            why = self._health.unreachable().get(tier.name, "no answer")
            return _Copy(tier, checkpoint_id, None, [], unknown=why)
        manifest, problems = answer
        return _Copy(tier, checkpoint_id, manifest, problems)

    def repair(self, bad: "_Copy", copies: list["_Copy"]
               ) -> tuple[Repair | None, list[Problem]]:
        """Replace ``bad`` from the first good copy of the same checkpoint on another tier
        (fastest first) holding every file of it; returns the repair or what is still bad."""
        cid, target = bad.checkpoint_id, bad.tier
        if bad.unknown is not None:  # not proven bad: never rewritten
            return None, [bad.unknown_problem()]
        sources = [c for c in copies if c.checkpoint_id == cid and not c.problems
                   and c.unknown is None and c.tier is not target and c.manifest is not None
                   and c.manifest.parts == 1
                   and (bad.manifest is None or set(c.manifest.files) >= set(bad.manifest.files))]
        if not sources:
            return None, [_still(p, "no good copy of it on another tier to repair it from")
                          for p in bad.problems]
        source = sources[0]
        job = DrainJob(cid, source.tier, targets=[target], token=uuid.uuid4().hex[:16],
                       all_files=source.manifest.files, replace=True,
                       pin=bad.manifest is not None and bad.manifest.pinned)
        self._retention.loading(cid, begins=True)  # keep spares the source meanwhile
        try:
            self._drainer.copy_now(job)
        except Exception as exc:  # noqa: BLE001 - reported; the other copies go on
            log.error("scrub: repairing %s on tier '%s' failed: %s", cid, target.name, exc)
            return None, [_still(p, f"the repair failed: {exc}") for p in bad.problems]
        finally:
            self._retention.loading(cid, begins=False)
            # What keep spared on the source for the repair goes now, not at the next save.
            self._retention.apply_quietly(source.tier)
        after = self.check(target, cid)
        if after is not None and after.unknown is not None:
            return None, [_still(p, "repaired, but the tier did not answer when the copy was "
                                    "re-read") for p in bad.problems]
        if after is None or after.problems:
            left = after.problems if after is not None else bad.problems
            return None, [_still(p, "still bad after the repair") for p in left]
        files = sorted({p.file or cid for p in bad.problems})
        ctx = self._context
        ctx.host.event(Event(EventKind.REPAIRED, cid, target.name, ctx.rank,
                             detail={"files": files, "source": source.tier.name}))
        log.info("scrub: repaired %s on tier '%s' from tier '%s' (%s)", cid, target.name,
                 source.tier.name, ", ".join(files))
        return Repair(cid, target.name, files, source.tier.name), []


def _still(problem: Problem, why: str) -> Problem:
    return Problem(problem.tier, problem.checkpoint_id, problem.file, f"{problem.what} ({why})")


class BackgroundScrub:
    """Re-reads one copy every ``every_s`` seconds, round robin over every copy of every tier
    (``[store] scrub_every_s``), so that rot in a cold copy is found while a good copy is still
    around: a bad copy is logged, announced (a ``failed`` event, ``during: scrub``) and, with
    ``repair``, replaced from a good one."""

    def __init__(self, scrubber: Scrubber, every_s: float, host, rank: int,
                 repair: bool = True):
        self._scrubber, self._every = scrubber, every_s
        self._host, self._rank, self._repair = host, rank, repair
        self._stop = threading.Event()
        self._queue: list[tuple[Tier, str]] = []
        self._thread = threading.Thread(target=self._run, name="tierstore-scrub", daemon=True)

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            try:
                self.step()
            except Exception:  # noqa: BLE001 - a scrub never takes the store down
                log.exception("background scrub failed; it goes on")

    def step(self) -> None:
        """Re-read the next copy (and repair it, when bad and ``repair``)."""
        if not self._queue:
            self._queue = self._scrubber.copies()
            if not self._queue:
                return
        tier, cid = self._queue.pop(0)
        copy = self._scrubber.check(tier, cid)
        if copy is not None and copy.unknown is not None:
            log.warning("scrub: %s", copy.unknown_problem())
            return
        if copy is None or not copy.problems:
            return
        error = "; ".join(map(str, copy.problems))
        log.error("scrub: %s", error)
        self._host.event(Event(EventKind.FAILED, cid, tier.name, self._rank,
                               detail={"during": "scrub", "error": error}))
        if self._repair:
            others = [self._scrubber.check(t, c) for t, c in self._scrubber.copies()
                      if c == cid and t is not tier]
            self._scrubber.repair(copy, [o for o in others if o is not None])

    def close(self) -> None:
        """Stop after the copy being re-read, if any."""
        self._stop.set()
        self._thread.join(timeout=10)
