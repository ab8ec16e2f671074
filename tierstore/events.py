"""Events (what happened, with timings) and phases (where the engine is about to go).

Observers receive :class:`Event` objects through the ``tierstore_event`` hook. Fault injectors
and tracers receive phase names through ``tierstore_phase`` *before* each phase runs; raising
there fails the operation exactly as a real fault at that point would.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Event", "EventKind", "FROM_PEERS", "Phase"]

#: the source a ``loaded`` event's ``bytes_from`` names for files other ranks sent (peer fetch):
#: no tier can be called so (a tier name has no parentheses)
FROM_PEERS = "(peers)"


class EventKind:
    """Names of the events the engine emits (``Event.kind``)."""

    STAGED = "staged"            # async_save copied the state dict to host buffers
    WRITTEN = "written"          # one data file is written and durable on a tier
    COMMITTED = "committed"      # a checkpoint became visible on a tier
    LOADED = "loaded"            # a load finished reading this rank's items (tier: where most
    #                              of its bytes came from; detail bytes_from: bytes per tier)
    EVICTED = "evicted"          # retention (keep) deleted a checkpoint from a tier
    COLLECTED = "collected"      # gc removed what an interrupted save left behind
    FELL_BACK = "fell_back"      # a file was read from a slower tier than the first choice
    FAILED = "failed"            # a save, commit or load failed; detail['error'] says why
    DRAIN_STARTED = "drain_started"
    DRAIN_FINISHED = "drain_finished"
    EMERGENCY_SAVED = "emergency_saved"  # a preemption checkpoint is committed on the fastest tier
    REPLICATED = "replicated"    # this rank's files reached its peers (and theirs reached it)
    #: a load got a file, or the blocks of it it reads, from other ranks (detail: file, from:
    #: the first sender, senders, ranges: the byte ranges [start, end) that came, size: the
    #: file's; the event's nbytes: those that came)
    PEER_FETCHED = "peer_fetched"
    #: a load knows where each file it reads comes from, before it reads them (detail: the
    #: files [{name, bytes, tier, fast}] of this rank, sources [{tier, bytes}],
    #: from_slow_tiers_bytes: what ``tierstore plan`` says for the whole job, per rank)
    RESTORE_PLANNED = "restore_planned"
    UNREACHABLE = "unreachable"  # a tier did not answer; what could do without it went on
                                 # (detail: during, error); skipped for a while after
    REJECTED = "rejected"        # a copy read from a tier failed its checks and was skipped
                                 # (detail: file, error); readers went on to the next copy
    STALLED = "stalled"          # the watchdog saw a save or load make no progress
                                 # (detail: operations); every thread's stack is logged
    REPAIRED = "repaired"        # scrub replaced a bad copy on a tier from a good one
                                 # (detail: files, source)
    REBUILT = "rebuilt"          # a load rebuilt this rank's lost files from its parity set
                                 # (erasure strategy; tier: the rebuilt replica set; detail:
                                 # files, from_parity)

    OPENED = "opened"            # a training process opened the store (seconds: how long
                                 # the open took; detail: pid, world_size); each restart of
                                 # a job opens it again
    STEP = "step"                # the training code finished a step (Store.record_step;
                                 # detail: step; seconds: the step's own time)
    INTERVAL = "interval"        # an every = "auto" tier's interval was chosen (detail: every,
                                 # interval_s, cost_s, mtbf_s, step_s and their sources)
    ALL = (STAGED, WRITTEN, COMMITTED, LOADED, EVICTED, COLLECTED, FELL_BACK, FAILED,
           DRAIN_STARTED, DRAIN_FINISHED, EMERGENCY_SAVED, REPLICATED, PEER_FETCHED,
           RESTORE_PLANNED, UNREACHABLE, REJECTED, STALLED, REPAIRED, REBUILT, OPENED, STEP,
           INTERVAL)


class Phase:
    """Named points of the save and load paths, announced through ``tierstore_phase``."""

    STAGE = "stage"                    # before copying a state dict for async_save
    SAVE_BEGIN = "save_begin"          # writer.reset: id validated, staging directory next
    WRITE_FILE = "write_file"          # before one data file is written (detail: file)
    WRITE_METADATA = "write_metadata"  # coordinator, before .metadata is written
    WRITE_MANIFEST = "write_manifest"  # before the manifest (the commit point) is written
    PUBLISH = "publish"                # before the checkpoint is made visible (rename)
    RETAIN = "retain"                  # before keep/every retention deletes old checkpoints
    LOAD_BEGIN = "load_begin"          # reader.reset: finding the tier that holds the id
    READ_FILE = "read_file"            # before one data file is read (detail: file)
    DRAIN_BEGIN = "drain_begin"        # before copying a committed checkpoint to a slower tier
    DRAIN_FILE = "drain_file"          # before one file is copied (detail: file)
    DRAIN_COMMIT = "drain_commit"      # before the copy is committed on the slower tier
    EMERGENCY_SAVE = "emergency_save"  # preemption: before the emergency checkpoint is saved
    REPLICATE = "replicate"            # before this rank's files are sent to its peers
    PEER_FETCH = "peer_fetch"          # a load, before files missing here are fetched from peers
    VERIFY_FILE = "verify_file"        # store.verify, before one file is re-read (detail: file)
    COLLECT = "collect"                # gc, before one leftover is removed (detail: entry)

    ALL = (STAGE, SAVE_BEGIN, WRITE_FILE, WRITE_METADATA, WRITE_MANIFEST, PUBLISH, RETAIN,
           LOAD_BEGIN, READ_FILE, DRAIN_BEGIN, DRAIN_FILE, DRAIN_COMMIT, EMERGENCY_SAVE,
           REPLICATE, PEER_FETCH, VERIFY_FILE, COLLECT)


@dataclass(frozen=True)
class Event:
    """Something that happened, as plain data (what the CLI and observers print or aggregate)."""

    kind: str
    checkpoint_id: str | None = None
    tier: str | None = None
    rank: int = 0
    seconds: float = 0.0
    nbytes: int = 0
    detail: dict[str, Any] = field(default_factory=dict)
    at: float = field(default_factory=time.time)

    @property
    def throughput(self) -> float:
        """Bytes per second (0 when no time was measured)."""
        return self.nbytes / self.seconds if self.seconds > 0 else 0.0
