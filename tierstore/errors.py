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
    "IntegrityError",
    "CommitError",
]


class TierstoreError(Exception):
    """Base class of every error tierstore raises on purpose."""


class ConfigError(TierstoreError, ValueError):
    """The configuration (TOML file or dict) is wrong; the message names the key and valid choices."""


class PluginError(TierstoreError):
    """A plugin could not be loaded or registered; the message names the plugin and where it came from."""


class CheckpointNotFound(TierstoreError, FileNotFoundError):
    """No tier holds a complete copy of the requested checkpoint."""


class IntegrityError(TierstoreError):
    """Stored bytes do not match the manifest (size or checksum) and no good copy was found."""


class CommitError(TierstoreError):
    """A checkpoint could not be made visible (e.g. the id already exists and overwrite is off)."""
