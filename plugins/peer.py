"""Backend ``peer``: a node's RAM (or disk) holding its own ranks' files plus the replicas other
ranks send it over torch.distributed, so that a lost node's shards come back from its peers.

The directory holds checkpoints in the usual layout; the replicas this rank keeps for rank ``s``
live under ``.replicas/<s>-held-by-<this rank>/`` in the same layout (a manifest naming rank
``s``). Which ranks send to which is the ``replication`` table's strategy (a plugin:
``clique``, ``ring``); moving the bytes is the store's (tierstore.engine.replication).
"""

from __future__ import annotations

import logging
import os
import re

from tierstore.plugin import hookimpl, IntegrityError, Option

from .local import LocalBackend, local_path_problem
from .safe_fs import is_dir_at

__all__ = ["PeerBackend", "REPLICA_DIR", "PARITY_DIR"]

log = logging.getLogger("tierstore")

#: directory (under the tier root) of the replicas this rank keeps for other ranks
REPLICA_DIR = ".replicas"
#: directory (under the tier root) of the parity each rank keeps (``erasure`` strategy)
PARITY_DIR = ".parity"
_REPLICA_NAME = re.compile(r"(0|[1-9][0-9]{0,8})-held-by-(0|[1-9][0-9]{0,8})")


class PeerBackend(LocalBackend):
    """A local directory (tmpfs by default, no fsync) that also receives peers' replicas."""

    options = (
        # This user's own name in /dev/shm (by uid), as the memory tier's: a name another
        # user could take first would refuse the tier (see plugins/ownership.py).
        Option("path", str, default=f"/dev/shm/tierstore-peer-{os.geteuid()}/{{node}}",
               expand=True, check=local_path_problem,
               description="directory of this node's copies; use {node} (or {rank}) "
                           "(default: /dev/shm/tierstore-peer-<uid>/{node})"),
        Option("replication", dict, required=True,
               description="table with 'strategy' (clique, ring) and the strategy's options, "
                           "e.g. { strategy = \"clique\", factor = 2, jump = 1 }"),
        Option("fsync", bool, default=False, description="fsync files (for a disk path)"),
    )

    def __init__(self, root: str, path: str | None = None, replication: dict | None = None,
                 fsync: bool = False):
        # Recycling: saves, replicas and sends reuse the pages (and mappings) of the
        # checkpoints that ``keep`` drops (tierstore_plugins.recycle).
        super().__init__(root, path, fsync=fsync, recycle=True)
        self.replication = dict(replication or {})

    def replica_backend(self, src: int, holder: int) -> LocalBackend:
        """Where rank ``holder`` keeps the replicas of rank ``src``'s files (recycling too)."""
        # Reached from this tier's root without following links: a ``.replicas`` swapped for
        # a link must not take the replicas (and their recycle bins) elsewhere.
        return LocalBackend(os.path.join(self.root, REPLICA_DIR, f"{src}-held-by-{holder}"),
                            fsync=self.durable, recycle=True, inside=self.root)

    def parity_backend(self, holder: int) -> LocalBackend:
        """Where rank ``holder`` keeps its share of its parity set's parity (recycling too),
        reached from this root without following links, as replicas are."""
        return LocalBackend(os.path.join(self.root, PARITY_DIR, f"held-by-{holder}"),
                            fsync=self.durable, recycle=True, inside=self.root)

    def replica_sets(self) -> list[tuple[int, int]]:
        """``(src, holder)`` of each ``.replicas/<src>-held-by-<holder>`` directory here (other
        names, and anything a link put there, are no replicas: the listing does not follow
        links, and replica_backend reaches each through this root)."""
        try:
            with self._tree.directory(self._rel(REPLICA_DIR)) as fd:
                names = [n for n in os.listdir(fd)
                         if _REPLICA_NAME.fullmatch(n) and is_dir_at(fd, n)]
        except (FileNotFoundError, NotADirectoryError):
            return []
        except IntegrityError as exc:  # .replicas is a link: nothing there is ours to serve
            log.warning("tier at %s: not serving replicas: %s", self.root, exc)
            return []
        return sorted((int(m[1]), int(m[2])) for m in map(_REPLICA_NAME.fullmatch, names))


@hookimpl
def tierstore_register_backends(register):
    register("peer", PeerBackend)
