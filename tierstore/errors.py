"""The exceptions tierstore raises.

Every message starts with what went wrong in words a user knows, says where (file and key for
configuration, tier and file for data) and ends with what to do about it.
"""

from __future__ import annotations

__all__ = [
    "TierstoreError",
    "ConfigError",
    "PluginError",
    "CheckpointNotFound",
    "LIST_HINT",
    "IntegrityError",
    "CommitError",
    "DrainError",
    "ReplicationError",
    "StagingError",
    "TierFullError",
    "TierInUseError",
    "RanksLostError",
]


class TierstoreError(Exception):
    """Base class of every error tierstore raises on purpose."""


class ConfigError(TierstoreError, ValueError):
    """The configuration (TOML file or dict) is wrong; the message names the key and valid choices."""


class PluginError(TierstoreError):
    """A plugin could not be loaded or registered; the message names the plugin and where it came from."""


class CheckpointNotFound(TierstoreError, FileNotFoundError):
    """No tier holds a complete copy of the requested checkpoint."""


#: how a CheckpointNotFound's message ends: where to see what is stored (the ``tierstore``
#: command says its own ``tierstore ls`` instead)
LIST_HINT = "store.list() shows what is stored"


class IntegrityError(TierstoreError):
    """Stored bytes do not match the manifest (size or checksum) and no good copy was found."""


class CommitError(TierstoreError):
    """A checkpoint could not be made visible (e.g. the id already exists and overwrite is off)."""


class TierInUseError(CommitError):
    """A save was refused because another job (or another open store of this process) saves
    into the same tier directory; the message names the tier, its directory and the holder.
    Nothing was written."""


class DrainError(TierstoreError):
    """Copying a committed checkpoint down to a slower tier failed; ``store.wait()`` raises it.

    ``checkpoint_id`` and ``tier`` say which copy is missing; the checkpoint is still complete on
    the tier it was saved to."""

    def __init__(self, message: str, checkpoint_id: str | None = None, tier: str | None = None):
        super().__init__(message)
        self.checkpoint_id = checkpoint_id
        self.tier = tier


class ReplicationError(DrainError):
    """Replicating a committed checkpoint to this rank's peers (the ``peer`` tier) failed;
    ``store.wait()`` raises it. A kind of :class:`DrainError` (both are background copies), so
    ``except DrainError`` catches it too."""


class TierFullError(TierstoreError, OSError):
    """A tier ran out of space (or quota: ``errno`` is ENOSPC or EDQUOT) while a checkpoint was
    written to it, whichever write found no room (a data file, ``.metadata``, the manifest, the
    staging directory); the message names the tier, the path, the bytes needed and free.
    Nothing was committed: the previous checkpoints are intact, and what the save wrote is
    removed when it fails (where other ranks write the same directory: by the next save or
    ``gc``)."""


class StagingError(TierstoreError):
    """A state dict could not be staged for ``dcp.async_save``: training changed a tensor before
    a lazy staging had copied it, or a budgeted staging's waves could not be written to the
    first tier. That save fails (through its futures); the checkpoints before it are intact."""


class RanksLostError(TierstoreError, RuntimeError):
    """A collective of the store's process group failed: a rank died or did not take part
    within ``[store] collective_timeout`` seconds. The message names the ranks that did not
    answer; the job's process groups are unusable after it: restart the job (the last
    committed checkpoint is intact)."""
