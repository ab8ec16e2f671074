"""Staging under a memory budget: the state dict copied in waves through one reused buffer of at
most ``max_staging_bytes`` (or the largest tensor, when that is larger), each wave written out
(to the first tier's spill, :mod:`tierstore.dcp.spill`) before its part of the buffer is reused.

The staged tree DCP plans from holds ``meta`` placeholders of the tensors' shapes and dtypes
(DTensors keep their placements around a meta local tensor); ``write_data`` copies each planned
item's record from the spill.

Ordering: the buffer is used as two halves that take turns, so that the next wave is copied while
the one before it is written; the copy of every tensor is therefore over (and training may
change the state) when the last wave is copied, one wave's write before the staging ends. A
tensor larger than half the buffer is a wave of its own and waits for the buffer to be free.
"""

from __future__ import annotations

import collections
import copy
import io
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

from tierstore.plugin.staging import CopyBatch, StagingJob, check_unchanged

__all__ = ["WaveBuffer", "placeholder_tree", "plan_waves", "Wave", "stage_in_waves"]

log = logging.getLogger("tierstore.staging")

#: tensors start at multiples of this in the buffer (any dtype's alignment, and a cache line)
_ALIGN = 64

_IMMUTABLE = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _is_dcp_leaf(value: Any) -> bool:
    """Whether DCP saves ``value`` (a list, tuple or other non-mapping) whole, pickled, rather
    than item by item: the rule of ``torch.distributed.checkpoint._traverse`` (not importable:
    a nested function there). A tuple is always whole; a list is whole unless it holds a
    tensor, a mapping or a list that is not whole."""
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    for entry in value:
        if isinstance(entry, (Mapping, list)) and not _is_dcp_leaf(entry):
            return False
        if isinstance(entry, torch.Tensor):
            return False
    return True


def placeholder_tree(state_dict: dict[str, Any], copy_whole: Callable[[Any], Any]
                     ) -> tuple[dict[str, Any], list[tuple[torch.Tensor, torch.Tensor, Any]]]:
    """``state_dict`` staged without its tensor data: every tensor replaced by a ``meta``
    tensor of its shape and dtype (a DTensor by a DTensor of its spec around a meta local
    tensor), non-tensor values taken now (copied when mutable). Returns the tree and the
    (placeholder, source, what to watch for in-place changes) triples of the tensors to copy,
    in the state dict's order. ``copy_whole(value)`` stages at once, outside the waves, a value
    the waves cannot handle: a ShardedTensor, and a container DCP pickles whole (a tuple
    holding tensors), whose tensors must be real in the pickle."""
    pairs: list[tuple[torch.Tensor, torch.Tensor, Any]] = []

    def plain(t: torch.Tensor, watched: Any = None) -> torch.Tensor:
        ph = torch.empty(t.shape, dtype=t.dtype, device="meta")
        pairs.append((ph, t, t if watched is None else watched))
        return ph

    def walk(value: Any) -> Any:
        kind = type(value)
        if kind in _IMMUTABLE:
            return value
        if kind is dict or kind is collections.OrderedDict:
            return kind((k, walk(v)) for k, v in value.items())
        if isinstance(value, DTensor):
            # an in-place op on a DTensor bumps its own version, not its local tensor's
            local = plain(value._local_tensor, watched=value)
            return DTensor(local, value._spec, requires_grad=False)
        if isinstance(value, ShardedTensor):
            return copy_whole(value)
        if isinstance(value, torch.Tensor):
            return plain(value.detach().as_subclass(torch.Tensor)
                         if type(value) not in (torch.Tensor, torch.nn.Parameter) else value)
        if kind is list or kind is tuple:
            if _is_dcp_leaf(value):
                return copy_whole(value)
            staged = [walk(v) for v in value]
            return staged if kind is list else tuple(staged)
        if isinstance(value, io.BytesIO):
            return io.BytesIO(value.getvalue())
        if isinstance(value, _IMMUTABLE):
            return value
        if isinstance(value, dict):
            return type(value)((k, walk(v)) for k, v in value.items())
        return copy.deepcopy(value)

    return walk(state_dict), pairs


@dataclass
class Wave:
    """Tensors copied and written together: (placeholder, source, offset from the wave's
    start, what to watch for in-place changes) each, the watched versions at the call, and the
    wave's bytes in the buffer."""

    items: list[tuple[torch.Tensor, torch.Tensor, int, Any]]
    nbytes: int
    versions: list[int] = field(default_factory=list)


def plan_waves(pairs: list[tuple[torch.Tensor, torch.Tensor, Any]], capacity: int
               ) -> list[Wave]:
    """Cut the (placeholder, source, watched) triples into waves of at most ``capacity`` bytes
    (in order); a larger tensor is a wave alone. The watched versions are noted now (the
    call)."""
    waves: list[Wave] = []
    cur = Wave([], 0)
    for ph, src, watched in pairs:
        n = _aligned(src.numel() * src.element_size())
        if cur.items and cur.nbytes + n > capacity:
            waves.append(cur)
            cur = Wave([], 0)
        cur.items.append((ph, src, cur.nbytes, watched))
        cur.versions.append(watched._version)
        cur.nbytes += n
    if cur.items:
        waves.append(cur)
    return waves


class WaveBuffer:
    """The reused buffer of a budgeted staging (allocated on first use, kept while it is the
    right size)."""

    def __init__(self, budget: int, pin: bool):
        self.budget = budget
        self.pin = pin
        self._arena: torch.Tensor | None = None

    def arena_for(self, largest: int) -> torch.Tensor:
        """The buffer for a state dict whose largest tensor has ``largest`` bytes: the budget,
        or that tensor when it is larger (the bound is the budget plus one tensor)."""
        # Whole multiples of the alignment (the second half's waves end at the buffer's end),
        # the budget rounded down: the buffer never exceeds it but for one larger tensor.
        size = max(self.budget // _ALIGN * _ALIGN, _aligned(largest))
        if self._arena is None or self._arena.numel() != size:
            self._arena = None
            self._arena = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        return self._arena

    @property
    def nbytes(self) -> int:
        """Bytes the buffer holds now."""
        return 0 if self._arena is None else self._arena.numel()

    def close(self) -> None:
        """Free the buffer."""
        self._arena = None


def stage_in_waves(job: StagingJob, arena: torch.Tensor, waves: list[Wave], spill: Any,
                   staged: dict[str, Any], *, check: bool,
                   copy_wave: Callable[[list[torch.Tensor], list[torch.Tensor]], None],
                   describe: Callable[[torch.Tensor], str]) -> dict[str, Any]:
    """The work of a budgeted job: copy each wave into its half of ``arena`` (``copy_wave``),
    hand it to a writing thread (``spill.write_wave``), and reuse a part of the buffer only
    once the wave in it is written. ``check``: compare the sources' versions after each wave
    (lazy). Returns ``staged``; the spill's index goes to ``job.stats.extra["spill"]``."""
    size = arena.numel()
    in_flight: list[tuple[tuple[int, int], Future, Wave]] = []
    placed: list[tuple[torch.Tensor, Any]] = []

    def collect(done: tuple[tuple[int, int], Future, Wave]) -> None:
        records = done[1].result()
        placed.extend((item[0], rec) for item, rec in zip(done[2].items, records))

    with ThreadPoolExecutor(1, thread_name_prefix="tierstore-spill") as writer:
        try:
            for number, wave in enumerate(waves):
                start = 0 if number % 2 == 0 else size - wave.nbytes
                region = (start, start + wave.nbytes)
                for entry in list(in_flight):
                    if entry[0][0] < region[1] and region[0] < entry[0][1]:
                        in_flight.remove(entry)
                        collect(entry)
                views = [arena[start + off:start + off + src.nbytes].view(src.dtype)
                         .view(src.shape) for _, src, off, _ in wave.items]
                srcs = [item[1] for item in wave.items]
                copy_wave(views, srcs)
                if check:
                    check_unchanged(CopyBatch(views, srcs, wave.versions,
                                              [item[3] for item in wave.items]), describe)
                in_flight.append((region, writer.submit(spill.write_wave, number, views), wave))
            job.mark_copied()
            for entry in in_flight:
                collect(entry)
        except BaseException:
            for _, fut, _ in in_flight:
                fut.cancel()
            raise
    job.stats.extra["spill"] = spill.finish(staged, placed)
    return staged
