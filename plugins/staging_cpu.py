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

import io
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.tensor import DTensor

from tierstore.plugin import hookimpl, Option, Stager, StagingError

__all__ = ["CpuStager", "PinnedStager", "ShmStager", "StateDictLayout", "describe_state_dict"]

log = logging.getLogger("tierstore.staging")


def _non_negative(value: int) -> str | None:
    return None if value >= 0 else "must be 0 (no limit) or a positive number of bytes"


@dataclass(frozen=True)
class StateDictLayout:
    """What staging buffers must match: the tree of keys with each tensor's kind, shape and
    dtype (``signature``), the bytes of tensor data, and whether any tensor is on CUDA."""

    signature: tuple
    nbytes: int
    on_cuda: bool


def describe_state_dict(state_dict: dict[str, Any]) -> StateDictLayout:
    """Walk ``state_dict`` once; see :class:`StateDictLayout`."""
    total = 0
    cuda = False

    def tensor_sig(t: torch.Tensor) -> tuple:
        nonlocal total, cuda
        total += t.numel() * t.element_size()
        cuda = cuda or t.is_cuda
        return (tuple(t.shape), t.dtype)

    def walk(value: Any) -> Any:
        if isinstance(value, DTensor):
            return ("dtensor", tensor_sig(value._local_tensor), value._spec)
        if isinstance(value, ShardedTensor):
            return ("sharded", value.metadata(),
                    tuple((s.metadata.shard_offsets, tensor_sig(s.tensor))
                          for s in value.local_shards()))
        if isinstance(value, torch.Tensor):
            return ("tensor", tensor_sig(value))
        if isinstance(value, dict):
            return ("dict", tuple((k, walk(v)) for k, v in value.items()))
        if isinstance(value, (list, tuple)):
            return (type(value).__name__, tuple(walk(v) for v in value))
        return ("value", type(value).__name__)

    signature = walk(state_dict)
    return StateDictLayout(signature, total, cuda)


def _fresh_byte_buffers(value: Any) -> Any:
    """Copy every ``io.BytesIO`` in a staged tree: they are mutable and belong to training."""
    if isinstance(value, io.BytesIO):
        return io.BytesIO(value.getvalue())
    if isinstance(value, dict):
        return {k: _fresh_byte_buffers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_fresh_byte_buffers(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_fresh_byte_buffers(v) for v in value)
    return value


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
        self._buffers: dict[str, Any] | None = None
        self._signature: tuple | None = None
        self._stream: Any = None
        self._warned_no_cuda = False
        #: bytes of tensor data copied by the last ``stage`` call
        self.last_bytes = 0
        #: whether the last ``stage`` call reused the buffers of the one before
        self.last_reused = False
        #: whether the current buffers are page-locked
        self.pinned = False

    @property
    def allocated_bytes(self) -> int:
        """Host memory the staging buffers hold now (0 before the first save)."""
        return 0 if self._buffers is None else self.last_bytes

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state_dict`` into the buffers (allocating them when the layout changed) and
        return the staged tree; the copy is finished when this returns."""
        layout = describe_state_dict(state_dict)
        if self.max_staging_bytes and layout.nbytes > self.max_staging_bytes:
            raise StagingError(
                f"staging this state dict needs {_size(layout.nbytes)} of host memory, more than "
                f"[store.staging] max_staging_bytes = {self.max_staging_bytes} "
                f"({_size(self.max_staging_bytes)}) allows; raise max_staging_bytes, or save "
                f"with dcp.save (which writes without staging)"
            )
        pin = self._want_pinned(layout)
        reuse = (self._buffers is not None and self._signature == layout.signature
                 and self.pinned == pin)
        if not reuse:
            # Drop the old buffers first, so both sets are never held at once.
            self._buffers = self._signature = None
            self._buffers = _create_cpu_state_dict(state_dict, pin_memory=pin,
                                                   share_memory=self.share)
            self._signature, self.pinned = layout.signature, pin
            log.debug("allocated %s of staging buffers (pinned=%s, shared=%s)",
                      _size(layout.nbytes), pin, self.share)
        staged = self._copy(state_dict, non_blocking=pin and layout.on_cuda)
        self.last_bytes, self.last_reused = layout.nbytes, reuse
        return _fresh_byte_buffers(staged)

    def _want_pinned(self, layout: StateDictLayout) -> bool:
        wanted = layout.on_cuda if self.pin is None else self.pin
        if wanted and not torch.cuda.is_available():
            if not self._warned_no_cuda:
                log.warning("staging '%s': CUDA is not available, so staging buffers use "
                            "pageable memory", type(self).__name__)
                self._warned_no_cuda = True
            return False
        return wanted

    def _copy(self, state_dict: dict[str, Any], non_blocking: bool) -> dict[str, Any]:
        if not non_blocking:
            return _copy_state_dict(state_dict, self._buffers, type_check=False)
        # Device -> pinned host copies on a side stream, after the work already queued on the
        # current stream (which produced the tensors), then waited for: the staged copy must be
        # complete when async_save returns.
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            staged = _copy_state_dict(state_dict, self._buffers, non_blocking=True,
                                      type_check=False)
        self._stream.synchronize()
        return staged

    def close(self) -> None:
        """Free the staging buffers."""
        self._buffers = self._signature = None


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
