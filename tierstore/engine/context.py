"""The narrow context services get instead of the Store: plain data, built once at open."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tierstore.config.validate import StoreConfig
from tierstore.plugin.host import PluginHost
from tierstore.tiers.tierset import TierSet
from tierstore.transport.collectives import RankContext

__all__ = ["StoreContext", "Groups"]


@dataclass(frozen=True)
class Groups:
    """The store's own gloo process groups (all None without torch.distributed)."""

    #: ``Store.process_group``: latest(), loads' metadata agreement, wait(all_ranks=True)
    main: Any = None
    #: collectives inside saves and loads (publishing parts, peer fetch), which may run in a
    #: background thread while the main thread uses ``main``
    io: Any = None
    #: peer replication's thread
    replication: Any = None


@dataclass(frozen=True)
class StoreContext:
    """What every service of one store may know: its validated config, its plugin host, where
    this process sits in the job, its tiers and its process groups."""

    config: StoreConfig
    host: PluginHost
    job: RankContext
    tiers: TierSet
    groups: Groups

    @property
    def rank(self) -> int:
        """This process's rank (0 without torch.distributed)."""
        return self.job.rank

    @property
    def copy_chunk_bytes(self) -> int:
        """Piece size of background copies, replication and peer fetches."""
        return self.config.copy_chunk_mib << 20
