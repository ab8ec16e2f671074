"""Where this process sits in the job (rank, node) and the store's own collectives.

Everything here works without torch.distributed: a single process is rank 0 of 1 on node 0.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

__all__ = ["RankContext", "rank_context", "make_store_group", "all_gather_object",
           "broadcast_object"]


@dataclass(frozen=True)
class RankContext:
    """Rank, local rank, node index (torchrun's GROUP_RANK) and world size of this process."""

    rank: int = 0
    local_rank: int = 0
    node: int = 0
    world_size: int = 1

    def placeholders(self) -> dict[str, int]:
        """Values for ``{rank}``, ``{local_rank}`` and ``{node}`` in tier paths."""
        return {"rank": self.rank, "local_rank": self.local_rank, "node": self.node}


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def rank_context(process_group: Any = None) -> RankContext:
    """The context of this process, from torch.distributed when initialized, else from torchrun's
    environment variables, else rank 0 of 1."""
    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank(process_group)
        world = dist.get_world_size(process_group)
    else:
        rank = _env_int("RANK", 0)
        world = _env_int("WORLD_SIZE", 1)
    return RankContext(rank=rank, local_rank=_env_int("LOCAL_RANK", 0),
                       node=_env_int("GROUP_RANK", 0), world_size=world)


def make_store_group(process_group: Any = None) -> Any:
    """A gloo group for the store's own collectives (None without torch.distributed).

    Collective: every rank must call it (``tierstore.open`` is called on every rank). A group of
    its own keeps checkpoint collectives, which may run in background threads, from interleaving
    with the training's collectives on the default group.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
    return dist.new_group(ranks=ranks, backend="gloo")


def all_gather_object(obj: Any, group: Any) -> list[Any]:
    """``[obj]`` without torch.distributed, else every rank's ``obj`` in rank order."""
    if group is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, group: Any, src_group_rank: int = 0) -> Any:
    """Rank ``src_group_rank``'s ``obj`` on every rank (``obj`` itself without a group)."""
    if group is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, group=group, group_src=src_group_rank)
    return box[0]
