"""Saves in flight: one at a time per store, their step numbers, and the tokens gc must spare.

``dcp.async_save`` runs each save in a new thread (or hands it to DCP's checkpoint process). Two
saves of one store must never overlap: the second would overwrite the staging buffers the first
is still writing from, and their collectives would interleave on the same process group. So a
new save waits until the thread carrying the previous one has finished.

A save is *carried* by a thread: for ``dcp.save`` the caller's; for ``async_save`` with the
thread executor, DCP's executor thread (known when it calls ``writer.reset``); with the process
executor, the thread that hands the writer to the checkpoint process and waits for its answer
(known when the writer is pickled). Between staging and that moment the save is *pending*.

When a carried save is over depends on its carrier. DCP's executor thread ends with the save it
carries (after DCP's last collectives of it), so its end is the save's. The caller's thread of a
``dcp.save`` lives on: that save is over when its writer's last call returns or fails (``finish``
on the coordinator, ``write_data`` on the other ranks: :meth:`SaveSlot.over`), or, where DCP
gives up on it without calling the writer again (another rank failed), when the carrier has
left DCP's save call (its stack says so), whichever comes first.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from types import CodeType
from typing import Any, Callable

from tierstore.format.ids import step_of

__all__ = ["SaveSlot", "SaveLedger", "save_call_watch"]

log = logging.getLogger("tierstore")

#: how long a staged save may stay without a carrier before it is presumed never started
_PENDING_GRACE_S = 60.0


class SaveSlot:
    """Serialises the saves of one store (see the module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._carrier: threading.Thread | None = None
        # Whether the carrier ends with its save (DCP's executor thread of a staged async
        # save); otherwise it is the caller of a dcp.save, which lives on (see the module).
        self._ends_with_thread = False
        # Where the carrier entered DCP's save call (see _dcp_entry), None: not found
        self._entry: tuple[int, CodeType] | None = None
        self._pending_since: float | None = None  # staged, carrier not known yet
        self._staging = False  # a staging still copying (no grace runs out meanwhile)
        # The thread that staged the pending save (training's): it never carries it (DCP
        # hands it to another thread), so a save it starts meanwhile is a new one that waits.
        self._staged_by: threading.Thread | None = None

    def _busy(self) -> bool:
        me = threading.current_thread()
        if self._staging:
            return True
        if self._pending_since is not None:
            if time.monotonic() - self._pending_since > _PENDING_GRACE_S:
                log.warning("a staged save never started (DCP did not call the writer); "
                            "going on with the next save")
                self._pending_since = None
                return False
            return True
        carrier = self._carrier
        if carrier is None or carrier is me:
            return False
        if not carrier.is_alive():
            return False
        if not self._ends_with_thread and self._entry is not None \
                and not _still_inside(carrier, self._entry):
            # dcp.save returned (or raised) without a last call to the writer: over.
            self._carrier, self._entry = None, None
            return False
        return True

    def wait_idle(self) -> float:
        """Block until no save is in flight (the caller's own thread does not count); return
        the seconds waited."""
        started = time.perf_counter()
        with self._cond:
            while self._busy():
                self._cond.wait(0.01)
        return time.perf_counter() - started

    def staged(self) -> float:
        """``stage()``: wait for the previous save, then mark a save staging (pending until
        :meth:`staging_done`). Returns the seconds waited."""
        with self._cond:
            waited = self.wait_idle()
            self._staging = True
            self._pending_since = None
            self._carrier = None
            self._staged_by = threading.current_thread()
            return waited

    def carried_here(self) -> float:
        """The current thread carries a save: the one staged before (async_save) or a new one
        (dcp.save, which waits for any save in flight first). Returns the seconds waited."""
        with self._cond:
            me = threading.current_thread()
            waited = 0.0
            staged_save = self._staging or self._pending_since is not None
            new_save = not staged_save or me is self._staged_by
            if new_save:
                # A new save (not the staged one: its stager's thread never carries it) waits
                # for the one in flight, staged or carried (a lazy staging takes a while).
                waited = self.wait_idle()
            self._staging = False
            self._pending_since = None
            self._carrier = me
            # The staged save is carried by DCP's thread, which ends with it; a new save by
            # the caller of dcp.save, whose thread goes on once the save is over.
            self._ends_with_thread = not new_save
            self._entry = None if self._ends_with_thread else _dcp_entry()
            self._cond.notify_all()
            return waited

    def over(self) -> None:
        """The save this thread carries is over: its writer's last call of it returned or
        failed. Nothing for a save carried by DCP's executor thread, which is over when that
        thread ends (DCP's last collectives of the save come after the writer's last call)."""
        with self._cond:
            if self._carrier is threading.current_thread() and not self._ends_with_thread:
                self._carrier, self._entry = None, None
                self._cond.notify_all()

    def staging_done(self) -> None:
        """The staging finished: the save is pending until a thread carries it, and the grace
        for DCP to start it counts from now (a lazy or budgeted staging takes as long as it
        takes; nothing presumes it abandoned meanwhile)."""
        with self._cond:
            if self._staging:
                self._staging = False
                self._pending_since = time.monotonic()
                self._cond.notify_all()

    def release_pending(self) -> None:
        """A staged save will not start (its staging failed)."""
        with self._cond:
            self._staging = False
            self._pending_since = None
            self._cond.notify_all()


#: the module of DCP's save calls (``dcp.save``, the deprecated ``save_state_dict``)
_DCP_SAVER = "torch.distributed.checkpoint.state_dict_saver"


def _dcp_entry() -> tuple[int, CodeType] | None:
    """Where this thread entered DCP's save call: the depth (from the thread's first frame)
    and code of its outermost frame in DCP's saver module; None when the writer was called
    from elsewhere. Kept as depth and code, not the frame, whose locals (the state dict) must
    not outlive the save."""
    frames = _stack(sys._getframe(1))  # not this frame: the list would hold it in a cycle
    try:
        for depth, frame in enumerate(frames):
            if frame.f_globals.get("__name__") == _DCP_SAVER:
                return depth, frame.f_code
        return None
    finally:
        del frames


def _still_inside(thread: threading.Thread, entry: tuple[int, CodeType]) -> bool:
    """Whether ``thread`` is still in the call it entered DCP's save by (``entry``). When in
    doubt (no stack to look at), yes: the save stays in flight until its writer says so."""
    top = sys._current_frames().get(thread.ident)  # type: ignore[arg-type]
    if top is None:
        return True
    depth, code = entry
    frames = _stack(top)
    # Another dcp.save of the same thread at the same depth reads as the same one: harmless,
    # that thread is in a save again.
    return len(frames) > depth and frames[depth].f_code is code


def _stack(top: Any) -> list[Any]:
    """The frames from a thread's first to ``top``."""
    frames = []
    while top is not None:
        frames.append(top)
        top = top.f_back
    frames.reverse()
    return frames


def save_call_watch() -> Callable[[], bool]:
    """For a writer call made inside DCP's save: a callable that says whether that save call
    is over (it returned or raised, or its thread ended). DCP's last collectives of a save
    come after its ``finish``: once over, whatever the save was to commit is committed."""
    thread, entry = threading.current_thread(), _dcp_entry()
    return lambda: not thread.is_alive() or (entry is not None
                                             and not _still_inside(thread, entry))


class SaveLedger:
    """The saves of one store: the slot that serialises them, how many have started (the step
    number of ids without one, and a save's sequence number for background jobs), and which
    save each thread is running (gc spares their files)."""

    def __init__(self) -> None:
        self.slot = SaveSlot()
        self._lock = threading.Lock()
        self._saves = 0
        # thread ident -> (token of the save that thread is running, what ends its hold on
        # its staging directory)
        self._in_flight: dict[int, tuple[str, list[Callable[[], None]]]] = {}
        #: the staging of the newest save (a ``StagingJob``; the optimizer hook waits on it)
        self.staging: Any = None
        #: the spill of the newest budgeted save (``tierstore.dcp.spill.Spill``), removed when
        #: that save is over
        self._spill: Any = None

    def wait_staging(self, timeout: float | None = None) -> float:
        """Wait until the newest save's staging has taken every value (``StagingJob.fence``);
        the seconds waited."""
        job = self.staging
        return 0.0 if job is None else job.fence(timeout)

    def keep_spill(self, spill: Any) -> None:
        """Own ``spill`` until :meth:`release_spill` (the save that wrote it is over)."""
        with self._lock:
            previous, self._spill = self._spill, spill
        if previous is not None:
            previous.release()

    def release_spill(self, directory: str | None = None) -> bool:
        """Remove the spill of the save that is over (only the one in ``directory``, when
        given); returns whether there was one to remove."""
        with self._lock:
            spill = self._spill
            if spill is None or (directory is not None and spill.directory != directory):
                return False
            self._spill = None
        spill.release()
        return True

    @property
    def save_seq(self) -> int:
        """How many saves this store has started (a save's number, for background jobs)."""
        return self._saves

    def step_for(self, checkpoint_id: str) -> int:
        """Count a new save; return the step number ``every`` is counted on: the id's trailing
        integer, else the count of saves made through this store (from 1)."""
        with self._lock:
            self._saves += 1
            count = self._saves
        step = step_of(checkpoint_id)
        return count if step is None else step

    def save_running(self, token: str | None) -> None:
        """Record that this thread now runs the save ``token`` (None: it runs none).

        DCP gives a writer no call when a save fails on another rank, so a save counts as over
        when its thread starts another one or ends; that is what lets gc collect its files (and
        what releases the save's hold on its staging directory, :meth:`hold_until_over`)."""
        with self._lock:
            ident = threading.get_ident()
            previous = self._in_flight.get(ident)
            if previous is not None and previous[0] == token:
                return
            self._in_flight.pop(ident, None)
            if token is not None:
                self._in_flight[ident] = (token, [])
        if previous is not None:
            _release_all(previous[1])

    def hold_until_over(self, release: Callable[[], None]) -> None:
        """Call ``release`` when the save this thread runs is over (see :meth:`save_running`)."""
        with self._lock:
            entry = self._in_flight.get(threading.get_ident())
            if entry is not None:
                entry[1].append(release)
                return
        release()

    def tokens_in_flight(self) -> set[str]:
        """Tokens of saves still running in live threads of this process (the saves of threads
        that ended are over: their holds are released here)."""
        alive = {t.ident for t in threading.enumerate()}
        with self._lock:
            over = [ident for ident in self._in_flight if ident not in alive]
            ended = [self._in_flight.pop(ident)[1] for ident in over]
            tokens = {tok for tok, _ in self._in_flight.values()}
        for releases in ended:
            _release_all(releases)
        return tokens


def _release_all(releases: list[Callable[[], None]]) -> None:
    for release in releases:
        try:
            release()
        except Exception:  # a lock that is gone already; nothing to hold any more
            log.exception("releasing a save's staging directory failed")
