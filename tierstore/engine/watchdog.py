"""The opt-in watchdog (``[store] watchdog = N``): when a save or load of this process made no
progress for N seconds, log the stack of every thread once, and emit a ``stalled`` event.

Progress is any phase or event of the store (a file written or read, a commit, a peer
transfer...). A save is in flight from ``writer.reset`` until this rank's part of it is over
(``finish`` on the coordinator, ``write_data`` elsewhere, or a failure); a load from
``reader.reset`` until ``read_data`` returns. That covers the waits inside DCP's collectives
between those calls, which is where a rank that died or hung elsewhere leaves the others.
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
import time
import traceback

from tierstore.events import Event, EventKind
from tierstore.plugin.host import PluginHost, hookimpl

__all__ = ["Watchdog"]

log = logging.getLogger("tierstore.watchdog")


class Watchdog:
    """Watches the saves and loads of one store (a plugin of its host: phases and events are
    its signs of progress). Does nothing until :meth:`start` with a positive period."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ops: dict[int, tuple[str, float]] = {}  # token -> (what, started)
        self._tokens = itertools.count(1)
        self._progress = time.monotonic()
        self._reported = False  # the current stall was logged
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._host: PluginHost | None = None
        self._rank = 0
        self.seconds = 0.0

    def start(self, seconds: float, host: PluginHost, rank: int) -> None:
        """Watch with a period of ``seconds`` (0: stay off)."""
        if seconds <= 0 or self._thread is not None:
            return
        self.seconds, self._host, self._rank = seconds, host, rank
        self._thread = threading.Thread(target=self._run, name="tierstore-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (the store closes)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # -- what the writer and reader tell it ----------------------------------------------------
    def begin(self, what: str) -> int:
        """A save or load (``what``, e.g. "save of 'step-3'") starts; returns its token."""
        with self._lock:
            token = next(self._tokens)
            self._ops[token] = (what, time.monotonic())
            self._progressed()
            return token

    def end(self, token: int | None) -> None:
        """The operation of ``token`` is over (None, or a token already ended: nothing)."""
        if token is None:
            return
        with self._lock:
            self._ops.pop(token, None)
            self._progressed()

    # -- progress: every phase and event of the store ------------------------------------------
    @hookimpl
    def tierstore_phase(self, phase, checkpoint_id, tier, rank, detail) -> None:
        with self._lock:
            self._progressed()

    @hookimpl
    def tierstore_event(self, event: Event) -> None:
        if event.kind != EventKind.STALLED:
            with self._lock:
                self._progressed()

    def _progressed(self) -> None:
        self._progress = time.monotonic()
        self._reported = False

    # -- the watching thread -------------------------------------------------------------------
    def _run(self) -> None:
        tick = min(1.0, self.seconds / 4)
        while not self._stop.wait(tick):
            with self._lock:
                idle = time.monotonic() - self._progress
                if not self._ops or self._reported or idle < self.seconds:
                    continue
                self._reported = True
                ops = list(self._ops.values())
            self._report(ops, idle)

    def _report(self, ops: list[tuple[str, float]], idle: float) -> None:
        doing = ", ".join(f"{what} (running {time.monotonic() - started:.0f} s)"
                          for what, started in ops)
        names = {t.ident: t.name for t in threading.enumerate()}
        stacks = []
        for ident, frame in sys._current_frames().items():
            if ident == threading.get_ident():
                continue  # the watchdog itself
            stacks.append(f"--- thread {names.get(ident, ident)}:\n"
                          + "".join(traceback.format_stack(frame)))
        log.warning("rank %d: %s made no progress for %.0f s (watchdog = %s s); a rank may have "
                    "died or hung, or a tier stopped answering. Stacks of every thread:\n%s",
                    self._rank, doing, idle, self.seconds, "\n".join(stacks))
        if self._host is not None:
            self._host.event(Event(EventKind.STALLED, rank=self._rank, seconds=idle,
                                   detail={"operations": [w for w, _ in ops]}))
