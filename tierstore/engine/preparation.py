"""The clients of remote tiers made ready before the first copy to them needs them.

A restart makes no client for a tier it does not touch: one rank checks and lists an object
store's tier for the whole job, and a load reads it only for what the nodes do not hold, so the
other ranks import no object-store client at all while the job restarts. But every rank copies
its own files of a node-local checkpoint to the shared tiers behind it, so its first drain
there would import the client and make its session (s3fs and botocore: 0.3-1 s of CPU on a
busy host) on the time to durable of that checkpoint, where a stock DCP job makes its client
when it starts. The first save of a process starts that work in the background
(:meth:`TierPreparation.start`, once): by then the restart is over, and the first copy finds
the client made. A failure there is left to the copy, which meets it again and says so.
"""

from __future__ import annotations

import logging
import threading

from tierstore.tiers.tier import Tier

__all__ = ["TierPreparation"]

log = logging.getLogger("tierstore")


class TierPreparation:
    """Prepares (``Backend.prepare``) the remote tiers of one store, once, in the background."""

    def __init__(self, tiers: list[Tier]):
        #: the tiers whose bytes are not on this machine's filesystems (object stores)
        self.tiers = [t for t in tiers if t.backend.local_path("") is None]
        self._started = False
        self._lock = threading.Lock()

    def start(self) -> None:
        """Prepare every remote tier on a daemon thread; the calls after the first do nothing."""
        with self._lock:
            if self._started or not self.tiers:
                return
            self._started = True
        threading.Thread(target=self._prepare_all, name="tierstore-prepare", daemon=True).start()

    def _prepare_all(self) -> None:
        for tier in self.tiers:
            try:
                tier.backend.prepare()
            except Exception:  # noqa: BLE001 - the first copy meets it again, and says so
                log.debug("preparing tier '%s' failed", tier.name, exc_info=True)
