"""Emergency checkpoint on preemption (SIGTERM).

A scheduler that preempts a job sends SIGTERM and waits a grace period before SIGKILL. The
signal handler only records the request; the training loop asks, once per step, whether any rank
got it (a tiny all-reduce, so that every rank answers the same at the same step), and if so
saves and exits::

    preemption = store.preemption()           # collective; installs the SIGTERM handler
    for step in range(start, steps):
        train_step()
        if preemption.requested_by_any():     # collective, every rank, every step
            preemption.save_and_exit(state_dict, f"step-{step}")
        ...

``save_and_exit`` lets the save in flight finish, saves the current state synchronously to the
fastest tier (no drains: there is no time), commits it, closes the store without waiting for
older drains (the next ``tierstore.open`` resumes them) and ends the process at once (its
``atexit`` handlers run; ``finally`` blocks above the call do not).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterable, NoReturn

import torch.distributed as dist

from tierstore.engine.context import StoreContext
from tierstore.engine.saves import SaveSlot
from tierstore.events import Event, EventKind, Phase
from tierstore.transport.collectives import all_reduce_max, make_store_group

__all__ = ["Preemption"]

log = logging.getLogger("tierstore")


class Preemption:
    """Turns SIGTERM into an emergency checkpoint at a step all ranks agree on.

    Build it with ``store.preemption()`` (on every rank, from the main thread). It gets the
    store's context, its save slot, a factory of emergency writers and the store's ``close``."""

    def __init__(self, context: StoreContext, slot: SaveSlot, emergency_writer: Callable[[], Any],
                 close_store: Callable[..., None], signals: Iterable[int] = (signal.SIGTERM,)):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("store.preemption() installs signal handlers, which Python "
                               "allows only in the main thread; call it there")
        self._context, self._slot = context, slot
        self._emergency_writer, self._close_store = emergency_writer, close_store
        self._signals = tuple(signals)
        self._received: int | None = None
        self._previous = {s: signal.signal(s, self._on_signal) for s in self._signals}
        # A group of its own: the per-step agreement must not interleave with the collectives
        # of an async save running on store.process_group in DCP's thread.
        self._group = make_store_group(context.groups.main, context.config.collective_timeout)

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Only record: the step in progress finishes, then the loop asks requested_by_any().
        self._received = signum

    @property
    def requested(self) -> bool:
        """Whether this process received one of the signals (no collective)."""
        return self._received is not None

    def requested_by_any(self) -> bool:
        """Whether any rank received the signal. Collective: every rank calls it at every step,
        and all get the same answer. When a rank is gone, it raises ``RanksLostError``: at once
        if this process got the signal (a launcher such as torchrun stops the survivors of a
        dead rank with SIGTERM, and the handler only records it; naming the lost ranks would
        keep the process for the roll call's 30 s), else after naming them."""
        return bool(all_reduce_max(1 if self.requested else 0, self._group,
                                   stop=lambda: self.requested))

    def save(self, state_dict: dict[str, Any], checkpoint_id: str) -> None:
        """Wait for the save in flight, then save ``state_dict`` to the fastest tier and commit
        it (collective: every rank calls it with the same id)."""
        import torch.distributed.checkpoint as dcp

        ctx = self._context
        fastest = ctx.tiers[0].name
        ctx.host.phase(Phase.EMERGENCY_SAVE, checkpoint_id, fastest, ctx.rank)
        started = time.perf_counter()
        self._slot.wait_idle()
        dcp.save(state_dict, storage_writer=self._emergency_writer(),
                 checkpoint_id=checkpoint_id, process_group=ctx.groups.main)
        ctx.host.event(Event(EventKind.EMERGENCY_SAVED, checkpoint_id, fastest, ctx.rank,
                             time.perf_counter() - started, detail={"signal": self._received}))
        log.warning("emergency checkpoint %s committed on tier '%s'", checkpoint_id, fastest)

    def save_and_exit(self, state_dict: dict[str, Any], checkpoint_id: str,
                      exit_code: int = 0) -> NoReturn:
        """``save``, then close the store without waiting for older drains (they are listed on
        stderr and resumed by the next ``tierstore.open``), run the process's ``atexit``
        handlers, flush stdout and stderr, and end the process at once with ``exit_code``
        (``os._exit``).

        At once, because the interpreter's own teardown (freeing every module, thread and
        tensor one by one) took 1.4 s after a committed emergency save in a 4-rank job: time
        that the scheduler's grace period and the job's restart both wait for, with the
        checkpoint already safe. So ``finally`` blocks and context managers around this call do
        not run; ``atexit`` handlers do (logging's flush among them)."""
        self.save(state_dict, checkpoint_id)
        self.close()
        self._close_store(wait=False)
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed or broken stream: nothing more to say
                pass
        os._exit(exit_code)

    def close(self) -> None:
        """Put the previous signal handlers back and release the agreement group."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        if self._group is not None and dist.is_initialized():
            dist.destroy_process_group(self._group)
        self._group = None
