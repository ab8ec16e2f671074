"""The state dicts a trial saves, and their bitwise comparison.

What a checkpoint holds is a function of its id and the trial's seed alone, so any process (the
faulty job, the checker, a reproduction run) can rebuild what must come back from a load.
"""

from __future__ import annotations

import re
from typing import Any

import torch

__all__ = ["blank_like", "differences", "state_for", "step_of"]


def step_of(checkpoint_id: str) -> int:
    """The trailing integer of an id (``step-7`` -> 7), as tierstore reads it."""
    match = re.search(r"(\d+)$", checkpoint_id)
    if match is None:
        raise ValueError(f"checkpoint id {checkpoint_id!r} has no step number")
    return int(match.group(1))


def state_for(checkpoint_id: str, seed: int, shared: bool = False) -> dict[str, Any]:
    """The state saved under ``checkpoint_id`` in the trial of ``seed``: small tensors of three
    dtypes (so several data files are written) and two non-tensor values; with ``shared``,
    also a frozen part the same in every save of the trial (on a deduplicated tier, chunks
    every checkpoint names)."""
    step = step_of(checkpoint_id)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    frozen = ({"frozen.weight": torch.randn(64, 64, generator=torch.Generator().manual_seed(
        seed))} if shared else {})
    return {
        **frozen,
        "model.weight": torch.randn(16, 8, generator=gen),
        "model.bias": torch.randint(-1000, 1000, (8,), generator=gen),
        "model.emb": torch.randn(32, generator=gen).to(torch.bfloat16),
        "optim.exp_avg": torch.randn(16, 8, generator=gen),
        "step": step,
        "note": f"{checkpoint_id} of seed {seed}",
    }


def blank_like(state: dict[str, Any]) -> dict[str, Any]:
    """A load target for ``state``: zero tensors in fresh memory, non-tensor values replaced by
    ones no checkpoint holds, so a value that was not loaded cannot pass for one that was."""
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None
            for k, v in state.items()}


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """A copy of a load target as it is now (tensors cloned), to compare it with after a load
    that failed: a failed load must leave its destination exactly as it found it."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def changed_by_failed_load(got: dict[str, Any], before: dict[str, Any]) -> str | None:
    """What a failed load changed in its destination (``before``: its :func:`snapshot`), or
    None when it is bitwise as it was."""
    wrong = differences(got, before)
    return "; ".join(wrong) if wrong else None


def differences(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """What differs between a loaded state and the saved one: keys, tensor dtypes, shapes and
    bytes (``torch.equal``), and non-tensor values (``==``); empty when they are equal."""
    out = []
    if sorted(got) != sorted(want):
        out.append(f"keys {sorted(got)} != {sorted(want)}")
    for key in sorted(set(got) & set(want)):
        a, b = got[key], want[key]
        if isinstance(b, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                out.append(f"{key}: {type(a).__name__} instead of a tensor")
            elif a.dtype != b.dtype or a.shape != b.shape:
                out.append(f"{key}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}")
            elif not torch.equal(a, b):
                out.append(f"{key}: values differ")
        elif a != b:
            out.append(f"{key}: {a!r} != {b!r}")
    return out
