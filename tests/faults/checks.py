"""The invariants, checked in a fresh process on the tiers a trial's job left behind.

1. ``latest()`` is never torn (it loads, bitwise) nor older than the last save that returned,
   and agrees with ``list()``;
2. every checkpoint ``list()`` shows, through the store and on each tier holding it, loads
   bitwise equal to what was saved under its id, or fails with a ``TierstoreError``;
3. the next save, ``wait()`` (resumed drains included) and ``gc()`` succeed, and afterwards no
   tier holds anything but complete checkpoints: no ``.tierstore-*`` entry, no visible
   directory or prefix without a manifest, no file a manifest does not name. On an object
   store, a prefix whose writer's lease (``.tierstore-lease.*``) has not expired is work in
   progress by design (a killed writer's lease runs out after ``lease_seconds`` + 60 s): there,
   gc runs once more as it would a day later, and only what is left then counts;
4. after a fault that fills a real filesystem (``tmpfs-full``, ``first-full``), every save that
   fails says so: a ``TierFullError`` naming the tier (never a bare ``OSError``), and nothing of
   it is left on the first tier once it has failed; a first-full save given room for its
   checkpoint commits;
5. (issue 25) the newest committed checkpoint (the newest whose save returned, or that a tier
   was seen holding) loads bitwise from some tier alone, or a newer one does; nothing is ever
   mixed (every load is bitwise one save's data: invariants 1, 2 and this one compare with the
   state of the id); nothing committed and within ``keep`` disappears: a checkpoint the job saw
   complete on a tier (``holds`` lines) is still there, unless the tier holds ``keep`` newer
   ones (a copy the trial damaged on purpose aside);
6. after a drain's source was corrupted or removed under it (``corrupt-source``,
   ``vanish-source``), every copy another tier lists loads bitwise: a bad source is never
   propagated;
7. (issue 43) a load that fails leaves its destination bitwise as it found it, in the job and
   in every check here (the multi-rank kinds check every rank's destination).

``check`` returns violations (a broken promise) and notes (what a user may see but the
contract allows, e.g. a load refused with a ``TierstoreError``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
import warnings
from typing import Any, Iterator
from unittest import mock

import tierstore
from tierstore.engine.publish import PENDING_PART
from tierstore.format.chunk_recipe import parse_recipe_name
from tierstore.tiers.chunks import CHUNKS_DIR, chunk_path

from .inject import BALLAST, FIRST_FULL, FULL_FAULTS
from .plan import Trial
from .scenario import Place, Scenario
from .state import blank_like, changed_by_failed_load, differences, snapshot, state_for, step_of
from .workload import FAILURES, Journal, describe

__all__ = ["check", "tier_entries"]

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

MANIFEST = "tierstore.json"
HIDDEN_PREFIX = ".tierstore-"
LEASE_PREFIX = ".tierstore-lease."


class Findings:
    """What a check found: violations and notes, each a line."""

    def __init__(self):
        self.violations: list[str] = []
        self.notes: list[str] = []

    def as_dict(self) -> dict[str, list[str]]:
        """JSON-ready."""
        return {"violations": self.violations, "notes": self.notes}


def check(scenario: Scenario, place: Place, trial: Trial | None = None) -> dict[str, list[str]]:
    """Check the invariants on ``place`` (see the module docstring) after ``trial``'s job."""
    found = Findings()
    _log_what_moves_copies()
    journal = Journal.read(place.journal)
    if trial is not None and trial.fault in FULL_FAULTS:
        _check_full(trial, journal, found)
    begun = [rest.split()[0] for kind, rest in journal if kind == "begin"]
    saved = [rest.split()[0] for kind, rest in journal if kind == "saved"]
    spoiled = {tuple(rest.split()[:2]) for kind, rest in journal if kind == "spoiled"}
    strict = trial is not None and trial.fault in ("corrupt-source", "vanish-source")
    good: dict[str, set[str]] = {}   # tier -> ids whose copy there loads bitwise
    listed: dict[str, list[str]] = {}  # tier -> ids it lists, newest first
    for tier in scenario.tiers(place, faulty=False):
        good[tier["name"]], listed[tier["name"]] = _check_tier_copies(
            scenario, tier, found, must_load=strict and tier["name"] != "fast")
    _check_kept(scenario, journal, saved, good, listed, spoiled, found)
    if place.mount is not None:
        # The operator frees the space before the job restarts: the store resumes drains as
        # soon as it opens, and on a full disk they would fail again (and rightly say so).
        try:
            os.remove(os.path.join(place.mount, BALLAST))
        except FileNotFoundError:
            pass
    with tierstore.open(scenario.config(place, faulty=False)) as store:
        # The last save's only copy may be one the trial damaged on purpose: then nothing can
        # bring it back, and latest() may be older.
        damaged = {i for _, i in spoiled}
        expect = [cid for cid in saved if cid not in damaged]
        if expect and any(step_of(c) > step_of(expect[-1]) for c in damaged):
            expect = []  # keep made room for a newer save, which the trial then damaged
        _check_latest(scenario, store, begun, expect, found, damaged)
        _check_loads(scenario, store, found)
        _check_recovery(scenario, store, found, damaged)
        complete = {}  # tier -> what is complete there, once nothing runs any more
        for info in store.list():
            for name in info.tiers:
                complete.setdefault(name, set()).add(info.id)
    for tier in scenario.tiers(place, faulty=False):
        # A copy the trial damaged on purpose (a file removed or changed) is no leftover of
        # an interrupted save: gc must not take it for one, nor must the check.
        damaged = {cid for name, cid in spoiled if name == tier["name"]}
        _check_leftovers(tier, complete.get(tier["name"], set()) | damaged, found)
    return found.as_dict()


def _check_full(trial: Trial, journal: list[tuple[str, str]], found: Findings) -> None:
    """Invariant 4, from the job's journal: from the fault on, each failed save is a
    TierFullError naming a tier and left nothing of itself on the first tier; after first-full
    with room to spare (``room >= 0``), the save it struck (the one begun last) committed."""
    struck = begun = None
    for kind, rest in journal:
        words = rest.split()
        if kind == "begin":
            begun = words[0]
        elif kind == "fired":
            struck = begun
        elif struck is None:
            continue
        elif kind == "error" and words[0] == "save":
            cause = rest.split(" ", 2)[2]
            if not re.search(r"TierFullError: \[Errno \d+\] tier '[^']+' is full", cause):
                found.violations.append(f"the save of {words[1]} failed on a full filesystem "
                                        f"without a TierFullError naming the tier: {cause}")
        elif kind == "remains" and words[1:]:
            found.violations.append(f"the failed save of {words[0]} left {words[1:]} on the "
                                    f"first tier")
    if trial.fault == FIRST_FULL and struck is not None and trial.room >= 0 \
            and ("saved", struck) not in journal:
        found.violations.append(f"the save of {struck} failed although the first tier had room "
                                f"for it ({trial.room:+d} pages to spare)")


def _log_what_moves_copies() -> None:
    """In the check's log (kept with a failed trial): every eviction, collection, resumed
    drain and copy of the stores the check opens, so that a failure says what removed or
    moved what."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(threadName)s %(name)s "
                        "%(message)s")
    for name in ("tierstore.retention", "tierstore.gc", "tierstore.recovery",
                 "tierstore.drain"):
        logging.getLogger(name).setLevel(logging.INFO)


def _single_tier(tier: dict) -> dict:
    """A config holding only ``tier``, with nothing that could change it (every = 1, no keep)."""
    return {"tier": [{k: v for k, v in tier.items() if k not in ("every", "keep")}]}


def _load(scenario: Scenario, store: tierstore.Store, cid: str, where: str,
          found: Findings, *, must_load: bool = False) -> bool:
    """Load ``cid``: equal bitwise, or a TierstoreError (a violation when ``must_load``).
    Whether it loaded bitwise."""
    import torch.distributed.checkpoint as dcp

    want = state_for(cid, scenario.seed, scenario.dedup)
    got = blank_like(want)
    before = snapshot(got)
    try:
        dcp.load(got, storage_reader=store.reader(), checkpoint_id=cid)
    except FAILURES as exc:  # classified below
        changed = changed_by_failed_load(got, before)
        if changed:
            found.violations.append(f"{cid} ({where}): a load that failed changed its "
                                    f"destination: {changed}")
        causes = [f[0] for f in getattr(exc, "failures", {}).values()
                  if isinstance(f, tuple)] or [exc]
        clear = all(isinstance(c, tierstore.TierstoreError) for c in causes)
        if must_load:
            found.violations.append(f"{cid} ({where}) does not load: {describe(exc)}")
        elif clear:
            found.notes.append(f"{cid} ({where}) refused: {describe(exc)}")
        else:
            found.violations.append(f"{cid} ({where}) failed to load without a TierstoreError: "
                                    f"{describe(exc)}")
        return False
    wrong = differences(got, want)
    if wrong:
        found.violations.append(f"{cid} ({where}) loads other data: {'; '.join(wrong)}")
    return not wrong


def _check_tier_copies(scenario: Scenario, tier: dict, found: Findings, *,
                       must_load: bool = False) -> tuple[set[str], list[str]]:
    """Invariant 2 on each tier alone: every copy it lists loads bitwise (``must_load``: a
    copy that is refused is a violation too, invariant 6). Returns the ids that loaded bitwise
    and every id the tier lists, newest first."""
    good, ids = set(), []
    with tierstore.open(_single_tier(tier)) as store:
        for info in store.list():
            ids.append(info.id)
            where = f"its copy on tier '{tier['name']}'" + (
                ", after a drain's source was spoiled" if must_load else "")
            if _load(scenario, store, info.id, where, found, must_load=must_load):
                good.add(info.id)
    return good, ids


def _check_kept(scenario: Scenario, journal: list[tuple[str, str]], saved: list[str],
                good: dict[str, set[str]], listed: dict[str, list[str]],
                spoiled: set[tuple[str, str]], found: Findings) -> None:
    """Invariant 5: the newest committed checkpoint loads from some tier alone (or a newer
    one does); what a tier was seen holding is still there unless ``keep`` newer ones are."""
    keep = {t["name"]: t.get("keep") for t in scenario.tiers(
        Place(fast="", slow="", journal="", log=""), faulty=False)}
    committed = set(saved)
    for kind, rest in journal:
        if kind != "holds":
            continue
        name, *ids = rest.split()
        committed.update(ids)
        for cid in ids:
            if (name, cid) in spoiled or cid in listed.get(name, []):
                continue
            # (a copy the trial damaged still counts as one the tier made room for)
            there = set(listed.get(name, [])) | {i for t, i in spoiled if t == name}
            newer = sorted((i for i in there if step_of(i) > step_of(cid)), key=step_of)
            if keep.get(name) is None or len(newer) < keep[name]:
                found.violations.append(
                    f"{cid} was complete on tier '{name}' and is gone although the tier "
                    f"holds {len(newer)} newer checkpoint(s) ({newer}) and keeps "
                    f"{keep.get(name) or 'all'}")
    if committed:
        newest = max(committed, key=step_of)
        if any(cid == newest for _, cid in spoiled):
            return  # the trial damaged it on purpose: its other copies are invariant 6's
        loads = {i for ids in good.values() for i in ids}
        if not any(step_of(i) >= step_of(newest) for i in loads):
            found.violations.append(
                f"the newest committed checkpoint {newest} loads bitwise from no tier alone, "
                f"nor does a newer one (bitwise: "
                f"{ {name: sorted(ids, key=step_of) for name, ids in good.items()} })")


def _check_latest(scenario: Scenario, store: tierstore.Store, begun: list[str],
                  saved: list[str], found: Findings, damaged: set[str] = frozenset()) -> None:
    """Invariant 1."""
    latest = store.latest()
    ids = [info.id for info in store.list()]
    for cid in ids:
        if cid not in begun:
            found.violations.append(f"list() shows {cid}, which the job never saved")
    if saved:
        last = saved[-1]
        if latest is None:
            found.violations.append(f"latest() is None although the save of {last} returned")
        elif step_of(latest) < step_of(last):
            found.violations.append(f"latest() is {latest}, older than {last}, whose save "
                                    f"returned")
        if last not in ids and (latest is None or step_of(latest) <= step_of(last)):
            # (a newer checkpoint may have committed in a save that then failed, and keep
            # made room for it)
            found.violations.append(f"{last} (its save returned) is not in list(): {ids}")
    if latest is not None:
        if latest not in begun:
            found.violations.append(f"latest() is {latest}, which the job never saved")
        if ids and latest != ids[0]:
            found.violations.append(f"latest() is {latest} but list() starts with {ids[0]}")
        # (a checkpoint the trial damaged on purpose may have no good copy left: a clear
        # TierstoreError is all it can give)
        _load(scenario, store, latest, "latest()", found, must_load=latest not in damaged)


def _check_loads(scenario: Scenario, store: tierstore.Store, found: Findings) -> None:
    """Invariant 2 through the store (the reader picks the copies, falling back)."""
    for info in store.list():
        _load(scenario, store, info.id, "through the store", found)


def _check_recovery(scenario: Scenario, store: tierstore.Store, found: Findings,
                    damaged: set[str] = frozenset()) -> None:
    """Invariant 3, first part: the next save, wait() and gc() succeed."""
    import torch.distributed.checkpoint as dcp

    cid = scenario.recovery_id()
    try:
        dcp.save(state_for(cid, scenario.seed, scenario.dedup), storage_writer=store.writer(), checkpoint_id=cid)
    except FAILURES as exc:
        found.violations.append(f"the next save ({cid}) failed: {describe(exc)}")
        return
    for what, call in (("wait()", store.wait), ("gc()", store.gc)):
        try:
            call()
        except FAILURES as exc:
            text = describe(exc)
            if isinstance(exc, tierstore.DrainError) and any(
                    f"'{cid}'" in text for cid in damaged):
                # a resumed drain of a copy the trial damaged on purpose must fail, and say so
                found.notes.append(f"{what} after the next save: {text}")
                continue
            found.violations.append(f"{what} after the next save failed: {text}")
    latest = store.latest()
    if latest != cid:
        found.violations.append(f"after the next save ({cid}) latest() is {latest}")
    info = next((i for i in store.list() if i.id == cid), None)
    if info is None or sorted(info.tiers) != ["fast", "slow"]:
        found.violations.append(f"after wait(), {cid} is on tiers "
                                f"{info.tiers if info else []}, not on both")
    _load(scenario, store, cid, "the next save", found, must_load=True)


# -- what is on a tier -------------------------------------------------------------------------

_filesystems: dict[str, Any] = {}


def _s3(tier: dict) -> tuple[Any, str]:
    """An s3fs filesystem for ``tier`` (one per process: making one costs a few hundred ms)
    and the tier's root path in it."""
    import s3fs

    key = json.dumps(tier["options"], sort_keys=True)
    if key not in _filesystems:
        _filesystems[key] = s3fs.S3FileSystem(skip_instance_cache=True,
                                              use_listings_cache=False, **tier["options"])
    return _filesystems[key], tier["url"].split("://", 1)[1].rstrip("/")


def tier_entries(tier: dict) -> dict[str, list[str]]:
    """Every file on ``tier`` grouped by its top-level entry (checkpoint directory, or hidden
    entry): {entry: [paths relative to the entry]}; an empty directory maps to []."""
    out: dict[str, list[str]] = {}
    if "url" in tier:
        fs, root = _s3(tier)
        for key in fs.find(root):
            top, _, rest = key[len(root) + 1:].partition("/")
            out.setdefault(top, []).append(rest)
        return out
    root = tier["path"]
    for top in os.listdir(root) if os.path.isdir(root) else []:
        path = os.path.join(root, top)
        files = []
        if os.path.isdir(path):
            for d, _, names in os.walk(path):
                files += [os.path.relpath(os.path.join(d, n), path) for n in names]
        else:
            files.append("")
        out[top] = files
    return out


def _read_manifest(tier: dict, cid: str) -> dict[str, Any]:
    if "url" in tier:
        fs, root = _s3(tier)
        raw = fs.cat(f"{root}/{cid}/{MANIFEST}")
    else:
        with open(os.path.join(tier["path"], cid, MANIFEST), "rb") as f:
            raw = f.read()
    return json.loads(raw)


def _leftovers(tier: dict, complete: set[str]) -> list[str]:
    """What a tier holds besides the ``complete`` checkpoints (see the module docstring), one
    line each; a line starting with ``LEASED`` is a prefix holding a writer's lease."""
    name = tier["name"]
    out = []
    entries = tier_entries(tier)
    if tier.get("dedup"):
        out += _unnamed_chunks(tier, entries)
    for top, files in sorted(entries.items()):
        if tier.get("dedup"):
            if top == CHUNKS_DIR:
                continue  # (checked above)
            files = [_logical_name(f) for f in files]
        # A node-local part whose checkpoint's commit this node has not yet learned carries
        # the pending marker until the next save settles it (tierstore.engine.publish): in a
        # complete checkpoint that is a state, not a leftover; an orphan part is no complete
        # checkpoint and is caught below.
        hidden = [f for f in files if any(p.startswith(HIDDEN_PREFIX) for p in f.split("/"))
                  and f != PENDING_PART]
        leased = "LEASED " if any(f.startswith(LEASE_PREFIX) for f in files) else ""
        if top.startswith("."):
            out.append(f"{leased}tier '{name}' still holds {top} after gc()")
        elif top not in complete:
            out.append(f"{leased}tier '{name}' shows {top}/ ({len(files)} files: "
                       f"{sorted(files)[:6]}), which is no complete checkpoint")
        elif hidden:
            out.append(f"{leased}tier '{name}': {top}/ still holds {hidden} after gc()")
        else:
            try:
                named = set(_read_manifest(tier, top)["files"]) | {MANIFEST}
            except FileNotFoundError:
                continue  # a damaged copy (see check): its manifest is what was removed

            stray = sorted(set(files) - named - {PENDING_PART})
            if stray:
                out.append(f"tier '{name}': {top}/ holds files its manifest does not name: "
                           f"{stray}")
    return out


def _logical_name(path: str) -> str:
    """The file a deduplicated tier's recipe stands for (any other path as it is)."""
    directory, _, base = path.rpartition("/")
    parsed = parse_recipe_name(base)
    if parsed is None:
        return path
    return f"{directory}/{parsed.name}" if directory else parsed.name


def _unnamed_chunks(tier: dict, entries: dict[str, list[str]]) -> list[str]:
    """On a deduplicated tier after gc: chunks no recipe names, files in the chunk store that
    are no chunk (a write a killed writer left). On an object store, where a chunk goes only
    once two passes well apart found it unnamed, the unnamed ones are only noted (LEASED)."""
    named: set[str] = set()
    for top, files in entries.items():
        for f in files:
            if top != CHUNKS_DIR and parse_recipe_name(f.rpartition("/")[2]) is not None:
                raw = _read_file(tier, f"{top}/{f}")
                named |= {chunk_path(d).split("/", 1)[1] for _, d in json.loads(raw)["chunks"]}
    stored = [f for f in entries.get(CHUNKS_DIR, []) if not f.startswith(".")]
    unnamed = sorted(set(stored) - named)
    if not unnamed:
        return []
    leased = "LEASED " if "url" in tier else ""
    return [f"{leased}tier '{tier['name']}' still holds {len(unnamed)} chunk files no recipe "
            f"names after gc(): {unnamed[:3]}"]


def _read_file(tier: dict, rel: str) -> bytes:
    if "url" in tier:
        fs, root = _s3(tier)
        return fs.cat(f"{root}/{rel}")
    with open(os.path.join(tier["path"], rel), "rb") as f:
        return f.read()


@contextlib.contextmanager
def _a_day_later(days: int = 1) -> Iterator[None]:
    """The object-store backends' lease clock (``tierstore_plugins.leases``, which both the
    ``fsspec`` and the ``obstore`` backend judge leases by), and a deduplicated tier's
    collector's, ``days`` days ahead: every lease has expired (this process is a fresh checker;
    no writer of its own holds one), and an unnamed chunk noted by a pass a day before goes."""
    from tierstore_plugins import leases
    from tierstore.tiers import chunks

    class Later:
        def __getattr__(self, attr):
            return getattr(time, attr)

        @staticmethod
        def time() -> float:
            return time.time() + 86_400 * days

    with mock.patch.object(leases, "time", Later()), mock.patch.object(chunks, "time", Later()):
        yield


def _check_leftovers(tier: dict, complete: set[str], found: Findings) -> None:
    """Invariant 3, second part: after gc, only complete checkpoints on the tier (on an object
    store, once the leases of writers that are gone have expired)."""
    left = _leftovers(tier, complete)
    found.violations += [line for line in left if not line.startswith("LEASED ")]
    leased = [line[len("LEASED "):] for line in left if line.startswith("LEASED ")]
    if leased:
        found.notes += [f"kept by a writer's lease until it expires: {line}" for line in leased]
        with _a_day_later(), tierstore.open(_single_tier(tier)) as store:
            store.gc()
            complete = {info.id for info in store.list()}
        if tier.get("dedup"):  # the second of the two passes an unnamed chunk waits for
            with _a_day_later(2), tierstore.open(_single_tier(tier)) as store:
                store.gc()
        found.violations += [f"a day later, {line.removeprefix('LEASED ')}"
                             for line in _leftovers(tier, complete)]
