"""Host buffers for one state-dict layout, and the per-save copy into them.

A save of thousands of small tensors must cost about what a plain ``copy_`` loop costs, so
everything that depends only on the layout is done once, when the buffers are made: the tree of
buffers itself (``torch.distributed``'s ``_create_cpu_state_dict``, which handles DTensor and
ShardedTensor), and per dict of it what each key's value must be (buffer, shape, dtype, DTensor
spec; noted on the first save). Each save then walks the state dict once beside that tree: it
checks that every tensor still has its buffer's shape, dtype and spec (``copy_`` would silently
broadcast or convert otherwise, and a changed placement would be saved under the old one),
builds the staged tree, gathers the pairs to copy, and copies them in one
``torch._foreach_copy_`` call.
"""

from __future__ import annotations

import collections
import copy
import io
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._state_dict_utils import _create_cpu_state_dict
from torch.distributed.tensor import DTensor

__all__ = ["StateDictLayout", "StagingBuffers", "describe_state_dict"]

#: values a staged tree may share with training: they cannot change under it
_IMMUTABLE = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)
_IMMUTABLE_EXACT = frozenset(_IMMUTABLE)


@dataclass(frozen=True)
class StateDictLayout:
    """What buffers for a state dict need: its bytes of tensor data, and whether any tensor is
    on CUDA (then the buffers are pinned). Whether later state dicts still fit the buffers is
    checked by :meth:`StagingBuffers.stage` itself, tensor by tensor."""

    nbytes: int
    on_cuda: bool


def describe_state_dict(state_dict: dict[str, Any]) -> StateDictLayout:
    """Walk ``state_dict`` once; see :class:`StateDictLayout`."""
    total = 0
    cuda = False

    def add(t: torch.Tensor) -> None:
        nonlocal total, cuda
        total += t.numel() * t.element_size()
        cuda = cuda or t.is_cuda

    def walk(value: Any) -> None:
        if isinstance(value, DTensor):
            add(value._local_tensor)
        elif isinstance(value, ShardedTensor):
            for shard in value.local_shards():
                add(shard.tensor)
        elif isinstance(value, torch.Tensor):
            add(value)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    walk(state_dict)
    return StateDictLayout(total, cuda)


_PLAIN, _DTENSOR, _OTHER = "plain", "dtensor", "other"


def _expectation(buffer: Any) -> tuple:
    """What a value staged into ``buffer`` must be: (kind, buffer, the tensor to copy into,
    shape, dtype, DTensor spec), with Nones where they do not apply."""
    if type(buffer) is torch.Tensor:
        return (_PLAIN, buffer, buffer, buffer.shape, buffer.dtype, None)
    if type(buffer) is DTensor:
        local = buffer._local_tensor
        return (_DTENSOR, buffer, local, local.shape, local.dtype, buffer._spec)
    return (_OTHER, buffer, None, None, None, None)


class _LayoutChanged(Exception):
    """The state dict no longer matches the buffers (caught by :meth:`StagingBuffers.stage`)."""


class StagingBuffers:
    """The host buffers of one layout (allocated here) and the copy of a state dict into them."""

    def __init__(self, state_dict: dict[str, Any], layout: StateDictLayout, *, pin: bool,
                 share: bool):
        self.layout = layout
        self.pinned = pin
        self.tree = _create_cpu_state_dict(state_dict, pin_memory=pin, share_memory=share)
        # Per dict of the buffer tree (by id; the tree lives as long as this object): each key's
        # expectation (see _expectation); a DTensor's spec is replaced by the first spec object
        # found equal to it, since training keeps the same spec objects from save to save.
        self._expected: dict[int, dict[Any, tuple]] = {}
        self._smallest_first: list[int] | None = None
        #: the DTensors whose local tensors the last :meth:`prepare` copies, by position
        self.dtensor_sources: dict[int, DTensor] = {}

    def smallest_first(self, dsts: list[torch.Tensor]) -> list[int]:
        """The positions of ``dsts`` (the buffers :meth:`prepare` returns, in its order) from
        the smallest buffer to the largest; worked out once (it depends on the layout alone)."""
        if self._smallest_first is None:
            self._smallest_first = sorted(range(len(dsts)), key=lambda i: dsts[i].nbytes)
        return self._smallest_first

    def prepare(self, state_dict: dict[str, Any]
                ) -> tuple[dict[str, Any], list[torch.Tensor], list[torch.Tensor]] | None:
        """Walk ``state_dict`` beside the buffers: the staged tree (its non-tensor values
        already taken), and the buffers and source tensors to copy into them, in order; None
        when its layout differs from the buffers'. Nothing is copied yet."""
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        self.dtensor_sources = {}
        try:
            staged = self._walk(state_dict, self.tree, dsts, srcs)
        except _LayoutChanged:
            return None
        return staged, dsts, srcs

    def watched(self, srcs: list[torch.Tensor]) -> list[Any]:
        """What tells whether each source of the last :meth:`prepare` changed in place: the
        tensor itself, or for a DTensor's local tensor the DTensor (an in-place op on a DTensor
        bumps its own version counter, not its local tensor's)."""
        owners = self.dtensor_sources
        if not owners:
            return srcs
        return [owners.get(i, src) for i, src in enumerate(srcs)]

    def stage(self, state_dict: dict[str, Any], non_blocking: bool, stream: Any = None
              ) -> dict[str, Any] | None:
        """Copy ``state_dict`` into the buffers and return the staged tree, or None (nothing
        copied) when its layout differs from the buffers'. With ``stream`` (CUDA), the copies
        are queued on it, ``non_blocking``; the caller waits for them."""
        prepared = self.prepare(state_dict)
        if prepared is None:
            return None
        staged, dsts, srcs = prepared
        if not dsts:
            return staged
        with torch.no_grad():
            if stream is None:
                torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking)
            else:
                with torch.cuda.stream(stream):
                    torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking)
        return staged

    def _walk(self, value: Any, buffer: Any, dsts: list, srcs: list) -> Any:
        """``value`` staged: tensors replaced by their buffers (the pair noted for the copy),
        containers rebuilt, other values shared when immutable and copied otherwise."""
        kind = type(value)
        if kind in _IMMUTABLE_EXACT:  # the step counts and hyperparameters, first: most values
            return value
        if kind is dict or kind is collections.OrderedDict:
            return self._walk_dict(value, buffer, dsts, srcs)
        if kind is torch.Tensor or kind is torch.nn.Parameter:
            if (type(buffer) is not torch.Tensor or value.shape != buffer.shape
                    or value.dtype is not buffer.dtype):
                raise _LayoutChanged
            dsts.append(buffer)
            srcs.append(value)
            return buffer
        if kind is list or kind is tuple:
            if type(buffer) not in (list, tuple) or len(buffer) != len(value):
                raise _LayoutChanged
            staged = [self._walk(v, b, dsts, srcs) for v, b in zip(value, buffer)]
            return staged if kind is list else tuple(staged)
        if isinstance(value, DTensor):
            return self._walk_dtensor(value, buffer, dsts, srcs)
        if isinstance(value, ShardedTensor):
            return self._walk_sharded(value, buffer, dsts, srcs)
        if isinstance(value, torch.Tensor):  # another subclass: stage its plain data
            return self._walk(value.detach().as_subclass(torch.Tensor), buffer, dsts, srcs)
        if isinstance(value, io.BytesIO):
            return io.BytesIO(value.getvalue())  # mutable, and training's own
        if isinstance(value, _IMMUTABLE):
            return value
        if isinstance(value, dict):  # an OrderedDict or another mapping type
            if not isinstance(buffer, dict) or buffer.keys() != value.keys():
                raise _LayoutChanged
            return type(value)((k, self._walk(v, buffer[k], dsts, srcs)) for k, v in value.items())
        return copy.deepcopy(value)  # as torch's own staging does with other values

    def _walk_dict(self, value: dict, buffer: Any, dsts: list, srcs: list) -> dict:
        """A dict (or OrderedDict, as ``model.state_dict()`` returns) staged; its plain tensors
        and DTensors are handled inline, against their buffers' shapes, dtypes and DTensor
        specs noted once (a state dict is mostly tensors, and a call or an attribute of a
        buffer per tensor would cost as much as its copy)."""
        if type(buffer) is not dict or len(buffer) != len(value):
            raise _LayoutChanged
        expected = self._expected.get(id(buffer))
        if expected is None:
            expected = self._expected[id(buffer)] = {k: _expectation(b) for k, b in buffer.items()}
        staged = {}
        plain = torch.Tensor
        add_dst, add_src = dsts.append, srcs.append
        for key, v in value.items():
            try:
                kind, b, dst, shape, dtype, spec = expected[key]
            except KeyError:
                raise _LayoutChanged from None
            t = type(v)
            if t is plain:
                if kind is not _PLAIN or v.dtype is not dtype or v.shape != shape:
                    raise _LayoutChanged
                add_dst(dst)
                add_src(v)
                staged[key] = b
            elif t is DTensor and kind is _DTENSOR:  # FSDP2's parameters and optimizer state
                local = v._local_tensor
                if v._spec is spec and local.dtype is dtype and local.shape == shape:
                    add_dst(dst)
                    self.dtensor_sources[len(srcs)] = v
                    add_src(local)
                    staged[key] = b
                else:  # first seen (or changed): compare the spec by value, then by identity
                    staged[key] = self._walk_dtensor(v, b, dsts, srcs)
                    expected[key] = (kind, b, dst, shape, dtype, v._spec)
            elif t is dict:  # an optimizer's per-parameter state
                staged[key] = self._walk_dict(v, b, dsts, srcs)
            else:
                staged[key] = self._walk(v, b, dsts, srcs)
        return staged if type(value) is dict else type(value)(staged)

    def _walk_dtensor(self, value: DTensor, buffer: Any, dsts: list, srcs: list) -> DTensor:
        if not isinstance(buffer, DTensor):
            raise _LayoutChanged
        local, mine = value._local_tensor, buffer._local_tensor
        if local.shape != mine.shape or local.dtype is not mine.dtype:
            raise _LayoutChanged
        if value._spec is not buffer._spec and value._spec != buffer._spec:
            raise _LayoutChanged
        dsts.append(mine)
        self.dtensor_sources[len(srcs)] = value
        srcs.append(local)
        return buffer

    def _walk_sharded(self, value: ShardedTensor, buffer: Any, dsts: list, srcs: list
                      ) -> ShardedTensor:
        if not isinstance(buffer, ShardedTensor) or value.metadata() != buffer.metadata():
            raise _LayoutChanged
        shards, mine = value.local_shards(), buffer.local_shards()
        if len(shards) != len(mine):
            raise _LayoutChanged
        for s, b in zip(shards, mine):
            if (s.metadata.shard_offsets != b.metadata.shard_offsets
                    or s.tensor.shape != b.tensor.shape or s.tensor.dtype is not b.tensor.dtype):
                raise _LayoutChanged
            dsts.append(b.tensor)
            srcs.append(s.tensor)
        return buffer
