"""The job a trial runs (in a forked child, with the fault armed), and its journal.

The job saves ``step-1`` .. ``step-<n>`` through a two-tier store, waits for the drains, loads
every checkpoint ``list()`` shows, verifies the newest and collects garbage, as a training job
and its operator would. A failing step is written down and the job goes on, as a job that
catches the error and carries on would. The journal is what the checker trusts about the job:
a save counts as returned only once its ``saved`` line is there.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import warnings
from typing import Iterator

import torch
from torch.distributed.checkpoint.api import CheckpointException

import tierstore

from . import inject
from .inject import Injector
from .scenario import Place, Scenario
from .state import blank_like, changed_by_failed_load, differences, snapshot, state_for

__all__ = ["FAILURES", "Journal", "checkpoint_sizes", "describe", "remains_of", "run_job"]

#: What a failed step raises: DCP's CheckpointException is a BaseException, not an Exception.
FAILURES = (Exception, CheckpointException)

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


class Journal:
    """What the job did, one line per event, appended with ``os.write`` so that a SIGKILL
    loses no line already written.

    Lines: ``begin ID``, ``saved ID`` (the save returned), ``fired WHAT`` (the fault struck),
    ``killed WHAT`` (where the first process of a restarted job died),
    ``error OPERATION ID TYPE: MESSAGE`` (a step failed), ``wrong ID DIFFERENCES`` (a load
    returned other data than was saved), ``remains ID ENTRIES`` (what a failed save left of
    itself on the first tier, right after it failed), ``timed ID START END`` (wall clock of a
    save that returned), ``holds TIER ID...`` (what ``list()`` showed complete on a tier at a
    quiet point: after a ``wait()`` that succeeded, before an operator's command), and what the
    new kinds saw: ``spoiled TIER ID FILE FAULT`` (a copy the fault damaged on purpose),
    ``stalled START END``, ``cli ...``, ``broken WHAT`` (a promise the job saw broken)."""

    def __init__(self, path: str):
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def write(self, *words: object) -> None:
        """Append one line (newlines in the words are flattened)."""
        line = " ".join(str(w) for w in words).replace("\n", " | ")
        os.write(self._fd, (line + "\n").encode())

    def close(self) -> None:
        """Close the file."""
        os.close(self._fd)

    @staticmethod
    def read(path: str) -> list[tuple[str, str]]:
        """The lines of the journal at ``path`` as (kind, rest) pairs; none when absent."""
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            return []
        return [(kind, rest) for kind, _, rest in (line.partition(" ") for line in lines)]


def describe(exc: BaseException) -> str:
    """``Type: message`` of an exception; for DCP's CheckpointException (whose message is a
    traceback), of what it wraps."""
    inner = [f[0] for f in getattr(exc, "failures", {}).values() if isinstance(f, tuple)]
    if inner:
        text = f"{type(exc).__name__} <- " + "; ".join(f"{type(e).__name__}: {e}" for e in inner)
    else:
        text = f"{type(exc).__name__}: {exc}"
    return text[:1000]


@contextlib.contextmanager
def step(injector: Injector, journal: Journal, operation: str,
         checkpoint_id: str | None = None) -> Iterator[None]:
    """Run one step of the job as ``operation``: a failure is journalled, and the job goes on."""
    injector.operation = operation
    try:
        yield
    except FAILURES as exc:  # the job carries on, as a training job would
        journal.write("error", operation, checkpoint_id or "-", describe(exc))


def remains_of(tier_root: str, cid: str) -> list[str]:
    """What a save of ``cid`` left on the tier at ``tier_root`` (a directory) without
    committing: its hidden staging directory, or a ``cid`` directory without a manifest."""
    try:
        names = os.listdir(tier_root)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith(f".tierstore-tmp.{cid}.") or (
        n == cid and not os.path.exists(os.path.join(tier_root, n, "tierstore.json"))))


@contextlib.contextmanager
def saving(journal: Journal, place: Place, cid: str) -> Iterator[None]:
    """Journal a save of ``cid``: ``begin``, then ``saved`` when it returns, or what it left
    of itself on the first tier when it fails (the failure goes on to ``step``)."""
    journal.write("begin", cid)
    started = time.time()
    try:
        yield
    except FAILURES:
        journal.write("remains", cid, *remains_of(place.fast, cid))
        raise
    journal.write("saved", cid)
    journal.write("timed", cid, f"{started:.3f}", f"{time.time():.3f}")


def holds(store: tierstore.Store, journal: Journal) -> None:
    """Write down which checkpoints each tier holds complete now (``holds`` lines): what the
    checker then expects to find there, unless ``keep`` made room for newer ones."""
    by_tier: dict[str, list[str]] = {}
    for info in store.list():
        for name in info.tiers:
            by_tier.setdefault(name, []).append(info.id)
    for name, ids in sorted(by_tier.items()):
        journal.write("holds", name, *ids)


def spoil_a_copy(place: Place, cid: str, journal: Journal) -> None:
    """Flip a byte in the middle of one data file of ``cid`` on the first tier (the ``ops``
    variant: something for ``scrub --repair`` to repair)."""
    root = os.path.join(place.fast, cid)
    names = sorted(n for n in os.listdir(root) if n.endswith(".distcp")) \
        if os.path.isdir(root) else []
    if not names:
        return
    with open(os.path.join(root, names[0]), "r+b") as f:
        size = f.seek(0, 2)
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    journal.write("spoiled", "fast", cid, names[0], "scrub-target")


def operator(store: tierstore.Store, scenario: Scenario, journal: Journal, place: Place,
             injector: Injector) -> None:
    """The ``ops`` variant: a copy on the first tier goes bad, the operator runs ``scrub
    --repair`` and promotes the newest checkpoint to the slow tier (which does not take it by
    ``every``), against the object store under its fault."""
    ids = scenario.save_ids()
    with step(injector, journal, "scrub"):
        spoil_a_copy(place, ids[-2], journal)
        holds(store, journal)
        report = store.scrub(repair=True)
        journal.write("scrubbed", f"checked={report.checked}", f"bad={len(report.bad)}",
                      f"repaired={len(report.repaired)}", f"unrepaired={len(report.unrepaired)}")
    with step(injector, journal, "promote", ids[-1]):
        holds(store, journal)
        store.promote(ids[-1], "slow")
        journal.write("promoted", ids[-1])


def save(store: tierstore.Store, scenario: Scenario, journal: Journal, cid: str,
         place: Place) -> None:
    """Save ``cid``; an async save changes the state as soon as ``async_save`` returns (the
    checkpoint must hold the values of the call, not the changed ones)."""
    import torch.distributed.checkpoint as dcp

    with saving(journal, place, cid):
        state = state_for(cid, scenario.seed, scenario.dedup)
        if scenario.async_saves:
            future = dcp.async_save(state, storage_writer=store.writer(), checkpoint_id=cid)
            with torch.no_grad():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        value.add_(1)
            future.result()
        else:
            dcp.save(state, storage_writer=store.writer(), checkpoint_id=cid)


def emergency_save(store: tierstore.Store, scenario: Scenario, journal: Journal,
                   place: Place) -> None:
    """Save the emergency checkpoint as a preempted job does (no signal handler needed)."""
    cid = scenario.emergency_id()
    with saving(journal, place, cid):
        preemption = store.preemption(signals=())
        try:
            preemption.save(state_for(cid, scenario.seed, scenario.dedup), cid)
        finally:
            preemption.close()


def checkpoint_sizes(scenario: Scenario, directory: str) -> dict[str, int]:
    """What each checkpoint of the job takes on its first tier, in bytes of allocated blocks:
    each saved once into a tier like it (same backend and settings) at ``directory``, on the
    first tier's own filesystem, and removed again (first-full trials; in a forked child)."""
    import torch.distributed.checkpoint as dcp

    config = scenario.config(Place(fast=directory, slow="", journal="", log=""), faulty=False)
    fast = {k: v for k, v in config["tier"][0].items() if k not in ("every", "keep")}
    sizes = {}
    with tierstore.open({"store": config["store"], "tier": [fast]}) as store:
        for cid in scenario.first_tier_saves():
            dcp.save(state_for(cid, scenario.seed, scenario.dedup), storage_writer=store.writer(),
                     checkpoint_id=cid)
            sizes[cid] = sum(os.stat(os.path.join(d, n)).st_blocks * 512
                             for d, _, names in os.walk(os.path.join(directory, cid))
                             for n in names)
    shutil.rmtree(directory)
    return sizes


def load_all(store: tierstore.Store, scenario: Scenario, journal: Journal,
             injector: Injector) -> None:
    """Load every checkpoint ``list()`` shows and compare it with what was saved."""
    import torch.distributed.checkpoint as dcp

    infos = []
    with step(injector, journal, "load"):
        infos = store.list()
    for info in infos:
        with step(injector, journal, "load", info.id):
            want = state_for(info.id, scenario.seed, scenario.dedup)
            got = blank_like(want)
            before = snapshot(got)
            try:
                dcp.load(got, storage_reader=store.reader(), checkpoint_id=info.id)
            except FAILURES:
                # A failed load must leave the destination as it found it (invariant 7).
                changed = changed_by_failed_load(got, before)
                if changed:
                    journal.write("broken", f"a load of {info.id} that failed changed its "
                                  f"destination: {changed}")
                raise
            wrong = differences(got, want)
            if wrong:
                journal.write("wrong", info.id, "; ".join(wrong))


def run_job(scenario: Scenario, place: Place, injector: Injector, *, prepare: bool) -> None:
    """Run the job (``prepare``: only the part of the first process, which saves up to
    ``restart_after`` and is to be killed in it; otherwise the rest, from a fresh store)."""
    journal = Journal(place.journal)
    injector.journal, injector.place, injector.scenario = journal, place, scenario
    # The first process's kill is part of the job's past, not the trial's fault.
    injector.on_fire = lambda what: journal.write("killed" if prepare else "fired", what)
    ids = scenario.save_ids()
    first = scenario.restart_after or 0
    store = None
    with step(injector, journal, "open"):
        store = tierstore.open(scenario.config(place, faulty=True), plugins=[injector, inject])
    if store is None:
        return
    if prepare:
        # Waiting for the drains after each save keeps the point where this process dies
        # the same in every run, and so what it leaves behind.
        for cid in ids[:first]:
            with step(injector, journal, "save", cid):
                save(store, scenario, journal, cid, place)
            with step(injector, journal, "wait"):
                store.wait()
    else:
        if first:  # what the killed process left: its drains resume at open, then gc
            with step(injector, journal, "wait"):
                store.wait()
                holds(store, journal)
            with step(injector, journal, "gc"):
                store.gc()
        for cid in ids[first:]:
            with step(injector, journal, "save", cid):
                save(store, scenario, journal, cid, place)
            if scenario.variant == "stall":
                time.sleep(0.4)  # a training step between saves: drains keep up, and stall
            if scenario.wait_each:
                with step(injector, journal, "wait"):
                    store.wait()
                    holds(store, journal)
        if scenario.emergency:
            with step(injector, journal, "save", scenario.emergency_id()):
                emergency_save(store, scenario, journal, place)
        with step(injector, journal, "wait"):
            store.wait()
            holds(store, journal)
        if scenario.variant == "ops":
            operator(store, scenario, journal, place, injector)
        load_all(store, scenario, journal, injector)
        with step(injector, journal, "verify"):
            latest = store.latest()
            report = store.verify(latest) if latest else None
            if report is not None and not report.ok:
                journal.write("error", "verify", latest, f"problems: {report}")
        with step(injector, journal, "gc"):
            store.gc()
    with step(injector, journal, "close"):
        store.close()
    journal.close()
