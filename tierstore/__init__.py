"""tierstore: multi-tier checkpoint storage for PyTorch Distributed Checkpoint (DCP).

    import torch.distributed.checkpoint as dcp
    import tierstore

    with tierstore.open("tiers.toml") as store:
        dcp.save(state_dict, storage_writer=store.writer(), checkpoint_id="step-100")
        dcp.load(state_dict, storage_reader=store.reader(), checkpoint_id=store.latest())
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tierstore.errors import (CheckpointNotFound, CommitError, ConfigError, DrainError,
                              IntegrityError, PluginError, RanksLostError, ReplicationError,
                              StagingError, TierFullError, TierInUseError, TierstoreError)
from tierstore.events import Event, EventKind, Phase
from tierstore.version import __version__

if TYPE_CHECKING:  # imported when first used (see __getattr__); listed here for tools
    from tierstore.engine.parity import ParityCheck
    from tierstore.plugin.host import hookimpl
    from tierstore.store import Store, open
    from tierstore.tiers.reports import CheckpointInfo, VerifyReport

#: names whose modules import the whole store (and torch, for parity): imported on first use, so
#: that what needs none of it (``tierstore --version``, an error class) starts at once
_LAZY = {"open": "tierstore.store", "Store": "tierstore.store",
         "hookimpl": "tierstore.plugin.host", "ParityCheck": "tierstore.engine.parity",
         "CheckpointInfo": "tierstore.tiers.reports", "VerifyReport": "tierstore.tiers.reports"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: the next access is a plain attribute
    return value

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
    "TierInUseError",
]
