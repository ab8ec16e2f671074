"""One save's staging as an object: what ``Stager.start`` returns and what the core waits on.

A :class:`StagingJob` copies a state dict off the training tensors, either before ``start``
returns (eager) or on a thread of its own (lazy), and ends with the staged tree, which DCP then
saves. It has two moments:

- **copied** (:meth:`StagingJob.fence`): every tensor's values have been taken (into host
  buffers, or written out in waves); from then on training may change its tensors. The
  optimizer hook (``Store.hook_optimizer``) waits for this, and nothing else.
- **done** (:attr:`StagingJob.future`): the staged tree is ready for DCP (with a memory budget,
  the last wave is written too). DCP's ``staging_completion`` is this future.

A lazy job also guards the promise that the checkpoint holds the values of the call: it notes
each source tensor's version counter (which every in-place change bumps) when the job starts and
compares after copying it; a tensor changed before its copy was taken fails the job with a
:class:`StagingError` that says so, rather than saving a mixture of two steps.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from tierstore.errors import StagingError

if TYPE_CHECKING:  # torch is imported where a copy runs: `tierstore ls` loads no torch
    import torch

__all__ = ["StagingJob", "StagingStats", "StagingWorker", "CopyBatch", "check_unchanged",
           "run_copies", "split_copies", "watch"]

log = logging.getLogger("tierstore.staging")

#: bytes copied between two checks of the source tensors' versions (and, on a thread, between
#: two chances for the training thread to take the GIL)
COPY_BATCH_BYTES = 64 << 20


@dataclass
class StagingStats:
    """What a finished job reports (the ``staged`` event carries it)."""

    #: bytes of tensor data copied
    nbytes: int = 0
    #: seconds from the start of the copy to its end (the stall, when eager)
    seconds: float = 0.0
    #: whether the buffers of the save before were reused
    reused: bool = False
    #: waves the copy took (1 without a memory budget)
    waves: int = 1
    #: the most bytes of staging buffers held at once
    buffer_bytes: int = 0
    #: plain data the core keeps beside the staged tree (the spilled records of a budgeted save)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class CopyBatch:
    """Some copies of a job: destination and source tensors, and, to check that the sources
    were not changed in place before they were copied, what to watch (the source, or the
    DTensor it is the local tensor of) with its version at the call (empty: not checked)."""

    dsts: list[torch.Tensor]
    srcs: list[torch.Tensor]
    versions: list[int] = field(default_factory=list)
    watched: list[Any] = field(default_factory=list)


def watch(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor],
          watched: Sequence[Any] | None = None) -> CopyBatch:
    """One batch of copies whose sources are checked: ``watched`` (default: the sources)
    with their versions now."""
    watched = list(srcs if watched is None else watched)
    return CopyBatch(list(dsts), list(srcs), [w._version for w in watched], watched)


def split_copies(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor],
                 watched: Sequence[Any] | None = None,
                 batch_bytes: int = COPY_BATCH_BYTES) -> list[CopyBatch]:
    """Cut the pairs into checked batches of about ``batch_bytes`` (in order)."""
    watched = srcs if watched is None else watched
    batches: list[CopyBatch] = []
    start, size = 0, 0
    for n, d in enumerate(dsts):
        size += d.nbytes
        if size >= batch_bytes:
            batches.append(watch(dsts[start:n + 1], srcs[start:n + 1], watched[start:n + 1]))
            start, size = n + 1, 0
    if start < len(dsts):
        batches.append(watch(dsts[start:], srcs[start:], watched[start:]))
    return batches


def check_unchanged(batch: CopyBatch, describe: Callable[[Any], str]) -> None:
    """Raise StagingError when a watched source of ``batch`` was changed in place since the
    call."""
    for src, version in zip(batch.watched, batch.versions):
        if src._version != version:
            raise StagingError(
                f"{describe(src)} was changed in place while lazy staging was copying it (its "
                f"version went from {version} to {src._version}), so this checkpoint would not "
                f"hold the values of the async_save call; it was not saved, and the checkpoints "
                f"before it are intact. Wait for the staging before changing the state: call "
                f"store.hook_optimizer(optimizer) once, or resp.staging_completion.result() "
                f"before optimizer.step()")


def run_copies(batches: list[CopyBatch], *, non_blocking: bool = False,
               stream: Any = None) -> None:
    """Copy every batch (``torch._foreach_copy_``), on ``stream`` when given (CUDA)."""
    import torch

    batches = [b for b in batches if b.dsts]
    with torch.no_grad():
        if stream is None:
            for b in batches:
                torch._foreach_copy_(b.dsts, b.srcs, non_blocking=non_blocking)
            return
        with torch.cuda.stream(stream):
            for b in batches:
                torch._foreach_copy_(b.dsts, b.srcs, non_blocking=non_blocking)


class StagingWorker:
    """The thread lazy jobs run on: one per stager, started on its first job and kept, so that a
    save starts no thread (nor the thread's pool of copy threads) while training waits in
    ``async_save`` (a budgeted job starts its spill writer later, on this thread) (that start was most of a lazy ``async_save``'s 7 ms on a busy 2-core
    machine; 2 ms without it). It runs at training's priority: a lower one (nice 10) changed
    nothing measurable in ``benchmarks/training_stall.py``."""

    def __init__(self, name: str = "tierstore-staging"):
        self._name = name
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, task: Callable[[], None]) -> None:
        """Run ``task`` on the worker's thread (after the tasks before it)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
        self._queue.put(task)

    def _loop(self) -> None:
        while True:
            task = self._queue.get()
            if task is None:
                return
            task()
            task = None  # (a finished job's staged tree must not wait here for the next one)

    def close(self, timeout: float = 10.0) -> None:
        """End the thread once the tasks queued before are done, and wait for it (at most
        ``timeout`` seconds): nothing of the staging runs on while the process shuts down."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            if thread is not threading.current_thread():
                thread.join(timeout)


class StagingJob:
    """The staging of one save (see the module docstring).

    Made by a staging plugin with ``work``, a callable that does the copy and returns the staged
    tree; it calls :meth:`mark_copied` once every value is taken (else that is marked when it
    returns). A lazy job runs on ``worker`` (see :class:`StagingWorker`). ``started``: the
    ``time.perf_counter()`` of the call, from which the stats' seconds count (default: now).
    A CUDA plugin may give a fence (:meth:`set_cuda_fence`) that orders the training's stream
    after the copies instead of blocking the host (see :meth:`fence`).
    """

    def __init__(self, work: Callable[["StagingJob"], dict[str, Any]], *, lazy: bool,
                 stats: StagingStats | None = None, started: float | None = None,
                 worker: StagingWorker | None = None):
        self.lazy = lazy
        self.stats = stats or StagingStats()
        self.future: Future = Future()
        self._work: Callable[[StagingJob], dict[str, Any]] | None = work
        self._copied = threading.Event()
        self._cuda_fence: Callable[[], bool] | None = None
        self._fenced = False
        self._on_done: list[Callable[["StagingJob"], None]] = []
        # ``stats.seconds`` count from here (``started``: when the plugin's start() began)
        self._started = time.perf_counter() if started is None else started
        self._worker = worker
        #: what the copy raised (set before the callbacks run); None while running or after
        #: a success
        self.error: BaseException | None = None

    @classmethod
    def finished(cls, staged: dict[str, Any], stats: StagingStats | None = None) -> "StagingJob":
        """A job whose copy is already done (an eager plugin's ``stage`` result); running it
        only hands the tree over."""
        return cls(lambda _job: staged, lazy=False, stats=stats)

    # -- running ---------------------------------------------------------------------------------
    def run(self) -> None:
        """Do the work here and now (eager), or on the worker's thread (lazy; a thread of its
        own without a worker)."""
        if not self.lazy:
            self._run()
        elif self._worker is not None:
            self._worker.submit(self._run)
        else:
            threading.Thread(target=self._run, name="tierstore-staging", daemon=True).start()

    def _run(self) -> None:
        work, self._work = self._work, None  # the job outlives its copy; its sources must not
        try:
            staged = work(self)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
            self._copied.set()
            self._finish(exc=exc)
            return
        self._copied.set()
        self.stats.seconds = time.perf_counter() - self._started
        self._finish(result=staged)

    def _finish(self, result: Any = None, exc: BaseException | None = None) -> None:
        # The callbacks (events, the save slot) run before the future completes: whoever
        # waits on the future then sees their effects.
        self.error = exc
        callbacks, self._on_done = self._on_done, []
        self._cuda_fence = None  # (it holds the source tensors; every copy is over now)
        for callback in callbacks:
            try:
                callback(self)
            except Exception:  # an observer's failure must not lose the staged state
                log.exception("a staging completion callback failed")
        if exc is not None:
            self.future.set_exception(exc)
        else:
            self.future.set_result(result)

    def on_done(self, callback: Callable[["StagingJob"], None]) -> None:
        """Call ``callback(job)`` when the job ends (``job.error`` says how), before its future
        completes. Register before :meth:`run`."""
        self._on_done.append(callback)

    # -- what the work calls -----------------------------------------------------------------------
    def mark_copied(self) -> None:
        """Every value has been taken: training may change its tensors from now on."""
        self.stats.seconds = time.perf_counter() - self._started
        self._copied.set()

    def set_cuda_fence(self, fence: Callable[[], bool]) -> None:
        """``fence()`` makes the training's current CUDA stream wait for the copies (no host
        wait) and returns True, or returns False when it cannot (the host must wait)."""
        self._cuda_fence = fence

    @property
    def fenced(self) -> bool:
        """Whether :meth:`fence` has ordered the training after the copies (later in-place
        changes of the sources are then expected, not races)."""
        return self._fenced

    # -- what training waits on ----------------------------------------------------------------
    @property
    def copied(self) -> bool:
        """Whether every value has been taken."""
        return self._copied.is_set()

    def fence(self, timeout: float | None = None) -> float:
        """Make it safe for training to change the state: returns once every value has been
        taken, or (CUDA) once the training stream is ordered after the device-to-host copies,
        or after ``timeout`` seconds (then :attr:`copied` is still False). Returns the seconds
        the host waited."""
        started = time.perf_counter()
        if not self._copied.is_set() and self._cuda_fence is not None and self._cuda_fence():
            self._fenced = True
            return time.perf_counter() - started
        if self._copied.wait(timeout):
            self._fenced = True
        return time.perf_counter() - started

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        """The staged tree (raises what the copy raised)."""
        return self.future.result(timeout)
