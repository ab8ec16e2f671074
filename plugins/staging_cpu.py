"""Staging plugins ``cpu``, ``pinned`` and ``shm``: copy the state dict off the training tensors
for ``dcp.async_save``, into host buffers allocated once and reused.

The buffers are kept between saves (that is what makes a save cost one copy instead of an
allocation plus a copy): a store holds about one state dict's worth of host memory per rank from
its first ``async_save`` until ``store.close()``. When the state dict's layout changes (a tensor's
shape or dtype, a key added or removed) the buffers are allocated anew; the old ones are freed
once the save that read them is over.

- ``cpu``: pageable memory; pinned automatically when tensors are on CUDA (the copy is then a
  non-blocking copy on a side stream, ended by an event).
- ``pinned``: page-locked memory always (falls back to pageable memory, with a warning, where
  CUDA is not available).
- ``shm``: shared memory, so that DCP's process executor hands the buffers to its checkpoint
  process without copying them again.

Each takes two options:

- ``lazy``: ``start`` takes the non-tensor values and notes what to copy, and the copy itself
  runs on the job's own thread (on CUDA it is queued at the call and the job waits for its
  event); ``dcp.async_save`` returns at once.
- ``max_staging_bytes``: a state dict larger than this is staged in waves through one buffer of
  that size instead of whole buffers (``staging_waves``); one that fits again goes back to them.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from tierstore.plugin import hookimpl, Option, Stager, StagingError
from tierstore.plugin.staging import (CopyBatch, StagingJob, StagingStats, StagingWorker,
                                      check_unchanged, run_copies, split_copies, watch)

# torch and the buffers' modules (which import it) are imported where a save stages: registering
# the plugin, which every store does, then costs no torch (`tierstore ls` loads none)
if TYPE_CHECKING:
    import torch

    from tierstore_plugins.staging_buffers import StagingBuffers, StateDictLayout
    from tierstore_plugins.staging_waves import WaveBuffer

__all__ = ["CpuStager", "PinnedStager", "ShmStager"]

log = logging.getLogger("tierstore.staging")


def _non_negative(value: int) -> str | None:
    return None if value >= 0 else "must be 0 (no limit) or a positive number of bytes"


class CpuStager(Stager):
    """Copies into reused host buffers; pinned when the state dict has CUDA tensors."""

    options = (
        Option("max_staging_bytes", int, default=0, check=_non_negative,
               description="most bytes of host memory staging may take; a larger state dict is "
                           "staged in waves through that much, each written to the first tier "
                           "before its buffer is reused (0: no limit)"),
        Option("lazy", bool, default=False,
               description="dcp.async_save returns before the state is copied; its "
                           "staging_completion (or store.hook_optimizer) says when training "
                           "may change the state"),
    )
    #: True: always page-locked; None: page-locked when a tensor is on CUDA
    pin: ClassVar[bool | None] = None
    #: True: buffers in shared memory (handed to DCP's checkpoint process without a copy)
    share: ClassVar[bool] = False

    def __init__(self, max_staging_bytes: int = 0, lazy: bool = False):
        self.max_staging_bytes = max_staging_bytes
        self.lazy = lazy
        self._buffers: StagingBuffers | None = None
        self._waves: WaveBuffer | None = None  # the buffer of a budgeted staging
        self._stream: Any = None
        self._warned_no_cuda = False
        self._worker = StagingWorker()
        #: bytes of tensor data copied by the last ``stage`` call
        self.last_bytes = 0
        #: whether the last ``stage`` call reused the buffers of the one before
        self.last_reused = False

    @property
    def pinned(self) -> bool:
        """Whether the current buffers are page-locked."""
        if self._waves is not None:
            return self._waves.pin
        return self._buffers is not None and self._buffers.pinned

    @property
    def allocated_bytes(self) -> int:
        """Host memory the staging buffers hold now (0 before the first save)."""
        if self._waves is not None:
            return self._waves.nbytes
        return 0 if self._buffers is None else self._buffers.layout.nbytes

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state_dict`` into the buffers (allocating them when the layout changed) and
        return the staged tree; the copy is finished when this returns. (The core calls
        :meth:`start`; this eager form has no spill, so it refuses a budget it would exceed.)"""
        job = self._start(state_dict, _no_spill, lazy=False)
        job.run()
        return job.result()

    def start(self, state_dict: dict[str, Any], spill: Callable[[], Any]) -> StagingJob:
        """The staging of one save: into the reused buffers, or in waves through the budget's
        buffer when the state dict is larger than ``max_staging_bytes``; run now (eager) or on
        a thread (``lazy``)."""
        return self._start(state_dict, spill, self.lazy)

    def _start(self, state_dict: dict[str, Any], spill: Callable[[], Any], lazy: bool
               ) -> StagingJob:
        from tierstore_plugins.staging_buffers import describe_state_dict

        started = time.perf_counter()
        if self._waves is not None:  # the save before did not fit the budget
            return self._start_waves(state_dict, spill, lazy, started)
        buffers = self._buffers
        prepared = buffers.prepare(state_dict) if buffers is not None else None
        reused = prepared is not None
        if not reused:
            # Drop the old buffers first, so both sets are never held at once.
            self._buffers = None
            layout = describe_state_dict(state_dict)
            if self.max_staging_bytes and layout.nbytes > self.max_staging_bytes:
                return self._start_waves(state_dict, spill, lazy, started)
            buffers = self._allocate(layout, state_dict)
            prepared = buffers.prepare(state_dict)
            if prepared is None:
                raise StagingError("the state dict changed while it was being staged")
        staged, dsts, srcs = prepared
        nbytes = buffers.layout.nbytes
        self.last_bytes, self.last_reused = nbytes, reused
        stats = StagingStats(nbytes=nbytes, reused=reused, buffer_bytes=nbytes)
        describe = _describer(state_dict)
        watched = buffers.watched(srcs) if lazy else srcs
        if lazy:
            order = buffers.smallest_first(dsts)
            dsts, srcs = [dsts[i] for i in order], [srcs[i] for i in order]
            watched = [watched[i] for i in order]
        if buffers.pinned and buffers.layout.on_cuda:
            return self._cuda_job(staged, dsts, srcs, watched, lazy, stats, describe, started)
        if not lazy:
            batches = [CopyBatch(dsts, srcs)]
        else:
            # The smallest tensors now, on the caller's thread: forward changes some of them
            # in place (BatchNorm's running statistics) long before the optimizer step.
            head = _head_count(dsts)
            run_copies([CopyBatch(dsts[:head], srcs[:head])])
            batches = split_copies(dsts[head:], srcs[head:], watched[head:])

        def work(job: StagingJob) -> dict[str, Any]:
            for batch in batches:
                run_copies([batch])
                if lazy:
                    check_unchanged(batch, describe)
            return staged

        return StagingJob(work, lazy=lazy, stats=stats, started=started,
                          worker=self._worker)

    def _cuda_job(self, staged: dict[str, Any], dsts: list, srcs: list, watched: list,
                  lazy: bool, stats: StagingStats, describe: Callable[[Any], str],
                  started: float) -> StagingJob:
        """Device -> pinned host copies queued now on a side stream, after the work already
        queued on the training's current stream (which produced the tensors); an event marks
        their end. The job waits on that event (never on a stream); the optimizer hook orders
        the training stream after it instead of blocking the host."""
        import torch

        if self._stream is None:
            self._stream = torch.cuda.Stream()
        side, training = self._stream, torch.cuda.current_stream()
        side.wait_stream(training)
        head = _head_count(dsts) if lazy else 0
        if head:
            # The smallest tensors first, and the training stream waits for them (on the
            # device): forward changes some in place (BatchNorm's running statistics).
            run_copies([CopyBatch(dsts[:head], srcs[:head])], non_blocking=True, stream=side)
            head_done = torch.cuda.Event()
            head_done.record(side)
            training.wait_event(head_done)
        batch = (watch(dsts[head:], srcs[head:], watched[head:]) if lazy
                 else CopyBatch(dsts, srcs))
        run_copies([batch], non_blocking=True, stream=side)
        for src in srcs:  # the allocator must not reuse a source's memory before the copy
            if src.is_cuda:
                src.record_stream(side)
        done = torch.cuda.Event()
        done.record(side)
        # The versions are compared once, by whichever comes first: the hook (before the
        # optimizer step changes them on purpose) or the job once the copies are over; a
        # change before that means a kernel queued after the call may have run before a copy.
        lock, verdict = threading.Lock(), []

        def check_once() -> None:
            with lock:
                if verdict:
                    return
                try:
                    check_unchanged(batch, describe)
                    verdict.append(None)
                except StagingError as exc:
                    verdict.append(exc)

        def fence() -> bool:  # the training thread, before it changes the state
            if lazy:
                check_once()
            torch.cuda.current_stream().wait_event(done)
            return True

        def work(job: StagingJob) -> dict[str, Any]:
            done.synchronize()
            if lazy:
                check_once()
                if verdict[0] is not None:
                    raise verdict[0]
            return staged

        job = StagingJob(work, lazy=lazy, stats=stats, started=started,
                          worker=self._worker)
        job.set_cuda_fence(fence)
        return job

    def _start_waves(self, state_dict: dict[str, Any], spill: Callable[[], Any], lazy: bool,
                     started: float) -> StagingJob:
        """Stage through the budget's buffer in waves (``staging_waves``); back to whole
        buffers when the state dict fits the budget again."""
        from tierstore_plugins.staging_buffers import describe_state_dict
        from tierstore_plugins.staging_waves import (WaveBuffer, placeholder_tree, plan_waves,
                                                     stage_in_waves)

        if describe_state_dict(state_dict).nbytes <= self.max_staging_bytes:
            self._waves = None  # fits whole buffers again (the same measure _start uses)
            return self._start(state_dict, spill, lazy)
        staged, pairs = placeholder_tree(state_dict, self._copy_whole)
        if not pairs:  # only values copied whole (ShardedTensors)
            return StagingJob.finished(staged, StagingStats(buffer_bytes=0))
        total = sum(src.numel() * src.element_size() for _, src, _ in pairs)
        on_cuda = any(src.is_cuda for _, src, _ in pairs)
        pin = self._want_pinned(on_cuda)
        if self._waves is None or self._waves.pin != pin:
            self._waves = WaveBuffer(self.max_staging_bytes, pin)
        largest = max(src.numel() * src.element_size() for _, src, _ in pairs)
        # Smallest first: forward changes some small tensors in place (BatchNorm's statistics).
        pairs.sort(key=lambda pair: pair[1].numel() * pair[1].element_size())
        arena = self._waves.arena_for(largest)
        waves = plan_waves(pairs, max(arena.numel() // 2, 1))
        sink = spill()
        self.last_bytes, self.last_reused = total, False
        stats = StagingStats(nbytes=total, waves=len(waves), buffer_bytes=arena.numel())
        copy_wave = self._cuda_wave_copier() if on_cuda and pin else _copy_on_host
        describe = _describer(state_dict)

        def work(job: StagingJob) -> dict[str, Any]:
            return stage_in_waves(job, arena, waves, sink, staged, check=lazy,
                                  copy_wave=copy_wave, describe=describe)

        return StagingJob(work, lazy=lazy, stats=stats, started=started,
                          worker=self._worker)

    def _cuda_wave_copier(self) -> Callable[[list, list], None]:
        """Copies of a wave on the side stream, after what the training stream had queued at the
        call (an event recorded now), waited for by the staging's own thread."""
        import torch

        if self._stream is None:
            self._stream = torch.cuda.Stream()
        side = self._stream
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream())

        def copy_wave(dsts: list, srcs: list) -> None:
            side.wait_event(ready)
            run_copies([CopyBatch(dsts, srcs)], non_blocking=True, stream=side)
            done = torch.cuda.Event()
            done.record(side)
            done.synchronize()

        return copy_wave

    def _copy_whole(self, value: Any) -> Any:
        """A value budgeted staging does not cut into waves (a ShardedTensor), copied now into
        buffers of its own."""
        from tierstore_plugins.staging_buffers import StagingBuffers, describe_state_dict

        single = {"value": value}
        buffers = StagingBuffers(single, describe_state_dict(single), pin=False, share=False)
        return buffers.stage(single, non_blocking=False)["value"]

    def _allocate(self, layout: StateDictLayout, state_dict: dict[str, Any]) -> StagingBuffers:
        from tierstore_plugins.staging_buffers import StagingBuffers

        pin = self._want_pinned(layout.on_cuda)
        self._buffers = StagingBuffers(state_dict, layout, pin=pin, share=self.share)
        log.debug("allocated %s of staging buffers (pinned=%s, shared=%s)",
                  _size(layout.nbytes), pin, self.share)
        return self._buffers

    def _want_pinned(self, on_cuda: bool) -> bool:
        import torch

        wanted = on_cuda if self.pin is None else self.pin
        if wanted and not torch.cuda.is_available():
            if not self._warned_no_cuda:
                log.warning("staging '%s': CUDA is not available, so staging buffers use "
                            "pageable memory", type(self).__name__)
                self._warned_no_cuda = True
            return False
        return wanted

    def close(self) -> None:
        """Free the staging buffers (and end the staging thread)."""
        self._buffers = None
        self._waves = None
        self._worker.close()


#: bytes of the smallest tensors a lazy staging copies at the call, before it returns
INLINE_BYTES = 1 << 20


def _head_count(dsts: list) -> int:
    """How many of the first (smallest) copies fit in :data:`INLINE_BYTES`."""
    total = 0
    for n, d in enumerate(dsts):
        total += d.nbytes
        if total > INLINE_BYTES:
            return n
    return len(dsts)


def _copy_on_host(dsts: list, srcs: list) -> None:
    run_copies([CopyBatch(dsts, srcs)])


def _no_spill() -> Any:
    raise StagingError("staging in waves (max_staging_bytes smaller than the state dict) needs "
                       "the store's spill; save through dcp.async_save with the store's writer")


def _describer(state_dict: dict[str, Any]) -> Callable[[Any], str]:
    """Names a source tensor by its path in ``state_dict`` (searched only when an error needs
    it)."""

    def describe(tensor: torch.Tensor) -> str:
        found = _path_of(state_dict, tensor, [])
        return f"tensor '{'.'.join(found)}'" if found is not None else "a tensor of the state dict"

    return describe


def _path_of(value: Any, tensor: Any, path: list[str]) -> list[str] | None:
    from torch.distributed.tensor import DTensor

    if value is tensor or (isinstance(value, DTensor) and value._local_tensor is tensor):
        return path
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return None
    for key, v in items:
        found = _path_of(v, tensor, [*path, str(key)])
        if found is not None:
            return found
    return None


class PinnedStager(CpuStager):
    """Copies into reused page-locked buffers (non-blocking copies from CUDA)."""

    pin = True


class ShmStager(CpuStager):
    """Copies into reused shared-memory buffers (pinned too when tensors are on CUDA), which
    DCP's process executor passes to its checkpoint process without another copy."""

    share = True


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"


@hookimpl
def tierstore_register_staging(register):
    register("cpu", CpuStager)
    register("pinned", PinnedStager)
    register("shm", ShmStager)
