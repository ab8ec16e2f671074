"""The claims a saving store holds on its tiers' directories: one job per directory.

Two jobs saving into one directory replace each other's checkpoints of the same id, and each
restores from the other's (see :mod:`tierstore_plugins.claims` for what was seen). Before its
first save, every process of a job claims each tier's directory with the job's token (agreed
at open: :func:`agree_job_token`); a tier whose directory another job holds refuses the save,
with an error that says whose it is and what to do, before anything is written. Claims are held
until the store closes; a backend that cannot claim (an object store) claims nothing.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Iterable

from tierstore.errors import TierInUseError
from tierstore.plugin import DirectoryLock
from tierstore.tiers.tier import Tier

__all__ = ["TierClaims", "agree_job_token"]

log = logging.getLogger("tierstore.claims")

_TOKEN_BYTES = 8


def agree_job_token(group: Any) -> str:
    """A token naming this job, the same on every rank of ``group`` (rank 0's, in one
    broadcast of a few bytes); a fresh one without a group. Collective."""
    mine = os.urandom(_TOKEN_BYTES)
    if group is None:  # one process (an operator's `tierstore pin`): no torch to import
        return mine.hex()
    import torch
    import torch.distributed as dist

    token = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    dist.broadcast(token, group=group, group_src=0)
    return bytes(token.tolist()).hex()


class TierClaims:
    """This process's claims for job ``job`` (its token; None: a store that never saves, which
    claims nothing)."""

    def __init__(self, job: str | None):
        #: the job's token, handed to DCP's checkpoint process with a save
        self.job = job
        self._held: dict[str, DirectoryLock] = {}
        self._guard = threading.Lock()

    def take(self, tiers: Iterable[Tier]) -> str | None:
        """Claim every tier of ``tiers`` not claimed yet; the error's message when another job
        holds one (None: the save may go on). A claim that fails for another reason (the
        tier's storage fails) is tried again at the next save: a failing tier never stops the
        saves of the healthy ones, and its own writes fail on their own."""
        if self.job is None:
            return None
        with self._guard:
            for tier in tiers:
                if tier.name in self._held:
                    continue
                try:
                    got = tier.backend.claim(self.job)
                except Exception as exc:  # noqa: BLE001 - see the docstring
                    log.warning("tier '%s': could not claim its directory for this job (%s); "
                                "trying again at the next save", tier.name, exc)
                    continue
                if isinstance(got, str):
                    return in_use_message(tier, got)
                self._held[tier.name] = got
        return None

    def unclaimed_elsewhere(self, tiers: Iterable[Tier]) -> list[Tier]:
        """The tiers of ``tiers`` that no other job holds (what a scan for unmade drains may
        read from and copy to: another job's checkpoints are not this job's to copy), asked
        without claiming anything. All of them for a store that never saves."""
        tiers = list(tiers)
        if self.job is None:
            return tiers
        free = []
        for tier in tiers:
            try:
                holder = tier.backend.claimed_by(self.job)
            except Exception:  # noqa: BLE001 - the scan asks the tier itself, and says so
                holder = None
            if holder is None:
                free.append(tier)
            else:
                log.info("tier '%s' is held by %s: not resuming drains from or to it",
                         tier.name, holder)
        return free

    def release(self) -> None:
        """Let go of every claim (the store closes)."""
        with self._guard:
            held, self._held = list(self._held.values()), {}
        for lock in held:
            lock.release()


def in_use_message(tier: Tier, holder: str) -> str:
    """What a save refused on ``tier`` (held by ``holder``, in words) tells the user."""
    return (f"tier '{tier.name}' ({tier.backend.describe()}) is in use by {holder}: two jobs "
            f"saving into one directory replace each other's checkpoints of the same id, and "
            f"each would restore from the other's. Give this job a directory of its own (the "
            f"tier's `path`, for example with the job's name in it), or stop the other job "
            f"first. Nothing was written")


def refuse(problem: str | None) -> None:
    """Raise the :class:`TierInUseError` of ``problem`` (a message from :meth:`TierClaims.take`
    on some rank), if any."""
    if problem is not None:
        raise TierInUseError(problem)
