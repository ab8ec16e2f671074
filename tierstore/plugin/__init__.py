"""The public plugin API: everything a plugin author (and every built-in plugin) imports.

Layer: plugin. It owns the hook specifications (``tierstore.hookspecs``), the base class of each
plugin kind with its contract (:mod:`tierstore.plugin.bases`), declared config keys
(:mod:`tierstore.plugin.options`), the per-store plugin host (:mod:`tierstore.plugin.host`) and
the retry helper offered to remote backends (:mod:`tierstore.plugin.retry`). It may import the
foundation (``tierstore.errors``, ``tierstore.events``, ``tierstore.version``), ``tierstore.format``
and ``tierstore.transport``; nothing above it.

A plugin is a module (or object) with hook implementations::

    # my_company/tierstore_ext.py
    from tierstore.plugin import Backend, Option, hookimpl

    class MyBackend(Backend):
        options = (Option("path", str, required=True, expand=True, description="where"),)
        def __init__(self, root: str, path: str): ...

    @hookimpl
    def tierstore_register_backends(register):
        register("mine", MyBackend)

registered either by ``[store] plugins = ["my_company.tierstore_ext"]`` in the TOML or by an
entry point in the plugin package's ``pyproject.toml``::

    [project.entry-points.tierstore]
    mine = "my_company.tierstore_ext"

Check it with the conformance kit, ``tierstore_conformance`` (one test class per kind).
"""

from tierstore.errors import (CommitError, ConfigError, IntegrityError, PluginError, StagingError,
                              TierstoreError)
from tierstore.events import Event, EventKind, Phase
from tierstore.format.checksum import Hasher, checksum_of
from tierstore.format.paths import confined
from tierstore.format.manifest import MANIFEST_NAME, METADATA_NAME, FileEntry, Manifest
from tierstore.plugin.bases import (Backend, Codec, CommitProtocol, DirectoryLock,
                                    ReplicationStrategy, Stager)
from tierstore.plugin.host import hookimpl
from tierstore.plugin.options import Option
from tierstore.plugin.retry import GaveUp, RetryPolicy, cannot_connect, foreground, with_retries
from tierstore.plugin.staging import StagingJob, StagingStats
from tierstore.transport.ends import (DescriptorEnd, FileSource, MappedFile, TransferEnd,
                                      WrittenFile, map_populated)

__all__ = [
    "hookimpl", "Option",
    "Backend", "CommitProtocol", "Codec", "Stager", "StagingJob", "StagingStats",
    "ReplicationStrategy", "DirectoryLock",
    "TransferEnd", "DescriptorEnd", "MappedFile", "WrittenFile", "FileSource", "map_populated",
    "Event", "EventKind", "Phase",
    "MANIFEST_NAME", "METADATA_NAME", "Manifest", "FileEntry", "Hasher", "checksum_of",
    "RetryPolicy", "with_retries", "GaveUp", "cannot_connect", "foreground",
    "CommitError", "ConfigError", "IntegrityError", "PluginError", "StagingError",
    "TierstoreError",
    "confined",
]
