"""tierstore's conformance kit: the tests every plugin (backend, commit protocol, codec, staging,
replication strategy, observer) must pass.

The built-in plugins pass these same tests (``tests/test_conformance_builtin.py``). To check your
own plugin, subclass the test classes in a test module of your package, give them fixtures for
your plugin, and run pytest::

    # tests/test_my_backend.py
    import pytest
    from tierstore_conformance import RenameBackendTests, StockLoadableRoundTripTests
    from my_company.tierstore_ext import MyBackend

    # MyBackend declares supports_rename = True; an object store (False) uses BackendTests
    class TestMyBackend(RenameBackendTests):
        # modules that register your plugins, if they are not installed as entry points
        plugin_modules = ("my_company.tierstore_ext",)

        @pytest.fixture
        def backend(self, tmp_path):            # required: a fresh, empty root per test
            backend = MyBackend(root=str(tmp_path / "tier"))
            yield backend
            backend.close()

        @pytest.fixture
        def unreachable_backend(self, tmp_path):  # required: a root that cannot be written
            blocker = tmp_path / "a-file"         # (check_reachable must say why)
            blocker.write_bytes(b"")
            backend = MyBackend(root=str(blocker / "tier"))
            yield backend
            backend.close()

        # optional: a commit protocol other than the backend's default_commit
        # @pytest.fixture
        # def commit_protocol(self): return MyCommit()

        # needed when MyBackend.local_path() is None: read a file without the backend
        # def backdoor_read(self, backend, path): return my_client.get(...)  # None if missing

    # first tier a filesystem without codecs; otherwise use RoundTripTests
    class TestMyBackendRoundTrip(StockLoadableRoundTripTests):
        @pytest.fixture
        def store_config(self, tmp_path):       # required: tierstore.open() config, fresh roots
            return {"store": {"plugins": ["my_company.tierstore_ext"]},
                    "tier": [{"name": "mine", "backend": "mine", "path": str(tmp_path / "t")}]}

then ``python -m pytest tests/test_my_backend.py``. The base classes have no ``Test`` prefix, so
pytest collects only your subclasses. Your subclass must use a ``Test`` prefix. The plugins page
of the documentation (``docs/plugins.md``, "Writing a backend") has a complete backend without
rename and its test module, with the ``backdoor_read`` a backend without ``local_path()`` needs.

No test is ever skipped: a test either checks something or fails saying what is missing. Pick the
classes that match what your plugin declares; tests fail when they do not:

- :class:`BackendTests`: the backend primitives (write/read, ``size``, ``list``, ``delete``,
  ``readinto``, ``check_reachable`` on a fresh and on an unreachable root), files outliving the
  instance that wrote them (override :meth:`BackendTests.reopen` if your backend needs more than
  ``root`` to be built), backdoor reads of the real files (through ``local_path()``, or override
  :meth:`BackendTests.backdoor_read`), the commit protocol (nothing visible before ``commit``,
  ``abort``, leftovers recognised, overwrite), and what ``Tier.verify`` finds after a flipped
  byte, a truncated file or a missing one. For backends with ``supports_rename = False``.
- :class:`RenameBackendTests`: all of :class:`BackendTests` plus ``rename`` of files, trees and
  with ``replace``. Required for backends with ``supports_rename = True``.
- :class:`RoundTripTests`: real ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` through a store,
  compared bit for bit; ``list``/``latest``/``verify``; saving an existing id with ``[store]
  overwrite`` off (refused, first kept) and on (replaced); invalid ids refused before anything is
  written; a missing id is ``CheckpointNotFound``.
- :class:`StockLoadableRoundTripTests`: all of :class:`RoundTripTests` plus stock ``dcp.load``
  reading the checkpoint straight from the first tier, for configs whose first tier is a
  filesystem (``local_path()``) without codecs (a test fails if it is not).

The other plugin kinds have a class each, with the same conventions (a required fixture that
fails saying what is missing, optional ones with defaults; see each class's docstring):

- :class:`CodecTests` (fixture ``codec``, an instance): ``extension()`` is a DCP
  ``StreamTransformExtension``; bytes written through it (empty, small, several MiB random and
  repetitive) read back identical through DCP's ``ExtensionRegistry`` from the descriptor; a
  ``dcp.save`` / ``dcp.load`` round trip through a store whose tier uses the codec (registered
  by a small plugin object, fixture ``codec_plugin``) is bitwise equal and records the
  descriptor on every item; stock DCP's ``FileSystemReader`` loads it back; ``options`` are
  described :class:`~tierstore.plugin.Option` objects.
- :class:`StagerTests` (fixture ``stager``): ``stage`` returns a host copy of the same structure
  (nested dicts, lists, tuples, plain values, a ``BytesIO``), bit for bit equal, that does not
  change when training updates the originals; a second stage shows the new values; shape,
  dtype and key changes between stages; ``last_bytes`` / ``last_reused``; ``close`` twice;
  ``dcp.async_save`` through a store using the stager.
- :class:`ReplicationStrategyTests` (fixtures ``strategy``, ``world_sizes``, optional
  ``bad_world_sizes``): ``check_world_size`` accepts and refuses; ``holders`` are other ranks,
  in range, once each, deterministic, and cover every rank (class attribute
  ``covers_every_rank``); ``str()`` shows the options.
- :class:`ParityStrategyTests` (those fixtures and ``ranks_per_node``), for a strategy that keeps
  parity instead of replicas: its sets split the ranks and every member agrees, no two members
  share a node, and any one lost member rebuilds bitwise through the core's layout.
- :class:`CommitProtocolTests` (fixtures ``backend`` and ``protocol``): ``begin`` / ``commit`` /
  ``abort`` / ``update_manifest`` through the protocol alone: published files and manifest,
  ``Phase.PUBLISH`` announced before the manifest is visible, nothing visible before commit,
  overwrite, leftovers of interrupted saves and deletes found by ``find_leftovers`` (protected
  tokens spared), committed checkpoints and a user's own files never leftovers.
- :class:`ObserverTests` (fixture ``observer``, a plugin object with a ``tierstore_event``
  hook implementation): every ``EventKind.ALL`` event accepted, from many threads; real saves
  and loads with the observer registered; a raising observer beside it does not fail a save.

For example::

    class TestMyCodec(CodecTests):
        @pytest.fixture
        def codec(self):
            return MyCodec(level=5)
"""

from __future__ import annotations

from .backend import BackendTests, RenameBackendTests
from .codec import CodecTests
from .commit import CommitProtocolTests
from .observer import ObserverTests
from .replication import ParityStrategyTests, ReplicationStrategyTests
from .roundtrip import (RoundTripTests, StockLoadableRoundTripTests, assert_state_dicts_equal,
                        make_state_dict)
from .staging import StagerTests

__all__ = ["BackendTests", "RenameBackendTests", "RoundTripTests", "StockLoadableRoundTripTests",
           "CodecTests", "StagerTests", "ReplicationStrategyTests", "ParityStrategyTests",
           "CommitProtocolTests",
           "ObserverTests", "assert_state_dicts_equal", "make_state_dict"]
