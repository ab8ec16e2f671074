"""tierstore: multi-tier checkpoint storage for PyTorch Distributed Checkpoint (DCP).

    import torch.distributed.checkpoint as dcp
    import tierstore

    with tierstore.open("tiers.toml") as store:
        dcp.save(state_dict, storage_writer=store.writer(), checkpoint_id="step-100")
        dcp.load(state_dict, storage_reader=store.reader(), checkpoint_id=store.latest())
"""

from __future__ import annotations

__version__ = "0.1.0"

from .errors import (CheckpointNotFound, CommitError, ConfigError, DrainError,  # noqa: E402
                     IntegrityError, PluginError, StagingError, TierstoreError)
from .events import Event, EventKind, Phase  # noqa: E402
from .info import CheckpointInfo, VerifyReport  # noqa: E402
from .plugin_manager import hookimpl  # noqa: E402
from .store import Store, open  # noqa: E402

__all__ = [
    "__version__",
    "open",
    "Store",
    "hookimpl",
    "CheckpointInfo",
    "VerifyReport",
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
    "StagingError",
]
