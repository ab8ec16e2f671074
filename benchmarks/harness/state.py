"""The state dicts the benchmarks save, and how they check what a load gave back.

Flat state dicts (``make_state_dict``: fp32 tensors of random data) for the throughput
benchmarks; nested ones (``{"model": ..., "optim": ...}`` with DTensors) are walked as DCP's
``flatten_state_dict`` walks them, so a copy loop, a raw write and a check see the same entries
a save does.
"""

from __future__ import annotations

import copy
import ctypes
import os
from typing import Any, Iterator

import torch

#: bytes in a GB: every GB/s figure of the benchmarks is 10^9 bytes per second
GB = 1e9


def make_state_dict(size_mib: int, tensors: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``tensors`` fp32 tensors of random data totalling ``size_mib`` MiB (the last one takes
    the remainder). 2-D where the size allows, like real weights."""
    total = size_mib * (1 << 20) // 4
    if tensors < 1 or total < tensors:
        raise SystemExit(f"--tensors must be between 1 and the number of floats ({total})")
    gen = torch.Generator().manual_seed(seed)
    per = total // tensors
    sd = {}
    for i in range(tensors):
        numel = per if i < tensors - 1 else total - per * (tensors - 1)
        shape = (numel // 1024, 1024) if numel % 1024 == 0 else (numel,)
        sd[f"layer{i:03d}.weight"] = torch.randn(shape, generator=gen, dtype=torch.float32)
    return sd


def rank_state_dict(size_mib: int, tensors: int, rank: int) -> dict[str, torch.Tensor]:
    """:func:`make_state_dict` for one rank of a job: seeded by the rank, its keys carrying
    it (``rank<r>.``), so that no two ranks save the same entry."""
    return {f"rank{rank}.{k}": v
            for k, v in make_state_dict(size_mib, tensors, seed=rank).items()}


def nbytes_of(sd: dict[str, torch.Tensor]) -> int:
    """Tensor payload in bytes: the figure every contender's GB/s is computed from."""
    return sum(t.nbytes for t in sd.values())


def check_equal(what: str, dest: dict[str, torch.Tensor], sd: dict[str, torch.Tensor]) -> None:
    """Fail loudly (``<what> returned wrong data for '<key>'``) when a load did not reproduce
    the saved tensors."""
    for key, ref in sd.items():
        if not torch.equal(dest[key].to(ref.device), ref):
            raise SystemExit(f"{what} returned wrong data for '{key}'")


# -- nested state dicts (get_state_dict's {"model": ..., "optim": ...}) ---------------------------

def _is_leaf(value: Any) -> bool:
    """Whether DCP's flatten_state_dict stops at ``value``: anything but a dict, and a list with
    no tensor, dict or non-leaf list in it (a list of FQNs, a tuple of betas: one entry)."""
    if isinstance(value, dict):
        return False
    if not isinstance(value, list):
        return True
    return not any(isinstance(v, torch.Tensor) or not _is_leaf(v) for v in value)


def leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every entry DCP saves of a nested state dict, as (dotted key, value): tensors (a DTensor
    as itself) and non-tensor values, descending into dicts and lists as DCP's
    flatten_state_dict does."""
    if _is_leaf(obj):
        yield prefix, obj
        return
    items = obj.items() if isinstance(obj, dict) else enumerate(obj)
    for k, v in items:
        yield from leaves(v, f"{prefix}.{k}" if prefix else str(k))


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def flat_tensors(obj: Any) -> dict[str, torch.Tensor]:
    """The tensors of a nested state dict under dotted keys, each DTensor as its local shard:
    what a copy loop or a raw write of this rank's state goes over."""
    return {k: local_tensor(v) for k, v in leaves(obj) if isinstance(v, torch.Tensor)}


def blank_like(obj: Any) -> Any:
    """A load destination for a nested state dict: the same nesting in new containers, every
    tensor a new zeroed one of the same shape and dtype (a DTensor one on the same mesh with the
    same placements), every other value a deep copy."""
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "to_local"):
            from torch.distributed.tensor import DTensor
            return DTensor.from_local(torch.zeros_like(obj.to_local()), obj.device_mesh,
                                      obj.placements, run_check=False, shape=obj.shape,
                                      stride=obj.stride())
        return torch.zeros_like(obj)
    if isinstance(obj, dict):
        return {k: blank_like(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [blank_like(v) for v in obj]
    return copy.deepcopy(obj)


def mismatched_keys(dest: Any, sd: Any) -> list[str]:
    """The dotted keys where a loaded nested state dict differs from the saved one: tensors
    compared bit for bit (``torch.equal`` of the local shards), other values with ``==``."""
    got = dict(leaves(dest))
    bad = []
    for key, ref in leaves(sd):
        if key not in got:
            bad.append(key)
        elif isinstance(ref, torch.Tensor):
            if not (isinstance(got[key], torch.Tensor)
                    and torch.equal(local_tensor(got[key]), local_tensor(ref))):
                bad.append(key)
        elif got[key] != ref:
            bad.append(key)
    return bad


# -- raw bytes ---------------------------------------------------------------------------------

def tensor_view(t: torch.Tensor) -> memoryview:
    """A byte view of a contiguous CPU tensor's memory, without a copy (numpy may be absent)."""
    assert t.is_contiguous() and t.device.type == "cpu"
    return memoryview((ctypes.c_char * t.nbytes).from_address(t.data_ptr())).cast("B")


def write_raw(path: str, tensors: list[torch.Tensor]) -> None:
    """The tensors' bytes written straight from their memory into one new file with
    ``os.write``, then ``fsync``: what the disk and the kernel allow."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in tensors:
            if t.nbytes == 0:
                continue
            view = tensor_view(t)
            done = 0
            while done < len(view):  # os.write may write less than asked
                done += os.write(fd, view[done:])
        os.fsync(fd)
    finally:
        os.close(fd)
