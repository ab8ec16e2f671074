"""Staging plugins ``cpu``, ``pinned`` and ``shm``: copy the state dict off the training tensors
for ``dcp.async_save``, into host buffers allocated once and reused.

The buffers are kept between saves (that is what makes a save cost one copy instead of an
allocation plus a copy): a store holds about one state dict's worth of host memory per rank from
its first ``async_save`` until ``store.close()``. When the state dict's layout changes (a tensor's
shape or dtype, a key added or removed) the buffers are allocated anew; the old ones are freed
once the save that read them is over.

- ``cpu``: pageable memory; pinned automatically when tensors are on CUDA (the copy is then a
  non-blocking copy on a side stream, waited for before ``async_save`` returns).
- ``pinned``: page-locked memory always (falls back to pageable memory, with a warning, where
  CUDA is not available).
- ``shm``: shared memory, so that DCP's process executor hands the buffers to its checkpoint
  process without copying them again.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import torch

from tierstore.plugin import hookimpl, Option, Stager, StagingError
from tierstore_plugins.staging_buffers import (StagingBuffers, StateDictLayout,
                                               describe_state_dict)

__all__ = ["CpuStager", "PinnedStager", "ShmStager"]

log = logging.getLogger("tierstore.staging")


def _non_negative(value: int) -> str | None:
    return None if value >= 0 else "must be 0 (no limit) or a positive number of bytes"


class CpuStager(Stager):
    """Copies into reused host buffers; pinned when the state dict has CUDA tensors."""

    options = (
        Option("max_staging_bytes", int, default=0, check=_non_negative,
               description="most bytes of host memory the staging buffers may take (0: no limit)"),
    )
    #: True: always page-locked; None: page-locked when a tensor is on CUDA
    pin: ClassVar[bool | None] = None
    #: True: buffers in shared memory (handed to DCP's checkpoint process without a copy)
    share: ClassVar[bool] = False

    def __init__(self, max_staging_bytes: int = 0):
        self.max_staging_bytes = max_staging_bytes
        self._buffers: StagingBuffers | None = None
        self._stream: Any = None
        self._warned_no_cuda = False
        #: bytes of tensor data copied by the last ``stage`` call
        self.last_bytes = 0
        #: whether the last ``stage`` call reused the buffers of the one before
        self.last_reused = False

    @property
    def pinned(self) -> bool:
        """Whether the current buffers are page-locked."""
        return self._buffers is not None and self._buffers.pinned

    @property
    def allocated_bytes(self) -> int:
        """Host memory the staging buffers hold now (0 before the first save)."""
        return 0 if self._buffers is None else self._buffers.layout.nbytes

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state_dict`` into the buffers (allocating them when the layout changed) and
        return the staged tree; the copy is finished when this returns."""
        buffers, staged = self._buffers, None
        if buffers is not None:
            staged = self._copy(buffers, state_dict)
        reused = staged is not None
        if not reused:
            # Drop the old buffers first, so both sets are never held at once.
            self._buffers = None
            buffers = self._allocate(state_dict)
            staged = self._copy(buffers, state_dict)
            if staged is None:
                raise StagingError("the state dict changed while it was being staged")
        self.last_bytes, self.last_reused = buffers.layout.nbytes, reused
        return staged

    def _allocate(self, state_dict: dict[str, Any]) -> StagingBuffers:
        layout = describe_state_dict(state_dict)
        if self.max_staging_bytes and layout.nbytes > self.max_staging_bytes:
            raise StagingError(
                f"staging this state dict needs {_size(layout.nbytes)} of host memory, more than "
                f"[store.staging] max_staging_bytes = {self.max_staging_bytes} "
                f"({_size(self.max_staging_bytes)}) allows; raise max_staging_bytes, or save "
                f"with dcp.save (which writes without staging)"
            )
        pin = self._want_pinned(layout)
        self._buffers = StagingBuffers(state_dict, layout, pin=pin, share=self.share)
        log.debug("allocated %s of staging buffers (pinned=%s, shared=%s)",
                  _size(layout.nbytes), pin, self.share)
        return self._buffers

    def _want_pinned(self, layout: StateDictLayout) -> bool:
        wanted = layout.on_cuda if self.pin is None else self.pin
        if wanted and not torch.cuda.is_available():
            if not self._warned_no_cuda:
                log.warning("staging '%s': CUDA is not available, so staging buffers use "
                            "pageable memory", type(self).__name__)
                self._warned_no_cuda = True
            return False
        return wanted

    def _copy(self, buffers: StagingBuffers, state_dict: dict[str, Any]) -> dict[str, Any] | None:
        if not (buffers.pinned and buffers.layout.on_cuda):
            return buffers.stage(state_dict, non_blocking=False)
        # Device -> pinned host copies on a side stream, after the work already queued on the
        # current stream (which produced the tensors), then waited for: the staged copy must be
        # complete when async_save returns.
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        staged = buffers.stage(state_dict, non_blocking=True, stream=self._stream)
        self._stream.synchronize()
        return staged

    def close(self) -> None:
        """Free the staging buffers."""
        self._buffers = None


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
