"""tierstore: multi-tier checkpoint storage for PyTorch Distributed Checkpoint (DCP).

    import torch.distributed.checkpoint as dcp
    import tierstore

    with tierstore.open("tiers.toml") as store:
        dcp.save(state_dict, storage_writer=store.writer(), checkpoint_id="step-100")
        dcp.load(state_dict, storage_reader=store.reader(), checkpoint_id=store.latest())
"""

from __future__ import annotations

from tierstore.errors import (CheckpointNotFound, CommitError, ConfigError, DrainError,
                              IntegrityError, PluginError, RanksLostError, ReplicationError,
                              StagingError,
                              TierFullError, TierstoreError)
from tierstore.events import Event, EventKind, Phase
from tierstore.plugin.host import hookimpl
from tierstore.store import Store, open
from tierstore.engine.parity import ParityCheck
from tierstore.tiers.reports import CheckpointInfo, VerifyReport
from tierstore.version import __version__

__all__ = [
    "__version__",
    "open",
    "Store",
    "hookimpl",
    "CheckpointInfo",
    "VerifyReport",
    "ParityCheck",
    "Event",
    "EventKind",
    "Phase",
    "TierstoreError",
    "ConfigError",
    "PluginError",
    "CheckpointNotFound",
    "IntegrityError",
    "CommitError",
    "DrainError",
    "ReplicationError",
    "RanksLostError",
    "StagingError",
    "TierFullError",
]
