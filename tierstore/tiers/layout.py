"""Which ranks share a tier's directory: the layout of each tier across the job.

A tier is **shared** when every rank sees one directory (one host, or a shared filesystem or
object store): the coordinator publishes each checkpoint there with one commit. It is
**node-local** when groups of ranks see different directories (``{node}`` or ``{rank}`` in the
path, or node-local disks on several hosts): each group's lowest rank publishes the group's
*part* of the checkpoint, and a checkpoint counts as complete on the tier only when every part is
(``Store.latest()`` agrees on that with a collective).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

from tierstore.transport.collectives import RankContext, all_gather_message
from tierstore.transport.shapes import as_list, as_str, as_tuple
from tierstore.errors import ConfigError

__all__ = ["TierLayout", "compute_layouts", "SINGLE"]


@dataclass(frozen=True)
class TierLayout:
    """This rank's view of one tier's layout (plain data)."""

    #: index of the group of ranks sharing this rank's directory, and how many groups there are
    part: int = 0
    parts: int = 1
    #: the ranks in this rank's group (their files live in this rank's directory)
    part_ranks: tuple[int, ...] = (0,)
    #: the ranks of every group, by part index
    all_parts: tuple[tuple[int, ...], ...] = ((0,),)

    @property
    def shared(self) -> bool:
        """One directory for the whole job."""
        return self.parts == 1

    @property
    def leader(self) -> int:
        """The rank that publishes this group's part."""
        return self.part_ranks[0]

    def part_of(self, rank: int) -> int:
        """The part holding ``rank``'s files."""
        return next(i for i, ranks in enumerate(self.all_parts) if rank in ranks)


SINGLE = TierLayout()


def compute_layouts(tiers: list[Any], ctx: RankContext, group: Any, source: Any) -> list[TierLayout]:
    """Collective under torch.distributed (every rank calls it from ``tierstore.open``): group
    the ranks of each tier by the directory they see. ``shared = true`` in a tier's config says
    that one path on several hosts is one filesystem; otherwise a directory is identified by its
    host and path."""
    if group is None:
        return [SINGLE for _ in tiers]
    host = socket.gethostname()
    mine = [t.backend.describe() if t.config.shared else (host, t.backend.describe())
            for t in tiers]
    views = all_gather_message(mine, group, lambda v: _view_from(v, len(tiers)),
                               f"one location per tier ({len(tiers)})")
    layouts = []
    for i, tier in enumerate(tiers):
        keys: dict[Any, list[int]] = {}
        for rank, view in enumerate(views):
            keys.setdefault(view[i], []).append(rank)
        if tier.config.shared and len(keys) > 1:
            where = source.where("tier", tier.config.index, "shared")
            raise ConfigError(
                f"{where}: tier '{tier.name}' says shared = true but its path differs between "
                f"ranks ({', '.join(sorted(map(str, keys)))}); remove {{rank}}/{{node}} from the "
                f"path or set shared = false"
            )
        all_parts = tuple(tuple(r) for r in sorted(keys.values()))
        part = next(p for p, ranks in enumerate(all_parts) if ctx.rank in ranks)
        layouts.append(TierLayout(part, len(all_parts), all_parts[part], all_parts))
    return layouts


def _view_from(value: Any, count: int) -> list:
    """One rank's locations of the ``count`` tiers (``describe()``, with its host for a tier
    that is not shared), from the plain data it sent."""
    views = as_list(value, lambda v: v if isinstance(v, str) else as_tuple(v, as_str, as_str))
    if len(views) != count:
        raise ValueError(f"{len(views)} locations for {count} tiers")
    return views
